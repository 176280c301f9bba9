//! Int8 matrix products for CPU decode and verify passes.
//!
//! Weights are quantized once, symmetrically, one scale per output row. Activations are
//! quantized at every call, each row on its own, with one scale per group of 32 features (as
//! llama.cpp's Q8 activation blocks: outlier channels then cost a group its precision, not the
//! whole row). Each group's products sum exactly in i32; then, in every code path alike,
//! `acc += (group sum as f32) * sx[r][g]` over the groups in order, and `out = acc * sw[o]`. So:
//!
//! - row r of a pass depends only on row r of the input: a verify pass over k+1 rows gives, row
//!   for row, the bits that k+1 one-row passes give;
//! - the scalar, AVX2, AVX-VNNI and AVX-512 VNNI paths give bit-identical results.
//!
//! Packed layout: blocks of 16 output rows; inside a block, runs of 4 input features, each run
//! 16 rows × 4 bytes (64 bytes, one zmm). A pass reads every block once for all of its rows: a
//! few rows at a time, from L1 after the first few.

use specfast_core::error::Error;

use crate::helper::Shared;
use crate::simd::Path;
use crate::slab::WeightBuf;

/// Output rows per packed block.
const BLOCK: usize = 16;
/// Input features per activation scale.
pub const GROUP: usize = 32;
/// Activation rows an AVX2 or scalar kernel call accumulates at once.
const ROWS: usize = 4;
/// The same for AVX-512 VNNI: 6 rows × 2 blocks × an integer and a float accumulator = 24 of
/// the 32 zmm registers.
const VNNI_ROWS: usize = 6;
/// Blocks a kernel call reads at once: each activation broadcast feeds two products.
const PAIR: usize = 2;
/// Above this many input features an i32 could overflow somewhere (checked at construction).
pub const MAX_COLS: usize = 1 << 20;
/// Matrices smaller than this many weights run on one thread (a split costs more than it saves).
pub(crate) const PARALLEL_MIN: usize = 1 << 15;
/// Pieces a product is cut into for the two threads to take (`helper::for_each`).
pub(crate) const UNITS: usize = 16;

/// A weight matrix that multiplies float32 activation rows, each row computed on its own: the
/// int8 one here and the 4-bit one in [`crate::q4`].
pub trait Product: Sync {
    /// Output rows n of the matrix.
    fn rows(&self) -> usize;
    /// Input columns (the width of x).
    fn cols(&self) -> usize;
    /// out (n, rows) = x (n, cols) · Wᵀ, both row-major.
    fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error>;
}

/// Which instruction set a product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Portable Rust.
    Scalar,
    /// AVX2 and FMA.
    Avx2,
    /// AVX-VNNI: the AVX2 path with vpdpbusd on ymm (Intel client CPUs without AVX-512).
    AvxVnni,
    /// AVX-512 with VNNI (vpdpbusd on zmm).
    Avx512Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs, at most the AVX2 one (`Avx2`) or the portable one
    /// under `SPECFAST_SIMD` ([`crate::simd::simd_cap`]).
    pub fn best() -> Kernel {
        match crate::simd::simd_cap() {
            Some(Path::Portable) => Kernel::Scalar,
            Some(_) if Kernel::Avx2.supported() => Kernel::Avx2,
            _ => Kernel::detected(),
        }
    }

    /// The fastest kernel this CPU runs.
    fn detected() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                return Kernel::Avx512Vnni;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni") {
                return Kernel::AvxVnni;
            }
            if is_x86_feature_detected!("avx2") {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// True when this CPU can run the kernel.
    pub fn supported(self) -> bool {
        match self {
            Kernel::Scalar => true,
            Kernel::Avx2 => cfg!(target_arch = "x86_64") && Kernel::detected() != Kernel::Scalar,
            Kernel::AvxVnni => {
                #[cfg(target_arch = "x86_64")]
                {
                    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni")
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    false
                }
            }
            Kernel::Avx512Vnni => Kernel::detected() == Kernel::Avx512Vnni,
        }
    }

    /// The kernel's name, as `from_name` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::AvxVnni => "avxvnni",
            Kernel::Avx512Vnni => "avx512vnni",
        }
    }

    /// The kernel named `name` (or "auto" for the best), if this CPU runs it.
    pub fn from_name(name: &str) -> Result<Kernel, Error> {
        let kernel = match name {
            "auto" => Kernel::best(),
            "scalar" => Kernel::Scalar,
            "avx2" => Kernel::Avx2,
            "avxvnni" => Kernel::AvxVnni,
            "avx512vnni" => Kernel::Avx512Vnni,
            _ => {
                return Err(Error::value(format!(
                "kernel must be 'auto', 'scalar', 'avx2', 'avxvnni' or 'avx512vnni', got {name:?}"
            )))
            }
        };
        if !kernel.supported() {
            return Err(Error::value(format!(
                "this CPU cannot run the {} kernel (best here: {})",
                kernel.name(),
                Kernel::best().name()
            )));
        }
        Ok(kernel)
    }
}

/// Symmetric int8 quantization of `x` into `out`: scale = max|x| / 127, values
/// round-half-even(x / scale). All zeros give scale 0 and values 0.
/// Adding and taking away 1.5 · 2^23 rounds |t| < 2^22 to the nearest integer, ties to even, as
/// round_ties_even does, but in vector code on any x86-64 (round_ties_even is a libm call per
/// value without SSE4.1, which was most of a 9-row product's time).
const ROUND: f32 = 12_582_912.0;

