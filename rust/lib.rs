//! specfast's core: plain Rust with no Python in it.
//!
//! - [`automaton`]: an online suffix automaton over token ids.
//! - [`bigvec`]: the growable array it keeps its states and transitions in (2 MiB pages), and
//!   the same advice for memory allocated elsewhere (a CPU KV cache).
//! - [`drafter`]: the n-gram drafter built on it (match policies, evidence-capped k, corpus).
//! - [`corpus`]: saving a drafter's corpus to a versioned, checksummed file and loading it back.
//! - [`accept`]: greedy verification and residual rejection sampling.
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
//! - [`error`]: the error type, turned into Python exceptions only at the boundary.
//!
//! All PyO3 code lives in the `python` module, compiled only with the `python` feature. Every
//! public item is documented (`missing_docs` is denied).

#![deny(missing_docs)]

pub mod accept;
pub mod attention;
pub mod automaton;
pub mod bigvec;
pub mod corpus;
pub mod drafter;
pub mod error;
pub mod float;
pub mod gguf;
pub mod helper;
pub mod int8;
pub mod layer;
pub mod q4;
pub mod simd;
pub mod slab;
pub mod tiles;

#[cfg(feature = "python")]
mod python;

/// Starts loading the cache line at `p` into L1 (`L1`) or L2 (`L2`), without waiting for it;
/// no effect on any value.
#[inline]
pub(crate) fn prefetch<const LEVEL: i32, T>(p: *const T) {
    // The intrinsic is safe to call since Rust 1.87 (SSE is baseline on x86_64); the `unsafe`
    // block keeps the minimum supported Rust building.
    #[cfg(target_arch = "x86_64")]
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<LEVEL>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `prefetch`'s levels: x86's `_MM_HINT_T0` and `_MM_HINT_T1`.
pub(crate) const L1: i32 = 3;
pub(crate) const L2: i32 = 2;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(L1 == std::arch::x86_64::_MM_HINT_T0 && L2 == std::arch::x86_64::_MM_HINT_T1);
