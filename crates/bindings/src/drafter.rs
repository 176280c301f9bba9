//! `specfast._core.NgramDrafter`: a thin wrapper over [`specfast_core::drafter::Drafter`].
//!
//! Token input is converted here, in Rust: a list or tuple of ints, a 1-D integer numpy array
//! (read in place when it is contiguous `uint32`), or a 1-D integer CPU torch tensor (through
//! `.numpy()`, which shares memory). Nothing loops over tokens in Python.
//!
//! Threads: the drafter sits behind a mutex, so calls from several threads serialise, whole
//! call by whole call (the class is `frozen`: PyO3's per-call borrow flag, which made a call
//! that overlapped a detached `extend` fail with "Already borrowed", is not used). The
//! interpreter is released only while indexing more than `DETACH_ABOVE` tokens, and while
//! waiting for the lock when another thread holds it.

use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyList, PyString, PyTuple};
use specfast_core::drafter::{Config, Drafter, Policy, MAX_K};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use crate::py_err;

/// Above this many tokens, indexing releases the interpreter.
const DETACH_ABOVE: usize = 4096;

const ALLOWED: &str =
    "a list or tuple of ints, a 1-D integer numpy array, or a 1-D integer CPU torch tensor";

fn range_error(what: &str, value: impl std::fmt::Display, index: usize) -> PyErr {
    PyValueError::new_err(format!(
        "{what}: token ids must be in [0, 2**32), got {value} at index {index}"
    ))
}

fn from_array<T>(arr: &Bound<'_, PyUntypedArray>, what: &str) -> PyResult<Vec<u32>>
where
    T: numpy::Element + Copy + std::fmt::Display,
    u32: TryFrom<T>,
{
    let arr = arr
        .cast::<PyArray1<T>>()
        .map_err(|_| PyTypeError::new_err(format!("{what}: unsupported array; give {ALLOWED}")))?;
    let ro = arr
        .try_readonly()
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))?;
    let view = ro.as_array();
    let mut out = Vec::with_capacity(view.len());
    for (i, &v) in view.iter().enumerate() {
        match u32::try_from(v) {
            Ok(t) => out.push(t),
            Err(_) => return Err(range_error(what, v, i)),
        }
    }
    Ok(out)
}

fn from_numpy(arr: &Bound<'_, PyUntypedArray>, what: &str) -> PyResult<Vec<u32>> {
    if arr.ndim() != 1 {
        return Err(PyValueError::new_err(format!(
            "{what}: expected a 1-D array, got {} dimensions; give {ALLOWED}",
            arr.ndim()
        )));
    }
    let dtype = arr.dtype();
    let kind = dtype.kind();
    let size = dtype.itemsize();
    let v = match (kind, size) {
        (b'u', 4) => from_array::<u32>(arr, what)?,
        (b'i', 8) => from_array::<i64>(arr, what)?,
        (b'i', 4) => from_array::<i32>(arr, what)?,
        (b'i', 2) => from_array::<i16>(arr, what)?,
        (b'i', 1) => from_array::<i8>(arr, what)?,
        (b'u', 8) => from_array::<u64>(arr, what)?,
        (b'u', 2) => from_array::<u16>(arr, what)?,
        (b'u', 1) => from_array::<u8>(arr, what)?,
        _ => {
            return Err(PyTypeError::new_err(format!(
                "{what}: array dtype {} is not an integer type; give {ALLOWED}",
                dtype
                    .str()
                    .map_or_else(|_| "?".to_owned(), |s| s.to_string())
            )))
        }
    };
    Ok(v)
}