pub(crate) fn quantize(x: &[f32], out: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        out.fill(0);
        return 0.0;
    }
    let scale = amax / 127.0;
    for (q, v) in out.iter_mut().zip(x) {
        let t = (v / scale).clamp(-127.0, 127.0);
        *q = ((t + ROUND) - ROUND) as i8;
    }
    scale
}

/// A weight matrix (rows = output features, cols = input features) in int8, packed for
/// [`Int8Matrix::matmul`].
pub struct Int8Matrix {
    rows: usize,
    cols: usize,
    width: usize,           // cols padded to whole groups
    packed: WeightBuf<i8>,  // [ceil(rows / 16)][width / 4][16][4]
    scales: WeightBuf<f32>, // (rows,) one per output row, padded to whole blocks with 0
}

impl Int8Matrix {
    /// Quantizes a row-major (rows, cols) float matrix.
    pub fn quantize(weight: &[f32], rows: usize, cols: usize) -> Result<Int8Matrix, Error> {
        if rows == 0 || cols == 0 {
            return Err(Error::value(format!(
                "an int8 matrix needs at least one row and one column, got ({rows}, {cols})"
            )));
        }
        if cols > MAX_COLS {
            return Err(Error::value(format!(
                "an int8 matrix takes at most {MAX_COLS} columns, got {cols}"
            )));
        }
        if rows.checked_mul(cols) != Some(weight.len()) {
            return Err(Error::value(format!(
                "weight has {} values, not {rows} x {cols}",
                weight.len()
            )));
        }
        if let Some(bad) = weight.iter().find(|v| !v.is_finite()) {
            return Err(Error::value(format!(
                "weights must be finite to quantize, found {bad}"
            )));
        }
        let width = cols.next_multiple_of(GROUP);
        let runs = width / 4;
        let blocks = rows.div_ceil(BLOCK);
        let mut packed = WeightBuf::from_elem(0i8, blocks * runs * BLOCK * 4);
        let mut scales = WeightBuf::from_elem(0.0f32, blocks * BLOCK);
        let mut q = vec![0i8; cols];
        for o in 0..rows {
            scales[o] = quantize(&weight[o * cols..(o + 1) * cols], &mut q);
            let (b, lane) = (o / BLOCK, o % BLOCK);
            for (k, &v) in q.iter().enumerate() {
                packed[((b * runs + k / 4) * BLOCK + lane) * 4 + k % 4] = v;
            }
        }
        Ok(Int8Matrix {
            rows,
            cols,
            width,
            packed,
            scales,
        })
    }

    /// Output rows n of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns (the width of x).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of packed weights a pass reads.
    pub fn nbytes(&self) -> usize {
        self.packed.len() + 4 * self.scales.len()
    }

    /// The quantized weights, row-major (rows, cols), and the scale of each row.
    pub fn weights(&self) -> (Vec<i8>, Vec<f32>) {
        let runs = self.width / 4;
        let mut q = vec![0i8; self.rows * self.cols];
        for o in 0..self.rows {
            let (b, lane) = (o / BLOCK, o % BLOCK);
            for k in 0..self.cols {
                q[o * self.cols + k] = self.packed[((b * runs + k / 4) * BLOCK + lane) * 4 + k % 4];
            }
        }
        (q, self.scales[..self.rows].to_vec())
    }

    /// out (n, rows) = x (n, cols) · Wᵀ, both row-major. A row of x that holds NaN or ±inf
    /// gives a row of NaN.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        let n = check_product(x, out, self.rows, self.cols, kernel)?;
        if n == 0 {
            return Ok(());
        }
        let acts = Activations::quantize(x, n, self.cols, self.width);
        let blocks = self.rows.div_ceil(BLOCK);
        let out = Shared::new(out);
        let block_len = self.width * BLOCK;
        // The rows in even chunks (9 = 5 + 4 on VNNI), each of which reads the blocks again.
        let most = rows_at_once(kernel);
        let chunk = n.div_ceil(n.div_ceil(most));
        let chunks = n.div_ceil(chunk);
        // The pairs of blocks of `range` in the order `forward` says; each fetches the next
        // pair its thread will run (see `for_each_from_ends`).
        let run = |range: std::ops::Range<usize>, forward: bool| {
            let mut acc = [0.0f32; VNNI_ROWS * PAIR * BLOCK];
            let pairs = (range.end - range.start).div_ceil(PAIR);
            for p in 0..pairs {
                let b = range.start + PAIR * if forward { p } else { pairs - 1 - p };
                let nb = PAIR.min(range.end - b);
                let w = &self.packed[b * block_len..(b + nb) * block_len];
                // The VNNI kernel fetches the next pair of blocks into L2 as it goes, a share of
                // their cache lines beside each run of each chunk of rows, so that reading the
                // weights overlaps the arithmetic. A unit's last pair fetches the first its
                // thread runs in its next unit (bench_runtime.py, bench_linear.py:
                // docs/benchmarks.md §14).
                let next = match forward {
                    true if b + 2 * PAIR <= blocks => Some(b + PAIR),
                    false if b >= PAIR => Some(b - PAIR),
                    _ => None,
                };
                let next = next.map_or(&[][..], |c| {
                    &self.packed[c * block_len..(c + PAIR) * block_len]
                });
                let share = (next.len() / 64).div_ceil(chunks) * 64;
                for (c, r0) in (0..n).step_by(chunk).enumerate() {
                    let m = chunk.min(n - r0);
                    let pf = &next[(c * share).min(next.len())..((c + 1) * share).min(next.len())];
                    dot_blocks(kernel, w, nb, &acts, r0, m, &mut acc, pf);
                    self.epilogue(b, nb, r0, m, &acc, &acts.bad, &out);
                }
            }
        };
        if self.rows * self.cols < PARALLEL_MIN || blocks < 2 * PAIR {
            run(0..blocks, true);
        } else {
            // This thread and the helper (see helper.rs), a few pairs of blocks at a time.
            let per = blocks.div_ceil(UNITS).next_multiple_of(PAIR);
            crate::helper::for_each_from_ends(blocks.div_ceil(per), |u, forward| {
                run(u * per..((u + 1) * per).min(blocks), forward);
            });
        }
        Ok(())
    }

    /// Writes the columns of blocks b..b+nb of rows r0..r0+m: acc * sw[o].
    #[allow(clippy::too_many_arguments)]
    fn epilogue(
        &self,
        b: usize,
        nb: usize,
        r0: usize,
        m: usize,
        acc: &[f32],
        bad: &[bool],
        out: &Shared<'_, f32>,
    ) {
        let o0 = b * BLOCK;
        let width = (nb * BLOCK).min(self.rows - o0);
        let scales = &self.scales[o0..o0 + width];
        for i in 0..m {
            let r = r0 + i;
            // SAFETY: each call writes only columns [o0, o0 + width) of its rows, a range no
            // other call writes.
            let at = r * self.rows + o0;
            let row = unsafe { out.part(at..at + width) };
            if bad[r] {
                row.fill(f32::NAN);
                continue;
            }
            let a = &acc[i * nb * BLOCK..i * nb * BLOCK + width];
            for ((y, &a), &sw) in row.iter_mut().zip(a).zip(scales) {
                *y = a * sw;
            }
        }
    }
}

