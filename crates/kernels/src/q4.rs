//! 4-bit weight matrix products for CPU decode and verify passes.
//!
//! Weights are llama.cpp's Q4_1 or Q4_0: each output row, in groups of 32 input features, holds
//! values q in 0..=15 with a scale d (f16) and, for Q4_1, a minimum m (f16), standing for
//! d·q + m; Q4_0 has no minimum and stands for d·(q - 8). Activations are int8, quantized at
//! every call with one scale per row and group (as in [`crate::int8`]), so a group's product is
//!
//!   Q4_1: Σ x·w = sx · (d · Σ q·xq + m · Σ xq),   Q4_0: Σ x·w = sx · d · (Σ q·xq - 8 Σ xq),
//!
//! exact integer sums and a few float operations. In every code path alike, for the groups in
//! order, `acc += (s as f32) * (d * sx)` with s the group's integer sum (Σ q·xq, or for Q4_0
//! Σ q·xq - 8 Σ xq), then for Q4_1 `acc += m * (sx * Σ xq as f32)`. So, as for int8, a row of a
//! pass depends only on its own input row, and the scalar, AVX2, AVX-VNNI and AVX-512 VNNI
//! paths give the same bits.
//!
//! Why 4 bits: a decode step reads every weight once, so 5 bits a weight (4, plus d and m per
//! 32; Q4_0's 4.5) read in 5/8 of int8's time. And unsigned 4-bit values let AVX2's vpmaddubsw
//! (u8 × s8) run without int8's sign juggling, and sum 8 of its i16 pairs before widening
//! (8 · 2 · 15 · 127 < 2^15), which halves the multiplies a verify pass makes; VNNI's vpdpbusd
//! (u8 × s8 into i32) takes them as they are. Q4_0's -8 Σ xq is where VNNI's sums start.
//!
//! Packed layout: blocks of 16 output rows; inside a block, per pair of runs of 4 features, 64
//! bytes: byte i holds row i / 4, feature i % 4 of the first run in its low nibble and of the
//! second run in its high one (the int8 layout's two runs, one nibble each).

use half::f16;
use specfast_core::error::Error;

use crate::helper::Shared;
use crate::int8::{check_product, Activations, Kernel, Product, GROUP, PARALLEL_MIN};
use crate::slab::WeightBuf;

/// Output rows per packed block.
const BLOCK: usize = 16;
/// Pieces a product is cut into for the two threads to take (`helper::for_each`). Few: each
/// piece a thread claims moves the claim counter's cache line between the cores, and a layer's
/// matrices (36-192 blocks) are small, so a claim costs more than an uneven last piece
/// (docs/benchmarks.md §12 has pass times against 16 pieces; 2 and 8 measured between).
const UNITS: usize = 4;
/// Input rows the AVX2 kernels take through a block at once (`x86::dot_half`).
const ROWS: usize = 8;
/// Input rows the AVX-512 VNNI kernel takes at once: a sum and a total a row, in 32 zmm.
const VNNI_ROWS: usize = 12;
/// Above this many input features the packing's indices could overflow (checked at
/// construction); the i32 group sums cannot, whatever the width.
pub const MAX_COLS: usize = 1 << 20;

/// A matrix in llama.cpp's Q4_1 layout (32-weight blocks, each with a scale and a minimum) or
/// its Q4_0 one (a scale only: w = d·(q - 8)).
pub struct Q4Matrix {
    rows: usize,
    cols: usize,
    width: usize,                    // cols padded to whole groups
    packed: WeightBuf<u8>,           // [ceil(rows / 16)][width / 8][64]
    scale: WeightBuf<f16>,           // [ceil(rows / 16)][width / 32][16]: d
    minimum: Option<WeightBuf<f16>>, // as scale: m (Q4_1), or None (Q4_0)
}

impl Q4Matrix {
    /// Quantizes a row-major (rows, cols) float matrix as llama.cpp's quantize does for Q4_1:
    /// per group, m = min and d = (max - min) / 15, each rounded to f16, q = round((w - m) / d).
    pub fn quantize(weight: &[f32], rows: usize, cols: usize) -> Result<Q4Matrix, Error> {
        check_shape(rows, cols, weight.len())?;
        if let Some(bad) = weight.iter().find(|v| !v.is_finite()) {
            return Err(Error::value(format!(
                "weights must be finite to quantize, found {bad}"
            )));
        }
        let groups = cols.div_ceil(GROUP);
        let mut q = vec![0u8; rows * cols];
        let mut d = vec![f16::ZERO; rows * groups];
        let mut m = vec![f16::ZERO; rows * groups];
        for o in 0..rows {
            for g in 0..groups {
                let (lo, hi) = (o * cols + g * GROUP, o * cols + ((g + 1) * GROUP).min(cols));
                let values = &weight[lo..hi];
                let min = values.iter().copied().fold(f32::INFINITY, f32::min);
                let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mh = f16::from_f32(min);
                let dh = f16::from_f32((max - mh.to_f32()) / 15.0);
                let (mf, df) = (mh.to_f32(), dh.to_f32());
                for (qk, &v) in q[lo..hi].iter_mut().zip(values) {
                    let t = if df > 0.0 { (v - mf) / df } else { 0.0 };
                    *qk = t.round().clamp(0.0, 15.0) as u8;
                }
                d[o * groups + g] = dh;
                m[o * groups + g] = mh;
            }
        }
        Q4Matrix::from_parts(&q, &d, Some(&m), rows, cols)
    }

