//! Causal attention over a KV cache for passes of a few query rows, each row computed on its
//! own, in an order that does not depend on how many rows the pass holds.
//!
//! A verify pass over k+1 tokens has to give, row for row, exactly what k+1 one-token passes
//! give: an int8 model rounds every activation, so a last-bit difference in attention grows into
//! a different token. torch's attention blocks its work by the number of rows. Here a row's
//! scores, softmax and weighted sum read only that row's query and the keys it sees.
//!
//! Its sums and exponentials are the SIMD layer's ([`crate::simd`]): lanes of fused
//! multiply-adds in a fixed tree, so the AVX-512, AVX2 and portable builds of [`attend`] give
//! the same bits.

// The generic loops below must inline into each build's `#[target_feature]` entry point, or
// their intrinsics run as calls: `inline(always)` is the point.
#![allow(clippy::inline_always)]

use half::f16;
use specfast_core::error::{Error, Result};

pub use crate::simd::{dot_product, gelu_tanh_mul, silu_mul, Elem, Path};
use crate::simd::{dots, key_lanes_two, Lanes, Portable, LANES};

/// Below this many multiply-adds a pass runs on the calling thread alone.
const PARALLEL_MIN: usize = 1 << 16;

/// The shape of one layer's attention.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    /// Query rows T of the pass, at positions `pos..pos + rows`.
    pub rows: usize,
    /// Query heads H.
    pub heads: usize,
    /// Key/value heads Hkv; query head h reads kv head h / (H / Hkv).
    pub kv_heads: usize,
    /// Width hd of a head.
    pub head_dim: usize,
    /// Slots S per kv head in the cache.
    pub capacity: usize,
    /// The position of the first row.
    pub pos: usize,
    /// A sliding window: row t sees only its last `window` keys, `pos + t + 1 - window..=pos
    /// + t` (Gemma 3's local layers); 0 for every key.
    pub window: usize,
    /// The scores' scale; None for 1/√hd.
    pub scale: Option<f32>,
}

impl Dims {
    /// The keys row t sees: `(lo, hi)`, keys `lo..hi`, with `lo` rounded down to an even key so
    /// that every path pairs the same keys into its even and odd chains, and whether key `lo`
    /// is outside the window (its weight is then 0).
    fn keys(&self, t: usize) -> (usize, usize, bool) {
        let hi = self.pos + t + 1;
        let start = if self.window == 0 {
            0
        } else {
            hi.saturating_sub(self.window)
        };
        (start & !1, hi, start & 1 == 1)
    }

    fn scale(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }
}

/// out (H, T, hd) = softmax(q kᵀ · scale) v per head, row t over keys `0..=pos + t` (or the
/// last `window` of them).
///
/// q is (H, T, hd); k and v are (Hkv, S, hd) with slots `0..pos + T` written. A row whose
/// scores are not all finite (a NaN or infinity in its query or keys) comes out as NaN.
pub fn attend<E: Elem>(q: &[f32], k: &[E], v: &[E], out: &mut [f32], d: &Dims) -> Result<()> {
    attend_with(q, k, v, out, d, Path::best())
}

/// [`attend`] through a chosen build of the loops (tests compare them).
pub fn attend_with<E: Elem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    d: &Dims,
    path: Path,
) -> Result<()> {
    check(q, k, v, out, d)?;
    if !path.supported() {
        return Err(Error::value(format!(
            "this CPU cannot run the {path:?} path"
        )));
    }
    let n_items = d.heads * d.rows;
    if n_items == 0 || d.head_dim == 0 {
        return Ok(());
    }
    let work = n_items * (d.pos + d.rows) * d.head_dim;
    let run = |first: usize, out: &mut [f32]| match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `supported` checked that this CPU has the features.
        Path::Avx512 => unsafe { x86::items_avx512(q, k, v, out, d, first) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Path::Avx2 => unsafe { x86::items_avx2(q, k, v, out, d, first) },
        // SAFETY: the portable build needs no CPU feature.
        _ => unsafe { items::<Portable, E>(q, k, v, out, d, first) },
    };
    if n_items < 2 || work < PARALLEL_MIN {
        run(0, out);
        return Ok(());
    }
    // This thread and the helper (helper.rs) take pieces of the (head, row) items, from both ends.
    // Each item writes its own hd values, so the split cannot change them. A piece lies within
    // one kv head, so that its items share the head's keys and values (`bundle`), and the
    // pieces are the kv heads cut once more at the middle item: each thread then takes about
    // half the items, and reads each kv head's keys and values for as many of them at once as
    // it can (bench_attention.py; docs/benchmarks.md §14).
    let per_kv = n_items / d.kv_heads;
    let mut cuts: Vec<usize> = (0..=d.kv_heads).map(|h| h * per_kv).collect();
    cuts.push(n_items / 2);
    cuts.sort_unstable();
    cuts.dedup();
    let shared = crate::helper::Shared::new(out);
    crate::helper::for_each(cuts.len() - 1, |u| {
        let (first, end) = (cuts[u], cuts[u + 1]);
        // SAFETY: pieces cover disjoint item ranges of `out`.
        let part = unsafe { shared.part(first * d.head_dim..end * d.head_dim) };
        run(first, part);
    });
    Ok(())
}

