//! The only PyO3 code in the crate: thin wrappers that convert arguments, call the core and map
//! errors. Compiled into the private extension module `specfast._core`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::Error;

mod accept;
mod drafter;

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        match err {
            Error::Value(message) => PyValueError::new_err(message),
        }
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    drafter::register(m)?;
    accept::register(m)?;
    Ok(())
}
