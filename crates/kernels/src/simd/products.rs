//! Products summed as attention sums them: lanes of fused multiply-adds, then a fixed tree, so
//! a value's bits depend on neither the build nor the other rows of a pass.

use super::{Lanes, Path, Portable, LANES};

/// Σ a·b as attention sums it (lanes of fused multiply-adds, then a fixed tree), on the best
/// build for this CPU.
pub fn dot_product(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_product of different lengths");
    match Path::best() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `best` checked the features.
        Path::Avx512 => unsafe { x86::dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Path::Avx2 => unsafe { x86::dot_avx2(a, b) },
        // SAFETY: the portable build needs no CPU feature.
        _ => unsafe { dot::<Portable>(a, b) },
    }
}

/// out (T, n) = x (T, dim) · w (n, dim)ᵀ, every value [`dot_product`]'s bits on any build: the
/// product of a float32 weight matrix (`crate::float`), summed as attention sums so that a
/// row's values do not depend on the other rows of the pass. `then` (rows of dim, or empty):
/// weights the caller multiplies next, whose first rows are fetched into L2 meanwhile.
pub(crate) fn dot_rows(
    x: &[f32],
    w: &[f32],
    then: &[f32],
    dim: usize,
    out: &mut [f32],
    path: Path,
) {
    assert!(
        dim > 0 && x.len().is_multiple_of(dim) && w.len().is_multiple_of(dim),
        "dot_rows: x and w must be whole rows of dim"
    );
    assert_eq!(
        out.len(),
        x.len() / dim * (w.len() / dim),
        "dot_rows: out is not T x n"
    );
    assert!(path.supported(), "dot_rows: this CPU cannot run {path:?}");
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `supported` checked the features.
        Path::Avx512 => unsafe { x86::dot_rows_avx512(x, w, then, dim, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Path::Avx2 => unsafe { x86::dot_rows_avx2(x, w, then, dim, out) },
        // SAFETY: the portable build needs no CPU feature.
        _ => unsafe { dot_rows_lanes::<Portable>(x, w, then, dim, out) },
    }
}

/// `dot_rows` on one build. The weights go K rows at a time, against the pass's rows a tile at
/// a time, so the K weight rows come from memory once and serve every row from L1: on 32-register
/// builds K = 8 against three rows (24 accumulators, each weight vector loaded once for the
/// three; a pair or a single row for the rest), on AVX2 K = 4 against a one-row pass and K = 3
/// against two rows for more (8 and 12 ymm accumulators: more would spill). Output columns past
/// the last K, and sizes that are not whole lanes, go through `dots`, one row at a time, as
/// attention's scores do.
#[inline(always)]
pub(crate) unsafe fn dot_rows_lanes<V: Lanes>(
    x: &[f32],
    w: &[f32],
    then: &[f32],
    dim: usize,
    out: &mut [f32],
) {
    let (rows, n) = (x.len() / dim, w.len() / dim);
    let (k, step) = match (V::WIDE, rows) {
        (true, _) => (8, 3),
        (false, 1) => (4, 1),
        // Two rows at a time load each weight vector once for both, where (4, 1)'s loads
        // would outnumber the FMA units' operands (bench_linear.py; docs/benchmarks.md §14).
        (false, _) => (3, 2),
    };
    let whole = if dim.is_multiple_of(LANES) {
        n / k * k
    } else {
        0
    };
    let tiles = rows.div_ceil(step);
    // Each tile fetches its share of the next K weight rows' cache lines into L2, a few lines
    // beside each step of its arithmetic, so that reading the weights from memory overlaps the
    // arithmetic of several rows; without it the hardware's prefetcher leaves the two mostly
    // in turn. The last step fetches the first rows of `then`, the weights its caller runs
    // next (bench_linear.py; docs/benchmarks.md §14).
    let lines = k * dim / 16;
    let share = lines.div_ceil(tiles);
    for j in (0..whole).step_by(k) {
        let wj = w.as_ptr().add(j * dim);
        for tile in 0..tiles {
            let (first, end) = (tile * share, ((tile + 1) * share).min(lines));
            let next = if j + 2 * k <= n {
                Some(wj.add(k * dim))
            } else if j + k == whole && then.len() >= k * dim {
                Some(then.as_ptr())
            } else {
                None
            };
            let pf = match next {
                Some(p) if first < end => (p.add(16 * first), end - first),
                _ => (wj, 0),
            };
            let t = step * tile;
            let dst = out.as_mut_ptr().add(t * n + j);
            let x_at = |r: usize| x.as_ptr().add((t + r) * dim);
            match (V::WIDE, rows - t) {
                (false, 1) if k == 4 => rows_tile::<V, 1, 4, 4>([x_at(0)], wj, dim, dst, n, pf),
                (false, 1) => rows_tile::<V, 1, 3, 3>([x_at(0)], wj, dim, dst, n, pf),
                (false, _) => rows_tile::<V, 2, 3, 6>([x_at(0), x_at(1)], wj, dim, dst, n, pf),
                (true, 1) => rows_tile::<V, 1, 8, 8>([x_at(0)], wj, dim, dst, n, pf),
                (true, 2) => rows_tile::<V, 2, 8, 16>([x_at(0), x_at(1)], wj, dim, dst, n, pf),
                (true, _) => {
                    rows_tile::<V, 3, 8, 24>([x_at(0), x_at(1), x_at(2)], wj, dim, dst, n, pf);
                }
            }
        }
    }
    if whole < n {
        for t in 0..rows {
            let xt = &x[t * dim..(t + 1) * dim];
            let row = &mut out[t * n + whole..(t + 1) * n];
            dots::<V>(xt, &w[whole * dim..], 1.0, row);
        }
    }
}

/// The R rows at `xs` against the K weight rows at `wp` (whole lanes of `dim`): `dot`'s lanes
/// for each of the N = R K pairs, then their trees, into K values at `dst` for each row (row r
/// at `dst + r * stride`); meanwhile `pf.1` cache lines from `pf.0` are fetched into L2.
#[inline(always)]
pub(crate) unsafe fn rows_tile<V: Lanes, const R: usize, const K: usize, const N: usize>(
    xs: [*const f32; R],
    wp: *const f32,
    dim: usize,
    dst: *mut f32,
    stride: usize,
    pf: (*const f32, usize),
) {
    let mut acc = [V::zero(); N];
    let per = pf.1.div_ceil(dim / LANES);
    for c in (0..dim).step_by(LANES) {
        let first = c / LANES * per;
        for line in first..(first + per).min(pf.1) {
            crate::prefetch::<{ crate::L2 }, _>(pf.0.add(16 * line));
        }
        let xc: [V; R] = std::array::from_fn(|r| V::load(xs[r].add(c)));
        for i in 0..K {
            let wc = V::load(wp.add(i * dim + c));
            for r in 0..R {
                acc[r * K + i] = V::fma(xc[r], wc, acc[r * K + i]);
            }
        }
    }
    let mut sums = [0.0f32; 32];
    if V::WIDE {
        // sums_scaled takes 16 registers: a third row's 8 go with 8 zeros (their trees unused).
        let mut h = 0;
        while h + 16 <= N {
            let a: &[V; 16] = acc[h..h + 16].try_into().unwrap_unchecked();
            V::sums_scaled(a, 1.0, sums.as_mut_ptr().add(h));
            h += 16;
        }
        if h < N {
            let mut rest = [V::zero(); 16];
            rest[..N - h].copy_from_slice(&acc[h..]);
            V::sums_scaled(&rest, 1.0, sums.as_mut_ptr().add(h));
        }
    } else {
        for (s, a) in sums.iter_mut().zip(&acc) {
            *s = a.sum();
        }
    }
    for r in 0..R {
        std::ptr::copy_nonoverlapping(sums.as_ptr().add(K * r), dst.add(r * stride), K);
    }
}

/// out = silu(gate) · up = gate / (1 + e^-gate) · up, elementwise, on the best build.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "silu_mul of different lengths"
    );
    match Path::best() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `best` checked the features.
        Path::Avx512 => unsafe { x86::silu_mul_avx512(gate, up, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Path::Avx2 => unsafe { x86::silu_mul_avx2(gate, up, out) },
        // SAFETY: the portable build needs no CPU feature.
        _ => unsafe { silu_mul_lanes::<Portable>(gate, up, out) },
    }
}