    /// A matrix from its values q (rows, cols) in 0..=15, d and m (rows, ceil(cols / 32)): a
    /// Q4_1 tensor's blocks, unpacked, exact: w = d·q + m. Without m, a Q4_0 tensor's:
    /// w = d·(q - 8).
    pub fn from_parts(
        q: &[u8],
        d: &[f16],
        m: Option<&[f16]>,
        rows: usize,
        cols: usize,
    ) -> Result<Q4Matrix, Error> {
        check_shape(rows, cols, q.len())?;
        let groups = cols.div_ceil(GROUP);
        let m_len = m.map_or(rows * groups, <[f16]>::len);
        if d.len() != rows * groups || m_len != rows * groups {
            return Err(Error::value(format!(
                "d and m must hold {rows} x {groups} values, got {} and {m_len}",
                d.len(),
            )));
        }
        if let Some(bad) = q.iter().find(|&&v| v > 15) {
            return Err(Error::value(format!(
                "4-bit values must be 0..=15, found {bad}"
            )));
        }
        if let Some(bad) = d.iter().chain(m.unwrap_or(&[])).find(|v| !v.is_finite()) {
            return Err(Error::value(format!("d and m must be finite, found {bad}")));
        }
        let width = cols.next_multiple_of(GROUP);
        let blocks = rows.div_ceil(BLOCK);
        let pairs = width / 8;
        let mut packed = WeightBuf::from_elem(0u8, blocks * pairs * 64);
        let mut scale = WeightBuf::from_elem(f16::ZERO, blocks * groups * BLOCK);
        let mut minimum = m.map(|_| WeightBuf::from_elem(f16::ZERO, blocks * groups * BLOCK));
        for o in 0..rows {
            let (b, lane) = (o / BLOCK, o % BLOCK);
            for k in 0..cols {
                let run = k / 4;
                let byte = (b * pairs + run / 2) * 64 + lane * 4 + k % 4;
                packed[byte] |= q[o * cols + k] << (4 * (run % 2));
            }
            for g in 0..groups {
                scale[(b * groups + g) * BLOCK + lane] = d[o * groups + g];
                if let (Some(to), Some(m)) = (minimum.as_mut(), m) {
                    to[(b * groups + g) * BLOCK + lane] = m[o * groups + g];
                }
            }
        }
        Ok(Q4Matrix {
            rows,
            cols,
            width,
            packed,
            scale,
            minimum,
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

    /// Bytes a pass reads: the packed values and their scales and minimums.
    pub fn nbytes(&self) -> usize {
        self.packed.len() + 2 * (self.scale.len() + self.minimum.as_ref().map_or(0, |m| m.len()))
    }

    /// The values (rows, cols) and d and m (rows, ceil(cols / 32)), as `from_parts` takes them
    /// (m None for Q4_0).
    pub fn parts(&self) -> (Vec<u8>, Vec<f16>, Option<Vec<f16>>) {
        let (pairs, groups) = (self.width / 8, self.width / GROUP);
        let mut q = vec![0u8; self.rows * self.cols];
        let mut d = vec![f16::ZERO; self.rows * groups];
        let mut m = self
            .minimum
            .as_ref()
            .map(|_| vec![f16::ZERO; self.rows * groups]);
        for o in 0..self.rows {
            let (b, lane) = (o / BLOCK, o % BLOCK);
            for k in 0..self.cols {
                let run = k / 4;
                let byte = self.packed[(b * pairs + run / 2) * 64 + lane * 4 + k % 4];
                q[o * self.cols + k] = (byte >> (4 * (run % 2))) & 15;
            }
            for g in 0..groups {
                let at = (b * groups + g) * BLOCK + lane;
                d[o * groups + g] = self.scale[at];
                if let (Some(m), Some(from)) = (m.as_mut(), self.minimum.as_ref()) {
                    m[o * groups + g] = from[at];
                }
            }
        }
        (q, d, m)
    }

    /// out (n, rows) = x (n, cols) · Wᵀ, both row-major. A row of x that holds NaN or ±inf
    /// gives a row of NaN.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        let n = check_product(x, out, self.rows, self.cols, kernel)?;
        if n == 0 {
            return Ok(());
        }
        let acts = Activations::quantize(x, n, self.cols, self.width);
        let sums = match self.minimum {
            Some(_) => GroupSums::Float(group_sums(&acts)),
            None => GroupSums::Start(acts.sums.iter().map(|&t| -8 * t).collect()),
        };
        let blocks = self.rows.div_ceil(BLOCK);
        let out = Shared::new(out);
        let most = rows_per_call(kernel);
        let run = |range: std::ops::Range<usize>| {
            let mut acc = [0.0f32; VNNI_ROWS * BLOCK];
            for b in range {
                let mut r0 = 0;
                for m in chunks(n, most) {
                    self.dot_block(kernel, b, &acts, &sums, r0, m, &mut acc);
                    self.write(b, r0, m, &acc, &acts.bad, &out);
                    r0 += m;
                }
            }
        };
        // This thread and the helper (see helper.rs), a few blocks at a time.
        let serial = self.rows * self.cols < PARALLEL_MIN || blocks < 4;
        crate::helper::in_pieces(blocks, UNITS, serial, run);
        Ok(())
    }

    /// acc[i * 16 + lane] = row r0 + i's product with block b's 16 rows, for m ≤ ROWS rows
    /// (VNNI_ROWS for the AVX-512 VNNI kernel).
    #[allow(clippy::too_many_arguments)]
    fn dot_block(
        &self,
        kernel: Kernel,
        b: usize,
        acts: &Activations,
        sums: &GroupSums,
        r0: usize,
        m: usize,
        acc: &mut [f32],
    ) {
        let (pairs, groups) = (self.width / 8, self.width / GROUP);
        let w = &self.packed[b * pairs * 64..(b + 1) * pairs * 64];
        let d = &self.scale[b * groups * BLOCK..(b + 1) * groups * BLOCK];
        let mn = (self.minimum.as_ref()).map(|m| &m[b * groups * BLOCK..(b + 1) * groups * BLOCK]);
        let (xs, sx, _) = acts.rows(r0, m);
        let at = r0 * groups..(r0 + m) * groups;
        let (xsum, start): (&[f32], &[i32]) = match sums {
            GroupSums::Float(f) => (&f[at], &[]),
            GroupSums::Start(s) => (&[], &s[at]),
        };
        let rows = Rows {
            xs,
            sx,
            xsum,
            start,
        };
        let block = Block {
            w,
            d,
            m: mn.unwrap_or(&[]),
            width: self.width,
        };
        // Each kernel is built twice, for Q4_1 and for Q4_0 (`S`): a branch on the layout in
        // the AVX-512 kernel's loop halved its 9-row speed.
        #[cfg(target_arch = "x86_64")]
        macro_rules! layouts {
            ($run:ident) => {
                if mn.is_some() {
                    $run!(false)
                } else {
                    $run!(true)
                }
            };
        }
        // The AVX2-width kernels: whole blocks for 1-2 rows, half blocks for more.
        #[cfg(target_arch = "x86_64")]
        macro_rules! ymm {
            ($dot:ident, $dot_half:ident) => {{
                macro_rules! run {
                    ($s:literal) => {
                        match m {
                            1 => x86::$dot::<1, $s>(&block, &rows, acc),
                            2 => x86::$dot::<2, $s>(&block, &rows, acc),
                            _ => {
                                let half_kernel = match m {
                                    3 => x86::$dot_half::<3, $s>,
                                    4 => x86::$dot_half::<4, $s>,
                                    5 => x86::$dot_half::<5, $s>,
                                    6 => x86::$dot_half::<6, $s>,
                                    7 => x86::$dot_half::<7, $s>,
                                    _ => x86::$dot_half::<8, $s>,
                                };
                                for half in 0..2 {
                                    half_kernel(&block, half, &rows, acc);
                                }
                            }
                        }
                    };
                }
                layouts!(run)
            }};
        }
        #[cfg(target_arch = "x86_64")]
        macro_rules! vnni {
            ($s:literal) => {
                match m {
                    1 => x86::dot_vnni::<1, $s>(&block, &rows, acc),
                    2 => x86::dot_vnni::<2, $s>(&block, &rows, acc),
                    3 => x86::dot_vnni::<3, $s>(&block, &rows, acc),
                    4 => x86::dot_vnni::<4, $s>(&block, &rows, acc),
                    5 => x86::dot_vnni::<5, $s>(&block, &rows, acc),
                    6 => x86::dot_vnni::<6, $s>(&block, &rows, acc),
                    7 => x86::dot_vnni::<7, $s>(&block, &rows, acc),
                    8 => x86::dot_vnni::<8, $s>(&block, &rows, acc),
                    9 => x86::dot_vnni::<9, $s>(&block, &rows, acc),
                    10 => x86::dot_vnni::<10, $s>(&block, &rows, acc),
                    11 => x86::dot_vnni::<11, $s>(&block, &rows, acc),
                    _ => x86::dot_vnni::<12, $s>(&block, &rows, acc),
                }
            };
        }
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a kernel other than Scalar passed `supported()`, so the CPU has AVX2 (every
            // such kernel's CPU has it); F16C is checked here (by `rows_per_call` for VNNI).
            // Slice lengths are as read.
            Kernel::Avx512Vnni if rows_per_call(kernel) == VNNI_ROWS => unsafe { layouts!(vnni) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::Avx2 if has_f16c() => unsafe { ymm!(dot, dot_half) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::AvxVnni if has_f16c() => unsafe { ymm!(dot_avxvnni, dot_half_avxvnni) },
            _ => dot_scalar(&block, &rows, m, acc),
        }
    }

    /// Writes block b's columns of rows r0..r0+m.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        b: usize,
        r0: usize,
        m: usize,
        acc: &[f32],
        bad: &[bool],
        out: &Shared<'_, f32>,
    ) {
        let width = BLOCK.min(self.rows - b * BLOCK);
        write_block(out, self.rows, b * BLOCK, width, r0, m, acc, bad);
    }
}

/// Writes a block's outputs `acc` ([i][16]) into columns o0..o0 + width of rows r0..r0 + m of
/// `out` (rows of `rows`), NaN for the rows of x that were not finite.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_block(
    out: &Shared<'_, f32>,
    rows: usize,
    o0: usize,
    width: usize,
    r0: usize,
    m: usize,
    acc: &[f32],
    bad: &[bool],
) {
    for i in 0..m {
        let r = r0 + i;
        let at = r * rows + o0;
        // SAFETY: a product's calls each write only columns [o0, o0 + width) of their rows, a
        // range no other call writes.
        let row = unsafe { out.part(at..at + width) };
        if bad[r] {
            row.fill(f32::NAN);
        } else {
            row.copy_from_slice(&acc[i * BLOCK..i * BLOCK + width]);
        }
    }
}

impl Product for Q4Matrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        Q4Matrix::matmul(self, x, out, kernel)
    }
}

