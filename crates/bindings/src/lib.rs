//! The only PyO3 code in the workspace: thin wrappers that convert arguments, call
//! `specfast-core` (drafter, acceptance) and `specfast-kernels` (the CPU runtime's arithmetic) and
//! map errors. Compiled by maturin into the private extension module `specfast._core`.

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use specfast_core::error::Error;

mod accept;
mod attention;
mod drafter;
mod float;
mod gguf;
mod int8;
mod layer;
mod q4;

/// The core's error as a Python exception. (A `From<Error> for PyErr` impl would be the
/// orphan rule's to refuse here, with both types in other crates: call sites map with this.)
pub(crate) fn py_err(err: Error) -> PyErr {
    match err {
        Error::Value(message) => PyValueError::new_err(message),
        // OSError(errno, strerror, filename) picks the subclass for errno, such as
        // FileNotFoundError, and sets `filename`.
        Error::Io {
            errno: Some(errno),
            message,
            path,
        } => PyOSError::new_err((errno, message, path.map(std::path::PathBuf::into_os_string))),
        err @ Error::Io { errno: None, .. } => PyOSError::new_err(err.to_string()),
    }
}

/// True when the CPU has AMX and the OS has enabled its tile state.
#[pyfunction]
fn amx_usable() -> bool {
    specfast_kernels::tiles::amx_usable()
}

/// The address of `void restore_ggml_tiles(void *)`, which reloads llama.cpp's AMX tile
/// configuration on the calling thread (a no-op without AMX), for libgomp's GOMP_parallel.
#[pyfunction]
fn ggml_tile_restorer() -> usize {
    specfast_kernels::tiles::restore_ggml_tiles as *const () as usize
}

/// Seconds that an empty job takes to the core's helper thread and back (the median of 101), or
/// None where there is no helper (one CPU).
#[pyfunction]
fn thread_round_trip() -> Option<f64> {
    specfast_kernels::helper::round_trip(101).map(|d| d.as_secs_f64())
}

/// Asks Linux for 2 MiB pages on the whole aligned 2 MiB ranges of `nbytes` from `address`
/// (a CPU tensor's memory, before it is first written); the bytes advised. Advice only.
#[pyfunction]
fn advise_huge_pages(address: usize, nbytes: usize) -> usize {
    specfast_core::bigvec::advise_huge_range(address, nbytes)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    drafter::register(m)?;
    accept::register(m)?;
    attention::register(m)?;
    float::register(m)?;
    gguf::register(m)?;
    int8::register(m)?;
    layer::register(m)?;
    q4::register(m)?;
    m.add_function(wrap_pyfunction!(amx_usable, m)?)?;
    m.add_function(wrap_pyfunction!(ggml_tile_restorer, m)?)?;
    m.add_function(wrap_pyfunction!(thread_round_trip, m)?)?;
    m.add_function(wrap_pyfunction!(advise_huge_pages, m)?)?;
    Ok(())
}
