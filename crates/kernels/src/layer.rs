//! One transformer layer of an int8, 4-bit or float32 model on CPU, in a single call: norms,
//! projections, RoPE, the cache write, attention and the MLP, every row of the pass computed on
//! its own.
//!
//! A decode step of a small model makes ~35 tensor operations per layer between its matrix
//! products, and on 2 cores each costs a few microseconds of dispatch: a third of the step.
//! Here the whole layer is one call, and each operation reads only its own row, so a verify
//! pass over k+1 tokens gives exactly what k+1 one-token passes give (see `attention`).

use specfast_core::error::{Error, Result};

use crate::attention::{self, Dims, Elem};
use crate::helper;
use crate::int8::{Kernel, Product, ROW_VALUES};

/// A Llama-family layer's weights (Llama, Qwen2, Qwen3, SmolLM2, Gemma 3): pre-norm attention
/// with grouped kv heads and rotate-half RoPE, then a pre-norm gated MLP.
pub struct Weights<'a> {
    /// (dim,) RMSNorm weight before attention.
    pub attn_norm: &'a [f32],
    /// ((H + 2 Hkv) hd, dim): q, k and v stacked.
    pub qkv: &'a dyn Product,
    /// ((H + 2 Hkv) hd,), or none.
    pub qkv_bias: Option<&'a [f32]>,
    /// (hd,) RMSNorm gains of every query head and of every key head, applied before RoPE
    /// (Qwen3), or none.
    pub qk_norm: Option<(&'a [f32], &'a [f32])>,
    /// (dim, H hd).
    pub o: &'a dyn Product,
    /// The RMSNorm gain before the MLP.
    pub ffn_norm: &'a [f32],
    /// (2 F, dim): gate then up.
    pub gate_up: &'a dyn Product,
    /// (dim, F).
    pub down: &'a dyn Product,
    /// (dim,) RMSNorm gains on the attention's output and on the MLP's, before each is added
    /// to the residual stream (Gemma 3), or none.
    pub post_norms: Option<(&'a [f32], &'a [f32])>,
    /// A local layer (Gemma 3): attention over the last `Shape::window` keys only, with the
    /// local RoPE tables.
    pub sliding: bool,
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// x · sigmoid(x) (Llama, Qwen).
    Silu,
    /// GELU's tanh approximation (Gemma).
    GeluTanh,
}

/// The layer's shape, and where the pass sits in the cache.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// RMSNorm's epsilon.
    pub eps: f32,
    /// Slots S per kv head in the cache.
    pub capacity: usize,
    /// The position of the pass's first row.
    pub pos: usize,
    /// The MLP's gate activation.
    pub act: Act,
    /// The attention scores' scale; None for 1/√hd.
    pub attn_scale: Option<f32>,
    /// Keys a sliding layer sees (its `Weights::sliding`).
    pub window: usize,
}

