//! Bindings for `specfast_kernels::gguf`: a frozen `GgufMatrix` built from a GGUF file's raw
//! blocks. The products run with the interpreter released.

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use specfast_kernels::gguf::{BlockType, GgufMatrix};

use super::int8::product_class;
use crate::py_err;

/// A weight matrix (out_features, in_features) stacked by rows from GGUF tensors, each kept in
/// its own block type (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1): the file's values and
/// scales, the file's bytes.
#[pyclass(frozen, name = "GgufMatrix", module = "specfast._core")]
pub struct PyGgufMatrix {
    pub(crate) inner: GgufMatrix,
}

product_class!(PyGgufMatrix, "GgufMatrix", {
    /// From parts [(type name, raw blocks as a C-contiguous uint8 array (rows, row_bytes))],
    /// stacked by rows, of `cols` columns. Every part but the last holds a multiple of 16 rows.
    #[staticmethod]
    fn from_tensors(
        py: Python<'_>,
        parts: Vec<(String, Bound<'_, PyAny>)>,
        cols: usize,
    ) -> PyResult<Self> {
        let mut arrays = Vec::with_capacity(parts.len());
        for (i, (name, raw)) in parts.iter().enumerate() {
            let t = BlockType::from_name(name).map_err(py_err)?;
            let Ok(a) = raw.extract::<PyReadonlyArray2<'_, u8>>() else {
                return Err(PyTypeError::new_err(format!(
                    "part {i} ({name}) must be a 2-D uint8 array of raw blocks (rows, row bytes)"
                )));
            };
            if !a.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "part {i} ({name}) must be C-contiguous"
                )));
            }
            arrays.push((t, a));
        }
        let views: Vec<(BlockType, &[u8], usize)> = arrays
            .iter()
            .map(|(t, a)| Ok((*t, a.as_slice()?, a.shape()[0])))
            .collect::<PyResult<_>>()?;
        let inner = py
            .detach(|| GgufMatrix::from_blocks(&views, cols))
            .map_err(py_err)?;
        Ok(PyGgufMatrix { inner })
    }

    /// The float32 (rows, cols) weights the blocks stand for (ggml's dequantization).
    fn dequantize<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let w = py.detach(|| self.inner.dequantize());
        PyArray1::from_vec(py, w).reshape([self.inner.rows(), self.inner.cols()])
    }

    /// (type name, rows) of each part, in order.
    fn types(&self) -> Vec<(&'static str, usize)> {
        (self.inner.types().into_iter())
            .map(|(t, rows)| (t.name(), rows))
            .collect()
    }
});

/// The GGUF block types a GgufMatrix holds as they are.
#[pyfunction]
fn gguf_block_types() -> Vec<&'static str> {
    BlockType::ALL.iter().map(|t| t.name()).collect()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGgufMatrix>()?;
    m.add_function(wrap_pyfunction!(gguf_block_types, m)?)?;
    Ok(())
}
