//! specfast's CPU inference kernels: plain Rust with no Python in it.
//!
//! - [`int8`]: int8 matrix products whose rows are quantized, and so computed, independently.
//! - [`float`]: float32 weight products whose rows are computed independently, as int8's.
//! - [`q4`]: 4-bit (llama.cpp Q4_1) weight products, rows computed independently as int8's.
//! - [`gguf`]: products in a GGUF file's own block types (Q4_K, Q5_K, Q6_K, Q8_0), as int8's.
//! - [`slab`]: the buffers those products' weights live in, side by side on 2 MiB pages.
//! - [`simd`]: sixteen f32 lanes in three builds that give the same bits, the exponential,
//!   and the dot products and SiLU everything above sums with.
//! - [`attention`]: causal attention whose rows are computed, like int8's, independently.
//! - [`layer`]: one int8 transformer layer in one call, rows computed independently.
//! - [`helper`]: a second thread that splits a short job in two without a wake-up delay.
//! - [`tiles`]: restoring llama.cpp's AMX tile configuration after torch released it.
//!
//! Errors are `specfast-core`'s [`specfast_core::error::Error`]. Every public item is documented
//! (`missing_docs` is denied).

#![deny(missing_docs)]

pub mod attention;
pub mod float;
pub mod gguf;
pub mod helper;
pub mod int8;
pub mod layer;
pub mod q4;
pub mod simd;
pub mod slab;
pub mod tiles;

// The core's prefetch, under the paths the kernels have always used (`crate::prefetch`).
pub(crate) use specfast_core::{prefetch, L1, L2};