/// The buffers a layer writes in full before it reads them: made once for a pass and reused by
/// each of its layers, so no layer zeroes fresh ones.
#[derive(Default)]
struct Scratch {
    normed: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    heads_out: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

/// `buf` as a slice of `len` values, grown if it is shorter (what it held is overwritten).
fn fit(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// x (T, dim) <- the layer applied to x, writing the T new keys and values into the cache
/// (k_cache, v_cache: (Hkv, S, hd)) at pos... cos and sin are (T, hd): the RoPE table's rows
/// for the pass's positions. On shapes `check` has passed, with the pass's scratch buffers
/// ([`forward_layers`] is the checked entry point, for one layer or many).
#[allow(clippy::too_many_arguments)]
fn forward<E: Elem>(
    x: &mut [f32],
    w: &Weights<'_>,
    s: &Shape,
    cos: &[f32],
    sin: &[f32],
    k_cache: &mut [E],
    v_cache: &mut [E],
    sc: &mut Scratch,
) -> Result<()> {
    let dim = w.attn_norm.len();
    let (h, hkv, hd) = (s.heads, s.kv_heads, s.head_dim);
    let rows = x.len() / dim;
    if rows == 0 {
        return Ok(());
    }
    let kernel = Kernel::best();
    let width = (h + 2 * hkv) * hd;

    // attention: qkv (T, (H + 2Hkv) hd)
    let normed = fit(&mut sc.normed, rows * dim);
    rms_norm(x, w.attn_norm, s.eps, normed);
    let qkv = fit(&mut sc.qkv, rows * width);
    w.qkv.matmul(normed, qkv, kernel)?;
    if let Some(bias) = w.qkv_bias {
        for row in qkv.chunks_exact_mut(width) {
            for (y, &b) in row.iter_mut().zip(bias) {
                *y += b;
            }
        }
    }
    let q = fit(&mut sc.q, h * rows * hd); // (H, T, hd), as attention reads it
    for (t, row) in qkv.chunks_exact_mut(width).enumerate() {
        let (c, sn) = (&cos[t * hd..(t + 1) * hd], &sin[t * hd..(t + 1) * hd]);
        for (j, head) in row[..(h + hkv) * hd].chunks_exact_mut(hd).enumerate() {
            if let Some((q_norm, k_norm)) = w.qk_norm {
                rms_norm_in_place(head, if j < h { q_norm } else { k_norm }, s.eps);
            }
            rope(head, c, sn);
        }
        let slot = s.pos + t;
        for i in 0..h {
            q[(i * rows + t) * hd..(i * rows + t + 1) * hd]
                .copy_from_slice(&row[i * hd..(i + 1) * hd]);
        }
        for j in 0..hkv {
            let at = (j * s.capacity + slot) * hd;
            let (k0, v0) = ((h + j) * hd, (h + hkv + j) * hd);
            store(&mut k_cache[at..at + hd], &row[k0..k0 + hd])?;
            store(&mut v_cache[at..at + hd], &row[v0..v0 + hd])?;
        }
    }
    let d = Dims {
        rows,
        heads: h,
        kv_heads: hkv,
        head_dim: hd,
        capacity: s.capacity,
        pos: s.pos,
        window: if w.sliding { s.window } else { 0 },
        scale: s.attn_scale,
    };
    let heads_out = fit(&mut sc.heads_out, h * rows * hd);
    attention::attend(q, k_cache, v_cache, heads_out, &d)?;
    let y = q; // (T, H hd) now
    for i in 0..h {
        for t in 0..rows {
            y[(t * h + i) * hd..(t * h + i + 1) * hd]
                .copy_from_slice(&heads_out[(i * rows + t) * hd..(i * rows + t + 1) * hd]);
        }
    }
    let proj = fit(&mut sc.proj, rows * dim);
    w.o.matmul(y, proj, kernel)?;
    add_normed(x, proj, w.post_norms.map(|(a, _)| a), s.eps, &mut sc.normed);

    // MLP
    let normed = fit(&mut sc.normed, rows * dim);
    rms_norm(x, w.ffn_norm, s.eps, normed);
    let ff = w.gate_up.rows() / 2;
    let gate_up = fit(&mut sc.gate_up, rows * 2 * ff);
    w.gate_up.matmul(normed, gate_up, kernel)?;
    let act = fit(&mut sc.act, rows * ff);
    let gate_up = &*gate_up;
    helper::for_row_parts(act, ff, ROW_VALUES / ff, |range, act| {
        let gu = &gate_up[range.start * 2 * ff..range.end * 2 * ff];
        for (a, gu) in act.chunks_exact_mut(ff).zip(gu.chunks_exact(2 * ff)) {
            match s.act {
                Act::Silu => attention::silu_mul(&gu[..ff], &gu[ff..], a),
                Act::GeluTanh => attention::gelu_tanh_mul(&gu[..ff], &gu[ff..], a),
            }
        }
    });
    let proj = fit(&mut sc.proj, rows * dim);
    w.down.matmul(act, proj, kernel)?;
    add_normed(x, proj, w.post_norms.map(|(_, f)| f), s.eps, &mut sc.normed);
    Ok(())
}

/// A model's final norm and vocabulary projection.
pub struct Head<'a> {
    /// (dim,) RMSNorm weight.
    pub norm: &'a [f32],
    /// The final RMSNorm's epsilon.
    pub eps: f32,
    /// (V, dim).
    pub output: &'a dyn Product,
}

impl Head<'_> {
    /// logits (R, V) <- the projection of the last R rows of x (T, dim), each normed on its own.
    pub fn logits(&self, x: &[f32], logits: &mut [f32]) -> Result<()> {
        self.check(x.len(), logits.len())?;
        let dim = self.norm.len();
        let r = logits.len() / self.output.rows();
        let mut normed = vec![0.0f32; r * dim];
        rms_norm(&x[x.len() - r * dim..], self.norm, self.eps, &mut normed);
        self.output.matmul(&normed, logits, Kernel::best())
    }

    fn check(&self, x_len: usize, logits_len: usize) -> Result<()> {
        let (dim, v) = (self.norm.len(), self.output.rows());
        if dim == 0 || self.output.cols() != dim || !x_len.is_multiple_of(dim) {
            return Err(Error::value(format!(
                "the head needs x of rows of dim = {dim} and an output matrix of {dim} columns; \
                 got {x_len} values and {} columns",
                self.output.cols()
            )));
        }
        if !logits_len.is_multiple_of(v) || logits_len / v > x_len / dim {
            return Err(Error::value(format!(
                "logits must be (R, V) with V = {v} and R at most x's {} rows; got {logits_len} \
                 values",
                x_len / dim
            )));
        }
        Ok(())
    }
}

/// dst <- src in the cache's type. A finite value that the type cannot hold (float16 rounds
/// ±65520 and beyond to infinity) is an error, not an infinity that would make its rows NaN.
fn store<E: Elem>(dst: &mut [E], src: &[f32]) -> Result<()> {
    // A fold without an early exit (vector code) first; the search only when one is there.
    let overflow = |x: &f32| x.is_finite() && x.abs() >= HALF_OVERFLOW;
    if E::HALF && src.iter().fold(false, |any, x| any | overflow(x)) {
        if let Some(x) = src.iter().find(|x| overflow(x)) {
            return Err(Error::value(format!(
                "a key or value ({x}) is beyond the float16 cache's range: use a float32 cache (Model.kv_dtype)"
            )));
        }
    }
    E::from_f32_slice(dst, src);
    Ok(())
}

/// The least f32 that float16 rounds to infinity: halfway from its largest, 65504, to 2^16.
const HALF_OVERFLOW: f32 = 65520.0;

