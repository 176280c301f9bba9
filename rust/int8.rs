//! Int8 matrix products for CPU decode and verify passes.
//!
//! Weights are quantized once, symmetrically, one scale per output row. Each activation row is
//! quantized on its own at every call, with its own scale. Products accumulate exactly in i32,
//! and the float epilogue `(acc as f32) * (sx[r] * sw[o])` is the same in every code path, so:
//!
//! - row r of a pass depends only on row r of the input: a verify pass over k+1 rows gives, row
//!   for row, the bits that k+1 one-row passes give;
//! - the scalar, AVX2 and AVX-512 VNNI paths give bit-identical results.
//!
//! Packed layout: blocks of 16 output rows; inside a block, groups of 4 input features, each
//! group 16 rows × 4 bytes (64 bytes, one zmm). A pass reads every block once for all of its
//! rows: 8 rows at a time, from L1 after the first 8.

use rayon::prelude::*;

use crate::error::Error;

/// Output rows per packed block.
const BLOCK: usize = 16;
/// Activation rows a kernel call accumulates at once (registers: 8 zmm accumulators).
const ROWS: usize = 8;
/// Blocks a kernel call reads at once (8 rows x 2 blocks: 16 zmm accumulators).
const PAIR: usize = 2;
/// Above this many input features an i32 accumulator could overflow (255 * 127 * K < 2^31).
pub const MAX_COLS: usize = 65_536;
/// Matrices smaller than this many weights run on one thread (a fork costs more than it saves).
const PARALLEL_MIN: usize = 1 << 16;

