//! Bindings for `crate::float`: a frozen `FloatMatrix` over numpy arrays. The products run with
//! the interpreter released.

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::int8::{contiguous, product_matmul};
use crate::float::FloatMatrix;

/// A float32 weight matrix (out_features, in_features) whose products compute each row of x on
/// its own (every value one fixed sum, whatever the number of rows).
#[pyclass(frozen, name = "FloatMatrix", module = "specfast._core")]
pub struct PyFloatMatrix {
    pub(crate) inner: FloatMatrix,
}

#[pymethods]
#[allow(clippy::needless_pass_by_value)] // numpy's borrowed arrays are extracted by value
impl PyFloatMatrix {
    /// A copy of a float32 (rows, cols) weight.
    #[new]
    fn new(py: Python<'_>, weight: PyReadonlyArray2<'_, f32>) -> PyResult<Self> {
        let shape = weight.shape();
        let (rows, cols) = (shape[0], shape[1]);
        let w = contiguous("weight", &weight)?;
        let inner = py.detach(|| FloatMatrix::new(w, rows, cols))?;
        Ok(PyFloatMatrix { inner })
    }

    /// out (n, rows) = x (n, cols) @ weight.T; kernel: "auto" or an int8 kernel's name, which
    /// picks the build of the same sums ("scalar": portable; the others AVX2 or AVX-512).
    #[pyo3(signature = (x, out, kernel="auto"))]
    fn matmul(
        &self,
        py: Python<'_>,
        x: PyReadonlyArray2<'_, f32>,
        out: PyReadwriteArray2<'_, f32>,
        kernel: &str,
    ) -> PyResult<()> {
        product_matmul(py, &self.inner, &x, out, kernel)
    }

    /// A copy of the weights, (rows, cols) float32.
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let (rows, cols) = (self.inner.rows(), self.inner.cols());
        PyArray1::from_slice(py, self.inner.weights()).reshape([rows, cols])
    }

    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }

    #[getter]
    fn cols(&self) -> usize {
        self.inner.cols()
    }

    /// Bytes a product reads.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    fn __repr__(&self) -> String {
        format!("FloatMatrix({}, {})", self.inner.rows(), self.inner.cols())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyFloatMatrix>()?;
    Ok(())
}