/// n rows as chunks of at most `most`, as even as can be: 9 rows in chunks of 8 go as 5 and 4,
/// not 8 and 1 (a chunk of 1-2 rows takes AVX2's `dot`, whose unpacking costs 4-8 times more a
/// multiply).
pub(crate) fn chunks(n: usize, most: usize) -> impl Iterator<Item = usize> {
    let parts = n.div_ceil(most).max(1);
    (0..parts).map(move |i| n / parts + usize::from(i < n % parts))
}

/// The most rows `dot_block` takes at once with `kernel`: VNNI_ROWS where the AVX-512 VNNI
/// kernel runs (it needs F16C too), ROWS otherwise.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn rows_per_call(kernel: Kernel) -> usize {
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512Vnni && has_f16c() {
        return VNNI_ROWS;
    }
    ROWS
}

fn check_shape(rows: usize, cols: usize, len: usize) -> Result<(), Error> {
    if rows == 0 || cols == 0 {
        return Err(Error::value(format!(
            "a 4-bit matrix needs at least one row and one column, got ({rows}, {cols})"
        )));
    }
    if cols > MAX_COLS {
        return Err(Error::value(format!(
            "a 4-bit matrix takes at most {MAX_COLS} columns, got {cols}"
        )));
    }
    if rows.checked_mul(cols) != Some(len) {
        return Err(Error::value(format!(
            "weight has {len} values, not {rows} x {cols}"
        )));
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn has_f16c() -> bool {
    is_x86_feature_detected!("f16c")
}

/// Per row and group, what a product needs of the activations' sums: Q4_1's m · Σ x term
/// takes sx · Σ xq; Q4_0's integer sums start at -8 Σ xq.
enum GroupSums {
    Float(Vec<f32>),
    Start(Vec<i32>),
}

/// Per row and group: sx · Σ xq, the group's activation sum (for the m · Σ x term).
fn group_sums(acts: &Activations) -> Vec<f32> {
    acts.scales
        .iter()
        .zip(&acts.sums)
        .map(|(&s, &t)| s * t as f32)
        .collect()
}

/// The activation rows of a kernel call: their int8 values, and per row and group the scale sx
/// and, for Q4_1, sx · Σ xq (xsum), for Q4_0 -8 Σ xq (start; each empty for the other).
#[derive(Clone, Copy)]
struct Rows<'a> {
    xs: &'a [i8],
    sx: &'a [f32],
    xsum: &'a [f32],
    start: &'a [i32],
}

/// One block of 16 output rows: its packed values and its d and m ([groups][16]; m empty for
/// Q4_0).
struct Block<'a> {
    w: &'a [u8],
    d: &'a [f16],
    m: &'a [f16],
    width: usize,
}