/// Which instruction set a product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    Avx2,
    Avx512Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                return Kernel::Avx512Vnni;
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
            Kernel::Avx2 => cfg!(target_arch = "x86_64") && Kernel::best() != Kernel::Scalar,
            Kernel::Avx512Vnni => Kernel::best() == Kernel::Avx512Vnni,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512Vnni => "avx512vnni",
        }
    }

    pub fn from_name(name: &str) -> Result<Kernel, Error> {
        let kernel = match name {
            "auto" => Kernel::best(),
            "scalar" => Kernel::Scalar,
            "avx2" => Kernel::Avx2,
            "avx512vnni" => Kernel::Avx512Vnni,
            _ => {
                return Err(Error::value(format!(
                    "kernel must be 'auto', 'scalar', 'avx2' or 'avx512vnni', got {name:?}"
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

/// Symmetric int8 quantization of one row: (scale, values), scale = max|x| / 127, values
/// round-half-even(x / scale). An all-zero row has scale 0 and values 0.
fn quantize_row(x: &[f32], out: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        out.fill(0);
        return 0.0;
    }
    let scale = amax / 127.0;
    for (q, v) in out.iter_mut().zip(x) {
        *q = (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// A weight matrix (rows = output features, cols = input features) in int8, packed for
/// [`Int8Matrix::matmul`].
pub struct Int8Matrix {
    rows: usize,
    cols: usize,
    groups: usize,     // ceil(cols / 4)
    packed: Vec<i8>,   // [ceil(rows / 16)][groups][16][4]
    scales: Vec<f32>,  // (rows,) one per output row, padded to whole blocks with 0
    offsets: Vec<i32>, // (rows,) 128 * the row's int8 sum (the VNNI path's u8 offset), padded
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
        let groups = cols.div_ceil(4);
        let blocks = rows.div_ceil(BLOCK);
        let mut packed = vec![0i8; blocks * groups * BLOCK * 4];
        let mut scales = vec![0.0f32; blocks * BLOCK];
        let mut offsets = vec![0i32; blocks * BLOCK];
        let mut q = vec![0i8; cols];
        for o in 0..rows {
            scales[o] = quantize_row(&weight[o * cols..(o + 1) * cols], &mut q);
            offsets[o] = 128 * q.iter().map(|&v| i32::from(v)).sum::<i32>();
            let (b, lane) = (o / BLOCK, o % BLOCK);
            for (k, &v) in q.iter().enumerate() {
                packed[((b * groups + k / 4) * BLOCK + lane) * 4 + k % 4] = v;
            }
        }
        Ok(Int8Matrix {
            rows,
            cols,
            groups,
            packed,
            scales,
            offsets,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of packed weights a pass reads.
    pub fn nbytes(&self) -> usize {
        self.packed.len() + 4 * self.scales.len()
    }

    /// The quantized weights, row-major (rows, cols), and the scale of each row.
    pub fn weights(&self) -> (Vec<i8>, Vec<f32>) {
        let mut q = vec![0i8; self.rows * self.cols];
        for o in 0..self.rows {
            let (b, lane) = (o / BLOCK, o % BLOCK);
            for k in 0..self.cols {
                q[o * self.cols + k] =
                    self.packed[((b * self.groups + k / 4) * BLOCK + lane) * 4 + k % 4];
            }
        }
        (q, self.scales[..self.rows].to_vec())
    }

    /// out (n, rows) = x (n, cols) · Wᵀ, both row-major. A row of x that holds NaN or ±inf
    /// gives a row of NaN.
    pub fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        if !x.len().is_multiple_of(self.cols) {
            return Err(Error::value(format!(
                "x has {} values, not a whole number of rows of {}",
                x.len(),
                self.cols
            )));
        }
        let n = x.len() / self.cols;
        if out.len() != n * self.rows {
            return Err(Error::value(format!(
                "out has {} values, expected {n} x {}",
                out.len(),
                self.rows
            )));
        }
        if !kernel.supported() {
            return Err(Error::value(format!(
                "this CPU cannot run the {} kernel",
                kernel.name()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        // Activations: each row quantized with its own scale, padded with zeros to whole
        // groups; the VNNI path reads them as u8 (q + 128) and subtracts 128 * Σw afterwards.
        let width = self.groups * 4;
        let mut xq = vec![0i8; n * width];
        let mut sx = vec![0.0f32; n];
        let mut bad = vec![false; n];
        for r in 0..n {
            let row = &x[r * self.cols..(r + 1) * self.cols];
            bad[r] = row.iter().any(|v| !v.is_finite());
            sx[r] = quantize_row(row, &mut xq[r * width..r * width + self.cols]);
        }
        if kernel == Kernel::Avx512Vnni {
            for v in &mut xq {
                *v = (v.cast_unsigned() ^ 0x80).cast_signed();
            }
        }
        let blocks = self.rows.div_ceil(BLOCK);
        let out_ptr = SendPtr(out.as_mut_ptr());
        let block_len = self.groups * BLOCK * 4;
        let run = |range: std::ops::Range<usize>| {
            let mut acc = vec![0i32; ROWS * PAIR * BLOCK];
            let mut b = range.start;
            while b < range.end {
                // Two blocks at a time: each activation broadcast feeds two products.
                let nb = PAIR.min(range.end - b);
                let w = &self.packed[b * block_len..(b + nb) * block_len];
                for r0 in (0..n).step_by(ROWS) {
                    let m = ROWS.min(n - r0);
                    let xs = &xq[r0 * width..(r0 + m) * width];
                    dot_blocks(kernel, w, nb, xs, width, m, &mut acc);
                    self.epilogue(b, nb, r0, m, &acc, &sx, &bad, kernel, out_ptr);
                }
                b += nb;
            }
        };
        if self.rows * self.cols < PARALLEL_MIN || rayon::current_num_threads() == 1 {
            run(0..blocks);
        } else {
            let chunk = blocks
                .div_ceil(rayon::current_num_threads())
                .max(1)
                .next_multiple_of(PAIR);
            (0..blocks)
                .step_by(chunk)
                .collect::<Vec<_>>()
                .into_par_iter()
                .for_each(|start| run(start..(start + chunk).min(blocks)));
        }
        Ok(())
    }

    /// Writes the columns of blocks b..b+nb of rows r0..r0+m:
    /// (acc - offset) as f32 * (sx[r] * sw[o]).
    #[allow(clippy::too_many_arguments)]
    fn epilogue(
        &self,
        b: usize,
        nb: usize,
        r0: usize,
        m: usize,
        acc: &[i32],
        sx: &[f32],
        bad: &[bool],
        kernel: Kernel,
        out: SendPtr,
    ) {
        let o0 = b * BLOCK;
        let width = (nb * BLOCK).min(self.rows - o0);
        let zeros = [0i32; PAIR * BLOCK];
        let offsets = if kernel == Kernel::Avx512Vnni {
            &self.offsets[o0..o0 + width]
        } else {
            &zeros[..width]
        };
        let scales = &self.scales[o0..o0 + width];
        for i in 0..m {
            let r = r0 + i;
            // SAFETY: each call writes only columns [o0, o0 + width) of its rows, a range no
            // other call writes, inside `out` (checked to be n x rows).
            let row =
                unsafe { std::slice::from_raw_parts_mut(out.0.add(r * self.rows + o0), width) };
            if bad[r] {
                row.fill(f32::NAN);
                continue;
            }
            let a = &acc[i * nb * BLOCK..i * nb * BLOCK + width];
            let s = sx[r];
            for (((y, &a), &off), &sw) in row.iter_mut().zip(a).zip(offsets).zip(scales) {
                *y = ((a - off) as f32) * (s * sw);
            }
        }
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the pointer is only written through disjoint ranges (see `epilogue`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// acc[i * nb * 16 + j * 16 + lane] = Σ_k x[i][k] · w[j][lane][k] for the m ≤ 8 rows of `xs`
/// and the nb ≤ 2 blocks of `w`.
fn dot_blocks(
    kernel: Kernel,
    w: &[i8],
    nb: usize,
    xs: &[i8],
    width: usize,
    m: usize,
    acc: &mut [i32],
) {
    debug_assert!(m <= ROWS && nb <= PAIR && w.len() == nb * width * BLOCK);
    debug_assert!(xs.len() == m * width && acc.len() >= m * nb * BLOCK);
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `supported()` checked that the CPU has these instructions; the slices'
        // lengths are the ones the kernels read.
        Kernel::Avx512Vnni => unsafe { x86::dot_vnni(w, nb, xs, width, m, acc) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => {
            for j in 0..nb {
                let wj = &w[j * width * BLOCK..(j + 1) * width * BLOCK];
                let mut one = [0i32; ROWS * BLOCK];
                unsafe { x86::dot_avx2(wj, xs, width, m, &mut one) };
                scatter(&one, j, nb, m, acc);
            }
        }
        _ => {
            for j in 0..nb {
                let wj = &w[j * width * BLOCK..(j + 1) * width * BLOCK];
                let mut one = [0i32; ROWS * BLOCK];
                dot_scalar(wj, xs, width, m, &mut one);
                scatter(&one, j, nb, m, acc);
            }
        }
    }
}

fn dot_scalar(w: &[i8], xs: &[i8], width: usize, m: usize, acc: &mut [i32]) {
    for i in 0..m {
        let x = &xs[i * width..(i + 1) * width];
        for lane in 0..BLOCK {
            let mut s = 0i32;
            for g in 0..width / 4 {
                for t in 0..4 {
                    s += i32::from(x[g * 4 + t]) * i32::from(w[(g * BLOCK + lane) * 4 + t]);
                }
            }
            acc[i * BLOCK + lane] = s;
        }
    }
}

/// Copies one block's (m, 16) sums into column block j of an (m, nb * 16) layout.
fn scatter(one: &[i32], j: usize, nb: usize, m: usize, acc: &mut [i32]) {
    for i in 0..m {
        let dst = i * nb * BLOCK + j * BLOCK;
        acc[dst..dst + BLOCK].copy_from_slice(&one[i * BLOCK..(i + 1) * BLOCK]);
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::wildcard_imports)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BLOCK, ROWS};

    /// VNNI: one vpdpbusd per row, block and group of 4 features (u8 activations, s8
    /// weights); each broadcast of a row's 4 activations feeds both blocks of a pair.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dot_vnni(
        w: &[i8],
        nb: usize,
        xs: &[i8],
        width: usize,
        m: usize,
        acc: &mut [i32],
    ) {
        macro_rules! rows {
            ($nb:literal) => {
                match m {
                    1 => vnni::<1, $nb>(w, xs, width, acc),
                    2 => vnni::<2, $nb>(w, xs, width, acc),
                    3 => vnni::<3, $nb>(w, xs, width, acc),
                    4 => vnni::<4, $nb>(w, xs, width, acc),
                    5 => vnni::<5, $nb>(w, xs, width, acc),
                    6 => vnni::<6, $nb>(w, xs, width, acc),
                    7 => vnni::<7, $nb>(w, xs, width, acc),
                    _ => vnni::<ROWS, $nb>(w, xs, width, acc),
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
        width: usize,
        acc: &mut [i32],
    ) {
        let mut a = [[_mm512_setzero_si512(); B]; R];
        let wp = w.as_ptr();
        let xp = xs.as_ptr();
        let block_len = width * BLOCK;
        for g in 0..width / 4 {
            let mut wv = [_mm512_setzero_si512(); B];
            for (j, v) in wv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(wp.add(j * block_len + g * 64).cast());
            }
            for (i, ai) in a.iter_mut().enumerate() {
                let x4 = xp.add(i * width + g * 4).cast::<i32>().read_unaligned();
                let xv = _mm512_set1_epi32(x4);
                for (aij, v) in ai.iter_mut().zip(&wv) {
                    *aij = _mm512_dpbusd_epi32(*aij, xv, *v);
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            for (j, aij) in ai.iter().enumerate() {
                _mm512_storeu_si512(acc.as_mut_ptr().add((i * B + j) * BLOCK).cast(), *aij);
            }
        }
    }

    /// AVX2: vpmaddubsw on |x| and sign(x)·w (pairs stay within i16: 2 · 127 · 127), then
    /// vpmaddwd with ones into i32; two ymm halves of 8 output rows each.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_avx2(w: &[i8], xs: &[i8], width: usize, m: usize, acc: &mut [i32]) {
        let mut i = 0;
        while i < m {
            match m - i {
                1 => avx2_rows::<1>(w, &xs[i * width..], width, &mut acc[i * BLOCK..]),
                2 => avx2_rows::<2>(w, &xs[i * width..], width, &mut acc[i * BLOCK..]),
                3 => avx2_rows::<3>(w, &xs[i * width..], width, &mut acc[i * BLOCK..]),
                _ => avx2_rows::<4>(w, &xs[i * width..], width, &mut acc[i * BLOCK..]),
            }
            i += 4;
        }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn avx2_rows<const R: usize>(w: &[i8], xs: &[i8], width: usize, acc: &mut [i32]) {
        let ones = _mm256_set1_epi16(1);
        let mut lo = [_mm256_setzero_si256(); R];
        let mut hi = [_mm256_setzero_si256(); R];
        let wp = w.as_ptr();
        let xp = xs.as_ptr();
        for g in 0..width / 4 {
            let w0 = _mm256_loadu_si256(wp.add(g * 64).cast());
            let w1 = _mm256_loadu_si256(wp.add(g * 64 + 32).cast());
            for i in 0..R {
                let x4 = xp.add(i * width + g * 4).cast::<i32>().read_unaligned();
                let xv = _mm256_set1_epi32(x4);
                let ax = _mm256_sign_epi8(xv, xv); // |x|
                let p0 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv));
                let p1 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv));
                lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(p0, ones));
                hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(p1, ones));
            }
        }
        for i in 0..R {
            _mm256_storeu_si256(acc.as_mut_ptr().add(i * BLOCK).cast(), lo[i]);
            _mm256_storeu_si256(acc.as_mut_ptr().add(i * BLOCK + 8).cast(), hi[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// The product from the quantized values, with integer sums in i64.
    fn reference(m: &Int8Matrix, x: &[f32], n: usize) -> Vec<f32> {
        let (q, sw) = m.weights();
        let mut out = vec![0.0; n * m.rows];
        let mut xq = vec![0i8; m.cols];
        for r in 0..n {
            let row = &x[r * m.cols..(r + 1) * m.cols];
            let sx = quantize_row(row, &mut xq);
            for o in 0..m.rows {
                let s: i64 = (0..m.cols)
                    .map(|k| i64::from(xq[k]) * i64::from(q[o * m.cols + k]))
                    .sum();
                out[r * m.rows + o] = (s as i32 as f32) * (sx * sw[o]);
            }
        }
        out
    }

    fn kernels() -> Vec<Kernel> {
        [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512Vnni]
            .into_iter()
            .filter(|k| k.supported())
            .collect()
    }

    #[test]
    fn every_kernel_equals_the_reference_bit_for_bit() {
        for &(rows, cols, n) in &[
            (1, 1, 1),
            (17, 5, 3),
            (48, 64, 9),
            (33, 130, 17),
            (300, 577, 2),
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
        let (rows, cols) = (70, 200);
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
                assert!(
                    (out[r * rows + o] - exact).abs() < 0.05,
                    "{} vs {exact}",
                    out[r * rows + o]
                );
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
        fn kernels_agree(rows in 1usize..40, cols in 1usize..70, n in 1usize..20, seed in 0u64..1000) {
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