fn check<E>(q: &[f32], k: &[E], v: &[E], out: &mut [f32], d: &Dims) -> Result<()> {
    if d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) {
        return Err(Error::value(format!(
            "heads ({}) must be a positive multiple of kv_heads ({})",
            d.heads, d.kv_heads
        )));
    }
    if d.pos.checked_add(d.rows).is_none_or(|end| end > d.capacity) {
        return Err(Error::value(format!(
            "{} rows from position {} do not fit a cache of {} slots",
            d.rows, d.pos, d.capacity
        )));
    }
    let qn = d.heads * d.rows * d.head_dim;
    let kn = d.kv_heads * d.capacity * d.head_dim;
    if q.len() != qn || out.len() != qn || k.len() != kn || v.len() != kn {
        return Err(Error::value(format!(
            "q and out must hold H x T x hd = {qn} values and k, v Hkv x S x hd = {kn}; got q \
             {}, out {}, k {}, v {}",
            q.len(),
            out.len(),
            k.len(),
            v.len()
        )));
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::simd::x86::{Avx2, Avx512};

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
    pub(super) unsafe fn items_avx512<E: super::Elem>(
        q: &[f32],
        k: &[E],
        v: &[E],
        out: &mut [f32],
        d: &super::Dims,
        first: usize,
    ) {
        super::items::<Avx512, E>(q, k, v, out, d, first);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn items_avx2<E: super::Elem>(
        q: &[f32],
        k: &[E],
        v: &[E],
        out: &mut [f32],
        d: &super::Dims,
        first: usize,
    ) {
        super::items::<Avx2, E>(q, k, v, out, d, first);
    }
}

/// Items `first..` (item = head * T + row) into `out`, which holds as many items as it fits.
/// A head of whole lanes goes a bundle at a time (`bundle`); other sizes, which only the
/// portable build gets (`attend_with`), one item at a time.
#[inline(always)]
unsafe fn items<V: Lanes, E: Elem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    d: &Dims,
    first: usize,
) {
    let hd = d.head_dim;
    if !hd.is_multiple_of(LANES) {
        items_one_by_one::<V, E>(q, k, v, out, d, first);
        return;
    }
    let group = d.heads / d.kv_heads;
    let kv_of = |item: usize| (item / d.rows) / group;
    // At most this many scores at once, whatever the context: 1 MiB.
    let most = (BUNDLE_SCORES / (d.pos + d.rows).next_multiple_of(LANES)).clamp(1, BUNDLE);
    let n_out = out.len() / hd;
    let mut n = 0;
    while n < n_out {
        let kv = kv_of(first + n);
        let mut m = 1;
        while n + m < n_out && m < most && kv_of(first + n + m) == kv {
            m += 1;
        }
        bundle::<V, E>(q, k, v, &mut out[n * hd..(n + m) * hd], d, first + n);
        n += m;
    }
}

thread_local! {
    /// `bundle`'s scores, kept from one bundle to the next on each thread: a bundle writes every
    /// score it reads, so it never needs a fresh, zeroed one.
    static SCORES: std::cell::UnsafeCell<Vec<f32>> = const { std::cell::UnsafeCell::new(Vec::new()) };
}

/// Items a bundle holds at most: they share a kv head, and read its keys and values a tile at
/// a time, so a tile read once from L2 serves all of them from L1.
const BUNDLE: usize = 32;
const BUNDLE_SCORES: usize = 1 << 18;
/// The bytes of a tile in f32: 64 keys of a 64-wide head, 32 of a 128-wide one, half of a 32
/// KiB L1. Its keys are a multiple of 16, so even: a tile starts every item's even chain on an
/// even key (`accumulate`). The size is bench_attention.py's choice (docs/benchmarks.md §14).
const TILE_BYTES: usize = 16 << 10;

/// Keys a tile of a head of `hd` values holds (see `TILE_BYTES`).
fn tile_keys(hd: usize) -> usize {
    (TILE_BYTES / (4 * hd.max(1)) / 16).max(1) * 16
}

/// Items from which a bundle fetches its next tile into L1 while it works on this one. With
/// this many, a tile's arithmetic outlasts its reads, and the cache's lines arrive where the
/// hardware's prefetchers, which stop at each 4 KiB page, leave them late. Smaller bundles go
/// without: there the fetch did not pay (bench_attention.py; docs/benchmarks.md §14).
const FETCH_ITEMS: usize = 4;
/// The most that the tile in f32 and the next one as the cache holds it may take, for the
/// fetch: three quarters of a 32 KiB L1. A float16 cache's tiles fit (16 + 8 KiB); a float32
/// cache's (16 + 16) do not, and fetching those did not pay (docs/benchmarks.md §14).
const FETCH_BYTES: usize = 24 << 10;

/// Fetches a tile's cache lines into L1 a share at a time, in the `steps` steps of the work
/// that goes before the tile is read (nothing when `on` is false).
struct Ahead {
    at: *const u8,
    end: *const u8,
    per: usize,
}

impl Ahead {
    fn new<E>(tile: &[E], on: bool, steps: usize) -> Ahead {
        let bytes = if on { std::mem::size_of_val(tile) } else { 0 };
        let at = tile.as_ptr().cast::<u8>();
        Ahead {
            at,
            end: at.wrapping_add(bytes),
            per: bytes.div_ceil(64).div_ceil(steps.max(1)),
        }
    }