/// x (T, dim) <- every layer of `layers` applied in turn: `forward` for layer l over its cache
/// (k_cache, v_cache: (L, Hkv, S, hd), layer l's part at l·Hkv·S·hd). One call for a whole pass,
/// so that nothing runs between the layers. Sliding layers take `local`'s (cos, sin) tables
/// where given, the others (and all without it) `cos` and `sin`. `features` (n, T, dim) gets, for each
/// `feature_layers[j]`, the residual stream entering that layer (an EAGLE-3 head reads them).
/// With `head`, its logits buffer (R, V) then gets [`Head::logits`] of the last R rows.
#[allow(clippy::too_many_arguments)]
pub fn forward_layers<E: Elem>(
    x: &mut [f32],
    layers: &[Weights<'_>],
    s: &Shape,
    cos: &[f32],
    sin: &[f32],
    local: Option<(&[f32], &[f32])>,
    k_cache: &mut [E],
    v_cache: &mut [E],
    feature_layers: &[usize],
    features: &mut [f32],
    head: Option<(&Head<'_>, &mut [f32])>,
) -> Result<()> {
    let n = layers.len();
    let per_layer = s.kv_heads * s.capacity * s.head_dim;
    if k_cache.len() != n * per_layer || v_cache.len() != n * per_layer {
        return Err(Error::value(format!(
            "k_cache and v_cache must be (L, Hkv, S, hd) = ({n}, {}, {}, {}) for {n} layers",
            s.kv_heads, s.capacity, s.head_dim
        )));
    }
    if let Some(&bad) = feature_layers.iter().find(|&&l| l >= n) {
        return Err(Error::value(format!(
            "feature layer {bad} is out of range for {n} layers"
        )));
    }
    if features.len() != feature_layers.len() * x.len() {
        return Err(Error::value(format!(
            "features must be (n, T, dim) with n = {} and T x dim = {}",
            feature_layers.len(),
            x.len()
        )));
    }
    if let Some((h, logits)) = &head {
        h.check(x.len(), logits.len())?;
    }
    let tables = |w: &Weights<'_>| match local {
        Some(t) if w.sliding => t,
        _ => (cos, sin),
    };
    // Every layer's shapes first, so that a bad one fails before the cache changes.
    for (w, (k, v)) in layers.iter().zip(
        k_cache
            .chunks_exact(per_layer)
            .zip(v_cache.chunks_exact(per_layer)),
    ) {
        let (c, sn) = tables(w);
        check(x, w, s, c, sn, k, v)?;
    }
    let caches = k_cache
        .chunks_exact_mut(per_layer)
        .zip(v_cache.chunks_exact_mut(per_layer));
    let mut scratch = Scratch::default();
    for (l, (w, (k, v))) in layers.iter().zip(caches).enumerate() {
        for (j, _) in feature_layers.iter().enumerate().filter(|&(_, &f)| f == l) {
            features[j * x.len()..(j + 1) * x.len()].copy_from_slice(x);
        }
        let (c, sn) = tables(w);
        forward(x, w, s, c, sn, k, v, &mut scratch)?;
    }
    match head {
        Some((h, logits)) => h.logits(x, logits),
        None => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
fn check<E>(
    x: &[f32],
    w: &Weights<'_>,
    s: &Shape,
    cos: &[f32],
    sin: &[f32],
    k_cache: &[E],
    v_cache: &[E],
) -> Result<()> {
    let dim = w.attn_norm.len();
    let (h, hkv, hd) = (s.heads, s.kv_heads, s.head_dim);
    let bad = |what: String| Err(Error::value(what));
    if dim == 0 || !x.len().is_multiple_of(dim) {
        return bad(format!("x has {} values, not rows of dim {dim}", x.len()));
    }
    let rows = x.len() / dim;
    if hkv == 0 || !h.is_multiple_of(hkv) || hd == 0 || !hd.is_multiple_of(2) {
        return bad(format!(
            "heads ({h}) must be a positive multiple of kv_heads ({hkv}), and head_dim ({hd}) \
             positive and even"
        ));
    }
    let width = (h + 2 * hkv) * hd;
    let ff = w.gate_up.rows() / 2;
    let shapes = [
        ("qkv", w.qkv.rows(), w.qkv.cols(), width, dim),
        ("o", w.o.rows(), w.o.cols(), dim, h * hd),
        ("gate_up", w.gate_up.rows(), w.gate_up.cols(), 2 * ff, dim),
        ("down", w.down.rows(), w.down.cols(), dim, ff),
    ];
    for (name, r, c, want_r, want_c) in shapes {
        if (r, c) != (want_r, want_c) {
            return bad(format!("{name} is {r} x {c}, expected {want_r} x {want_c}"));
        }
    }
    if w.ffn_norm.len() != dim || w.qkv_bias.is_some_and(|b| b.len() != width) {
        return bad(format!(
            "ffn_norm must hold dim = {dim} values and qkv_bias {width}"
        ));
    }
    if w.post_norms
        .is_some_and(|(a, f)| a.len() != dim || f.len() != dim)
    {
        return bad(format!(
            "post_attn_norm and post_ffn_norm must hold dim = {dim} values"
        ));
    }
    if w.sliding && s.window == 0 {
        return bad("a sliding layer needs a window of at least one key".to_string());
    }
    if w.qk_norm
        .is_some_and(|(q, k)| q.len() != hd || k.len() != hd)
    {
        return bad(format!(
            "q_norm and k_norm must hold head_dim = {hd} values"
        ));
    }
    if cos.len() != rows * hd || sin.len() != rows * hd {
        return bad(format!("cos and sin must be (T, hd) = ({rows}, {hd})"));
    }
    let cache = hkv * s.capacity * hd;
    if k_cache.len() != cache || v_cache.len() != cache {
        return bad(format!(
            "k_cache and v_cache must be (Hkv, S, hd) = ({hkv}, {}, {hd})",
            s.capacity
        ));
    }
    if s.pos.checked_add(rows).is_none_or(|end| end > s.capacity) {
        return bad(format!(
            "{rows} rows from position {} do not fit a cache of {} slots",
            s.pos, s.capacity
        ));
    }
    Ok(())
}

/// out = x / rms(x) · weight per row, the mean square summed as `attention`'s dot product.
/// Rows go in ranges to both threads when there are many (a prefill).
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    helper::for_row_parts(out, dim, ROW_VALUES / dim, |rows, out| {
        rms_norm_rows(&x[rows.start * dim..rows.end * dim], weight, eps, out);
    });
}

fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let r = 1.0 / (attention::dot_product(row, row) / dim as f32 + eps).sqrt();
        for ((y, &v), &g) in o.iter_mut().zip(row).zip(weight) {
            *y = v * r * g;
        }
    }
}

