//! Bindings for `specfast_core::accept`: convert arrays and id lists, call the core, map errors.
//!
//! Probability matrices are numpy arrays or CPU torch tensors (viewed through `.numpy()`, which
//! shares memory), float32 or float64, 2-D. C-contiguous input is read in place; anything else is
//! copied once.

use numpy::{
    PyArray2, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray2, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use specfast_core::accept::{self, Prob};

use crate::py_err;

/// A borrowed 2-D probability matrix of either supported dtype.
enum Probs<'py> {
    F32(PyReadonlyArray2<'py, f32>),
    F64(PyReadonlyArray2<'py, f64>),
}

impl Probs<'_> {
    fn shape(&self) -> (usize, usize) {
        let s = match self {
            Probs::F32(a) => a.shape(),
            Probs::F64(a) => a.shape(),
        };
        (s[0], s[1])
    }
}

/// A numpy array for `obj`: numpy arrays pass through, CPU torch tensors are viewed with
/// `.detach().numpy()` (no copy).
fn to_numpy<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyUntypedArray>> {
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        return Ok(array.clone());
    }
    let ty = obj.get_type();
    let module: String = ty.module()?.extract()?;
    if module.starts_with("torch") && obj.hasattr("device")? {
        let device = obj.getattr("device")?.getattr("type")?;
        let device: String = device.extract()?;
        if device != "cpu" {
            return Err(PyTypeError::new_err(format!(
                "{name} is a {device} tensor; the Rust sampler takes CPU tensors or numpy arrays \
                 (specfast.accept_sampled sends device tensors to the torch path)"
            )));
        }
        let dtype: String = obj.getattr("dtype")?.str()?.extract()?;
        if dtype != "torch.float32" && dtype != "torch.float64" {
            return Err(PyTypeError::new_err(format!(
                "{name} must be float32 or float64, got {dtype}"
            )));
        }
        let array = obj.call_method0("detach")?.call_method0("numpy")?;
        return Ok(array.cast_into::<PyUntypedArray>()?);
    }
    Err(PyTypeError::new_err(format!(
        "{name} must be a numpy array or a CPU torch tensor, got {}",
        ty.name()?
    )))
}

fn extract_probs<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Probs<'py>> {
    let array = to_numpy(name, obj)?;
    if array.ndim() != 2 {
        return Err(PyValueError::new_err(format!(
            "{name} must be 2-D (rows, V), got shape {:?}",
            array.shape()
        )));
    }
    let dtype = array.dtype();
    if dtype.is_equiv_to(&numpy::dtype::<f32>(obj.py())) {
        Ok(Probs::F32(array.cast::<PyArray2<f32>>()?.try_readonly()?))
    } else if dtype.is_equiv_to(&numpy::dtype::<f64>(obj.py())) {
        Ok(Probs::F64(array.cast::<PyArray2<f64>>()?.try_readonly()?))
    } else {
        Err(PyTypeError::new_err(format!(
            "{name} must be float32 or float64, got {}",
            dtype.str()?
        )))
    }
}

/// Token ids as u32; negative ids and ids past u32 are rejected here, ids ≥ V by the core.
fn extract_ids(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be a sequence of token ids, got str"
        )));
    }
    // Lists and tuples extract directly; arrays and tensors go through `.tolist()`.
    let listed;
    let obj = if obj.hasattr("tolist")? {
        listed = obj.call_method0("tolist")?;
        &listed
    } else {
        obj
    };
    let ids: Vec<i64> = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} must be a sequence of int token ids (list, tuple, 1-D integer array)"
        ))
    })?;
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id).map_err(|_| {
                PyValueError::new_err(format!(
                    "{name}[{i}] = {id} is not a valid token id; ids must be in [0, V)"
                ))
            })
        })
        .collect()
}

/// Runs `f` over a contiguous view of each matrix, copying only when the input is strided.
fn with_slices<T: Prob + numpy::Element, R>(
    p: &PyReadonlyArray2<'_, T>,
    q: Option<&PyReadonlyArray2<'_, T>>,
    f: impl FnOnce(&[T], Option<&[T]>) -> R,
) -> R {
    let p_owned;
    // `as_slice` also accepts Fortran order; only C order is the row-major layout we need.
    let p_slice = if let (true, Ok(s)) = (p.is_c_contiguous(), p.as_slice()) {
        s
    } else {
        p_owned = p.as_array().iter().copied().collect::<Vec<T>>();
        &p_owned[..]
    };
    let q_owned;
    let q_slice = match q {
        None => None,
        Some(q) => Some(if let (true, Ok(s)) = (q.is_c_contiguous(), q.as_slice()) {
            s
        } else {
            q_owned = q.as_array().iter().copied().collect::<Vec<T>>();
            &q_owned[..]
        }),
    };
    f(p_slice, q_slice)
}