    /// Fetches the next share of lines.
    #[inline(always)]
    fn step(&mut self) {
        for _ in 0..self.per {
            if self.at >= self.end {
                return;
            }
            crate::prefetch::<{ crate::L1 }, _>(self.at);
            self.at = self.at.wrapping_add(64);
        }
    }
}

/// The items of `out` (consecutive, from `first`, one kv head), each exactly as
/// `items_one_by_one` computes it: the same scores, softmax and chains of multiply-adds, in the
/// same order per item; only which item goes next changes.
#[inline(always)]
unsafe fn bundle<V: Lanes, E: Elem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    d: &Dims,
    first: usize,
) {
    let hd = d.head_dim;
    let m = out.len() / hd;
    let group = d.heads / d.kv_heads;
    let head_len = d.capacity * hd;
    let kv = (first / d.rows) / group;
    let (kh, vh) = (&k[kv * head_len..], &v[kv * head_len..]);
    let scale = d.scale();
    let range = |i: usize| d.keys((first + i) % d.rows);
    let keys = |i: usize| range(i).1;
    let most = (0..m).map(keys).max().unwrap_or(0);
    let tile = tile_keys(hd);
    // Tiles wholly before every item's window are skipped.
    let least = (0..m).map(|i| range(i).0).min().unwrap_or(0) / tile * tile;
    // A windowed row's softmax runs over whole lanes from its first key: one more lane.
    let width = (d.pos + d.rows).next_multiple_of(LANES) + if d.window > 0 { LANES } else { 0 };
    // SAFETY: this thread's buffer, which one bundle at a time uses (bundles do not nest). (A
    // pointer out of the closure rather than the work inside it: a closure is not reliably
    // inlined into the `#[target_feature]` entry point.)
    let buf = unsafe { &mut *SCORES.with(std::cell::UnsafeCell::get) };
    if buf.len() < m * width {
        buf.resize(m * width, 0.0);
    }
    let scores = &mut buf[..m * width];
    let qs = &q[first * hd..(first + m) * hd];
    let fetch = m >= FETCH_ITEMS && tile * hd * (4 + std::mem::size_of::<E>()) <= FETCH_BYTES;
    // A tile of a float16 cache, in f32.
    let mut wide = Vec::new();
    // The items by how many keys they see, so that in the tile where their keys end, items over
    // the same keys (the query heads of one row) are neighbours, which go together.
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by_key(|&i| keys(i));
    // (item, where its keys in the tile start and end), in `order`
    let span = |i: usize, j0: usize| {
        let (lo, hi, _) = range(i);
        let end = hi.min(j0 + tile).max(j0);
        (i, lo.max(j0).min(end), end)
    };
    let mut ends = Vec::with_capacity(m);
    for j0 in (least..most).step_by(tile) {
        ends.clear();
        ends.extend(order.iter().map(|&i| span(i, j0)));
        let kt = widen::<V, E>(&kh[j0 * hd..most.min(j0 + tile) * hd], &mut wide);
        // The next tile: this head's next keys, or after the last its first values.
        let next = if j0 + tile < most {
            &kh[(j0 + tile) * hd..most.min(j0 + 2 * tile) * hd]
        } else {
            &vh[..most.min(tile) * hd]
        };
        let ahead = Ahead::new(next, fetch, ends.len().div_ceil(2));
        score_tile::<V>(qs, kt, scale, &ends, j0, scores, width, ahead);
    }
    let mut totals = vec![None; m];
    for (i, (row, total)) in scores.chunks_exact_mut(width).zip(&mut totals).enumerate() {
        let (lo, hi, skip) = range(i);
        let n = hi - lo;
        *total = softmax_weights::<V>(&mut row[lo..lo + n.next_multiple_of(LANES)], n, skip);
    }
    // Per item and lane-group: its even chain, then its odd one (hd / LANES groups each).
    let mut chains = vec![0.0f32; m * 2 * hd];
    for j0 in (least..most).step_by(tile) {
        // Items with no keys left in this tile, or no weights (NaN rows), end here.
        ends.clear();
        ends.extend(order.iter().map(|&i| match totals[i] {
            Some(_) => span(i, j0),
            None => (i, j0, j0),
        }));
        let vt = widen::<V, E>(&vh[j0 * hd..most.min(j0 + tile) * hd], &mut wide);
        let next = &vh[most.min(j0 + tile) * hd..most.min(j0 + 2 * tile) * hd];
        let ahead = Ahead::new(next, fetch, ends.len().div_ceil(ITEMS_PER_LOAD));
        value_tile::<V>(scores, width, vt, hd, &ends, j0, &mut chains, ahead);
    }
    for (i, o) in out.chunks_exact_mut(hd).enumerate() {
        let Some(total) = totals[i] else {
            o.fill(f32::NAN);
            continue;
        };
        let (even, odd) = chains[i * 2 * hd..(i + 1) * 2 * hd].split_at(hd);
        for ((y, &e), &od) in o.iter_mut().zip(even).zip(odd) {
            *y = (e + od) / total;
        }
    }
}