#[inline(always)]
pub(crate) unsafe fn silu_mul_lanes<V: Lanes>(gate: &[f32], up: &[f32], out: &mut [f32]) {
    gated_lanes::<V, false>(gate, up, out);
}

/// out = act(gate) · up, SiLU or (GELU) GELU-tanh, LANES values at a time (the tail through a
/// padded lane). (A const, not a function argument: a function pointer is not inlined into the
/// `#[target_feature]` entry point.)
#[inline(always)]
pub(crate) unsafe fn gated_lanes<V: Lanes, const GELU: bool>(
    gate: &[f32],
    up: &[f32],
    out: &mut [f32],
) {
    let whole = gate.len() / LANES * LANES;
    for c in (0..whole).step_by(LANES) {
        let y = gated_step::<V, GELU>(V::load(gate.as_ptr().add(c)), V::load(up.as_ptr().add(c)));
        y.store(out.as_mut_ptr().add(c));
    }
    if whole < gate.len() {
        let n = gate.len() - whole;
        let (mut g, mut u, mut y) = ([0.0f32; LANES], [0.0f32; LANES], [0.0f32; LANES]);
        g[..n].copy_from_slice(&gate[whole..]);
        u[..n].copy_from_slice(&up[whole..]);
        gated_step::<V, GELU>(V::load(g.as_ptr()), V::load(u.as_ptr())).store(y.as_mut_ptr());
        out[whole..].copy_from_slice(&y[..n]);
    }
}

