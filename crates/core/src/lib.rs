//! specfast's speculative core: the n-gram drafter and exact acceptance, in plain Rust with no
//! Python in it.
//!
//! - [`automaton`]: an online suffix automaton over token ids.
//! - [`bigvec`]: the growable array it keeps its states and transitions in (2 MiB pages), and
//!   the same advice for memory allocated elsewhere (a CPU KV cache).
//! - [`drafter`]: the n-gram drafter built on it (match policies, evidence-capped k, corpus).
//! - [`corpus`]: saving a drafter's corpus to a versioned, checksummed file and loading it back.
//! - [`accept`]: greedy verification and residual rejection sampling.
//! - [`error`]: the error type of this crate and of `specfast-kernels`, turned into Python
//!   exceptions only at the boundary (`specfast-bindings`).
//!
//! Every public item is documented (`missing_docs` is denied).

#![deny(missing_docs)]

pub mod accept;
pub mod automaton;
pub mod bigvec;
pub mod corpus;
pub mod drafter;
pub mod error;

/// Starts loading the cache line at `p` into L1 (`L1`) or L2 (`L2`), without waiting for it;
/// no effect on any value. Public for `specfast-kernels`, which prefetches the same way.
#[inline]
pub fn prefetch<const LEVEL: i32, T>(p: *const T) {
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

/// `prefetch`'s level for L1: x86's `_MM_HINT_T0`.
pub const L1: i32 = 3;
/// `prefetch`'s level for L2: x86's `_MM_HINT_T1`.
pub const L2: i32 = 2;
#[cfg(target_arch = "x86_64")]
const _: () = assert!(L1 == std::arch::x86_64::_MM_HINT_T0 && L2 == std::arch::x86_64::_MM_HINT_T1);
