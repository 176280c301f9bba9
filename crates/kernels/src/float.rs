//! Float32 weight matrices for CPU passes, each row of a pass computed on its own.
//!
//! A library GEMM (oneDNN, MKL, OpenBLAS) blocks its sums by the number of rows, so a verify
//! pass's row need not equal a one-token pass to the last bit; none of them streams a batch-1
//! product at the memory's rate on every CPU either (bench_linear.py; docs/benchmarks.md §14).
//! Here every output value is attention's dot product (`attention::dot_rows`: 16 lanes of
//! fused multiply-adds, then a fixed tree), so a row's values depend only on that row, and the
//! AVX-512, AVX2 and portable builds give the same bits.
//!
//! The weights stay row-major float32, in pieces of whole output rows that this thread and the
//! helper take from both ends (`helper::for_each`).

use specfast_core::error::Error;

use crate::helper::Shared;
use crate::int8::{check_product, Kernel, Product, PARALLEL_MIN, UNITS};
use crate::simd::{self, Path};
use crate::slab::WeightBuf;

/// A float32 weight matrix (rows = output features, cols = input features), row-major.
pub struct FloatMatrix {
    rows: usize,
    cols: usize,
    weight: WeightBuf<f32>,
}

impl FloatMatrix {
    /// A copy of a row-major (rows, cols) matrix.
    pub fn new(weight: &[f32], rows: usize, cols: usize) -> Result<FloatMatrix, Error> {
        if rows == 0 || cols == 0 {
            return Err(Error::value(format!(
                "a float matrix needs at least one row and one column, got ({rows}, {cols})"
            )));
        }
        if rows.checked_mul(cols) != Some(weight.len()) {
            return Err(Error::value(format!(
                "weight has {} values, not {rows} x {cols}",
                weight.len()
            )));
        }
        Ok(FloatMatrix {
            rows,
            cols,
            weight: WeightBuf::from_slice(weight),
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

    /// The weights, row-major (rows, cols).
    pub fn weights(&self) -> &[f32] {
        &self.weight
    }

    /// Bytes of weights a pass reads.
    pub fn nbytes(&self) -> usize {
        4 * self.weight.len()
    }

    /// out (n, rows) = x (n, cols) · Wᵀ, both row-major; `kernel` picks the build (the float
    /// products have no int8 instructions: the VNNI kernels run the AVX-512 or AVX2 build).
    pub fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        let n = check_product(x, out, self.rows, self.cols, kernel)?;
        if n == 0 {
            return Ok(());
        }
        let path = path_of(kernel);
        // Output rows a piece holds: a multiple of dot_rows' steps (8 weight rows, or 3 and 4 on
        // AVX2), so that no piece leaves rows to its one-at-a-time tail.
        let step = if path == Path::Avx2 { 24 } else { 8 };
        let per = self.rows.div_ceil(UNITS).next_multiple_of(step);
        let blocks = self.rows.div_ceil(per);
        let out = Shared::new(out);
        // Piece b, then the start of the piece its thread takes next (`next`), whose first
        // weight rows its last step fetches (as it fetches its own next rows at every step).
        let piece = |b: usize| {
            &self.weight[b * per * self.cols..((b + 1) * per).min(self.rows) * self.cols]
        };
        let run = |b: usize, next: Option<usize>| {
            let (o0, w) = (b * per, piece(b));
            let then = next.filter(|&c| c < blocks).map_or(&[][..], piece);
            let width = w.len() / self.cols;
            let mut part = vec![0.0f32; n * width];
            simd::dot_rows(x, w, then, self.cols, &mut part, path);
            for (r, values) in part.chunks_exact(width).enumerate() {
                // SAFETY: piece b alone writes columns [o0, o0 + width) of each row.
                let at = r * self.rows + o0;
                unsafe { out.part(at..at + width) }.copy_from_slice(values);
            }
        };
        if self.rows * self.cols < PARALLEL_MIN || blocks < 2 {
            (0..blocks).for_each(|b| run(b, Some(b + 1)));
        } else {
            crate::helper::for_each_from_ends(blocks, |b, front| {
                run(b, if front { Some(b + 1) } else { b.checked_sub(1) });
            });
        }
        Ok(())
    }
}

impl Product for FloatMatrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn matmul(&self, x: &[f32], out: &mut [f32], kernel: Kernel) -> Result<(), Error> {
        FloatMatrix::matmul(self, x, out, kernel)
    }
}

/// The build of attention's sums a kernel stands for (all give the same bits).
fn path_of(kernel: Kernel) -> Path {
    let path = match kernel {
        Kernel::Scalar => Path::Portable,
        Kernel::Avx2 | Kernel::AvxVnni => Path::Avx2,
        Kernel::Avx512Vnni => Path::Avx512,
    };
    if path.supported() {
        path
    } else {
        Path::Portable
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::tests::values;
    use crate::int8::tests::kernels;

    fn product(m: &FloatMatrix, x: &[f32], kernel: Kernel) -> Vec<f32> {
        let mut out = vec![f32::NAN; x.len() / m.cols() * m.rows()];
        m.matmul(x, &mut out, kernel).unwrap();
        out
    }

    /// Odd shapes (whole lanes or not, blocks and pairs with tails) against a float64
    /// reference, and every value equal to `dot_product`'s on every kernel.
    #[test]
    fn matches_float64_and_dot_product_on_every_kernel() {
        for &(rows, cols, n) in &[
            (1, 1, 1),
            (7, 5, 3),
            (9, 16, 1),
            (33, 48, 9),
            (100, 64, 2),
            (250, 576, 9),
            (17, 100, 5),
            (40, 32, 4),
            (24, 64, 16),
            (31, 48, 8),
            (300, 1536, 3),
        ] {
            let w = values(rows * cols, (rows * cols) as u64);
            let x = values(n * cols, n as u64 + 7);
            let m = FloatMatrix::new(&w, rows, cols).unwrap();
            for kernel in kernels() {
                let got = product(&m, &x, kernel);
                for r in 0..n {
                    for o in 0..rows {
                        let (xr, wo) = (&x[r * cols..(r + 1) * cols], &w[o * cols..(o + 1) * cols]);
                        let exact: f64 = xr
                            .iter()
                            .zip(wo)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum();
                        let v = got[r * rows + o];
                        assert!(
                            (f64::from(v) - exact).abs() < 1e-4 * (cols as f64).sqrt(),
                            "{rows}x{cols} n={n}"
                        );
                        assert_eq!(v.to_bits(), simd::dot_product(xr, wo).to_bits());
                    }
                }
            }
        }
    }

    /// Row r of a pass equals the one-row pass of row r, bit for bit; a pass that dropped or
    /// misplaced a row would not (every value starts as NaN).
    #[test]
    fn a_row_does_not_depend_on_the_rows_beside_it() {
        let (rows, cols) = (200, 576);
        let m = FloatMatrix::new(&values(rows * cols, 3), rows, cols).unwrap();
        let x = values(9 * cols, 4);
        for kernel in kernels() {
            let all = product(&m, &x, kernel);
            for r in 0..9 {
                let one = product(&m, &x[r * cols..(r + 1) * cols], kernel);
                assert_eq!(&all[r * rows..(r + 1) * rows], &one[..]);
            }
        }
    }

    /// The negative control of the bit-for-bit checks above: the same products summed in
    /// another order (one sequential sum, as a GEMM blocked differently might) differ from
    /// `dot_product` in the last bits of some values.
    #[test]
    fn another_order_of_sums_gives_other_bits() {
        let (rows, cols) = (64, 576);
        let (w, x) = (values(rows * cols, 5), values(cols, 6));
        let differ = (0..rows)
            .filter(|&o| {
                let wo = &w[o * cols..(o + 1) * cols];
                let seq = x.iter().zip(wo).fold(0.0f32, |s, (&a, &b)| a.mul_add(b, s));
                seq.to_bits() != simd::dot_product(&x, wo).to_bits()
            })
            .count();
        assert!(differ > rows / 4, "only {differ} of {rows} differ");
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(FloatMatrix::new(&[], 0, 4).is_err());
        assert!(FloatMatrix::new(&[1.0; 6], 2, 4).is_err());
        let m = FloatMatrix::new(&[1.0; 8], 2, 4).unwrap();
        let mut out = vec![0.0; 2];
        assert!(m.matmul(&[1.0; 5], &mut out, Kernel::Scalar).is_err());
        assert!(m.matmul(&[1.0; 4], &mut [0.0; 3], Kernel::Scalar).is_err());
    }
}
