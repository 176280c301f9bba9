//! Bindings for `specfast_kernels::int8`: a frozen `Int8Matrix` over numpy float32 arrays. The
//! products run with the interpreter released.

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specfast_kernels::int8::{self, Kernel, Product};

use crate::py_err;

pub(crate) fn contiguous<'a>(name: &str, a: &'a PyReadonlyArray2<'_, f32>) -> PyResult<&'a [f32]> {
    match (a.is_c_contiguous(), a.as_slice()) {
        (true, Ok(s)) => Ok(s),
        _ => Err(PyValueError::new_err(format!(
            "{name} must be a C-contiguous float32 array"
        ))),
    }
}

/// out (n, rows) = x (n, cols) @ W.T for either weight kind, with the interpreter released.
pub(crate) fn product_matmul(
    py: Python<'_>,
    m: &dyn Product,
    x: &PyReadonlyArray2<'_, f32>,
    mut out: PyReadwriteArray2<'_, f32>,
    kernel: &str,
) -> PyResult<()> {
    let kernel = Kernel::from_name(kernel).map_err(py_err)?;
    let (xs, os) = (x.shape(), out.shape());
    if xs[1] != m.cols() || os[0] != xs[0] || os[1] != m.rows() {
        return Err(PyValueError::new_err(format!(
            "x must be (n, {}) and out (n, {}); got x {:?} and out {:?}",
            m.cols(),
            m.rows(),
            xs,
            os
        )));
    }
    let x = contiguous("x", x)?;
    let contiguous_out = out.is_c_contiguous();
    let (true, Ok(out)) = (contiguous_out, out.as_slice_mut()) else {
        return Err(PyValueError::new_err(
            "out must be a C-contiguous float32 array",
        ));
    };
    py.detach(|| m.matmul(x, out, kernel)).map_err(py_err)?;
    Ok(())
}

/// A weight-matrix class's `#[pymethods]`: its own methods (`$own`), then those every such
/// class has alike: `matmul` (through `product_matmul`), the `rows`, `cols` and `nbytes`
/// getters, and the repr.
macro_rules! product_class {
    ($class:ident, $name:literal, { $($own:tt)* }) => {
        #[pymethods]
        #[allow(clippy::needless_pass_by_value)] // numpy's borrowed arrays are extracted by value
        impl $class {
            $($own)*

            /// out (n, rows) = x (n, cols) @ weight.T, each row of x computed on its own;
            /// kernel: "auto" or a kernel's name (see int8_kernel).
            #[pyo3(signature = (x, out, kernel="auto"))]
            fn matmul(
                &self,
                py: Python<'_>,
                x: PyReadonlyArray2<'_, f32>,
                out: PyReadwriteArray2<'_, f32>,
                kernel: &str,
            ) -> PyResult<()> {
                $crate::int8::product_matmul(py, &self.inner, &x, out, kernel)
            }

            #[getter]
            fn rows(&self) -> usize {
                self.inner.rows()
            }

            #[getter]
            fn cols(&self) -> usize {
                self.inner.cols()
            }

            /// Bytes a product reads: the weights as stored, with any scales and minimums.
            #[getter]
            fn nbytes(&self) -> usize {
                self.inner.nbytes()
            }

            fn __repr__(&self) -> String {
                format!(concat!($name, "({}, {})"), self.inner.rows(), self.inner.cols())
            }
        }
    };
}
pub(crate) use product_class;

type QuantizedWeights<'py> = (Bound<'py, PyArray2<i8>>, Bound<'py, PyArray1<f32>>);

/// A weight matrix (out_features, in_features) quantized to int8, one scale per output row.
#[pyclass(frozen, name = "Int8Matrix", module = "specfast._core")]
pub struct PyInt8Matrix {
    pub(crate) inner: int8::Int8Matrix,
}

product_class!(PyInt8Matrix, "Int8Matrix", {
    #[new]
    fn new(py: Python<'_>, weight: PyReadonlyArray2<'_, f32>) -> PyResult<Self> {
        let shape = weight.shape();
        let (rows, cols) = (shape[0], shape[1]);
        let w = contiguous("weight", &weight)?;
        let inner = py
            .detach(|| int8::Int8Matrix::quantize(w, rows, cols))
            .map_err(py_err)?;
        Ok(PyInt8Matrix { inner })
    }

    /// The quantized weights (rows, cols) int8 and the scale of each row (rows,) float32.
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<QuantizedWeights<'py>> {
        let (q, s) = self.inner.weights();
        let q = PyArray1::from_vec(py, q).reshape([self.inner.rows(), self.inner.cols()])?;
        Ok((q, PyArray1::from_vec(py, s)))
    }
});

/// The int8 kernel this CPU runs: "avx512vnni", "avxvnni", "avx2" or "scalar".
#[pyfunction]
fn int8_kernel() -> &'static str {
    Kernel::best().name()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyInt8Matrix>()?;
    m.add_function(wrap_pyfunction!(int8_kernel, m)?)?;
    Ok(())
}