impl Product for Int8Matrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        Int8Matrix::matmul(self, x, out, kernel)
    }
}

/// The number of rows n of x (n, cols), after checking that out is (n, rows) and that this CPU
/// runs `kernel`.
pub(crate) fn check_product(
    x: &[f32],
    out: &[f32],
    rows: usize,
    cols: usize,
    kernel: Kernel,
) -> Result<usize, Error> {
    if !x.len().is_multiple_of(cols) {
        return Err(Error::value(format!(
            "x has {} values, not a whole number of rows of {cols}",
            x.len()
        )));
    }
    let n = x.len() / cols;
    if out.len() != n * rows {
        return Err(Error::value(format!(
            "out has {} values, expected {n} x {rows}",
            out.len()
        )));
    }
    if !kernel.supported() {
        return Err(Error::value(format!(
            "this CPU cannot run the {} kernel",
            kernel.name()
        )));
    }
    Ok(n)
}

/// A pass's activations: (n, width) int8 values, one scale and one sum of the int8 values per
/// row and group, and which rows were not finite.
pub(crate) struct Activations {
    pub(crate) q: Vec<i8>,
    pub(crate) scales: Vec<f32>, // (n, width / GROUP)
    pub(crate) sums: Vec<i32>,   // (n, width / GROUP): Σ q
    pub(crate) bad: Vec<bool>,
    pub(crate) width: usize,
}

impl Activations {
    pub(crate) fn quantize(x: &[f32], n: usize, cols: usize, width: usize) -> Activations {
        let groups = width / GROUP;
        let mut q = vec![0i8; n * width];
        let mut scales = vec![0.0f32; n * groups];
        let mut sums = vec![0i32; n * groups];
        let mut bad = vec![false; n];
        let (qs, ss, us, bs) = (
            Shared::new(&mut q),
            Shared::new(&mut scales),
            Shared::new(&mut sums),
            Shared::new(&mut bad),
        );
        crate::helper::for_row_ranges(n, ROW_VALUES / width, |rows| {
            // SAFETY: the ranges of rows are disjoint, and so are their parts of each array.
            let (q, scales, sums, bad) = unsafe {
                (
                    qs.part(rows.start * width..rows.end * width),
                    ss.part(rows.start * groups..rows.end * groups),
                    us.part(rows.start * groups..rows.end * groups),
                    bs.part(rows.clone()),
                )
            };
            let x = &x[rows.start * cols..rows.end * cols];
            quantize_rows(x, cols, width, q, scales, sums, bad);
        });
        Activations {
            q,
            scales,
            sums,
            bad,
            width,
        }
    }

    /// Rows r0..r0 + m: (values, scales, sums).
    pub(crate) fn rows(&self, r0: usize, m: usize) -> (&[i8], &[f32], &[i32]) {
        let groups = self.width / GROUP;
        (
            &self.q[r0 * self.width..(r0 + m) * self.width],
            &self.scales[r0 * groups..(r0 + m) * groups],
            &self.sums[r0 * groups..(r0 + m) * groups],
        )
    }
}

/// Values of x a piece of per-row work takes at least, when a pass's rows are split between
/// the two threads (`helper::for_row_ranges`): enough that the split costs less than it saves.
pub(crate) const ROW_VALUES: usize = 4096;