fn dot_scalar(blk: &Block<'_>, rows: &Rows<'_>, m: usize, acc: &mut [f32]) {
    let Rows {
        xs,
        sx,
        xsum,
        start,
    } = *rows;
    let groups = blk.width / GROUP;
    for i in 0..m {
        let x = &xs[i * blk.width..(i + 1) * blk.width];
        for lane in 0..BLOCK {
            let mut total = 0.0f32;
            for g in 0..groups {
                let mut s = if blk.m.is_empty() {
                    start[i * groups + g]
                } else {
                    0i32
                };
                for (k, &xk) in x.iter().enumerate().skip(g * GROUP).take(GROUP) {
                    let run = k / 4;
                    let byte = blk.w[(run / 2) * 64 + lane * 4 + k % 4];
                    let q = (byte >> (4 * (run % 2))) & 15;
                    s += i32::from(q) * i32::from(xk);
                }
                let d = blk.d[g * BLOCK + lane].to_f32();
                total += (s as f32) * (d * sx[i * groups + g]);
                if !blk.m.is_empty() {
                    total += blk.m[g * BLOCK + lane].to_f32() * xsum[i * groups + g];
                }
            }
            acc[i * BLOCK + lane] = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::wildcard_imports)]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{Block, Rows, BLOCK, GROUP};

    /// Eight f16 values at p, as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn eight(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }

    /// The AVX2-width kernels, 8 output rows a ymm: `$one(sum, w, x)` adds a run's products of
    /// u8 values w and s8 activations x to a group's sum, `$two` two runs', and `$widen` makes
    /// the sum i32 lanes. AVX2 sums in i16 by vpmaddubsw (8 · 2 · 15 · 127 < 2^15) and widens
    /// once a group by vpmaddwd; AVX-VNNI's vpdpbusd sums in i32. The same integers, so the
    /// same bits.
    macro_rules! ymm_kernels {
        ($dot:ident, $dot_half:ident, $features:literal, $one:expr, $two:expr, $widen:expr) => {
            /// Per group and pair of runs: the 64 packed bytes become 4 ymm of u8 values (two
            /// runs × two halves of 8 rows); each feeds one product per row against the run's 4
            /// activations broadcast. The sums add up across the group's 4 pairs and widen once
            /// per group.
            #[target_feature(enable = $features)]
            pub unsafe fn $dot<const R: usize, const S: bool>(
                blk: &Block<'_>,
                rows: &Rows<'_>,
                acc: &mut [f32],
            ) {
                let Rows {
                    xs,
                    sx,
                    xsum,
                    start,
                } = *rows;
                let groups = blk.width / GROUP;
                let nibble = _mm256_set1_epi8(15);
                let wp = blk.w.as_ptr();
                let xp = xs.as_ptr();
                let mut total = [[_mm256_setzero_ps(); 2]; R];
                for g in 0..groups {
                    let mut sums = [[_mm256_setzero_si256(); 2]; R];
                    for pair in g * 4..(g + 1) * 4 {
                        // As int8's.
                        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(pair * 64 + 2048).cast());
                        let lo = _mm256_loadu_si256(wp.add(pair * 64).cast());
                        let hi = _mm256_loadu_si256(wp.add(pair * 64 + 32).cast());
                        // [run][half]
                        let w = [
                            [_mm256_and_si256(lo, nibble), _mm256_and_si256(hi, nibble)],
                            [
                                _mm256_and_si256(_mm256_srli_epi16(lo, 4), nibble),
                                _mm256_and_si256(_mm256_srli_epi16(hi, 4), nibble),
                            ],
                        ];
                        for (i, si) in sums.iter_mut().enumerate() {
                            for (run, wr) in w.iter().enumerate() {
                                let at = i * blk.width + (2 * pair + run) * 4;
                                let xv =
                                    _mm256_set1_epi32(xp.add(at).cast::<i32>().read_unaligned());
                                for (sih, wh) in si.iter_mut().zip(wr) {
                                    *sih = $one(*sih, *wh, xv);
                                }
                            }
                        }
                    }
                    let d = blk.d.as_ptr().add(g * BLOCK);
                    let d = [eight(d), eight(d.add(8))];
                    let m = if S {
                        [_mm256_setzero_ps(); 2]
                    } else {
                        let m = blk.m.as_ptr().add(g * BLOCK);
                        [eight(m), eight(m.add(8))]
                    };
                    for (i, (ti, si)) in total.iter_mut().zip(&sums).enumerate() {
                        let s = _mm256_set1_ps(sx[i * groups + g]);
                        for h in 0..2 {
                            let int = if S {
                                _mm256_add_epi32(
                                    $widen(si[h]),
                                    _mm256_set1_epi32(start[i * groups + g]),
                                )
                            } else {
                                $widen(si[h])
                            };
                            let exact = _mm256_cvtepi32_ps(int);
                            let t =
                                _mm256_add_ps(ti[h], _mm256_mul_ps(exact, _mm256_mul_ps(d[h], s)));
                            ti[h] = if S {
                                t
                            } else {
                                let xs = _mm256_set1_ps(xsum[i * groups + g]);
                                _mm256_add_ps(t, _mm256_mul_ps(m[h], xs))
                            };
                        }
                    }
                }
                for (i, ti) in total.iter().enumerate() {
                    _mm256_storeu_ps(acc.as_mut_ptr().add(i * BLOCK), ti[0]);
                    _mm256_storeu_ps(acc.as_mut_ptr().add(i * BLOCK + 8), ti[1]);
                }
            }

            /// One half of a block (8 output rows) for R = 3..=8 input rows: each pair's 32 bytes
            /// are unpacked once for all R rows, so at 8 rows the unpacking costs a quarter of
            /// `dot::<2>`'s per multiply. A block is read twice (once per half), the second time
            /// from L1; for 1-2 rows, whose passes read the weights from memory, `dot` reads them
            /// once.
            #[target_feature(enable = $features)]
            pub unsafe fn $dot_half<const R: usize, const S: bool>(
                blk: &Block<'_>,
                half: usize,
                rows: &Rows<'_>,
                acc: &mut [f32],
            ) {
                let Rows {
                    xs,
                    sx,
                    xsum,
                    start,
                } = *rows;
                let groups = blk.width / GROUP;
                let nibble = _mm256_set1_epi8(15);
                let wp = blk.w.as_ptr().add(32 * half);
                let xp = xs.as_ptr();
                // The running totals live in `acc` (L1), not registers: R sums, two weight
                // vectors and the constants already fill AVX2's 16.
                let base = acc.as_mut_ptr();
                let total = |i: usize| base.add(i * BLOCK + 8 * half);
                for i in 0..R {
                    _mm256_storeu_ps(total(i), _mm256_setzero_ps());
                }
                for g in 0..groups {
                    let mut sums = [_mm256_setzero_si256(); R];
                    for pair in g * 4..(g + 1) * 4 {
                        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(pair * 64 + 2048).cast());
                        let v = _mm256_loadu_si256(wp.add(pair * 64).cast());
                        let w0 = _mm256_and_si256(v, nibble);
                        let w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                        for (i, si) in sums.iter_mut().enumerate() {
                            let at = i * blk.width + pair * 8;
                            let x0 = _mm256_set1_epi32(xp.add(at).cast::<i32>().read_unaligned());
                            let x1 =
                                _mm256_set1_epi32(xp.add(at + 4).cast::<i32>().read_unaligned());
                            *si = $two(*si, w0, x0, w1, x1);
                        }
                    }
                    let d = eight(blk.d.as_ptr().add(g * BLOCK + 8 * half));
                    let m = if S {
                        _mm256_setzero_ps()
                    } else {
                        eight(blk.m.as_ptr().add(g * BLOCK + 8 * half))
                    };
                    for (i, si) in sums.iter().enumerate() {
                        let s = _mm256_set1_ps(*sx.get_unchecked(i * groups + g));
                        let int = if S {
                            _mm256_add_epi32(
                                $widen(*si),
                                _mm256_set1_epi32(*start.get_unchecked(i * groups + g)),
                            )
                        } else {
                            $widen(*si)
                        };
                        let exact = _mm256_cvtepi32_ps(int);
                        let t = _mm256_loadu_ps(total(i));
                        let t = _mm256_add_ps(t, _mm256_mul_ps(exact, _mm256_mul_ps(d, s)));
                        let t = if S {
                            t
                        } else {
                            let xs = _mm256_set1_ps(*xsum.get_unchecked(i * groups + g));
                            _mm256_add_ps(t, _mm256_mul_ps(m, xs))
                        };
                        _mm256_storeu_ps(total(i), t);
                    }
                }
            }
        };
    }

    ymm_kernels!(
        dot,
        dot_half,
        "avx2,f16c",
        |s, w, x| _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x)),
        |s, w0, x0, w1, x1| _mm256_add_epi16(
            s,
            _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1))
        ),
        |s| _mm256_madd_epi16(s, _mm256_set1_epi16(1))
    );
    ymm_kernels!(
        dot_avxvnni,
        dot_half_avxvnni,
        "avx2,avxvnni,f16c",
        |s, w, x| _mm256_dpbusd_avx_epi32(s, w, x),
        |s, w0, x0, w1, x1| _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s, w0, x0), w1, x1),
        |s| s
    );

    /// AVX-512 VNNI: a pair's 64 bytes become two zmm of u8 values (one run each, all 16 rows),
    /// and each meets a row's 4 activations, broadcast, in one vpdpbusd straight into i32: a
    /// whole block a multiply and nothing to widen. Up to 4 rows, each run has its own sum, so
    /// that one row's vpdpbusd chain is not the pass's latency.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub unsafe fn dot_vnni<const R: usize, const S: bool>(
        blk: &Block<'_>,
        rows: &Rows<'_>,
        acc: &mut [f32],
    ) {
        let Rows {
            xs,
            sx,
            xsum,
            start,
        } = *rows;
        let groups = blk.width / GROUP;
        let split = R <= 4;
        let nibble = _mm512_set1_epi8(15);
        let wp = blk.w.as_ptr();
        let xp = xs.as_ptr();
        let mut total = [_mm512_setzero_ps(); R];
        for g in 0..groups {
            let mut sums = [[_mm512_setzero_si512(); 2]; R];
            if S {
                for (i, si) in sums.iter_mut().enumerate() {
                    si[0] = _mm512_set1_epi32(*start.get_unchecked(i * groups + g));
                }
            }
            for pair in g * 4..(g + 1) * 4 {
                // One or two rows read faster than the hardware prefetches: into L2, 4 KB
                // ahead; more rows keep 2 KB into L1 (bench_runtime.py; docs/benchmarks.md
                // §14).
                if R > 2 {
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(pair * 64 + 2048).cast());
                } else {
                    _mm_prefetch::<_MM_HINT_T1>(wp.wrapping_add(pair * 64 + 4096).cast());
                }
                let v = _mm512_loadu_si512(wp.add(pair * 64).cast());
                let w0 = _mm512_and_si512(v, nibble);
                let w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                for (i, si) in sums.iter_mut().enumerate() {
                    let at = i * blk.width + pair * 8;
                    let x0 = _mm512_set1_epi32(xp.add(at).cast::<i32>().read_unaligned());
                    let x1 = _mm512_set1_epi32(xp.add(at + 4).cast::<i32>().read_unaligned());
                    let first = _mm512_dpbusd_epi32(si[0], w0, x0);
                    if split {
                        si[0] = first;
                        si[1] = _mm512_dpbusd_epi32(si[1], w1, x1);
                    } else {
                        si[0] = _mm512_dpbusd_epi32(first, w1, x1);
                    }
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().add(g * BLOCK).cast()));
            let m = if S {
                _mm512_setzero_ps()
            } else {
                _mm512_cvtph_ps(_mm256_loadu_si256(blk.m.as_ptr().add(g * BLOCK).cast()))
            };
            for (i, (ti, si)) in total.iter_mut().zip(&sums).enumerate() {
                let s = _mm512_set1_ps(*sx.get_unchecked(i * groups + g));
                let sum = if split {
                    _mm512_add_epi32(si[0], si[1])
                } else {
                    si[0]
                };
                let exact = _mm512_cvtepi32_ps(sum);
                let t = _mm512_add_ps(*ti, _mm512_mul_ps(exact, _mm512_mul_ps(d, s)));
                *ti = if S {
                    t
                } else {
                    let xs = _mm512_set1_ps(*xsum.get_unchecked(i * groups + g));
                    _mm512_add_ps(t, _mm512_mul_ps(m, xs))
                };
            }
        }
        for (i, ti) in total.iter().enumerate() {
            _mm512_storeu_ps(acc.as_mut_ptr().add(i * BLOCK), *ti);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int8::tests::{kernels, lcg};
    use proptest::prelude::*;

    /// The product from the unpacked parts, in f64 where the integer sums are formed, then in
    /// the documented f32 order.
    fn reference(mat: &Q4Matrix, x: &[f32], n: usize) -> Vec<f32> {
        let (q, d, m) = mat.parts();
        let (rows, cols) = (mat.rows, mat.cols);
        let groups = cols.div_ceil(GROUP);
        let mut out = vec![0.0; n * rows];
        for r in 0..n {
            let row = &x[r * cols..(r + 1) * cols];
            if row.iter().any(|v| !v.is_finite()) {
                out[r * rows..(r + 1) * rows].fill(f32::NAN);
                continue;
            }
            let mut xq = vec![0i8; cols];
            let mut scales = vec![];
            for lo in (0..cols).step_by(GROUP) {
                let hi = (lo + GROUP).min(cols);
                scales.push(crate::int8::quantize(&row[lo..hi], &mut xq[lo..hi]));
            }
            for o in 0..rows {
                let mut total = 0.0f32;
                for (g, &s) in scales.iter().enumerate() {
                    let ks = g * GROUP..((g + 1) * GROUP).min(cols);
                    let dot: f64 = ks
                        .clone()
                        .map(|k| f64::from(xq[k]) * f64::from(q[o * cols + k]))
                        .sum();
                    let sum: f64 = ks.map(|k| f64::from(xq[k])).sum();
                    let dg = d[o * groups + g].to_f32();
                    match &m {
                        Some(m) => {
                            total += (dot as f32) * (dg * s);
                            total += m[o * groups + g].to_f32() * (s * sum as f32);
                        }
                        None => total += ((dot - 8.0 * sum) as f32) * (dg * s),
                    }
                }
                out[r * rows + o] = total;
            }
        }
        out
    }

    /// A Q4_0 matrix of random values and scales (as a GGUF's Q4_0 tensor would hold).
    fn symmetric(seed: u64, rows: usize, cols: usize) -> Q4Matrix {
        let groups = cols.div_ceil(GROUP);
        let q: Vec<u8> = (lcg(seed, rows * cols).iter())
            .map(|v| ((v + 1.0) * 8.0).clamp(0.0, 15.0) as u8)
            .collect();
        let d: Vec<f16> = (lcg(seed + 1, rows * groups).iter())
            .map(|v| f16::from_f32(0.01 + v.abs() / 8.0))
            .collect();
        Q4Matrix::from_parts(&q, &d, None, rows, cols).unwrap()
    }

    /// The weight w[o, k] a matrix stands for, from its parts.
    fn weight(
        parts: &(Vec<u8>, Vec<f16>, Option<Vec<f16>>),
        cols: usize,
        o: usize,
        k: usize,
    ) -> f32 {
        let (q, d, m) = parts;
        let g = o * cols.div_ceil(GROUP) + k / GROUP;
        let q = f32::from(q[o * cols + k]);
        match m {
            Some(m) => d[g].to_f32() * q + m[g].to_f32(),
            None => d[g].to_f32() * (q - 8.0),
        }
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
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
            (50, 96, 70),  // many rows
        ] {
            let q41 = Q4Matrix::quantize(&lcg(rows as u64, rows * cols), rows, cols).unwrap();
            let q40 = symmetric(rows as u64, rows, cols);
            let x = lcg(7 + n as u64, n * cols);
            for m in [q41, q40] {
                let want = reference(&m, &x, n);
                for k in kernels() {
                    let mut out = vec![0.0; n * rows];
                    m.matmul(&x, &mut out, k).unwrap();
                    assert!(
                        same_bits(&out, &want),
                        "{k:?} at ({rows}, {cols}) x {n} rows, Q4_{}",
                        i32::from(m.minimum.is_some())
                    );
                }
            }
        }
    }

    #[test]
    fn the_reference_catches_a_kernel_that_drops_the_last_row() {
        let (rows, cols, n) = (40, 70, 5);
        let m = Q4Matrix::quantize(&lcg(9, rows * cols), rows, cols).unwrap();
        let x = lcg(10, n * cols);
        let mut out = vec![0.0; n * rows];
        m.matmul(
            &x[..(n - 1) * cols],
            &mut out[..(n - 1) * rows],
            Kernel::best(),
        )
        .unwrap();
        assert!(!same_bits(&out, &reference(&m, &x, n)));
    }

    #[test]
    fn a_row_does_not_depend_on_the_other_rows() {
        let (rows, cols) = (700, 200);
        let m = Q4Matrix::quantize(&lcg(1, rows * cols), rows, cols).unwrap();
        let mut x = lcg(2, 9 * cols);
        x[5 * cols] = 40.0;
        let mut all = vec![0.0; 9 * rows];
        m.matmul(&x, &mut all, Kernel::best()).unwrap();
        for r in 0..9 {
            let mut one = vec![0.0; rows];
            m.matmul(&x[r * cols..(r + 1) * cols], &mut one, Kernel::best())
                .unwrap();
            assert!(same_bits(&one, &all[r * rows..(r + 1) * rows]), "row {r}");
        }
    }

    #[test]
    fn parts_round_trip_and_stand_for_the_weights() {
        let (rows, cols) = (20, 70);
        let w = lcg(3, rows * cols);
        let m = Q4Matrix::quantize(&w, rows, cols).unwrap();
        let parts = m.parts();
        let (q, d, mn) = &parts;
        let again = Q4Matrix::from_parts(q, d, mn.as_deref(), rows, cols).unwrap();
        assert_eq!(again.packed[..], m.packed[..]);
        let groups = cols.div_ceil(GROUP);
        for o in 0..rows {
            for k in 0..cols {
                let dg = d[o * groups + k / GROUP].to_f32();
                let v = weight(&parts, cols, o, k);
                // half a step of 1/15 of the group's range, plus f16 rounding of d and m
                assert!(
                    (v - w[o * cols + k]).abs() <= dg * 0.5 + 2e-3,
                    "{v} vs {}",
                    w[o * cols + k]
                );
            }
        }
    }

    #[test]
    fn q4_0_round_trips_without_a_minimum() {
        let (rows, cols) = (20, 70);
        let m = symmetric(3, rows, cols);
        let (q, d, mn) = m.parts();
        assert!(mn.is_none());
        let again = Q4Matrix::from_parts(&q, &d, None, rows, cols).unwrap();
        assert_eq!(again.packed[..], m.packed[..]);
        assert_eq!(again.scale[..], m.scale[..]);
        // 4.5 bits a weight against Q4_1's 5
        let with_min = Q4Matrix::quantize(&lcg(3, rows * cols), rows, cols).unwrap();
        assert_eq!(with_min.nbytes() - m.nbytes(), 2 * 32 * 3);
    }

    #[test]
    fn close_to_the_float_product_of_its_weights() {
        let (rows, cols, n) = (64, 256, 4);
        let x = lcg(4, n * cols);
        let q41 = Q4Matrix::quantize(&lcg(3, rows * cols), rows, cols).unwrap();
        for m in [q41, symmetric(3, rows, cols)] {
            let parts = m.parts();
            let mut out = vec![0.0; n * rows];
            m.matmul(&x, &mut out, Kernel::best()).unwrap();
            for r in 0..n {
                for o in 0..rows {
                    let exact: f32 = (0..cols)
                        .map(|k| x[r * cols + k] * weight(&parts, cols, o, k))
                        .sum();
                    let got = out[r * rows + o];
                    assert!((got - exact).abs() < 0.03, "{got} vs {exact}");
                }
            }
        }
    }

    #[test]
    fn q4_0_is_not_q4_1_with_a_zero_minimum() {
        // The control for the -8: read as Q4_1 with m = 0, the same values and scales give a
        // product far from d·(q - 8)'s.
        let (rows, cols, n) = (32, 64, 2);
        let m = symmetric(8, rows, cols);
        let (q, d, _) = m.parts();
        let zero = vec![f16::ZERO; d.len()];
        let wrong = Q4Matrix::from_parts(&q, &d, Some(&zero), rows, cols).unwrap();
        let x = lcg(9, n * cols);
        let (mut a, mut b) = (vec![0.0; n * rows], vec![0.0; n * rows]);
        m.matmul(&x, &mut a, Kernel::best()).unwrap();
        wrong.matmul(&x, &mut b, Kernel::best()).unwrap();
        let far = a
            .iter()
            .zip(&b)
            .filter(|(x, y)| (*x - *y).abs() > 0.1)
            .count();
        assert!(far > a.len() / 2, "{far} of {}", a.len());
    }

    #[test]
    fn bad_rows_and_bad_input() {
        let m = Q4Matrix::quantize(&lcg(5, 32 * 8), 32, 8).unwrap();
        let mut x = lcg(6, 2 * 8);
        x[9] = f32::NAN;
        let mut out = vec![0.0; 2 * 32];
        m.matmul(&x, &mut out, Kernel::best()).unwrap();
        assert!(out[..32].iter().all(|v| v.is_finite()));
        assert!(out[32..].iter().all(|v| v.is_nan()));
        assert!(m.matmul(&x[..7], &mut out, Kernel::best()).is_err());
        assert!(Q4Matrix::quantize(&[1.0, f32::INFINITY], 1, 2).is_err());
        assert!(Q4Matrix::quantize(&[], 0, 0).is_err());
        let d = [f16::ONE];
        assert!(Q4Matrix::from_parts(&[16, 0], &d, Some(&d), 1, 2).is_err());
        assert!(Q4Matrix::from_parts(&[16, 0], &d, None, 1, 2).is_err());
        assert!(Q4Matrix::from_parts(&[1, 0], &d, Some(&[f16::NAN]), 1, 2).is_err());
        assert!(Q4Matrix::from_parts(&[1, 0], &[f16::NAN], None, 1, 2).is_err());
        assert!(Q4Matrix::from_parts(&[1, 0], &d, Some(&[]), 1, 2).is_err());
        assert!(Q4Matrix::from_parts(&[1, 0], &[], None, 1, 2).is_err());
    }

    proptest! {
        #[test]
        fn kernels_agree(rows in 1usize..40, cols in 1usize..100, n in 1usize..12, seed in 0u64..1000) {
            let q41 = Q4Matrix::quantize(&lcg(seed, rows * cols), rows, cols).unwrap();
            let x = lcg(seed + 1, n * cols);
            for m in [q41, symmetric(seed, rows, cols)] {
                let want = reference(&m, &x, n);
                for k in kernels() {
                    let mut out = vec![0.0; n * rows];
                    m.matmul(&x, &mut out, k).unwrap();
                    prop_assert!(same_bits(&out, &want));
                }
            }
        }
    }
}
