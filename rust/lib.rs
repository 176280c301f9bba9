//! specfast's core: plain Rust with no Python in it.
//!
//! - [`automaton`]: an online suffix automaton over token ids.
//! - [`bigvec`]: the growable array it keeps its states and transitions in (2 MiB pages).
//! - [`drafter`]: the n-gram drafter built on it (match policies, evidence-capped k, corpus).
//! - [`corpus`]: saving a drafter's corpus to a versioned, checksummed file and loading it back.
//! - [`accept`]: greedy verification and residual rejection sampling.
//! - [`int8`]: int8 matrix products whose rows are quantized, and so computed, independently.
//! - [`float`]: float32 weight products whose rows are computed independently, as int8's.
//! - [`q4`]: 4-bit (llama.cpp Q4_1) weight products, rows computed independently as int8's.
//! - [`attention`]: causal attention whose rows are computed, like int8's, independently.
//! - [`layer`]: one int8 transformer layer in one call, rows computed independently.
//! - [`helper`]: a second thread that splits a short job in two without a wake-up delay.
//! - [`tiles`]: restoring llama.cpp's AMX tile configuration after torch released it.
//! - [`error`]: the error type, turned into Python exceptions only at the boundary.
//!
//! All PyO3 code lives in the `python` module, compiled only with the `python` feature.

pub mod accept;
pub mod attention;
pub mod automaton;
pub mod bigvec;
pub mod corpus;
pub mod drafter;
pub mod error;
pub mod float;
pub mod helper;
pub mod int8;
pub mod layer;
pub mod q4;
pub mod tiles;

#[cfg(feature = "python")]
mod python;