fn from_sequence<'py>(
    items: impl Iterator<Item = Bound<'py, PyAny>>,
    what: &str,
) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(items.size_hint().0);
    for (i, item) in items.enumerate() {
        if item.is_instance_of::<PyBool>() || item.is_instance_of::<PyFloat>() {
            return Err(PyTypeError::new_err(format!(
                "{what}: token ids must be ints, got {} at index {i}; give {ALLOWED}",
                item.get_type()
                    .name()
                    .map_or_else(|_| "?".to_owned(), |n| n.to_string())
            )));
        }
        match item.extract::<i64>() {
            Ok(v) => match u32::try_from(v) {
                Ok(t) => out.push(t),
                Err(_) => return Err(range_error(what, v, i)),
            },
            Err(e) if e.is_instance_of::<PyOverflowError>(item.py()) => {
                return Err(range_error(what, item.repr()?, i));
            }
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "{what}: token ids must be ints, got {} at index {i}; give {ALLOWED}",
                    item.get_type()
                        .name()
                        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
                )))
            }
        }
    }
    Ok(out)
}

fn torch_tensor_class(py: Python<'_>) -> Option<Bound<'_, PyAny>> {
    // A tensor can only exist if torch is already imported; never import it here.
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    let torch = modules.get_item("torch").ok()?;
    torch.getattr("Tensor").ok()
}

/// Converts any accepted token container to ids. Borrows contiguous `uint32` arrays when `borrow`.
fn with_tokens<R>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    f: impl FnOnce(&[u32]) -> PyResult<R>,
) -> PyResult<R> {
    let py = obj.py();
    if let Ok(list) = obj.cast::<PyList>() {
        return f(&from_sequence(list.iter(), what)?);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return f(&from_sequence(tuple.iter(), what)?);
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        // Zero-copy for the common contiguous uint32 case.
        if arr.ndim() == 1 {
            if let Ok(a) = arr.cast::<PyArray1<u32>>() {
                if let Ok(ro) = a.try_readonly() {
                    if let Ok(slice) = ro.as_slice() {
                        return f(slice);
                    }
                }
            }
        }
        return f(&from_numpy(arr, what)?);
    }
    if let Some(cls) = torch_tensor_class(py) {
        if obj.is_instance(&cls)? {
            let device = obj
                .getattr("device")?
                .getattr("type")?
                .extract::<String>()?;
            if device != "cpu" {
                return Err(PyValueError::new_err(format!(
                    "{what}: the tensor is on {device}; give a CPU tensor (call .cpu() first)"
                )));
            }
            let dim = obj.call_method0("dim")?.extract::<usize>()?;
            if dim != 1 {
                return Err(PyValueError::new_err(format!(
                    "{what}: expected a 1-D tensor, got {dim} dimensions; give {ALLOWED}"
                )));
            }
            let dtype = obj.getattr("dtype")?;
            let bad = obj.call_method0("is_floating_point")?.is_truthy()?
                || obj.call_method0("is_complex")?.is_truthy()?
                || dtype.str()? == "torch.bool";
            if bad {
                return Err(PyTypeError::new_err(format!(
                    "{what}: tensor dtype {} is not an integer type; give {ALLOWED}",
                    dtype.str()?
                )));
            }
            let np = obj
                .call_method0("detach")?
                .call_method0("numpy")
                .map_err(|e| PyTypeError::new_err(format!("{what}: cannot read tensor: {e}")))?;
            let arr = np
                .cast::<PyUntypedArray>()
                .map_err(|_| PyTypeError::new_err(format!("{what}: cannot read tensor")))?;
            return f(&from_numpy(arr, what)?);
        }
    }
    let name = obj
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    let hint = if obj.is_instance_of::<PyString>() {
        " (a str is text, not token ids; tokenize it first)"
    } else {
        ""
    };
    Err(PyTypeError::new_err(format!(
        "{what}: got {name}{hint}; give {ALLOWED}"
    )))
}