#[inline(always)]
unsafe fn gated_step<V: Lanes, const GELU: bool>(g: V, u: V) -> V {
    if GELU {
        gelu_tanh_mul_step(g, u)
    } else {
        silu_mul_step(g, u)
    }
}

/// out = gelu(gate) · up, GELU's tanh approximation, elementwise, on the best build:
/// 0.5 x (1 + tanh(y)) = x / (1 + e^(-2y)), y = √(2/π) (x + 0.044715 x³).
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "gelu_tanh_mul of different lengths"
    );
    match Path::best() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `best` checked the features.
        Path::Avx512 => unsafe { x86::gelu_tanh_mul_avx512(gate, up, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Path::Avx2 => unsafe { x86::gelu_tanh_mul_avx2(gate, up, out) },
        // SAFETY: the portable build needs no CPU feature.
        _ => unsafe { gated_lanes::<Portable, true>(gate, up, out) },
    }
}

#[inline(always)]
pub(crate) unsafe fn gelu_tanh_mul_step<V: Lanes>(g: V, u: V) -> V {
    // -2y = g · (A + B g²), with A = -2√(2/π) and B = A · 0.044715; unfused, as every build.
    const A: f32 = -1.595_769_2;
    const B: f32 = -0.071_354_814;
    let z = V::mul(g, V::add(V::splat(A), V::mul(V::splat(B), V::mul(g, g))));
    V::mul(V::div(g, V::add(V::splat(1.0), z.exp())), u)
}

// (Functions, not closures: a closure is not inlined into the `#[target_feature]` entry point
// reliably, and its intrinsics then run as calls, ~100x slower.)
#[inline(always)]
pub(crate) unsafe fn silu_mul_step<V: Lanes>(g: V, u: V) -> V {
    let e = V::sub(V::zero(), g).exp();
    V::mul(V::div(g, V::add(V::splat(1.0), e)), u)
}

/// One key's q · k: lanes of fused multiply-adds over the head (tails of a head size that is
/// not a multiple of LANES go in lanes 0..), then the tree.
#[inline(always)]
pub(crate) unsafe fn dot<V: Lanes>(q: &[f32], kj: &[f32]) -> f32 {
    let whole = q.len() / LANES * LANES;
    let mut acc = V::zero();
    for c in (0..whole).step_by(LANES) {
        acc = V::fma(V::load(q.as_ptr().add(c)), V::load(kj.as_ptr().add(c)), acc);
    }
    if whole < q.len() {
        let mut tq = [0.0f32; LANES];
        let mut tk = [0.0f32; LANES];
        tq[..q.len() - whole].copy_from_slice(&q[whole..]);
        tk[..q.len() - whole].copy_from_slice(&kj[whole..]);
        acc = V::fma(V::load(tq.as_ptr()), V::load(tk.as_ptr()), acc);
    }
    acc.sum()
}