/// `Activations::quantize` for the rows of x (rows of `cols`), into their parts of q (rows of
/// `width`), scales and sums (rows of width / GROUP) and bad.
fn quantize_rows(
    x: &[f32],
    cols: usize,
    width: usize,
    q: &mut [i8],
    scales: &mut [f32],
    sums: &mut [i32],
    bad: &mut [bool],
) {
    let groups = width / GROUP;
    #[cfg(target_arch = "x86_64")]
    if cols == width && is_x86_feature_detected!("avx512f") {
        for (r, row) in x.chunks_exact(cols).enumerate() {
            let (q, scales, sums) = (
                &mut q[r * width..(r + 1) * width],
                &mut scales[r * groups..(r + 1) * groups],
                &mut sums[r * groups..(r + 1) * groups],
            );
            // SAFETY: the CPU has AVX-512F (checked above); the row and its parts hold whole
            // groups.
            bad[r] = !unsafe { x86::quantize_row(row, q, scales, sums) };
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let avx2 = is_x86_feature_detected!("avx2");
    for (r, row) in x.chunks_exact(cols).enumerate() {
        // Written once a row: the two threads quantize rows side by side, and a store a group
        // to one cache line of flags made them pass it back and forth (9 rows of 1536 took
        // 1.4-1.6 times as long).
        let mut row_bad = false;
        for g in 0..groups {
            let (lo, hi) = (g * GROUP, ((g + 1) * GROUP).min(cols));
            if lo >= hi {
                continue;
            }
            let dst = &mut q[r * width + lo..r * width + hi];
            let at = r * groups + g;
            #[cfg(target_arch = "x86_64")]
            if avx2 && hi - lo == GROUP {
                // SAFETY: the CPU has AVX2 (checked above); both slices hold GROUP values.
                let finite;
                (scales[at], sums[at], finite) = unsafe { x86::quantize_group(&row[lo..hi], dst) };
                row_bad |= !finite;
                continue;
            }
            row_bad |= row[lo..hi].iter().any(|v| !v.is_finite());
            scales[at] = quantize(&row[lo..hi], dst);
            sums[at] = dst.iter().map(|&v| i32::from(v)).sum();
        }
        bad[r] = row_bad;
    }
}

/// The most activation rows one kernel call takes.
fn rows_at_once(kernel: Kernel) -> usize {
    if kernel == Kernel::Avx512Vnni {
        VNNI_ROWS
    } else {
        ROWS
    }
}

/// acc[i * nb * 16 + j * 16 + lane] = Σ_g (Σ_{k in g} x[i][k] · w[j][lane][k]) · sx[i][g] for
/// rows r0..r0+m (m ≤ rows_at_once(kernel)) and the nb ≤ 2 blocks of `w`. The VNNI kernel
/// also fetches `pf`'s cache lines into L2 (the next blocks' share for this call).
#[allow(clippy::too_many_arguments)]
fn dot_blocks(
    kernel: Kernel,
    w: &[i8],
    nb: usize,
    acts: &Activations,
    r0: usize,
    m: usize,
    acc: &mut [f32],
    pf: &[i8],
) {
    let width = acts.width;
    let (xs, sx, xsum) = acts.rows(r0, m);
    debug_assert!(m <= rows_at_once(kernel) && nb <= PAIR && w.len() == nb * width * BLOCK);
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `supported()` checked that the CPU has these instructions; the slices'
        // lengths are the ones the kernels read.
        Kernel::Avx512Vnni => unsafe { x86::dot_vnni(w, nb, xs, sx, xsum, width, m, acc, pf) },
        _ => {
            for j in 0..nb {
                let wj = &w[j * width * BLOCK..(j + 1) * width * BLOCK];
                let mut one = [0.0f32; ROWS * BLOCK];
                match kernel {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    Kernel::Avx2 => unsafe { x86::dot_avx2(wj, xs, sx, xsum, width, m, &mut one) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    Kernel::AvxVnni => unsafe {
                        x86::dot_avxvnni(wj, xs, sx, xsum, width, m, &mut one);
                    },
                    _ => dot_scalar(wj, xs, sx, width, m, &mut one),
                }
                for i in 0..m {
                    let dst = i * nb * BLOCK + j * BLOCK;
                    acc[dst..dst + BLOCK].copy_from_slice(&one[i * BLOCK..(i + 1) * BLOCK]);
                }
            }
        }
    }
}

fn dot_scalar(w: &[i8], xs: &[i8], sx: &[f32], width: usize, m: usize, acc: &mut [f32]) {
    let groups = width / GROUP;
    for i in 0..m {
        let x = &xs[i * width..(i + 1) * width];
        for lane in 0..BLOCK {
            let mut total = 0.0f32;
            for g in 0..groups {
                let mut s = 0i32;
                for k in g * GROUP..(g + 1) * GROUP {
                    s += i32::from(x[k]) * i32::from(w[((k / 4) * BLOCK + lane) * 4 + k % 4]);
                }
                total += (s as f32) * sx[i * groups + g];
            }
            acc[i * BLOCK + lane] = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::wildcard_imports)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BLOCK, GROUP, VNNI_ROWS};

    /// [`super::quantize`] of one group of 32 values, the sum of the int8 values, and whether
    /// all were finite. The same operations lane by lane (|v| max, v / scale, clamp, round half
    /// to even), so the same values where all are finite; where not, the row's output is NaN.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_group(x: &[f32], out: &mut [i8]) -> (f32, i32, bool) {
        debug_assert!(x.len() == GROUP && out.len() == GROUP);
        let p = x.as_ptr();
        let v = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(p.add(i)));
        // v - v is 0 where v is finite and NaN where not; OR keeps any NaN's bits.
        let nan = v.iter().fold(_mm256_setzero_ps(), |a, &vi| {
            _mm256_or_ps(a, _mm256_sub_ps(vi, vi))
        });
        let finite = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(nan, nan)) == 0;
        let sign = _mm256_set1_ps(-0.0);
        let m = v.iter().fold(_mm256_setzero_ps(), |m, &vi| {
            _mm256_max_ps(m, _mm256_andnot_ps(sign, vi))
        });
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
        if amax == 0.0 {
            out.fill(0);
            return (0.0, 0, finite);
        }
        let scale = amax / 127.0;
        let (s, hi, lo) = (
            _mm256_set1_ps(scale),
            _mm256_set1_ps(127.0),
            _mm256_set1_ps(-127.0),
        );
        // Round half to even, as the scalar path's (t + 1.5·2^23) - 1.5·2^23 does.
        let q = v.map(|vi| {
            _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(_mm256_div_ps(vi, s), hi), lo))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let sum = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256(sum, 1),
        );
        let sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b0100_1110));
        let sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0b1011_0001));
        // i32 -> i16 -> i8 packs work within 128-bit lanes; the permute puts them back in order.
        let w = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out.as_mut_ptr().cast(), w);
        (scale, _mm_cvtsi128_si32(sum), finite)
    }

    /// `super::quantize_rows` for a row of whole groups, a group in two zmm: each group's
    /// values, scale and sum exactly as [`quantize_group`] gives them (the same operations lane
    /// by lane), and whether all were finite.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn quantize_row(
        x: &[f32],
        q: &mut [i8],
        scales: &mut [f32],
        sums: &mut [i32],
    ) -> bool {
        let groups = x.len() / GROUP;
        assert!(x.len() == groups * GROUP && q.len() == x.len());
        assert!(scales.len() == groups && sums.len() == groups);
        let (hi, lo) = (_mm512_set1_ps(127.0), _mm512_set1_ps(-127.0));
        let (p, out) = (x.as_ptr(), q.as_mut_ptr());
        let mut unordered: __mmask16 = 0;
        for g in 0..groups {
            let a = _mm512_loadu_ps(p.add(g * GROUP));
            let b = _mm512_loadu_ps(p.add(g * GROUP + 16));
            // v - v is NaN where v is not finite.
            let (da, db) = (_mm512_sub_ps(a, a), _mm512_sub_ps(b, b));
            unordered |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(da, db);
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            let (scale, qa, qb) = if amax == 0.0 {
                (0.0, _mm512_setzero_si512(), _mm512_setzero_si512())
            } else {
                let scale = amax / 127.0;
                let s = _mm512_set1_ps(scale);
                // Round half to even (the MXCSR default), as `quantize_group` does.
                let round = |v| {
                    _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_div_ps(v, s), hi), lo))
                };
                (scale, round(a), round(b))
            };
            _mm_storeu_si128(out.add(g * GROUP).cast(), _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128(out.add(g * GROUP + 16).cast(), _mm512_cvtepi32_epi8(qb));
            scales[g] = scale;
            sums[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        }
        unordered == 0
    }

    /// VNNI: one vpdpbusd per row, block and run of 4 features. vpdpbusd multiplies u8 by s8,
    /// so the weights go in as w + 128 (w ^ 0x80, once per load for all the rows) against the
    /// s8 activations, and each group's sum starts at -128 · Σx, the activations' sum the
    /// quantization counted: the same exact integers as the other paths. Each broadcast of a
    /// row's 4 activations feeds both blocks of a pair. Meanwhile the cache lines of `pf` are
    /// fetched into L2, a few beside each run.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dot_vnni(
        w: &[i8],
        nb: usize,
        xs: &[i8],
        sx: &[f32],
        xsum: &[i32],
        width: usize,
        m: usize,
        acc: &mut [f32],
        pf: &[i8],
    ) {
        macro_rules! rows {
            ($nb:literal) => {
                match m {
                    1 => vnni::<1, $nb>(w, xs, sx, xsum, width, acc, pf),
                    2 => vnni::<2, $nb>(w, xs, sx, xsum, width, acc, pf),
                    3 => vnni::<3, $nb>(w, xs, sx, xsum, width, acc, pf),
                    4 => vnni::<4, $nb>(w, xs, sx, xsum, width, acc, pf),
                    5 => vnni::<5, $nb>(w, xs, sx, xsum, width, acc, pf),
                    VNNI_ROWS => vnni::<VNNI_ROWS, $nb>(w, xs, sx, xsum, width, acc, pf),
                    _ => unreachable!("1 to {VNNI_ROWS} rows a call, got {m}"),
                }
            };
        }
        if nb == 2 {
            rows!(2);
        } else {
            rows!(1);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni<const R: usize, const B: usize>(
        w: &[i8],
        xs: &[i8],
        sx: &[f32],
        xsum: &[i32],
        width: usize,
        acc: &mut [f32],
        pf: &[i8],
    ) {
        let groups = width / GROUP;
        let block_len = width * BLOCK;
        let bias = _mm512_set1_epi8(-128); // 0x80
        let wp = w.as_ptr();
        let xp = xs.as_ptr();
        let lines = pf.len() / 64;
        let per = lines.div_ceil(width / 4);
        let mut total = [[_mm512_setzero_ps(); B]; R];
        // A group's 8 runs as a loop: with a constant count LLVM unrolls them, hoists every
        // run's weights and broadcasts to the stack ahead of its products, and the 4-row kernel
        // (of a 9-row pass's 5 + 4) then ran at half the rate of the 5-row one.
        let runs = std::hint::black_box(GROUP / 4);
        for g in 0..groups {
            // Each row's sums start at -128 · Σx, so that they end at Σ w·x with no subtraction
            // per block: the same integers, one operation fewer a row and block of each group.
            let mut sums: [[__m512i; B]; R] =
                std::array::from_fn(|i| [_mm512_set1_epi32(-128 * xsum[i * groups + g]); B]);
            for run in g * runs..(g + 1) * runs {
                for line in run * per..((run + 1) * per).min(lines) {
                    _mm_prefetch::<_MM_HINT_T1>(pf.as_ptr().add(64 * line).cast());
                }
                let mut wv = [_mm512_setzero_si512(); B];
                for (j, v) in wv.iter_mut().enumerate() {
                    let wj = _mm512_loadu_si512(wp.add(j * block_len + run * 64).cast());
                    *v = _mm512_xor_si512(wj, bias);
                }
                for (i, si) in sums.iter_mut().enumerate() {
                    let x4 = xp.add(i * width + run * 4).cast::<i32>().read_unaligned();
                    let xv = _mm512_set1_epi32(x4);
                    for (sij, v) in si.iter_mut().zip(&wv) {
                        *sij = _mm512_dpbusd_epi32(*sij, *v, xv);
                    }
                }
            }
            for (i, (ti, si)) in total.iter_mut().zip(&sums).enumerate() {
                let scale = _mm512_set1_ps(sx[i * groups + g]);
                for (tij, sij) in ti.iter_mut().zip(si) {
                    let exact = _mm512_cvtepi32_ps(*sij);
                    *tij = _mm512_add_ps(*tij, _mm512_mul_ps(exact, scale));
                }
            }
        }
        for (i, ti) in total.iter().enumerate() {
            for (j, tij) in ti.iter().enumerate() {
                _mm512_storeu_ps(acc.as_mut_ptr().add((i * B + j) * BLOCK), *tij);
            }
        }
    }

    /// The AVX2-width kernels: two ymm halves of 8 output rows each, 2 rows at a time.
    /// `$load(w)` prepares a run's weights once for all the rows, `$step(sum, x, w)` adds one
    /// run's products for a row's broadcast activations x, and a group's sum then loses
    /// `$bias` · Σx. AVX2 multiplies |x| (u8) by sign(x)·w (s8) with vpmaddubsw (pairs stay
    /// within i16: 2 · 127 · 127) and vpmaddwd with ones; AVX-VNNI, as the zmm kernel, w + 128
    /// (u8) by x (s8) with one vpdpbusd, less 128 · Σx. The sums are the same integers, so the
    /// bits are the same.
    macro_rules! ymm_kernel {
        ($dot:ident, $rows:ident, $features:literal, $load:expr, $step:expr, $bias:literal) => {
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            pub unsafe fn $dot(
                w: &[i8],
                xs: &[i8],
                sx: &[f32],
                xsum: &[i32],
                width: usize,
                m: usize,
                acc: &mut [f32],
            ) {
                let groups = width / GROUP;
                let mut i = 0;
                while i < m {
                    let (x, s, a) = (&xs[i * width..], &sx[i * groups..], &mut acc[i * BLOCK..]);
                    let xsum = &xsum[i * groups..];
                    if m - i == 1 {
                        $rows::<1>(w, x, s, xsum, width, a);
                    } else {
                        $rows::<2>(w, x, s, xsum, width, a);
                    }
                    i += 2;
                }
            }

            #[target_feature(enable = $features)]
            unsafe fn $rows<const R: usize>(
                w: &[i8],
                xs: &[i8],
                sx: &[f32],
                xsum: &[i32],
                width: usize,
                acc: &mut [f32],
            ) {
                let groups = width / GROUP;
                let wp = w.as_ptr();
                let xp = xs.as_ptr();
                let mut total = [[_mm256_setzero_ps(); 2]; R];
                // A loop, not unrolled: as in `vnni`.
                let runs = std::hint::black_box(GROUP / 4);
                for g in 0..groups {
                    let mut sums = [[_mm256_setzero_si256(); 2]; R];
                    for run in g * runs..(g + 1) * runs {
                        // The hardware's prefetchers alone leave this loop waiting on memory
                        // (bench_linear.py; docs/benchmarks.md §14): ask for the line 32 runs
                        // ahead.
                        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(run * 64 + 2048).cast());
                        let w0 = $load(_mm256_loadu_si256(wp.add(run * 64).cast()));
                        let w1 = $load(_mm256_loadu_si256(wp.add(run * 64 + 32).cast()));
                        for (i, si) in sums.iter_mut().enumerate() {
                            let x4 = xp.add(i * width + run * 4).cast::<i32>().read_unaligned();
                            let xv = _mm256_set1_epi32(x4);
                            si[0] = $step(si[0], xv, w0);
                            si[1] = $step(si[1], xv, w1);
                        }
                    }
                    for (i, (ti, si)) in total.iter_mut().zip(&sums).enumerate() {
                        let scale = _mm256_set1_ps(sx[i * groups + g]);
                        let offset = _mm256_set1_epi32($bias * xsum[i * groups + g]);
                        for (tij, sij) in ti.iter_mut().zip(si) {
                            let exact = _mm256_cvtepi32_ps(_mm256_sub_epi32(*sij, offset));
                            *tij = _mm256_add_ps(*tij, _mm256_mul_ps(exact, scale));
                        }
                    }
                }
                for (i, ti) in total.iter().enumerate() {
                    _mm256_storeu_ps(acc.as_mut_ptr().add(i * BLOCK), ti[0]);
                    _mm256_storeu_ps(acc.as_mut_ptr().add(i * BLOCK + 8), ti[1]);
                }
            }
        };
    }

    ymm_kernel!(
        dot_avx2,
        avx2_rows,
        "avx2",
        |w| w,
        |sum, xv, w| {
            let ones = _mm256_set1_epi16(1);
            let (ax, wx) = (_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(w, xv)); // |x|, sign(x)·w
            _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, wx), ones))
        },
        0
    );
    /// A VNNI kernel of ymm width over `$dpbusd`: w + 128 (u8) by x (s8), less 128 · Σx.
    macro_rules! ymm_vnni_kernel {
        ($dot:ident, $rows:ident, $features:literal, $dpbusd:ident) => {
            ymm_kernel!(
                $dot,
                $rows,
                $features,
                |w| _mm256_xor_si256(w, _mm256_set1_epi8(-128)),
                |sum, xv, w| $dpbusd(sum, w, xv),
                128
            );
        };
    }
    ymm_vnni_kernel!(
        dot_avxvnni,
        avxvnni_rows,
        "avx2,avxvnni",
        _mm256_dpbusd_avx_epi32
    );
    // The AVX-VNNI kernel with the EVEX encoding of the same instruction, so that its test also
    // runs on CPUs with AVX-512 VNNI but not AVX-VNNI (Zen 4, Ice Lake).
    #[cfg(test)]
    ymm_vnni_kernel!(
        dot_avxvnni_evex,
        avxvnni_evex_rows,
        "avx2,avx512f,avx512vl,avx512vnni",
        _mm256_dpbusd_epi32
    );
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Reproducible values in [-0.5, 0.5).
    pub(crate) fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// The product from the quantized values, with each group's sum in i64.
    fn reference(m: &Int8Matrix, x: &[f32], n: usize) -> Vec<f32> {
        let (q, sw) = m.weights();
        let mut out = vec![0.0; n * m.rows];
        for r in 0..n {
            let row = &x[r * m.cols..(r + 1) * m.cols];
            let mut xq = vec![0i8; m.cols];
            let mut scales = vec![];
            for lo in (0..m.cols).step_by(GROUP) {
                let hi = (lo + GROUP).min(m.cols);
                scales.push(quantize(&row[lo..hi], &mut xq[lo..hi]));
            }
            for o in 0..m.rows {
                let mut total = 0.0f32;
                for (g, &s) in scales.iter().enumerate() {
                    let lo = g * GROUP;
                    let sum: i64 = (lo..(lo + GROUP).min(m.cols))
                        .map(|k| i64::from(xq[k]) * i64::from(q[o * m.cols + k]))
                        .sum();
                    total += (sum as i32 as f32) * s;
                }
                out[r * m.rows + o] = total * sw[o];
            }
        }
        out
    }

    /// The kernels this CPU runs.
    pub(crate) fn kernels() -> Vec<Kernel> {
        [
            Kernel::Scalar,
            Kernel::Avx2,
            Kernel::AvxVnni,
            Kernel::Avx512Vnni,
        ]
        .into_iter()
        .filter(|k| k.supported())
        .collect()
    }

    /// Groups of activations to round: random ones (a seed each), then a group of zeros and
    /// groups whose quotients fall on halves (ties round to even) and on the ±127 ends.
    #[cfg(target_arch = "x86_64")]
    fn rounding_cases(seeds: std::ops::Range<u64>) -> Vec<Vec<f32>> {
        let mut groups: Vec<Vec<f32>> = seeds.map(|s| lcg(s, GROUP)).collect();
        groups.push(vec![0.0; GROUP]);
        groups.push((0..GROUP).map(|i| i as f32 - 15.5).collect());
        groups.push(
            (0..GROUP)
                .map(|i| (i as f32 - 16.0) * 127.0 / 16.0)
                .collect(),
        );
        groups
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_quantization_gives_the_scalar_values() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        for x in &rounding_cases(0..200) {
            let (mut a, mut b) = ([0i8; GROUP], [0i8; GROUP]);
            let scale = quantize(x, &mut a);
            // SAFETY: AVX2 was checked above.
            let got = unsafe { x86::quantize_group(x, &mut b) };
            let sum: i32 = a.iter().map(|&v| i32::from(v)).sum();
            assert_eq!(
                (got.0.to_bits(), got.1, got.2),
                (scale.to_bits(), sum, true)
            );
            assert_eq!(a, b);
        }
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = lcg(7, GROUP);
            x[GROUP - 1] = bad;
            // SAFETY: as above.
            assert!(!unsafe { x86::quantize_group(&x, &mut [0i8; GROUP]) }.2);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_row_quantization_gives_the_scalar_values() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        // In rows of 1, 3 and 18 groups, the special groups last, where a loop that stopped a
        // group short would miss them.
        let groups = rounding_cases(300..340);
        for per_row in [1, 3, 18] {
            for chunk in groups.rchunks(per_row) {
                let x: Vec<f32> = chunk.concat();
                let n = chunk.len();
                let (mut q, mut scales, mut sums) = (vec![0i8; x.len()], vec![0.0; n], vec![0; n]);
                // SAFETY: AVX-512F was checked above; the parts hold whole groups.
                let finite = unsafe { x86::quantize_row(&x, &mut q, &mut scales, &mut sums) };
                assert!(finite);
                for (g, group) in chunk.iter().enumerate() {
                    let mut want = [0i8; GROUP];
                    let scale = quantize(group, &mut want);
                    let sum: i32 = want.iter().map(|&v| i32::from(v)).sum();
                    assert_eq!(&q[g * GROUP..(g + 1) * GROUP], &want[..]);
                    assert_eq!((scales[g].to_bits(), sums[g]), (scale.to_bits(), sum));
                }
            }
        }
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = lcg(8, 3 * GROUP);
            x[3 * GROUP - 1] = bad;
            let (mut q, mut scales, mut sums) = (vec![0i8; x.len()], vec![0.0; 3], vec![0; 3]);
            // SAFETY: as above.
            assert!(!unsafe { x86::quantize_row(&x, &mut q, &mut scales, &mut sums) });
        }
    }

    /// The AVX-VNNI kernel's body, run through its EVEX twin on CPUs with AVX-512 VNNI, which
    /// may lack AVX-VNNI itself (CPUs with AVX-VNNI also run the kernel in the test below).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avxvnni_body_equals_the_scalar_kernel() {
        if !(is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni")) {
            return;
        }
        for &(rows, cols, n) in &[(16, 32, 1), (33, 130, 3), (48, 577, 4), (20, 64, 2)] {
            let m = Int8Matrix::quantize(&lcg(rows as u64, rows * cols), rows, cols).unwrap();
            let x = lcg(9 + n as u64, n * cols);
            let acts = Activations::quantize(&x, n, cols, m.width);
            let (xs, sx, xsum) = acts.rows(0, n);
            let block_len = m.width * BLOCK;
            for b in 0..rows.div_ceil(BLOCK) {
                let w = &m.packed[b * block_len..(b + 1) * block_len];
                let (mut want, mut got) = ([0.0f32; ROWS * BLOCK], [0.0f32; ROWS * BLOCK]);
                dot_scalar(w, xs, sx, m.width, n, &mut want);
                // SAFETY: the CPU has the twin's instructions (checked above).
                unsafe { x86::dot_avxvnni_evex(w, xs, sx, xsum, m.width, n, &mut got) };
                let bits = |a: [f32; ROWS * BLOCK]| a.map(f32::to_bits);
                assert_eq!(
                    bits(got),
                    bits(want),
                    "({rows}, {cols}) x {n} rows, block {b}"
                );
            }
        }
    }

    #[test]
    fn every_kernel_equals_the_reference_bit_for_bit() {
        for &(rows, cols, n) in &[
            (1, 1, 1),
            (17, 5, 3),
            (48, 64, 9),
            (33, 130, 17),
            (300, 577, 2),
            (1000, 96, 5), // parallel
        ] {
            let w = lcg(rows as u64, rows * cols);
            let m = Int8Matrix::quantize(&w, rows, cols).unwrap();
            let x = lcg(7 + n as u64, n * cols);
            let want = reference(&m, &x, n);
            for k in kernels() {
                let mut out = vec![0.0; n * rows];
                m.matmul(&x, &mut out, k).unwrap();
                assert_eq!(out, want, "{k:?} at ({rows}, {cols}) x {n} rows");
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_other_rows() {
        let (rows, cols) = (700, 200); // big enough to run on several threads
        let m = Int8Matrix::quantize(&lcg(1, rows * cols), rows, cols).unwrap();
        let mut x = lcg(2, 9 * cols);
        x[5 * cols] = 40.0; // one row with a large value: a shared scale would move every row
        let mut all = vec![0.0; 9 * rows];
        m.matmul(&x, &mut all, Kernel::best()).unwrap();
        for r in 0..9 {
            let mut one = vec![0.0; rows];
            m.matmul(&x[r * cols..(r + 1) * cols], &mut one, Kernel::best())
                .unwrap();
            assert_eq!(one, all[r * rows..(r + 1) * rows]);
        }
    }

    #[test]
    fn close_to_the_float_product() {
        let (rows, cols, n) = (64, 256, 4);
        let w = lcg(3, rows * cols);
        let x = lcg(4, n * cols);
        let m = Int8Matrix::quantize(&w, rows, cols).unwrap();
        let mut out = vec![0.0; n * rows];
        m.matmul(&x, &mut out, Kernel::best()).unwrap();
        for r in 0..n {
            for o in 0..rows {
                let exact: f32 = (0..cols).map(|k| x[r * cols + k] * w[o * cols + k]).sum();
                let got = out[r * rows + o];
                assert!((got - exact).abs() < 0.03, "{got} vs {exact}");
            }
        }
    }

    #[test]
    fn bad_rows_and_bad_shapes() {
        let m = Int8Matrix::quantize(&lcg(5, 32 * 8), 32, 8).unwrap();
        let mut x = lcg(6, 2 * 8);
        x[9] = f32::NAN;
        let mut out = vec![0.0; 2 * 32];
        m.matmul(&x, &mut out, Kernel::best()).unwrap();
        assert!(out[..32].iter().all(|v| v.is_finite()));
        assert!(out[32..].iter().all(|v| v.is_nan()));
        assert!(m.matmul(&x[..7], &mut out, Kernel::best()).is_err());
        assert!(m.matmul(&x, &mut out[..5], Kernel::best()).is_err());
        assert!(Int8Matrix::quantize(&[1.0, f32::INFINITY], 1, 2).is_err());
        assert!(Int8Matrix::quantize(&[1.0; 6], 2, 2).is_err());
        assert!(Int8Matrix::quantize(&[], 0, 0).is_err());
        assert!(Kernel::from_name("fast").is_err());
    }

    proptest! {
        #[test]
        fn kernels_agree(rows in 1usize..40, cols in 1usize..100, n in 1usize..12, seed in 0u64..1000) {
            let m = Int8Matrix::quantize(&lcg(seed, rows * cols), rows, cols).unwrap();
            let x = lcg(seed + 1, n * cols);
            let want = reference(&m, &x, n);
            for k in kernels() {
                let mut out = vec![0.0; n * rows];
                m.matmul(&x, &mut out, k).unwrap();
                prop_assert_eq!(&out, &want);
            }
        }
    }
}