/// An int argument in `[lo, hi]`, with a ValueError or TypeError that says so.
fn int_arg(obj: &Bound<'_, PyAny>, name: &str, lo: i64, hi: i64) -> PyResult<i64> {
    let msg = || format!("{name} must be an int in [{lo}, {hi}]");
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyFloat>() {
        return Err(PyTypeError::new_err(format!(
            "{}, got {}",
            msg(),
            obj.repr()?
        )));
    }
    match obj.extract::<i64>() {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        Ok(v) => Err(PyValueError::new_err(format!("{}, got {v}", msg()))),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(PyValueError::new_err(
            format!("{}, got {}", msg(), obj.repr()?),
        )),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{}, got {}",
            msg(),
            obj.get_type().name()?
        ))),
    }
}

/// Proposes draft tokens by suffix-automaton lookup over everything committed so far.
#[pyclass(name = "NgramDrafter", module = "specfast._core", frozen)]
pub struct PyNgramDrafter {
    inner: Mutex<Drafter>,
}

impl PyNgramDrafter {
    /// The drafter, locked. Uncontended, this is one atomic operation with the interpreter
    /// attached. Contended, it waits detached: the holder may be indexing with the interpreter
    /// released and must be able to reattach to return, so waiting attached would deadlock.
    fn lock(&self, py: Python<'_>) -> MutexGuard<'_, Drafter> {
        loop {
            match self.inner.try_lock() {
                Ok(guard) => return guard,
                // No call panics while holding the lock (a panic would surface as an
                // exception first), so the data is as consistent as the last call left it.
                Err(TryLockError::Poisoned(e)) => return e.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    // A guard cannot leave `detach` (it is not Send): wait there until the
                    // lock is free, then retry attached.
                    py.detach(|| drop(self.inner.lock().unwrap_or_else(PoisonError::into_inner)));
                }
            }
        }
    }

    /// Runs bulk work on the drafter with the interpreter released, locking inside.
    fn detached<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Drafter) -> R + Send) -> R {
        py.detach(|| f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner)))
    }
}

#[pymethods]
impl PyNgramDrafter {
    #[new]
    #[pyo3(signature = (*, min_match=None, policy="earliest", k_factor=f64::INFINITY, k_offset=0.0, max_corpus_tokens=None))]
    fn new(
        min_match: Option<&Bound<'_, PyAny>>,
        policy: &str,
        k_factor: f64,
        k_offset: f64,
        max_corpus_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let defaults = Config::default();
        let min_match = match min_match {
            Some(m) => int_arg(m, "min_match", 1, 1 << 30)? as usize,
            None => defaults.min_match,
        };
        let max_corpus_tokens = match max_corpus_tokens {
            Some(m) => int_arg(m, "max_corpus_tokens", 0, 1 << 27)? as usize,
            None => defaults.max_corpus_tokens,
        };
        let config = Config {
            min_match,
            policy: Policy::parse(policy).map_err(py_err)?,
            k_factor,
            k_offset,
            max_corpus_tokens,
        };
        Ok(PyNgramDrafter {
            inner: Mutex::new(Drafter::new(config).map_err(py_err)?),
        })
    }

    /// Appends committed tokens to the live sequence and indexes them.
    fn extend(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        with_tokens(tokens, "extend", |ids| {
            if ids.len() > DETACH_ABOVE {
                // Copy first: a borrowed numpy buffer could be written by another thread.
                let ids = ids.to_vec();
                self.detached(py, |d| d.extend(&ids)).map_err(py_err)?;
            } else {
                self.lock(py).extend(ids).map_err(py_err)?;
            }
            Ok(())
        })
    }

    /// Up to k tokens that followed the longest earlier match; [] when nothing matches.
    fn propose(&self, py: Python<'_>, k: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let k = int_arg(k, "k", 0, i64::try_from(MAX_K).unwrap_or(i64::MAX))? as usize;
        self.lock(py).propose(k).map_err(py_err)
    }

    /// Adds a document to the corpus that matches may also come from.
    fn add_document(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        with_tokens(tokens, "add_document", |ids| {
            if ids.len() > DETACH_ABOVE {
                let ids = ids.to_vec();
                self.detached(py, |d| d.add_document(&ids))
                    .map_err(py_err)?;
            } else {
                self.lock(py).add_document(ids).map_err(py_err)?;
            }
            Ok(())
        })
    }