/// Dispatches on the dtype pair and checks the draft matrix against the target's.
fn dispatch<R>(
    target: &Bound<'_, PyAny>,
    draft_probs: Option<&Bound<'_, PyAny>>,
    f32_fn: impl FnOnce(&[f32], usize, Option<&[f32]>) -> specfast_core::error::Result<R>,
    f64_fn: impl FnOnce(&[f64], usize, Option<&[f64]>) -> specfast_core::error::Result<R>,
) -> PyResult<R> {
    let p = extract_probs("target_probs", target)?;
    let q = draft_probs
        .map(|q| extract_probs("draft_probs", q))
        .transpose()?;
    let (_, vocab) = p.shape();
    if let Some(q) = &q {
        let (_, qv) = q.shape();
        if qv != vocab {
            return Err(PyValueError::new_err(format!(
                "draft_probs has V = {qv} but target_probs has V = {vocab}; they must match"
            )));
        }
    }
    let out = match (&p, &q) {
        (Probs::F32(p), None) => with_slices(p, None, |p, q| f32_fn(p, vocab, q)),
        (Probs::F32(p), Some(Probs::F32(q))) => with_slices(p, Some(q), |p, q| f32_fn(p, vocab, q)),
        (Probs::F64(p), None) => with_slices(p, None, |p, q| f64_fn(p, vocab, q)),
        (Probs::F64(p), Some(Probs::F64(q))) => with_slices(p, Some(q), |p, q| f64_fn(p, vocab, q)),
        _ => {
            return Err(PyTypeError::new_err(
                "draft_probs and target_probs must have the same dtype (both float32 or both \
                 float64)",
            ))
        }
    };
    out.map_err(py_err)
}

/// Greedy verification: the accepted prefix of `draft` plus the target's token at the first
/// mismatch (or the bonus). `target_ids` has len(draft) + 1 entries.
#[pyfunction]
fn accept_greedy(draft: &Bound<'_, PyAny>, target_ids: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let draft = extract_ids("draft", draft)?;
    let target = extract_ids("target_ids", target_ids)?;
    accept::accept_greedy(&draft, &target).map_err(py_err)
}

/// Speculative sampling with seeded randomness (SplitMix64).
#[pyfunction]
#[pyo3(signature = (target_probs, draft, draft_probs=None, *, seed))]
fn accept_sampled(
    target_probs: &Bound<'_, PyAny>,
    draft: &Bound<'_, PyAny>,
    draft_probs: Option<&Bound<'_, PyAny>>,
    seed: u64,
) -> PyResult<Vec<u32>> {
    let draft = extract_ids("draft", draft)?;
    dispatch(
        target_probs,
        draft_probs,
        |p, v, q| accept::accept_sampled(p, v, &draft, q, seed),
        |p, v, q| accept::accept_sampled(p, v, &draft, q, seed),
    )
}

/// Speculative sampling with explicit uniforms (k accept draws, k + 1 sample draws).
#[pyfunction]
#[allow(clippy::needless_pass_by_value)] // PyO3 extracts sequences into owned Vecs
#[pyo3(signature = (target_probs, draft, draft_probs, accept_uniforms, sample_uniforms))]
fn accept_sampled_with_uniforms(
    target_probs: &Bound<'_, PyAny>,
    draft: &Bound<'_, PyAny>,
    draft_probs: Option<&Bound<'_, PyAny>>,
    accept_uniforms: Vec<f64>,
    sample_uniforms: Vec<f64>,
) -> PyResult<Vec<u32>> {
    let draft = extract_ids("draft", draft)?;
    let (a, s) = (&accept_uniforms, &sample_uniforms);
    dispatch(
        target_probs,
        draft_probs,
        |p, v, q| accept::accept_sampled_with_uniforms(p, v, &draft, q, a, s),
        |p, v, q| accept::accept_sampled_with_uniforms(p, v, &draft, q, a, s),
    )
}

/// The uniforms `accept_sampled(..., seed=seed)` uses for k draft tokens.
#[pyfunction]
fn uniforms(seed: u64, k: usize) -> PyResult<(Vec<f64>, Vec<f64>)> {
    if k > MAX_DRAFT_LEN {
        return Err(PyValueError::new_err(format!(
            "k = {k} is too large; at most {MAX_DRAFT_LEN} draft tokens"
        )));
    }
    Ok(accept::uniforms(seed, k))
}

/// A bound on k for `uniforms`, which allocates 2k + 1 draws before any matrix checks k.
const MAX_DRAFT_LEN: usize = 1 << 20;

/// The implemented rule as tables: acceptance probabilities (k) and the normalised correction /
/// bonus distributions ((k + 1) × V, float64). For exact enumeration in tests.
#[pyfunction]
#[pyo3(signature = (target_probs, draft, draft_probs=None))]
fn rule_tables<'py>(
    py: Python<'py>,
    target_probs: &Bound<'py, PyAny>,
    draft: &Bound<'py, PyAny>,
    draft_probs: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Vec<f64>, Bound<'py, PyArray2<f64>>)> {
    let ids = extract_ids("draft", draft)?;
    let (vocab, (a, dists)) = dispatch(
        target_probs,
        draft_probs,
        |p, v, q| accept::rule_tables(p, v, &ids, q).map(|t| (v, t)),
        |p, v, q| accept::rule_tables(p, v, &ids, q).map(|t| (v, t)),
    )?;
    let rows = ids.len() + 1;
    let array = numpy::PyArray1::from_vec(py, dists).reshape([rows, vocab])?;
    Ok((a, array))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(accept_greedy, m)?)?;
    m.add_function(wrap_pyfunction!(accept_sampled, m)?)?;
    m.add_function(wrap_pyfunction!(accept_sampled_with_uniforms, m)?)?;
    m.add_function(wrap_pyfunction!(uniforms, m)?)?;
    m.add_function(wrap_pyfunction!(rule_tables, m)?)?;
    Ok(())
}