/// scores[j] = q · k_j · scale, where the head is whole lanes 16 keys at a time on 32-register
/// builds and then four at a time, so that several sums are in flight (each is still `dot`'s).
#[inline(always)]
pub(crate) unsafe fn dots<V: Lanes>(q: &[f32], kh: &[f32], scale: f32, scores: &mut [f32]) {
    let hd = q.len();
    let mut j = 0;
    if hd.is_multiple_of(LANES) {
        while V::WIDE && j + 16 <= scores.len() {
            let acc = key_lanes::<V, 16>(q, kh.as_ptr().add(j * hd));
            V::sums_scaled(&acc, scale, scores.as_mut_ptr().add(j));
            j += 16;
        }
        while j + 4 <= scores.len() {
            let acc = key_lanes::<V, 4>(q, kh.as_ptr().add(j * hd));
            for (i, a) in acc.iter().enumerate() {
                scores[j + i] = a.sum() * scale;
            }
            j += 4;
        }
    }
    while j < scores.len() {
        scores[j] = dot::<V>(q, &kh[j * hd..(j + 1) * hd]) * scale;
        j += 1;
    }
}

/// `dot`'s lanes for the K keys at `kp` (a head of whole lanes), before their trees.
#[inline(always)]
pub(crate) unsafe fn key_lanes<V: Lanes, const K: usize>(q: &[f32], kp: *const f32) -> [V; K] {
    let hd = q.len();
    let mut acc = [V::zero(); K];
    for c in (0..hd).step_by(LANES) {
        let qc = V::load(q.as_ptr().add(c));
        for (i, a) in acc.iter_mut().enumerate() {
            *a = V::fma(qc, V::load(kp.add(i * hd + c)), *a);
        }
    }
    acc
}

/// `key_lanes` of two queries for the 8 keys at `kp`, each key vector loaded once for both:
/// the first query's 8 accumulators, then the second's.
#[inline(always)]
pub(crate) unsafe fn key_lanes_two<V: Lanes>(q0: &[f32], q1: &[f32], kp: *const f32) -> [V; 16] {
    let hd = q0.len();
    let mut acc = [V::zero(); 16];
    for c in (0..hd).step_by(LANES) {
        let (a, b) = (V::load(q0.as_ptr().add(c)), V::load(q1.as_ptr().add(c)));
        for i in 0..8 {
            let kc = V::load(kp.add(i * hd + c));
            acc[i] = V::fma(a, kc, acc[i]);
            acc[8 + i] = V::fma(b, kc, acc[8 + i]);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::super::x86::{Avx2, Avx512};

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(crate) unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        super::dot::<Avx512>(a, b)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        super::dot::<Avx2>(a, b)
    }

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(crate) unsafe fn dot_rows_avx512(
        x: &[f32],
        w: &[f32],
        then: &[f32],
        dim: usize,
        out: &mut [f32],
    ) {
        super::dot_rows_lanes::<Avx512>(x, w, then, dim, out);
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_rows_avx2(
        x: &[f32],
        w: &[f32],
        then: &[f32],
        dim: usize,
        out: &mut [f32],
    ) {
        super::dot_rows_lanes::<Avx2>(x, w, then, dim, out);
    }

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(crate) unsafe fn silu_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
        super::silu_mul_lanes::<Avx512>(gate, up, out);
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn silu_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
        super::silu_mul_lanes::<Avx2>(gate, up, out);
    }

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(crate) unsafe fn gelu_tanh_mul_avx512(gate: &[f32], up: &[f32], out: &mut [f32]) {
        super::gated_lanes::<Avx512, true>(gate, up, out);
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn gelu_tanh_mul_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
        super::gated_lanes::<Avx2, true>(gate, up, out);
    }
}