    /// Saves the configuration and corpus documents (not the live sequence) to `path`,
    /// atomically: a crash mid-save leaves any previous file whole. `fingerprint` names the
    /// tokenizer, so that `load` can refuse a corpus built with another one.
    #[pyo3(signature = (path, *, fingerprint=""))]
    #[allow(clippy::needless_pass_by_value)] // PyO3 extracts a path argument as an owned PathBuf
    fn save(&self, py: Python<'_>, path: PathBuf, fingerprint: &str) -> PyResult<()> {
        self.detached(py, |d| d.save_file(&path, fingerprint))
            .map_err(py_err)?;
        Ok(())
    }

    /// Loads a drafter saved by `save`, with an empty live sequence. With `fingerprint`, a file
    /// saved with another fingerprint is refused (ValueError).
    #[staticmethod]
    #[pyo3(signature = (path, *, fingerprint=None))]
    #[allow(clippy::needless_pass_by_value)] // as in `save`
    fn load(py: Python<'_>, path: PathBuf, fingerprint: Option<&str>) -> PyResult<Self> {
        let inner = py
            .detach(|| Drafter::load_file(&path, fingerprint))
            .map_err(py_err)?;
        Ok(PyNgramDrafter {
            inner: Mutex::new(inner),
        })
    }

    /// An independent copy: the same options, corpus and live sequence (Rust's `Clone`, with
    /// the interpreter released, since the indexes may be large).
    fn __copy__(&self, py: Python<'_>) -> Self {
        let inner = self.detached(py, |d| d.clone());
        PyNgramDrafter {
            inner: Mutex::new(inner),
        }
    }

    /// As `__copy__`: a drafter holds no Python objects to copy deeper.
    fn __deepcopy__(&self, py: Python<'_>, memo: &Bound<'_, PyAny>) -> Self {
        let _ = memo;
        self.__copy__(py)
    }

    /// Clears the live sequence; the corpus stays.
    fn reset(&self, py: Python<'_>) {
        self.lock(py).reset();
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.lock(py).len()
    }

    /// Bytes held by the live and corpus indexes, counting allocated capacity.
    fn memory_bytes(&self, py: Python<'_>) -> usize {
        self.lock(py).memory_bytes()
    }

    /// Length of the longest suffix of the live sequence seen earlier (live or corpus), or 0.
    #[getter]
    fn match_length(&self, py: Python<'_>) -> usize {
        self.lock(py).match_length()
    }

    /// Tokens indexed in the corpus.
    #[getter]
    fn corpus_tokens(&self, py: Python<'_>) -> usize {
        self.lock(py).corpus_len()
    }

    #[getter]
    fn policy(&self, py: Python<'_>) -> &'static str {
        self.lock(py).config().policy.name()
    }

    #[getter]
    fn min_match(&self, py: Python<'_>) -> usize {
        self.lock(py).config().min_match
    }

    #[getter]
    fn k_factor(&self, py: Python<'_>) -> f64 {
        self.lock(py).config().k_factor
    }

    #[getter]
    fn k_offset(&self, py: Python<'_>) -> f64 {
        self.lock(py).config().k_offset
    }

    #[getter]
    fn max_corpus_tokens(&self, py: Python<'_>) -> usize {
        self.lock(py).config().max_corpus_tokens
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let d = self.lock(py);
        let c = d.config();
        format!(
            "NgramDrafter(min_match={}, policy={:?}, k_factor={}, k_offset={}, \
             max_corpus_tokens={}, len={}, corpus_tokens={})",
            c.min_match,
            c.policy.name(),
            c.k_factor,
            c.k_offset,
            c.max_corpus_tokens,
            d.len(),
            d.corpus_len()
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNgramDrafter>()?;
    Ok(())
}
