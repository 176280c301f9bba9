//! Bindings for `crate::layer`: one int8 layer over numpy float32 arrays (the model's torch
//! tensors, shared without copies), run with the interpreter released.

use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyReadwriteArray3, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::int8::PyInt8Matrix;
use super::q4::PyQ4Matrix;
use crate::int8::Product;
use crate::layer::{self, Shape, Weights};

/// An Int8Matrix's or a Q4Matrix's product.
fn product<'a>(name: &str, obj: &'a Bound<'_, PyAny>) -> PyResult<&'a dyn Product> {
    if let Ok(m) = obj.cast::<PyInt8Matrix>() {
        return Ok(&m.get().inner);
    }
    if let Ok(m) = obj.cast::<PyQ4Matrix>() {
        return Ok(&m.get().inner);
    }
    Err(PyTypeError::new_err(format!(
        "{name} must be an Int8Matrix or a Q4Matrix, got {}",
        obj.get_type().name()?
    )))
}

fn contiguous_error(name: &str) -> PyErr {
    PyValueError::new_err(format!("{name} must be a C-contiguous float32 array"))
}

macro_rules! slice {
    ($name:literal, $a:expr) => {
        if $a.is_c_contiguous() {
            $a.as_slice().map_err(|_| contiguous_error($name))?
        } else {
            return Err(contiguous_error($name));
        }
    };
}

macro_rules! slice_mut {
    ($name:literal, $a:expr) => {
        if $a.is_c_contiguous() {
            $a.as_slice_mut().map_err(|_| contiguous_error($name))?
        } else {
            return Err(contiguous_error($name));
        }
    };
}

/// x (T, dim) <- one int8 layer applied to it, in place; writes the T new keys and values into
/// k_cache, v_cache (Hkv, S, hd) at pos. Each row is computed on its own.
#[pyfunction]
#[pyo3(signature = (
    x, attn_norm, qkv, qkv_bias, o, ffn_norm, gate_up, down, cos, sin, k_cache, v_cache, pos,
    heads, eps,
))]
#[allow(clippy::too_many_arguments, clippy::needless_pass_by_value)]
fn int8_layer(
    py: Python<'_>,
    mut x: PyReadwriteArray2<'_, f32>,
    attn_norm: PyReadonlyArray1<'_, f32>,
    qkv: &Bound<'_, PyAny>,
    qkv_bias: Option<PyReadonlyArray1<'_, f32>>,
    o: &Bound<'_, PyAny>,
    ffn_norm: PyReadonlyArray1<'_, f32>,
    gate_up: &Bound<'_, PyAny>,
    down: &Bound<'_, PyAny>,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
    mut k_cache: PyReadwriteArray3<'_, f32>,
    mut v_cache: PyReadwriteArray3<'_, f32>,
    pos: usize,
    heads: usize,
    eps: f32,
) -> PyResult<()> {
    let ks = k_cache.shape().to_vec();
    if v_cache.shape() != ks.as_slice() {
        return Err(PyValueError::new_err(format!(
            "k_cache and v_cache must have one shape; got {ks:?} and {:?}",
            v_cache.shape()
        )));
    }
    let shape = Shape {
        heads,
        kv_heads: ks[0],
        head_dim: ks[2],
        eps,
        capacity: ks[1],
        pos,
    };
    let bias = match &qkv_bias {
        Some(b) => Some(slice!("qkv_bias", b)),
        None => None,
    };
    let w = Weights {
        attn_norm: slice!("attn_norm", attn_norm),
        qkv: product("qkv", qkv)?,
        qkv_bias: bias,
        o: product("o", o)?,
        ffn_norm: slice!("ffn_norm", ffn_norm),
        gate_up: product("gate_up", gate_up)?,
        down: product("down", down)?,
    };
    let (cos, sin) = (slice!("cos", cos), slice!("sin", sin));
    let x = slice_mut!("x", x);
    let k = slice_mut!("k_cache", k_cache);
    let v = slice_mut!("v_cache", v_cache);
    py.detach(|| layer::forward(x, &w, &shape, cos, sin, k, v))?;
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(int8_layer, m)?)?;
    Ok(())
}
