//! Bindings for `specfast_kernels::layer`: a model's int8, 4-bit or float32 layers over numpy
//! float32 arrays (the model's torch tensors and cache, shared without copies), run with the
//! interpreter released.

use half::f16;
use numpy::{
    Element, PyArray4, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyReadwriteArray3, PyReadwriteArray4, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use specfast_kernels::attention::Elem;
use specfast_kernels::int8::Product;
use specfast_kernels::layer::{self, Act, Head, Shape, Weights};

use super::float::PyFloatMatrix;
use super::gguf::PyGgufMatrix;
use super::int8::PyInt8Matrix;
use super::q4::PyQ4Matrix;
use crate::py_err;

fn contiguous_error(name: &str) -> PyErr {
    PyValueError::new_err(format!("{name} must be a C-contiguous array"))
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

/// A weight matrix of the stack: an Int8Matrix, a Q4Matrix, a GgufMatrix or a FloatMatrix,
/// held for the stack's lifetime.
enum Matrix {
    Int8(Py<PyInt8Matrix>),
    Q4(Py<PyQ4Matrix>),
    Gguf(Py<PyGgufMatrix>),
    Float(Py<PyFloatMatrix>),
}

impl Matrix {
    fn new(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Matrix> {
        if let Ok(m) = obj.cast::<PyInt8Matrix>() {
            return Ok(Matrix::Int8(m.clone().unbind()));
        }
        if let Ok(m) = obj.cast::<PyQ4Matrix>() {
            return Ok(Matrix::Q4(m.clone().unbind()));
        }
        if let Ok(m) = obj.cast::<PyGgufMatrix>() {
            return Ok(Matrix::Gguf(m.clone().unbind()));
        }
        if let Ok(m) = obj.cast::<PyFloatMatrix>() {
            return Ok(Matrix::Float(m.clone().unbind()));
        }
        Err(PyTypeError::new_err(format!(
            "{name} must be an Int8Matrix, a Q4Matrix, a GgufMatrix or a FloatMatrix, got {}",
            obj.get_type().name()?
        )))
    }

    fn product(&self) -> &dyn Product {
        match self {
            Matrix::Int8(m) => &m.get().inner,
            Matrix::Q4(m) => &m.get().inner,
            Matrix::Gguf(m) => &m.get().inner,
            Matrix::Float(m) => &m.get().inner,
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Matrix,
    qkv_bias: Option<Vec<f32>>,
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    o: Matrix,
    ffn_norm: Vec<f32>,
    gate_up: Matrix,
    down: Matrix,
    post_norms: Option<(Vec<f32>, Vec<f32>)>,
    sliding: bool,
}

impl Layer {
    fn weights(&self) -> Weights<'_> {
        Weights {
            attn_norm: &self.attn_norm,
            qkv: self.qkv.product(),
            qkv_bias: self.qkv_bias.as_deref(),
            qk_norm: self.qk_norm.as_ref().map(|(q, k)| (&q[..], &k[..])),
            o: self.o.product(),
            ffn_norm: &self.ffn_norm,
            gate_up: self.gate_up.product(),
            down: self.down.product(),
            post_norms: self.post_norms.as_ref().map(|(a, f)| (&a[..], &f[..])),
            sliding: self.sliding,
        }
    }
}

type LayerArgs<'py> = (
    PyReadonlyArray1<'py, f32>,
    Bound<'py, PyAny>,
    Option<PyReadonlyArray1<'py, f32>>,
    Bound<'py, PyAny>,
    PyReadonlyArray1<'py, f32>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
);

/// Two (n,) gains of a layer: (q_norm, k_norm) or (post_attn_norm, post_ffn_norm).
type NormPair<'py> = (PyReadonlyArray1<'py, f32>, PyReadonlyArray1<'py, f32>);

/// A model's int8, 4-bit or float32 layers and its head (final norm and output matrix), run
/// over a pass in one call with the interpreter released. It holds the weight matrices and copies of the
/// norms and biases: built again whenever the model's weights change.
#[pyclass(frozen, name = "CoreLayers", module = "specfast._core")]
pub struct PyCoreLayers {
    layers: Vec<Layer>,
    heads: usize,
    eps: f32,
    norm: Vec<f32>,
    output: Matrix,
    act: Act,
    attn_scale: Option<f32>,
    window: usize,
}

#[pymethods]
#[allow(clippy::needless_pass_by_value)] // numpy's borrowed arrays are extracted by value
impl PyCoreLayers {
    /// layers: per layer (attn_norm, qkv, qkv_bias or None, o, ffn_norm, gate_up, down), the
    /// norms and bias float32 arrays, the others Int8Matrix, Q4Matrix, GgufMatrix or FloatMatrix; heads:
    /// query heads; norm (dim,) and output (V, dim): the final norm and the vocabulary
    /// projection. qk_norms: per layer (q_norm, k_norm), each (hd,), applied to every query
    /// and key head before RoPE (Qwen3, Gemma 3), or None. Gemma 3's: post_norms, per layer
    /// (post_attn_norm, post_ffn_norm), each (dim,); act "gelu_tanh" (else "silu");
    /// attn_scale, the scores' scale (None: 1/sqrt(hd)); sliding_layers, the layers that see
    /// only their last `window` keys (with `forward`'s local RoPE tables).
    #[new]
    #[pyo3(signature = (layers, heads, eps, norm, output, *, qk_norms=None, post_norms=None, act="silu", attn_scale=None, sliding_layers=Vec::new(), window=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: Vec<LayerArgs<'_>>,
        heads: usize,
        eps: f32,
        norm: PyReadonlyArray1<'_, f32>,
        output: &Bound<'_, PyAny>,
        qk_norms: Option<Vec<NormPair<'_>>>,
        post_norms: Option<Vec<NormPair<'_>>>,
        act: &str,
        attn_scale: Option<f32>,
        sliding_layers: Vec<usize>,
        window: usize,
    ) -> PyResult<Self> {
        let copy = |name: &str, a: &PyReadonlyArray1<'_, f32>| -> PyResult<Vec<f32>> {
            Ok(a.as_slice().map_err(|_| contiguous_error(name))?.to_vec())
        };
        for (name, pairs) in [("qk_norms", &qk_norms), ("post_norms", &post_norms)] {
            if pairs.as_ref().is_some_and(|n| n.len() != layers.len()) {
                return Err(PyValueError::new_err(format!(
                    "{name} must hold one pair per layer ({})",
                    layers.len()
                )));
            }
        }
        let act = match act {
            "silu" => Act::Silu,
            "gelu_tanh" => Act::GeluTanh,
            other => {
                return Err(PyValueError::new_err(format!(
                    "act must be \"silu\" or \"gelu_tanh\", got {other:?}"
                )))
            }
        };
        if let Some(&bad) = sliding_layers.iter().find(|&&l| l >= layers.len()) {
            return Err(PyValueError::new_err(format!(
                "sliding layer {bad} is out of range for {} layers",
                layers.len()
            )));
        }
        if !sliding_layers.is_empty() && window == 0 {
            return Err(PyValueError::new_err(
                "sliding_layers need a window of at least one key",
            ));
        }
        if attn_scale.is_some_and(|a| !a.is_finite() || a <= 0.0) {
            return Err(PyValueError::new_err(format!(
                "attn_scale must be a positive finite number, got {attn_scale:?}"
            )));
        }
        let layers = layers
            .iter()
            .enumerate()
            .map(|(i, (attn, qkv, bias, o, ffn, gate_up, down))| {
                let qk_norm = match &qk_norms {
                    Some(n) => Some((copy("q_norm", &n[i].0)?, copy("k_norm", &n[i].1)?)),
                    None => None,
                };
                let post = match &post_norms {
                    Some(n) => Some((
                        copy("post_attn_norm", &n[i].0)?,
                        copy("post_ffn_norm", &n[i].1)?,
                    )),
                    None => None,
                };
                Ok(Layer {
                    attn_norm: copy("attn_norm", attn)?,
                    qkv: Matrix::new("qkv", qkv)?,
                    qkv_bias: bias.as_ref().map(|b| copy("qkv_bias", b)).transpose()?,
                    qk_norm,
                    o: Matrix::new("o", o)?,
                    ffn_norm: copy("ffn_norm", ffn)?,
                    gate_up: Matrix::new("gate_up", gate_up)?,
                    down: Matrix::new("down", down)?,
                    post_norms: post,
                    sliding: sliding_layers.contains(&i),
                })
            })
            .collect::<PyResult<Vec<Layer>>>()?;
        Ok(PyCoreLayers {
            layers,
            heads,
            eps,
            norm: copy("norm", &norm)?,
            output: Matrix::new("output", output)?,
            act,
            attn_scale,
            window,
        })
    }

    /// x (T, dim) <- every layer applied in turn, in place; writes the T new keys and values
    /// into k_cache, v_cache (L, Hkv, S, hd), both float32 or both float16, at pos. cos, sin:
    /// (T, hd). features (n, T, dim), if given, gets the residual stream entering each of
    /// feature_layers; logits (R, V), if given, the head's logits for the last R rows. local:
    /// the sliding layers' (cos, sin), if they differ. Each row is computed on its own.
    #[pyo3(signature = (x, cos, sin, k_cache, v_cache, pos, feature_layers=Vec::new(), features=None, logits=None, local=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        x: PyReadwriteArray2<'_, f32>,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        k_cache: &Bound<'_, PyAny>,
        v_cache: &Bound<'_, PyAny>,
        pos: usize,
        feature_layers: Vec<usize>,
        features: Option<PyReadwriteArray3<'_, f32>>,
        logits: Option<PyReadwriteArray2<'_, f32>>,
        local: Option<(PyReadonlyArray2<'_, f32>, PyReadonlyArray2<'_, f32>)>,
    ) -> PyResult<()> {
        let args = (x, cos, sin, local, pos, feature_layers, features, logits);
        if let Some((k, v)) = caches::<f32>(k_cache, v_cache)? {
            return self.run(py, k, v, args);
        }
        if let Some((k, v)) = caches::<f16>(k_cache, v_cache)? {
            return self.run(py, k, v, args);
        }
        Err(PyTypeError::new_err(
            "k_cache and v_cache must both be float32 or both float16 numpy arrays (L, Hkv, S, hd)",
        ))
    }

    fn __len__(&self) -> usize {
        self.layers.len()
    }
}