/// x <- x / rms(x) · weight, for one head: the same operations as `rms_norm_rows`.
fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let r = 1.0 / (attention::dot_product(x, x) / x.len() as f32 + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(weight) {
        *v = *v * r * g;
    }
}

/// Rotate-half RoPE on one head: (a, b) -> (a cos - b sin, b cos + a sin) for a in the first
/// half and b in the second.
fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (a, b) = head.split_at_mut(half);
    let ((c1, c2), (s1, s2)) = (cos.split_at(half), sin.split_at(half));
    // Zipped, so that it compiles to vector code (indexed, its bounds checks kept it scalar);
    // the same unfused operations either way, so the same bits.
    let tables = c1.iter().zip(s1).zip(c2.iter().zip(s2));
    for ((x1, x2), ((&ca, &sa), (&cb, &sb))) in a.iter_mut().zip(b.iter_mut()).zip(tables) {
        let (p, q) = (*x1, *x2);
        *x1 = p * ca - q * sa;
        *x2 = q * cb + p * sb;
    }
}

/// x += y, or x += rms_norm(y) · gain with a post-norm gain (Gemma 3), through `buf`.
fn add_normed(x: &mut [f32], y: &[f32], gain: Option<&[f32]>, eps: f32, buf: &mut Vec<f32>) {
    match gain {
        Some(g) => {
            let normed = fit(buf, y.len());
            rms_norm(y, g, eps, normed);
            add_into(x, normed);
        }
        None => add_into(x, y),
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int8::Int8Matrix;
    use crate::q4::Q4Matrix;
    use half::f16;

    /// One layer through the checked entry point; rope is [cos, sin], kv the layer's cache.
    fn one_layer(
        x: &mut [f32],
        w: &Weights<'_>,
        s: &Shape,
        [cos, sin]: [&[f32]; 2],
        (k, v): (&mut [f32], &mut [f32]),
    ) -> Result<()> {
        forward_layers(
            x,
            std::slice::from_ref(w),
            s,
            cos,
            sin,
            None,
            k,
            v,
            &[],
            &mut [],
            None,
        )
    }

    struct Layer {
        attn_norm: Vec<f32>,
        qkv: Box<dyn Product>,
        qk_norm: Option<(Vec<f32>, Vec<f32>)>,
        o: Box<dyn Product>,
        ffn_norm: Vec<f32>,
        gate_up: Box<dyn Product>,
        down: Box<dyn Product>,
        post_norms: Option<(Vec<f32>, Vec<f32>)>,
        sliding: bool,
    }

    impl Layer {
        fn weights(&self) -> Weights<'_> {
            Weights {
                attn_norm: &self.attn_norm,
                qkv: self.qkv.as_ref(),
                qkv_bias: None,
                qk_norm: self.qk_norm.as_ref().map(|(q, k)| (&q[..], &k[..])),
                o: self.o.as_ref(),
                ffn_norm: &self.ffn_norm,
                gate_up: self.gate_up.as_ref(),
                down: self.down.as_ref(),
                post_norms: self.post_norms.as_ref().map(|(a, f)| (&a[..], &f[..])),
                sliding: self.sliding,
            }
        }
    }

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }

    const DIM: usize = 48;
    const SHAPE: Shape = Shape {
        heads: 4,
        kv_heads: 2,
        head_dim: 12,
        eps: 1e-5,
        capacity: 40,
        pos: 0,
        act: Act::Silu,
        attn_scale: None,
        window: 0,
    };

    /// A layer of random weights, int8 or (`four_bit`) Q4_1.
    fn layer(four_bit: bool) -> Layer {
        let width = (4 + 2 * 2) * 12;
        let m = |r: usize, c: usize, seed| -> Box<dyn Product> {
            let w = values(r * c, seed, 0.5);
            if four_bit {
                Box::new(Q4Matrix::quantize(&w, r, c).unwrap())
            } else {
                Box::new(Int8Matrix::quantize(&w, r, c).unwrap())
            }
        };
        Layer {
            attn_norm: values(DIM, 1, 1.0).iter().map(|v| 1.0 + v).collect(),
            qkv: m(width, DIM, 2),
            qk_norm: None,
            o: m(DIM, 48, 3),
            ffn_norm: values(DIM, 4, 1.0).iter().map(|v| 1.0 + v).collect(),
            gate_up: m(2 * 40, DIM, 5),
            down: m(DIM, 40, 6),
            post_norms: None,
            sliding: false,
        }
    }

    fn run(l: &Layer, x: &mut [f32], pos: usize, cache: &mut (Vec<f32>, Vec<f32>)) {
        run_in(l, x, pos, cache, SHAPE.capacity);
    }

    fn run_in(
        l: &Layer,
        x: &mut [f32],
        pos: usize,
        cache: &mut (Vec<f32>, Vec<f32>),
        capacity: usize,
    ) {
        let s = Shape {
            capacity,
            pos,
            ..SHAPE
        };
        run_shaped(l, x, &s, cache);
    }

    /// The RoPE tables (cos, sin) of T rows from `pos`, for a base of `base`.
    fn tables(rows: usize, pos: usize, base: f32) -> (Vec<f32>, Vec<f32>) {
        let angle = |p: usize, i: usize| p as f32 / base.powf((i % 6) as f32 / 6.0);
        let cos = (0..rows * 12)
            .map(|j| angle(pos + j / 12, j % 12).cos())
            .collect();
        let sin = (0..rows * 12)
            .map(|j| angle(pos + j / 12, j % 12).sin())
            .collect();
        (cos, sin)
    }

    fn run_shaped(l: &Layer, x: &mut [f32], s: &Shape, cache: &mut (Vec<f32>, Vec<f32>)) {
        let (cos, sin) = tables(x.len() / DIM, s.pos, 10.0);
        one_layer(
            x,
            &l.weights(),
            s,
            [&cos, &sin],
            (&mut cache.0, &mut cache.1),
        )
        .unwrap();
    }

    /// A Gemma 3 layer: q/k norms, post-norms, GELU, the query scale and a window of 4 keys.
    fn gemma() -> (Layer, Shape) {
        let mut l = with_qk_norm(layer(false));
        let gain = |seed| values(DIM, seed, 1.0).iter().map(|v| 1.0 + v).collect();
        l.post_norms = Some((gain(14), gain(15)));
        l.sliding = true;
        let s = Shape {
            act: Act::GeluTanh,
            attn_scale: Some(0.2),
            window: 4,
            ..SHAPE
        };
        (l, s)
    }

    fn gemma_pass(l: &Layer, s: &Shape, x: &[f32]) -> Vec<f32> {
        let n = 2 * 40 * 12;
        let mut y = x.to_vec();
        run_shaped(l, &mut y, s, &mut (vec![0.0; n], vec![0.0; n]));
        y
    }

    /// Gemma 3's layer: a pass over 9 rows (past its window of 4) equals 9 one-row passes bit
    /// for bit, and each part of it changes the output (a layer that dropped one would not).
    #[test]
    fn gemma_rows_are_independent_and_each_part_matters() {
        let (g, s) = gemma();
        let n = 2 * 40 * 12;
        let x = values(9 * DIM, 21, 2.0);
        let mut whole = x.clone();
        let mut cache = (vec![0.0; n], vec![0.0; n]);
        run_shaped(&g, &mut whole, &Shape { pos: 2, ..s }, &mut cache);
        let mut cache2 = (vec![0.0; n], vec![0.0; n]);
        for t in 0..9 {
            let mut r = x[t * DIM..(t + 1) * DIM].to_vec();
            run_shaped(&g, &mut r, &Shape { pos: 2 + t, ..s }, &mut cache2);
            assert_eq!(r, whole[t * DIM..(t + 1) * DIM], "row {t}");
        }
        assert_eq!(cache, cache2);
        let want = gemma_pass(&g, &s, &x);
        let (mut no_post, mut global) = (gemma().0, gemma().0);
        no_post.post_norms = None;
        global.sliding = false;
        assert_ne!(gemma_pass(&no_post, &s, &x), want, "post norms");
        assert_ne!(gemma_pass(&global, &s, &x), want, "window");
        let silu = Shape {
            act: Act::Silu,
            ..s
        };
        assert_ne!(gemma_pass(&g, &silu, &x), want, "GELU");
        let scale = Shape {
            attn_scale: None,
            ..s
        };
        assert_ne!(gemma_pass(&g, &scale, &x), want, "query scale");
    }

    /// Sliding layers read the local RoPE tables and the others the global ones; a sliding
    /// layer needs a window.
    #[test]
    fn local_tables_reach_the_sliding_layers_only() {
        let (g, s) = gemma();
        let mut global = gemma().0;
        global.sliding = false;
        let n = 2 * 40 * 12;
        let x = values(5 * DIM, 22, 2.0);
        let (cos, sin) = tables(5, 0, 10.0);
        let (lcos, lsin) = tables(5, 0, 3.0);
        let run = |l: &Layer, local: Option<(&[f32], &[f32])>| {
            let mut y = x.clone();
            let (mut k, mut v) = (vec![0.0; n], vec![0.0; n]);
            let ws = [l.weights()];
            forward_layers(
                &mut y,
                &ws,
                &s,
                &cos,
                &sin,
                local,
                &mut k,
                &mut v,
                &[],
                &mut [],
                None,
            )
            .unwrap();
            y
        };
        let local = Some((&lcos[..], &lsin[..]));
        assert_ne!(run(&g, local), run(&g, None));
        assert_eq!(run(&global, local), run(&global, None));
        let mut y = x.clone();
        let (mut k, mut v) = (vec![0.0; n], vec![0.0; n]);
        let no_window = Shape { window: 0, ..s };
        let err = forward_layers(
            &mut y,
            &[g.weights()],
            &no_window,
            &cos,
            &sin,
            None,
            &mut k,
            &mut v,
            &[],
            &mut [],
            None,
        )
        .unwrap_err();
        assert!(err.to_string().contains("window"), "{err}");
    }

    /// A pass long enough that its norms, activation rounding and SiLU go to both threads in
    /// ranges of rows (`helper::for_row_ranges`) equals its rows one at a time, bit for bit.
    #[test]
    fn a_long_pass_split_between_threads_equals_its_rows() {
        let (rows, capacity) = (250, 256);
        assert!(rows >= 2 * (ROW_VALUES / 40), "the SiLU's rows must split");
        let l = layer(true);
        let n = 2 * capacity * 12;
        let x = values(rows * DIM, 19, 2.0);
        let mut whole = x.clone();
        let mut cache = (vec![0.0; n], vec![0.0; n]);
        run_in(&l, &mut whole, 0, &mut cache, capacity);
        let mut one = (vec![0.0; n], vec![0.0; n]);
        for t in 0..rows {
            let mut r = x[t * DIM..(t + 1) * DIM].to_vec();
            run_in(&l, &mut r, t, &mut one, capacity);
            assert_eq!(r, whole[t * DIM..(t + 1) * DIM], "row {t}");
        }
        assert_eq!(cache, one);
    }

    /// A pass over T rows equals T one-row passes, bit for bit, cache included.
    #[test]
    fn rows_are_independent() {
        for four_bit in [false, true] {
            rows_are_independent_with(&layer(four_bit));
        }
    }

    fn with_qk_norm(mut l: Layer) -> Layer {
        let gain = |seed| values(12, seed, 1.0).iter().map(|v| 1.0 + v).collect();
        l.qk_norm = Some((gain(7), gain(8)));
        l
    }

    /// Qwen3's q/k norms: rows stay independent, and the norms change the output (a layer
    /// that skipped them would equal the plain one).
    #[test]
    fn qk_norm_rows_are_independent_and_matter() {
        let (plain, normed) = (layer(false), with_qk_norm(layer(false)));
        rows_are_independent_with(&normed);
        let n = 2 * 40 * 12;
        let x = values(3 * DIM, 9, 2.0);
        let (mut a, mut b) = (x.clone(), x.clone());
        run(&plain, &mut a, 0, &mut (vec![0.0; n], vec![0.0; n]));
        run(&normed, &mut b, 0, &mut (vec![0.0; n], vec![0.0; n]));
        assert_ne!(a, b);
    }

    /// A key head normed with the query gain (the q/k norms swapped) is caught: each gain
    /// reaches its own heads.
    #[test]
    fn qk_norm_gains_reach_their_own_heads() {
        let normed = with_qk_norm(layer(false));
        let mut swapped = with_qk_norm(layer(false));
        let (q, k) = swapped.qk_norm.take().unwrap();
        swapped.qk_norm = Some((k, q));
        let n = 2 * 40 * 12;
        let x = values(3 * DIM, 9, 2.0);
        let (mut a, mut b) = (x.clone(), x);
        run(&normed, &mut a, 0, &mut (vec![0.0; n], vec![0.0; n]));
        run(&swapped, &mut b, 0, &mut (vec![0.0; n], vec![0.0; n]));
        assert_ne!(a, b);
    }

    fn rows_are_independent_with(l: &Layer) {
        let n = 2 * 40 * 12;
        let x = values(7 * DIM, 9, 2.0);
        let mut whole = x.clone();
        let mut cache = (vec![0.0; n], vec![0.0; n]);
        run(l, &mut whole, 3, &mut cache);
        let mut rows = Vec::new();
        let mut cache2 = (vec![0.0; n], vec![0.0; n]);
        for t in 0..7 {
            let mut r = x[t * DIM..(t + 1) * DIM].to_vec();
            run(l, &mut r, 3 + t, &mut cache2);
            rows.extend(r);
        }
        assert_eq!(whole, rows);
        assert_eq!(cache, cache2);
        assert!(whole.iter().all(|v| v.is_finite()) && whole != x);
    }

    /// Negative control for the test above: a row that misses an earlier row's key (slot 0
    /// never written) is not what the pass gave it, so the comparison sees context.
    #[test]
    fn a_row_depends_on_the_keys_before_it() {
        let l = layer(true);
        let n = 2 * 40 * 12;
        let x = values(2 * DIM, 9, 2.0);
        let mut whole = x.clone();
        let mut cache = (vec![0.0; n], vec![0.0; n]);
        run(&l, &mut whole, 0, &mut cache);
        let mut r = x[DIM..].to_vec();
        run(&l, &mut r, 1, &mut (vec![0.0; n], vec![0.0; n]));
        assert_ne!(r, whole[DIM..]);
    }

    /// A whole stack in one call equals its layers called one by one, and hands back the
    /// residual entering each feature layer.
    #[test]
    fn a_stack_equals_its_layers_one_by_one() {
        let ls = [layer(true), layer(false), layer(true)];
        let ws: Vec<Weights<'_>> = ls.iter().map(Layer::weights).collect();
        let n = 2 * 40 * 12;
        let x = values(3 * DIM, 11, 2.0);
        let rows = 3;
        let c: Vec<f32> = (0..rows * 12).map(|j| (j as f32 * 0.1).cos()).collect();
        let sn: Vec<f32> = (0..rows * 12).map(|j| (j as f32 * 0.1).sin()).collect();
        let s = Shape { pos: 2, ..SHAPE };
        let (mut k, mut v) = (values(3 * n, 12, 1.0), values(3 * n, 13, 1.0));
        let (k0, v0) = (k.clone(), v.clone());
        let mut whole = x.clone();
        let mut features = vec![0.0; 2 * x.len()];
        forward_layers(
            &mut whole,
            &ws,
            &s,
            &c,
            &sn,
            None,
            &mut k,
            &mut v,
            &[2, 1],
            &mut features,
            None,
        )
        .unwrap();
        let mut each = x.clone();
        let (mut k1, mut v1) = (k0.clone(), v0.clone());
        let mut seen = Vec::new();
        for (l, w) in ws.iter().enumerate() {
            seen.push(each.clone());
            let (kl, vl) = (&mut k1[l * n..(l + 1) * n], &mut v1[l * n..(l + 1) * n]);
            one_layer(&mut each, w, &s, [&c, &sn], (kl, vl)).unwrap();
        }
        assert_eq!(whole, each);
        assert_eq!((k, v), (k1, v1));
        assert_eq!(features[..x.len()], seen[2]);
        assert_eq!(features[x.len()..], seen[1]);
        assert_ne!(seen[2], seen[1]);
    }

    /// A stack whose caches, feature layers or feature buffer do not fit is an error before
    /// anything is written.
    #[test]
    fn a_stack_checks_before_it_writes() {
        let ls = [layer(true), layer(true)];
        let output = output_matrix();
        let ws: Vec<Weights<'_>> = ls.iter().map(Layer::weights).collect();
        let n = 2 * 40 * 12;
        let c = vec![1.0; 12];
        let mut x = vec![0.5; DIM];
        let (mut k, mut v) = (vec![0.0; 2 * n], vec![0.0; 2 * n]);
        let mut f = vec![0.0; DIM];
        let short = &mut vec![0.0; n];
        let h = head(&output);
        // one thing wrong in each
        macro_rules! stack {
            ($k:expr, $cos:expr, $layers:expr, $f:expr, $head:expr) => {
                forward_layers(
                    &mut x, &ws, &SHAPE, $cos, &c, None, $k, &mut v, $layers, $f, $head,
                )
            };
        }
        let two_rows = &mut [0.0; 2 * VOCAB]; // logits for 2 rows of a 1-row pass
        for err in [
            stack!(short, &c, &[], &mut [], None),
            stack!(&mut k, &c, &[2], &mut f, None),
            stack!(&mut k, &c, &[0, 1], &mut f, None),
            stack!(&mut k, &c[..6], &[], &mut [], None),
            stack!(&mut k, &c, &[], &mut [], Some((&h, &mut two_rows[..]))),
        ] {
            assert!(err.is_err());
        }
        assert!(k.iter().chain(&v).all(|&e| e == 0.0) && x == vec![0.5; DIM]);
        let logits = &mut [0.0; VOCAB];
        stack!(&mut k, &c, &[1], &mut f, Some((&h, &mut logits[..]))).unwrap();
        assert!(k.iter().any(|&e| e != 0.0) && x != vec![0.5; DIM]);
        assert!(logits.iter().all(|l| l.is_finite() && *l != 0.0));
    }

    const VOCAB: usize = 37;

    fn head(output: &Int8Matrix) -> Head<'_> {
        Head {
            norm: &NORM,
            eps: 1e-5,
            output,
        }
    }

    static NORM: [f32; DIM] = [0.75; DIM];

    fn output_matrix() -> Int8Matrix {
        Int8Matrix::quantize(&values(VOCAB * DIM, 21, 1.0), VOCAB, DIM).unwrap()
    }

    /// The head's logits are the output matrix times each normed row, for the last R rows
    /// alone: 1 row of a 3-row pass gives what the 3 rows give for it, bit for bit.
    #[test]
    fn head_projects_the_last_rows() {
        let output = output_matrix();
        let h = head(&output);
        let x = values(3 * DIM, 22, 3.0);
        let mut all = vec![0.0; 3 * VOCAB];
        h.logits(&x, &mut all).unwrap();
        let mut last = vec![0.0; VOCAB];
        h.logits(&x, &mut last).unwrap();
        assert_eq!(last, all[2 * VOCAB..]);
        for (r, row) in x.chunks_exact(DIM).enumerate() {
            let ms = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / DIM as f64;
            let normed: Vec<f32> = row
                .iter()
                .map(|&v| (f64::from(v) * 0.75 / (ms + 1e-5).sqrt()) as f32)
                .collect();
            let mut want = vec![0.0; VOCAB];
            output.matmul(&normed, &mut want, Kernel::best()).unwrap();
            for (a, b) in all[r * VOCAB..(r + 1) * VOCAB].iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-3 * (1.0 + b.abs()),
                    "row {r}: {a} vs {b}"
                );
            }
        }
        // the unnormed rows give other logits: the norm is applied
        let mut raw = vec![0.0; VOCAB];
        output.matmul(&x[..DIM], &mut raw, Kernel::best()).unwrap();
        assert!(raw.iter().zip(&all).any(|(a, b)| (a - b).abs() > 1e-2));
        assert!(h.logits(&x, &mut vec![0.0; 4 * VOCAB]).is_err());
        assert!(h.logits(&x, &mut [0.0; VOCAB + 1]).is_err());
    }

    /// A float16 cache takes what it can hold and refuses, with an error, a key beyond its range
    /// (the same pass over a float32 cache runs).
    #[test]
    fn a_key_beyond_float16_is_an_error() {
        let n = 2 * 40 * 12;
        let c = vec![1.0; 12];
        let mut l = layer(false);
        let mut x = values(DIM, 7, 2.0);
        let (mut k, mut v) = (vec![f16::ZERO; n], vec![f16::ZERO; n]);
        let pass = |l: &Layer, x: &mut [f32], k: &mut [f16], v: &mut [f16]| {
            forward_layers(
                x,
                &[l.weights()],
                &SHAPE,
                &c,
                &c,
                None,
                k,
                v,
                &[],
                &mut [],
                None,
            )
        };
        pass(&l, &mut x, &mut k, &mut v).unwrap();
        assert!(k.iter().any(|h| h.to_f32() != 0.0));
        l.attn_norm.iter_mut().for_each(|w| *w *= 1e6);
        let mut x = values(DIM, 7, 2.0);
        let err = pass(&l, &mut x, &mut k, &mut v).unwrap_err();
        assert!(err.to_string().contains("float16"), "{err}");
        let mut x = values(DIM, 7, 2.0);
        let (mut k, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        one_layer(&mut x, &l.weights(), &SHAPE, [&c, &c], (&mut k, &mut v)).unwrap();
        assert!(k.iter().any(|x| x.abs() > 65504.0));
    }

    #[test]
    fn store_refuses_exactly_what_float16_rounds_to_infinity() {
        let below = f32::from_bits(HALF_OVERFLOW.to_bits() - 1);
        for x in [below, -below, 1.5, f32::INFINITY, f32::NAN] {
            let mut dst = [f16::ZERO; 3];
            store(&mut dst, &[x, 0.25, x]).unwrap();
            let one = f16::from_f32(x);
            assert!(dst[0].to_bits() == one.to_bits() && dst[2].to_bits() == one.to_bits());
            assert!(x.is_finite() == dst[0].is_finite(), "{x}");
        }
        for x in [HALF_OVERFLOW, -HALF_OVERFLOW, 1e30] {
            assert!(f16::from_f32(x).is_infinite());
            assert!(store(&mut [f16::ZERO; 2], &[0.0, x]).is_err(), "{x}");
        }
        // A float32 cache holds them all.
        let mut dst = [0.0f32; 2];
        store(&mut dst, &[1e30, -HALF_OVERFLOW]).unwrap();
        assert_eq!(
            dst.map(f32::to_bits),
            [1e30f32, -HALF_OVERFLOW].map(f32::to_bits)
        );
    }

    #[test]
    fn bad_shapes_are_errors() {
        let l = layer(false);
        let n = 2 * 40 * 12;
        let mut cache = (vec![0.0; n], vec![0.0; n - 1]);
        let w = l.weights();
        let mut x = vec![0.0; DIM];
        let c = vec![1.0; 12];
        let err =
            one_layer(&mut x, &w, &SHAPE, [&c, &c], (&mut cache.0, &mut cache.1)).unwrap_err();
        assert!(err.to_string().contains("k_cache"), "{err}");
        let (mut k, mut v) = (vec![0.0; n], vec![0.0; n]);
        assert!(one_layer(&mut x, &w, &SHAPE, [&c[..6], &c], (&mut k, &mut v)).is_err());
        let far = Shape {
            pos: usize::MAX,
            ..SHAPE
        };
        let err = one_layer(&mut x, &w, &far, [&c, &c], (&mut k, &mut v)).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
        one_layer(&mut x, &w, &SHAPE, [&c, &c], (&mut k, &mut v)).unwrap();
        let mut short = with_qk_norm(layer(false));
        short.qk_norm.as_mut().unwrap().1.pop();
        let err = one_layer(&mut x, &short.weights(), &SHAPE, [&c, &c], (&mut k, &mut v));
        assert!(err.unwrap_err().to_string().contains("k_norm"));
    }
}