/// Cache values as f32: themselves, or for float16 converted into `wide` (a tile, once for all
/// the items of a bundle). Each f16 is an f32 exactly, so the bits are those of a float32 cache
/// holding the same values, and everything past here reads f32.
#[inline(always)]
unsafe fn widen<'a, V: Lanes, E: Elem>(src: &'a [E], wide: &'a mut Vec<f32>) -> &'a [f32] {
    if !E::HALF {
        // Elem is sealed to f32 and f16, so a cache that is not HALF is f32.
        return std::slice::from_raw_parts(src.as_ptr().cast::<f32>(), src.len());
    }
    wide.resize(src.len(), 0.0);
    let (from, whole) = (src.as_ptr().cast::<f16>(), src.len() / LANES * LANES);
    for c in (0..whole).step_by(LANES) {
        V::load_half(from.add(c)).store(wide.as_mut_ptr().add(c));
    }
    for (w, &x) in wide[whole..].iter_mut().zip(&src[whole..]) {
        *w = x.to_f32();
    }
    wide
}

/// Scores of a bundle's items (queries `qs`, hd each) over a tile's keys (`kt`, from key j0),
/// item i over keys `j0..e` for each `(i, e)` of `ends`, into row i of `scores`. Two items
/// over the same keys go together and share each key loaded (`key_lanes_two`); each score is
/// still `dot`'s.
///
/// Keys held dimension-major (16 keys to a vector, one chain of multiply-adds a key in the
/// order of d) would need no tree, but the cache holds keys row by row, and a 16 × 16
/// transpose of every tile for each bundle costs more than the trees it saves: a one-row
/// bundle shares each tile among only its kv head's query heads (docs/benchmarks.md §14).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_tile<V: Lanes>(
    qs: &[f32],
    kt: &[f32],
    scale: f32,
    ends: &[(usize, usize, usize)],
    j0: usize,
    scores: &mut [f32],
    width: usize,
    mut ahead: Ahead,
) {
    let hd = qs.len() / ends.len(); // one query per item
    let qrow = |i: usize| &qs[i * hd..(i + 1) * hd];
    let can_pair = V::WIDE && hd.is_multiple_of(LANES);
    let mut at = 0;
    while at < ends.len() {
        ahead.step();
        let (i, s, e) = ends[at];
        let mut j = s;
        // The next item, where it is over the same keys and can share them.
        let pair = ends
            .get(at + 1)
            .filter(|&&(_, s2, e2)| can_pair && s2 == s && e2 == e);
        if let Some(&(i2, _, _)) = pair {
            while j + 8 <= e {
                let acc = key_lanes_two::<V>(qrow(i), qrow(i2), kt.as_ptr().add((j - j0) * hd));
                let mut both = [0.0f32; 16];
                V::sums_scaled(&acc, scale, both.as_mut_ptr());
                scores[i * width + j..][..8].copy_from_slice(&both[..8]);
                scores[i2 * width + j..][..8].copy_from_slice(&both[8..]);
                j += 8;
            }
        }
        let n = 1 + usize::from(pair.is_some());
        for &(r, _, _) in &ends[at..at + n] {
            if j < e {
                dots::<V>(
                    qrow(r),
                    &kt[(j - j0) * hd..(e - j0) * hd],
                    scale,
                    &mut scores[r * width + j..r * width + e],
                );
            }
        }
        at += n;
    }
}

/// Continues the even and odd chains of a bundle's items (`chains`: per item, even then odd,
/// hd each) over a tile's keys (`vt`, from key j0), item i over keys `s..e` for each
/// `(i, s, e)` of `ends` (s even), its weights in row i of `scores`. Up to ITEMS_PER_LOAD
/// neighbours in `ends` over the same keys go together and share each value loaded.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn value_tile<V: Lanes>(
    scores: &[f32],
    width: usize,
    vt: &[f32],
    hd: usize,
    ends: &[(usize, usize, usize)],
    j0: usize,
    chains: &mut [f32],
    mut ahead: Ahead,
) {
    let chunks = hd / LANES;
    let mut at = 0;
    while at < ends.len() {
        ahead.step();
        let (_, s, e) = ends[at];
        let n = ends[at..]
            .iter()
            .take(ITEMS_PER_LOAD)
            .take_while(|&&(_, s2, e2)| s2 == s && e2 == e)
            .count();
        let group = &ends[at..at + n];
        let vt = &vt[(s - j0) * hd..(e - j0) * hd];
        let cp = chains.as_mut_ptr();
        if e > s && V::WIDE && n == ITEMS_PER_LOAD && chunks.is_multiple_of(4) {
            let ps = std::array::from_fn(|r| scores[group[r].0 * width + s..].as_ptr());
            let states = std::array::from_fn(|r| cp.add(group[r].0 * 2 * hd));
            for c0 in (0..chunks).step_by(4) {
                accumulate_items::<V, ITEMS_PER_LOAD, 4>(&ps, e - s, vt, hd, c0, &states);
            }
        } else if e > s {
            for &(r, _, _) in group {
                let state = &mut chains[r * 2 * hd..(r + 1) * 2 * hd];
                accumulate::<V>(&scores[r * width + s..r * width + e], vt, hd, chunks, state);
            }
        }
        at += n;
    }
}