type PassArgs<'py> = (
    PyReadwriteArray2<'py, f32>,
    PyReadonlyArray2<'py, f32>,
    PyReadonlyArray2<'py, f32>,
    Option<(PyReadonlyArray2<'py, f32>, PyReadonlyArray2<'py, f32>)>,
    usize,
    Vec<usize>,
    Option<PyReadwriteArray3<'py, f32>>,
    Option<PyReadwriteArray2<'py, f32>>,
);

/// The two caches as writable arrays of E, or None if either holds another dtype.
#[allow(clippy::type_complexity)]
fn caches<'py, E: Element>(
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
) -> PyResult<Option<(PyReadwriteArray4<'py, E>, PyReadwriteArray4<'py, E>)>> {
    let (Ok(k), Ok(v)) = (k.cast::<PyArray4<E>>(), v.cast::<PyArray4<E>>()) else {
        return Ok(None);
    };
    let busy = |_| PyValueError::new_err("k_cache and v_cache must be two distinct arrays");
    Ok(Some((
        k.try_readwrite().map_err(busy)?,
        v.try_readwrite().map_err(busy)?,
    )))
}

impl PyCoreLayers {
    fn run<E: Element + Elem>(
        &self,
        py: Python<'_>,
        mut k_cache: PyReadwriteArray4<'_, E>,
        mut v_cache: PyReadwriteArray4<'_, E>,
        args: PassArgs<'_>,
    ) -> PyResult<()> {
        let (mut x, cos, sin, local, pos, feature_layers, mut features, mut logits) = args;
        let ks = k_cache.shape().to_vec();
        if v_cache.shape() != ks.as_slice() {
            return Err(PyValueError::new_err(format!(
                "k_cache and v_cache must have one shape; got {ks:?} and {:?}",
                v_cache.shape()
            )));
        }
        let shape = Shape {
            heads: self.heads,
            kv_heads: ks[1],
            head_dim: ks[3],
            eps: self.eps,
            capacity: ks[2],
            pos,
            act: self.act,
            attn_scale: self.attn_scale,
            window: self.window,
        };
        let weights: Vec<Weights<'_>> = self.layers.iter().map(Layer::weights).collect();
        let (cos, sin) = (slice!("cos", cos), slice!("sin", sin));
        let local = match &local {
            Some((c, s)) => Some((slice!("local cos", c), slice!("local sin", s))),
            None => None,
        };
        let x = slice_mut!("x", x);
        let k = slice_mut!("k_cache", k_cache);
        let v = slice_mut!("v_cache", v_cache);
        let feats: &mut [f32] = match features.as_mut() {
            Some(f) => slice_mut!("features", f),
            None => &mut [],
        };
        let vocab = self.output.product().rows();
        let logits: Option<&mut [f32]> = match logits.as_mut() {
            Some(l) if l.shape()[1] != vocab => {
                return Err(PyValueError::new_err(format!(
                    "logits must be (R, V) with V = {vocab}; got {:?}",
                    l.shape()
                )))
            }
            Some(l) => Some(slice_mut!("logits", l)),
            None => None,
        };
        let head = Head {
            norm: &self.norm,
            eps: self.eps,
            output: self.output.product(),
        };
        let head = logits.map(|l| (&head, l));
        py.detach(|| {
            layer::forward_layers(
                x,
                &weights,
                &shape,
                cos,
                sin,
                local,
                k,
                v,
                &feature_layers,
                feats,
                head,
            )
        })
        .map_err(py_err)?;
        Ok(())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCoreLayers>()?;
    Ok(())
}
