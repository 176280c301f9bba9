//! Bindings for `specfast_kernels::q4`: a frozen `Q4Matrix` over numpy arrays. The products run
//! with the interpreter released.

use half::f16;
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specfast_kernels::q4::Q4Matrix;

use super::int8::{contiguous, product_class};
use crate::py_err;

type Parts<'py> = (
    Bound<'py, PyArray2<u8>>,
    Bound<'py, PyArray2<f32>>,
    Option<Bound<'py, PyArray2<f32>>>,
);

/// A weight matrix (out_features, in_features) in 4 bits, as llama.cpp's Q4_1: per output row
/// and group of 32 inputs, values q in 0..=15 with a scale d and a minimum m (f16): d·q + m; or
/// as its Q4_0 (from_parts without m): d·(q - 8).
#[pyclass(frozen, name = "Q4Matrix", module = "specfast._core")]
pub struct PyQ4Matrix {
    pub(crate) inner: Q4Matrix,
}

product_class!(PyQ4Matrix, "Q4Matrix", {
    /// Quantizes a float32 (rows, cols) weight: per group, m = min, d = (max - min) / 15.
    #[new]
    fn new(py: Python<'_>, weight: PyReadonlyArray2<'_, f32>) -> PyResult<Self> {
        let shape = weight.shape();
        let (rows, cols) = (shape[0], shape[1]);
        let w = contiguous("weight", &weight)?;
        let inner = py
            .detach(|| Q4Matrix::quantize(w, rows, cols))
            .map_err(py_err)?;
        Ok(PyQ4Matrix { inner })
    }

    /// From a Q4_1 tensor's parts: q (rows, cols) uint8 in 0..=15, and d and m (rows,
    /// ceil(cols / 32)) float32, rounded to f16 (exact for a GGUF's own f16 values); with m
    /// None, a Q4_0 tensor's: d·(q - 8).
    #[staticmethod]
    #[pyo3(signature = (q, d, m=None))]
    fn from_parts(
        py: Python<'_>,
        q: PyReadonlyArray2<'_, u8>,
        d: PyReadonlyArray2<'_, f32>,
        m: Option<PyReadonlyArray2<'_, f32>>,
    ) -> PyResult<Self> {
        let (rows, cols) = (q.shape()[0], q.shape()[1]);
        let (Ok(qs), true) = (q.as_slice(), q.is_c_contiguous()) else {
            return Err(PyValueError::new_err(
                "q must be a C-contiguous uint8 array",
            ));
        };
        let groups = cols.div_ceil(32);
        let m_shape = m.as_ref().map_or(d.shape(), |m| m.shape());
        if d.shape() != [rows, groups] || m_shape != [rows, groups] {
            return Err(PyValueError::new_err(format!(
                "d and m must be ({rows}, {groups}) for q of shape ({rows}, {cols}); got {:?} and {:?}",
                d.shape(),
                m_shape
            )));
        }
        let half = |a: &[f32]| a.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>();
        let dh = half(contiguous("d", &d)?);
        let mh = match &m {
            Some(m) => Some(half(contiguous("m", m)?)),
            None => None,
        };
        let inner = py
            .detach(|| Q4Matrix::from_parts(qs, &dh, mh.as_deref(), rows, cols))
            .map_err(py_err)?;
        Ok(PyQ4Matrix { inner })
    }

    /// (q (rows, cols) uint8, d, m (rows, ceil(cols / 32)) float32), as from_parts takes them
    /// (m None for Q4_0).
    fn parts<'py>(&self, py: Python<'py>) -> PyResult<Parts<'py>> {
        let (q, d, m) = self.inner.parts();
        let (rows, cols) = (self.inner.rows(), self.inner.cols());
        let groups = cols.div_ceil(32);
        let float = |v: Vec<f16>| v.into_iter().map(f16::to_f32).collect::<Vec<_>>();
        Ok((
            PyArray1::from_vec(py, q).reshape([rows, cols])?,
            PyArray1::from_vec(py, float(d)).reshape([rows, groups])?,
            match m {
                Some(m) => Some(PyArray1::from_vec(py, float(m)).reshape([rows, groups])?),
                None => None,
            },
        ))
    }
});

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyQ4Matrix>()?;
    Ok(())
}
