//! The only PyO3 code in the crate: thin wrappers that convert arguments, call the core and map
//! errors. Compiled into the private extension module `specfast._core`.

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

use crate::error::Error;

mod accept;
mod drafter;

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
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
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    drafter::register(m)?;
    accept::register(m)?;
    Ok(())
}
