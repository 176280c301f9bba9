//! Bindings for `specfast_kernels::attention`: row-exact causal attention over numpy float32
//! arrays, run with the interpreter released.

use numpy::{PyReadonlyArray3, PyReadwriteArray3, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use specfast_kernels::attention::{self, Dims, Path};

use crate::py_err;

fn slice<'a>(name: &str, a: &'a PyReadonlyArray3<'_, f32>) -> PyResult<&'a [f32]> {
    match (a.is_c_contiguous(), a.as_slice()) {
        (true, Ok(s)) => Ok(s),
        _ => Err(PyValueError::new_err(format!(
            "{name} must be a C-contiguous float32 array"
        ))),
    }
}

/// out (H, T, hd) = causal attention of q (H, T, hd), rows at positions pos.., over the cache
/// k, v (Hkv, S, hd), each row computed on its own (its result does not depend on T).
#[pyfunction]
#[pyo3(signature = (q, k, v, out, pos, path="auto"))]
#[allow(clippy::needless_pass_by_value)] // numpy's borrowed arrays are extracted by value
fn row_attention(
    py: Python<'_>,
    q: PyReadonlyArray3<'_, f32>,
    k: PyReadonlyArray3<'_, f32>,
    v: PyReadonlyArray3<'_, f32>,
    mut out: PyReadwriteArray3<'_, f32>,
    pos: usize,
    path: &str,
) -> PyResult<()> {
    let path = match path {
        "auto" => Path::best(),
        "avx512" => Path::Avx512,
        "avx2" => Path::Avx2,
        "portable" => Path::Portable,
        other => {
            return Err(PyValueError::new_err(format!(
                "path must be \"auto\", \"avx512\", \"avx2\" or \"portable\", got {other:?}"
            )))
        }
    };
    let (qs, ks) = (q.shape(), k.shape());
    if out.shape() != qs || v.shape() != ks || qs[2] != ks[2] {
        return Err(PyValueError::new_err(format!(
            "q and out must be (H, T, hd) and k, v (Hkv, S, hd) with the same hd; got q {qs:?}, \
             out {:?}, k {ks:?}, v {:?}",
            out.shape(),
            v.shape()
        )));
    }
    let d = Dims {
        rows: qs[1],
        heads: qs[0],
        kv_heads: ks[0],
        head_dim: qs[2],
        capacity: ks[1],
        pos,
        window: 0,
        scale: None,
    };
    let (q, k, v) = (slice("q", &q)?, slice("k", &k)?, slice("v", &v)?);
    let contiguous_out = out.is_c_contiguous();
    let (true, Ok(out)) = (contiguous_out, out.as_slice_mut()) else {
        return Err(PyValueError::new_err(
            "out must be a C-contiguous float32 array",
        ));
    };
    py.detach(|| attention::attend_with(q, k, v, out, &d, path))
        .map_err(py_err)?;
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(row_attention, m)?)?;
    Ok(())
}
