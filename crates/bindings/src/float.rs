//! Bindings for `specfast_kernels::float`: a frozen `FloatMatrix` over numpy arrays. The products
//! run with the interpreter released.

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use specfast_kernels::float::FloatMatrix;

use super::int8::{contiguous, product_class};
use crate::py_err;

/// A float32 weight matrix (out_features, in_features) whose products compute each row of x on
/// its own (every value one fixed sum, whatever the number of rows).
#[pyclass(frozen, name = "FloatMatrix", module = "specfast._core")]
pub struct PyFloatMatrix {
    pub(crate) inner: FloatMatrix,
}

product_class!(PyFloatMatrix, "FloatMatrix", {
    /// A copy of a float32 (rows, cols) weight.
    #[new]
    fn new(py: Python<'_>, weight: PyReadonlyArray2<'_, f32>) -> PyResult<Self> {
        let shape = weight.shape();
        let (rows, cols) = (shape[0], shape[1]);
        let w = contiguous("weight", &weight)?;
        let inner = py
            .detach(|| FloatMatrix::new(w, rows, cols))
            .map_err(py_err)?;
        Ok(PyFloatMatrix { inner })
    }

    /// A copy of the weights, (rows, cols) float32.
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let (rows, cols) = (self.inner.rows(), self.inner.cols());
        PyArray1::from_slice(py, self.inner.weights()).reshape([rows, cols])
    }
});

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFloatMatrix>()?;
    Ok(())
}