/// Continues an item's even and odd chains (`state`: even then odd, hd each) over one tile of
/// keys (`p` their weights, `vt` their values), as `lane_groups` runs them over all keys:
/// even keys into the even chain, odd ones into the odd one, a last unpaired key into the even
/// one. The tile starts on an even key.
#[inline(always)]
unsafe fn accumulate<V: Lanes>(p: &[f32], vt: &[f32], hd: usize, chunks: usize, state: &mut [f32]) {
    debug_assert!(vt.len() >= p.len() * hd && state.len() == 2 * hd);
    let (ps, states, keys) = ([p.as_ptr()], [state.as_mut_ptr()], p.len());
    let mut c0 = 0;
    // Eight chains in flight where 32 registers hold them, four otherwise.
    while V::WIDE && c0 + 4 <= chunks {
        accumulate_items::<V, 1, 4>(&ps, keys, vt, hd, c0, &states);
        c0 += 4;
    }
    while c0 + 2 <= chunks {
        accumulate_items::<V, 1, 2>(&ps, keys, vt, hd, c0, &states);
        c0 += 2;
    }
    if c0 < chunks {
        accumulate_items::<V, 1, 1>(&ps, keys, vt, hd, c0, &states);
    }
}

/// Items whose value sums `bundle` runs together, each value vector loaded once for all.
const ITEMS_PER_LOAD: usize = 3;

/// `accumulate` for lane-groups c0..c0+G of N items over the same `keys` values (`ps[i]` item
/// i's weights, `states[i]` its chains): each item's chains get the same multiply-adds in the
/// same order as alone, so the same bits; each value loaded serves all N.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // even[i][g], odd[i][g] and chunk c0 + g together
unsafe fn accumulate_items<V: Lanes, const N: usize, const G: usize>(
    ps: &[*const f32; N],
    keys: usize,
    vt: &[f32],
    hd: usize,
    c0: usize,
    states: &[*mut f32; N],
) {
    debug_assert!(vt.len() >= keys * hd);
    let vp = vt.as_ptr().add(c0 * LANES);
    let mut even = [[V::zero(); G]; N];
    let mut odd = [[V::zero(); G]; N];
    for i in 0..N {
        for g in 0..G {
            even[i][g] = V::load(states[i].add((c0 + g) * LANES));
            odd[i][g] = V::load(states[i].add(hd + (c0 + g) * LANES));
        }
    }
    let mut j = 0;
    while j + 2 <= keys {
        let (r0, r1) = (vp.add(j * hd), vp.add((j + 1) * hd));
        for g in 0..G {
            let (v0, v1) = (V::load(r0.add(g * LANES)), V::load(r1.add(g * LANES)));
            for i in 0..N {
                even[i][g] = V::fma(V::splat(*ps[i].add(j)), v0, even[i][g]);
                odd[i][g] = V::fma(V::splat(*ps[i].add(j + 1)), v1, odd[i][g]);
            }
        }
        j += 2;
    }
    if j < keys {
        let r0 = vp.add(j * hd);
        for g in 0..G {
            let v0 = V::load(r0.add(g * LANES));
            for i in 0..N {
                even[i][g] = V::fma(V::splat(*ps[i].add(j)), v0, even[i][g]);
            }
        }
    }
    for i in 0..N {
        for g in 0..G {
            even[i][g].store(states[i].add((c0 + g) * LANES));
            odd[i][g].store(states[i].add(hd + (c0 + g) * LANES));
        }
    }
}

/// `items` one item at a time: its scores over all keys, softmax, then the weighted sum.
#[inline(always)]
unsafe fn items_one_by_one<V: Lanes, E: Elem>(
    q: &[f32],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    d: &Dims,
    first: usize,
) {
    let hd = d.head_dim;
    let group = d.heads / d.kv_heads;
    let head_len = d.capacity * hd;
    let scale = d.scale();
    // Scores padded to whole lanes: padding repeats a real score while the maximum is taken,
    // then is -inf, whose weight is 0.
    let width = (d.pos + d.rows).next_multiple_of(LANES);
    let mut scores = vec![0.0f32; width];
    let mut acc = vec![0.0f32; hd.next_multiple_of(LANES)];
    let (mut wide_k, mut wide_v) = (Vec::new(), Vec::new());
    for (n, o) in out.chunks_exact_mut(hd).enumerate() {
        let item = first + n;
        let (h, t) = (item / d.rows, item % d.rows);
        let kv = h / group;
        let (lo, hi, skip) = d.keys(t);
        let keys = hi - lo;
        let qrow = &q[item * hd..(item + 1) * hd];
        let (k0, k1) = (kv * head_len + lo * hd, kv * head_len + hi * hd);
        let kh = widen::<V, E>(&k[k0..k1], &mut wide_k);
        let vh = widen::<V, E>(&v[k0..k1], &mut wide_v);
        let padded = &mut scores[..keys.next_multiple_of(LANES)];
        dots::<V>(qrow, kh, scale, &mut padded[..keys]);
        let Some(total) = softmax_weights::<V>(padded, keys, skip) else {
            o.fill(f32::NAN);
            continue;
        };
        weighted_sum::<V>(&padded[..keys], vh, hd, &mut acc);
        for (y, &a) in o.iter_mut().zip(&acc[..hd]) {
            *y = a / total;
        }
    }
}

/// padded[..keys] (scores) -> e^(s - max) in place, the rest -> 0; their sum. With `skip`, the
/// first key is outside the window: its weight is 0 too, and its score is not read. None if a
/// score is not finite.
#[inline(always)]
unsafe fn softmax_weights<V: Lanes>(padded: &mut [f32], keys: usize, skip: bool) -> Option<f32> {
    let (real, pad) = padded.split_at_mut(keys);
    let first = usize::from(skip);
    pad.fill(real[first]);
    real[0] = real[first];
    // s · 0 is 0 for finite s and NaN for NaN or ±inf; max is exact in any order.
    let zero = V::zero();
    let mut probe = V::zero();
    let mut top = V::splat(f32::NEG_INFINITY);
    let p = padded.as_mut_ptr();
    for c in (0..padded.len()).step_by(LANES) {
        let x = V::load(p.add(c));
        probe = V::fma(x, zero, probe);
        top = V::max(top, x);
    }
    if probe.sum() != 0.0 {
        return None;
    }
    let mut m = [0.0f32; LANES];
    top.store(m.as_mut_ptr());
    let m = V::splat(m.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    padded[keys..].fill(f32::NEG_INFINITY);
    if skip {
        padded[0] = f32::NEG_INFINITY;
    }
    let mut total = V::zero();
    let minus_one = V::splat(-1.0);
    for c in (0..padded.len()).step_by(LANES) {
        let e = V::fma(m, minus_one, V::load(p.add(c))).exp(); // s - m, rounded once
        e.store(p.add(c));
        total = V::add(total, e);
    }
    Some(total.sum())
}

/// acc[..hd] = Σ_j p_j v_j, for `acc` of hd rounded up to whole lanes. Per lane, even keys are
/// summed in one chain of multiply-adds and odd keys in another, then the two are added; four
/// lane-groups go at once (two on 16-register builds), so that eight chains are in flight. How
/// many go at once does not change a lane's sums.
#[inline(always)]
unsafe fn weighted_sum<V: Lanes>(p: &[f32], vh: &[f32], hd: usize, acc: &mut [f32]) {
    let chunks = acc.len() / LANES;
    let mut c = 0;
    if V::WIDE {
        while c + 4 <= chunks {
            lane_groups::<V, 4>(p, vh, hd, c, acc);
            c += 4;
        }
    }
    while c + 2 <= chunks {
        lane_groups::<V, 2>(p, vh, hd, c, acc);
        c += 2;
    }
    while c < chunks {
        lane_groups::<V, 1>(p, vh, hd, c, acc);
        c += 1;
    }
}

/// Lanes c of key j's values (vh: (keys, hd)); past the end of the head, zeros.
#[inline(always)]
unsafe fn head_lanes<V: Lanes>(vh: &[f32], hd: usize, j: usize, c: usize) -> V {
    let at = c * LANES;
    if hd.is_multiple_of(LANES) || at + LANES <= hd {
        V::load(vh.as_ptr().add(j * hd + at))
    } else {
        let mut tail = [0.0f32; LANES];
        tail[..hd - at].copy_from_slice(&vh[j * hd + at..(j + 1) * hd]);
        V::load(tail.as_ptr())
    }
}

#[inline(always)]
#[allow(clippy::needless_range_loop)] // even[g], odd[g] and chunk c0 + g together
unsafe fn lane_groups<V: Lanes, const G: usize>(
    p: &[f32],
    vh: &[f32],
    hd: usize,
    c0: usize,
    acc: &mut [f32],
) {
    let mut even = [V::zero(); G];
    let mut odd = [V::zero(); G];
    let mut j = 0;
    while j + 2 <= p.len() {
        let (p0, p1) = (V::splat(p[j]), V::splat(p[j + 1]));
        for g in 0..G {
            even[g] = V::fma(p0, head_lanes::<V>(vh, hd, j, c0 + g), even[g]);
            odd[g] = V::fma(p1, head_lanes::<V>(vh, hd, j + 1, c0 + g), odd[g]);
        }
        j += 2;
    }
    if j < p.len() {
        let p0 = V::splat(p[j]);
        for g in 0..G {
            even[g] = V::fma(p0, head_lanes::<V>(vh, hd, j, c0 + g), even[g]);
        }
    }
    for g in 0..G {
        V::add(even[g], odd[g]).store(acc.as_mut_ptr().add((c0 + g) * LANES));
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    use proptest::prelude::*;

    /// Softmax attention in f64 over the same inputs.
    fn reference(q: &[f32], k: &[f32], v: &[f32], d: &Dims) -> Vec<f64> {
        let hd = d.head_dim;
        let g = d.heads / d.kv_heads;
        let mut out = vec![0.0f64; q.len()];
        for h in 0..d.heads {
            for t in 0..d.rows {
                let item = h * d.rows + t;
                let base = (h / g) * d.capacity * hd;
                let keys = d.pos + t + 1;
                let first = if d.window == 0 {
                    0
                } else {
                    keys.saturating_sub(d.window)
                };
                let scale = d.scale.map_or(1.0 / (hd as f64).sqrt(), f64::from);
                let s: Vec<f64> = (0..keys)
                    .map(|j| {
                        let dot = (0..hd)
                            .map(|x| f64::from(q[item * hd + x]) * f64::from(k[base + j * hd + x]))
                            .sum::<f64>();
                        if j < first {
                            f64::NEG_INFINITY
                        } else {
                            dot * scale
                        }
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = p.iter().sum();
                for x in 0..hd {
                    out[item * hd + x] = (0..keys)
                        .map(|j| p[j] * f64::from(v[base + j * hd + x]))
                        .sum::<f64>()
                        / z;
                }
            }
        }
        out
    }

    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn case(d: &Dims, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let qn = d.heads * d.rows * d.head_dim;
        let kn = d.kv_heads * d.capacity * d.head_dim;
        (values(qn, seed), values(kn, seed + 1), values(kn, seed + 2))
    }

    fn run<E: Elem>(q: &[f32], k: &[E], v: &[E], d: &Dims, path: Path) -> Vec<f32> {
        let mut out = vec![0.0f32; q.len()];
        attend_with(q, k, v, &mut out, d, path).unwrap();
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn matches_f64_reference(
            rows in 1usize..6, kv in 1usize..4, g in 1usize..4, hd in 1usize..40,
            pos in 0usize..70, spare in 0usize..5, seed in 0u64..1000,
            window in prop_oneof![Just(0usize), 1usize..40], scale in prop::option::of(0.05f32..0.5),
        ) {
            let d = Dims { rows, heads: kv * g, kv_heads: kv, head_dim: hd,
                           capacity: pos + rows + spare, pos, window, scale };
            let (q, k, v) = case(&d, seed);
            let want = reference(&q, &k, &v, &d);
            let got = run(&q, &k, &v, &d, Path::best());
            for (g, w) in got.iter().zip(&want) {
                prop_assert!((f64::from(*g) - w).abs() < 1e-5, "{g} vs {w}");
            }
        }
    }

    /// The point of the module: row t of a T-row pass equals a one-row pass at position pos + t.
    #[test]
    fn a_row_does_not_depend_on_the_row_count() {
        let d = Dims {
            rows: 9,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            capacity: 600,
            pos: 500,
            window: 0,
            scale: None,
        };
        let (q, k, v) = case(&d, 7);
        let many = run(&q, &k, &v, &d, Path::best());
        for t in 0..d.rows {
            let one = Dims {
                rows: 1,
                pos: d.pos + t,
                ..d
            };
            let q1: Vec<f32> = (0..d.heads)
                .flat_map(|h| {
                    let i = (h * d.rows + t) * d.head_dim;
                    q[i..i + d.head_dim].to_vec()
                })
                .collect();
            let got = run(&q1, &k, &v, &one, Path::best());
            for h in 0..d.heads {
                let i = (h * d.rows + t) * d.head_dim;
                assert_eq!(
                    got[h * d.head_dim..(h + 1) * d.head_dim],
                    many[i..i + d.head_dim]
                );
            }
        }
    }

    /// Bundles (items sharing a kv head, keys a tile at a time) give each item the bits it gets
    /// alone: several tiles, odd and even key counts, a bundle cut at its size limit.
    #[test]
    fn bundles_give_the_bits_of_one_item_at_a_time() {
        // 151-162 keys: 3 tiles of a 64-wide head, 5 or 6 of a 128-wide one.
        for head_dim in [64, 128] {
            assert!(tile_keys(head_dim) < 150 / 2);
            let d = Dims {
                rows: 12,
                heads: 8,
                kv_heads: 2,
                head_dim,
                capacity: 170,
                pos: 150,
                window: 0,
                scale: None,
            };
            let (q, k, v) = case(&d, 5);
            let mut alone = vec![0.0f32; q.len()];
            // SAFETY: the portable build needs no CPU feature.
            unsafe { items_one_by_one::<Portable, _>(&q, &k, &v, &mut alone, &d, 0) };
            assert_eq!(run(&q, &k, &v, &d, Path::best()), alone, "{head_dim}");
            let mut bundled = vec![0.0f32; q.len()];
            // SAFETY: as above.
            unsafe { items::<Portable, _>(&q, &k, &v, &mut bundled, &d, 0) };
            assert_eq!(bundled, alone, "{head_dim}");
        }
    }

    /// Negative control for the test above: a row that also sees the next row's key differs.
    #[test]
    fn seeing_one_more_key_changes_a_row() {
        let d = Dims {
            rows: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 16,
            capacity: 40,
            pos: 30,
            window: 0,
            scale: None,
        };
        let (q, k, v) = case(&d, 3);
        let a = run(&q, &k, &v, &d, Path::best());
        let b = run(&q, &k, &v, &Dims { pos: 31, ..d }, Path::best());
        assert_ne!(a, b);
    }

    #[test]
    fn every_path_gives_the_same_bits() {
        // 72: items one at a time; 64 and 128: bundles (tiles of 64 and 32 keys), and scores 16
        // (AVX-512) or 4 keys at a time.
        for head_dim in [72, 64, 128] {
            let d = Dims {
                rows: 5,
                heads: 6,
                kv_heads: 2,
                head_dim,
                capacity: 300,
                pos: 210,
                window: 0,
                scale: None,
            };
            let (q, k, v) = case(&d, 11);
            let portable = run(&q, &k, &v, &d, Path::Portable);
            for path in [Path::Avx2, Path::Avx512] {
                if path.supported() {
                    assert_eq!(run(&q, &k, &v, &d, path), portable, "{path:?} {head_dim}");
                }
            }
        }
    }

    /// A sliding window keeps every promise above: each path, bundles and one item at a time,
    /// and a row of a many-row pass give the same bits, with windows that start on odd and even
    /// keys, inside and across tiles; and the window is real (a window wider by one differs).
    #[test]
    fn a_window_gives_the_same_bits_on_every_path_and_row_count() {
        for (head_dim, window) in [(64, 37), (64, 100), (128, 64), (72, 5), (64, 1)] {
            let d = Dims {
                rows: 9,
                heads: 8,
                kv_heads: 2,
                head_dim,
                capacity: 300,
                pos: 210,
                window,
                scale: Some(0.0625),
            };
            let (q, k, v) = case(&d, 23);
            let want = run(&q, &k, &v, &d, Path::Portable);
            let mut alone = vec![0.0f32; q.len()];
            // SAFETY: the portable build needs no CPU feature.
            unsafe { items_one_by_one::<Portable, _>(&q, &k, &v, &mut alone, &d, 0) };
            assert_eq!(alone, want, "{head_dim} {window}");
            for path in [Path::Avx2, Path::Avx512] {
                if path.supported() {
                    assert_eq!(
                        run(&q, &k, &v, &d, path),
                        want,
                        "{path:?} {head_dim} {window}"
                    );
                }
            }
            let wider = run(
                &q,
                &k,
                &v,
                &Dims {
                    window: window + 1,
                    ..d
                },
                Path::Portable,
            );
            assert_ne!(wider, want, "a window of {window} changed nothing");
            for t in [0, 3, 8] {
                let one = Dims {
                    rows: 1,
                    pos: d.pos + t,
                    ..d
                };
                let qt: Vec<f32> = (0..d.heads)
                    .flat_map(|h| q[(h * 9 + t) * head_dim..(h * 9 + t + 1) * head_dim].to_vec())
                    .collect();
                let got = run(&qt, &k, &v, &one, Path::best());
                for h in 0..d.heads {
                    let i = (h * 9 + t) * head_dim;
                    assert_eq!(got[h * head_dim..(h + 1) * head_dim], want[i..i + head_dim]);
                }
            }
        }
    }

    fn halves(x: &[f32]) -> Vec<f16> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }

    /// An f16 cache gives, on every path, the bits of an f32 cache holding the same (rounded)
    /// values; the rounding is real (the unrounded cache differs), and bundles and rows keep
    /// their bits as with f32.
    #[test]
    fn a_half_cache_is_its_values_in_f32_on_every_path() {
        for head_dim in [72, 64, 128] {
            let d = Dims {
                rows: 9,
                heads: 9,
                kv_heads: 3,
                head_dim,
                capacity: 300,
                pos: 210,
                window: 0,
                scale: None,
            };
            let (q, k, v) = case(&d, 17);
            let (kh, vh) = (halves(&k), halves(&v));
            let widen = |x: &[f16]| x.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let want = run(&q, &widen(&kh), &widen(&vh), &d, Path::Portable);
            assert_ne!(
                run(&q, &k, &v, &d, Path::Portable),
                want,
                "rounding changed nothing"
            );
            for path in [Path::Portable, Path::Avx2, Path::Avx512] {
                if path.supported() {
                    assert_eq!(run(&q, &kh, &vh, &d, path), want, "{path:?} {head_dim}");
                }
            }
            // Row t of the 9-row pass is the one-row pass at pos + t.
            let all = run(&q, &kh, &vh, &d, Path::best());
            for t in [0, 4, 8] {
                let one = Dims {
                    rows: 1,
                    pos: d.pos + t,
                    ..d
                };
                let qt: Vec<f32> = (0..d.heads)
                    .flat_map(|h| q[(h * 9 + t) * head_dim..(h * 9 + t + 1) * head_dim].to_vec())
                    .collect();
                let got = run(&qt, &kh, &vh, &one, Path::best());
                for h in 0..d.heads {
                    assert_eq!(
                        got[h * head_dim..(h + 1) * head_dim],
                        all[(h * 9 + t) * head_dim..(h * 9 + t + 1) * head_dim],
                        "row {t} head {h}"
                    );
                }
            }
        }
    }

    #[test]
    fn non_finite_rows_come_out_nan() {
        let d = Dims {
            rows: 2,
            heads: 1,
            kv_heads: 1,
            head_dim: 8,
            capacity: 4,
            pos: 1,
            window: 0,
            scale: None,
        };
        let (mut q, k, v) = case(&d, 5);
        q[8] = f32::NAN; // row 1
        let out = run(&q, &k, &v, &d, Path::best());
        assert!(out[..8].iter().all(|x| x.is_finite()));
        assert!(out[8..].iter().all(|x| x.is_nan()));
    }

    #[test]
    fn bad_shapes_are_errors() {
        let d = Dims {
            rows: 2,
            heads: 3,
            kv_heads: 2,
            head_dim: 4,
            capacity: 4,
            pos: 0,
            window: 0,
            scale: None,
        };
        let mut out = vec![0.0; 24];
        assert!(attend(&[0.0; 24], &[0.0; 32], &[0.0; 32], &mut out, &d).is_err());
        let d = Dims {
            heads: 2,
            pos: 3,
            ..d
        };
        let mut out = vec![0.0; 16];
        let err = attend(&[0.0; 16], &[0.0; 32], &[0.0; 32], &mut out, &d).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
        // A position whose end overflows is the same error, not a panic.
        let d = Dims {
            pos: usize::MAX,
            ..d
        };
        let err = attend(&[0.0; 16], &[0.0; 32], &[0.0; 32], &mut out, &d).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
    }
}
