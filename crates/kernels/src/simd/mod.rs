//! The crate's SIMD layer: sixteen f32 lanes ([`Lanes`]) built three ways (AVX-512, AVX2,
//! portable), the exponential they share, what a KV cache holds ([`Elem`]), and the products
//! summed as attention sums them (`products`).
//!
//! Every sum is written as [`LANES`] independent lanes of fused multiply-adds, added in a fixed
//! tree at the end, and the exponential is a polynomial of fused multiply-adds. IEEE rounds each
//! of those operations exactly, and LLVM vectorizes them without reordering, so the AVX-512,
//! AVX2 and portable builds give the same bits.

// The generic loops must inline into each build's `#[target_feature]` entry point, or their
// intrinsics run as calls: `inline(always)` is the point.
#![allow(clippy::inline_always)]

use half::f16;

mod products;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

pub use products::{dot_product, gelu_tanh_mul, silu_mul};

pub(crate) use products::{dot_rows, dots, key_lanes_two};

/// Independent accumulators per sum (one AVX-512 register, two AVX2 ones).
pub const LANES: usize = 16;

/// Which build of the loops runs. All give the same bits; the choice is speed only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// AVX-512F.
    Avx512,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// Portable Rust, and the reference.
    Portable,
}

/// The build the environment variable `SPECFAST_SIMD` caps every product at ("avx2" or
/// "portable"), read once: to run an AVX-512 CPU's passes through the AVX2 or portable build and
/// see that they give the same bits. None when it is unset (or names another build).
pub fn simd_cap() -> Option<Path> {
    static CAP: std::sync::OnceLock<Option<Path>> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("SPECFAST_SIMD").ok()?.as_str() {
        "avx2" => Some(Path::Avx2),
        "portable" => Some(Path::Portable),
        _ => None,
    })
}

impl Path {
    /// The fastest build this CPU runs (at most `simd_cap`'s).
    pub fn best() -> Path {
        let cap = simd_cap();
        #[cfg(target_arch = "x86_64")]
        {
            if cap.is_none() && std::arch::is_x86_feature_detected!("avx512f") {
                return Path::Avx512;
            }
            if cap != Some(Path::Portable) && Path::Avx2.supported() {
                return Path::Avx2;
            }
        }
        let _ = cap;
        Path::Portable
    }

    /// True when this CPU can run the build.
    pub fn supported(self) -> bool {
        match self {
            Path::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// Sixteen f32 lanes. Each build implements the same operations, each exactly rounded, so the
/// loops below give the same bits through any of them.
pub(crate) trait Lanes: Copy {
    /// The build has 32 vector registers (AVX-512), not 16: room for twice the accumulators.
    const WIDE: bool;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    /// The 16 values at `p`.
    unsafe fn load(p: *const f32) -> Self;
    /// The 16 half-precision values at `p`, as f32 (exactly: every f16 is an f32).
    unsafe fn load_half(p: *const f16) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// a · b + c, rounded once.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn sub(a: Self, b: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn div(a: Self, b: Self) -> Self;
    unsafe fn max(a: Self, b: Self) -> Self;
    /// (l + l+8), then (l + l+4), (l + l+2), (l + l+1): a fixed tree.
    unsafe fn sum(self) -> f32;
    /// out[i] = a[i].sum() · scale. A build may do the 16 trees at once, level by level: the
    /// same additions of the same pairs, so the same bits.
    #[inline(always)]
    unsafe fn sums_scaled(a: &[Self; 16], scale: f32, out: *mut f32) {
        for (i, ai) in a.iter().enumerate() {
            *out.add(i) = ai.sum() * scale;
        }
    }
    /// e^x per lane, as [`exp`].
    unsafe fn exp(self) -> Self;
}

/// What a KV cache holds: f32, or f16 (half the bytes for a pass to read, each value rounded
/// once when the cache is written; attention computes in f32 either way).
pub trait Elem: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The type is `half::f16`: loads convert (exactly, as every f16 is an f32).
    const HALF: bool;
    /// The value as an f32, exactly.
    fn to_f32(self) -> f32;
    /// dst[i] = src[i] rounded to nearest, ties to even, a vector at a time where the CPU
    /// converts them (F16C).
    fn from_f32_slice(dst: &mut [Self], src: &[f32]);
}

impl Elem for f32 {
    const HALF: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32_slice(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
}

impl Elem for f16 {
    const HALF: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32_slice(dst: &mut [f16], src: &[f32]) {
        half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
    }
}

mod sealed {
    /// f32 and f16 only: `widen` reads a cache that is not HALF as f32.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

/// One lane of [`Lanes::exp`]: e^x within about 2 ulp for x in [-87.3, 88], 0 below, and
/// e^88 above. Cody-Waite reduction x = n ln 2 + r, Cephes' degree-6 polynomial for e^r, then
/// 2^n through the exponent bits.
pub(crate) fn exp(x: f32) -> f32 {
    let small = x < EXP_MIN;
    #[allow(clippy::manual_clamp)] // max/min as the SIMD builds do them (clamp panics on NaN)
    let x = x.max(EXP_MIN).min(EXP_MAX);
    let n = x.mul_add(std::f32::consts::LOG2_E, 0.5).floor();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let y = (p * r).mul_add(r, r) + 1.0;
    // n in [-126, 127] here, so the biased exponent n + 127 is a normal one.
    let e = y * f32::from_bits(((n as i32 + 127) as u32) << 23);
    if small {
        0.0
    } else {
        e
    }
}

pub(crate) const EXP_MIN: f32 = -87.3;
pub(crate) const EXP_MAX: f32 = 88.0;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// The portable build, and the reference for the others.
#[derive(Clone, Copy)]
pub(crate) struct Portable([f32; LANES]);

impl Lanes for Portable {
    const WIDE: bool = true;
    unsafe fn zero() -> Self {
        Portable([0.0; LANES])
    }
    unsafe fn splat(x: f32) -> Self {
        Portable([x; LANES])
    }
    unsafe fn load(p: *const f32) -> Self {
        Portable(std::array::from_fn(|l| *p.add(l)))
    }
    unsafe fn load_half(p: *const f16) -> Self {
        Portable(std::array::from_fn(|l| (*p.add(l)).to_f32()))
    }
    unsafe fn store(self, p: *mut f32) {
        for (l, &x) in self.0.iter().enumerate() {
            *p.add(l) = x;
        }
    }
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l].mul_add(b.0[l], c.0[l])))
    }
    unsafe fn add(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l] + b.0[l]))
    }
    unsafe fn sub(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l] - b.0[l]))
    }
    unsafe fn mul(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l] * b.0[l]))
    }
    unsafe fn div(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l] / b.0[l]))
    }
    unsafe fn max(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|l| a.0[l].max(b.0[l])))
    }
    unsafe fn sum(self) -> f32 {
        let h = self.0;
        let h8: [f32; 8] = std::array::from_fn(|l| h[l] + h[l + 8]);
        let h4: [f32; 4] = std::array::from_fn(|l| h8[l] + h8[l + 4]);
        (h4[0] + h4[2]) + (h4[1] + h4[3])
    }
    unsafe fn exp(self) -> Self {
        Portable(self.0.map(exp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::tests::values;
    use products::{dot, silu_mul_lanes};

    #[test]
    fn exp_is_close_to_libm() {
        let mut worst = 0.0f64;
        for i in -200_000..200_000 {
            let x = 87.0 * f64::from(i) / 200_000.0;
            let got = f64::from(exp(x as f32));
            let want = (x as f32 as f64).exp();
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0).to_bits(), 1.0f32.to_bits());
        assert_eq!(exp(-100.0).to_bits(), 0.0f32.to_bits());
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn gelu_tanh_gives_the_same_bits_on_every_path() {
        let g: Vec<f32> = values(1000, 31).iter().map(|x| x * 6.0).collect();
        let u = values(1000, 32);
        let run = |path: Path| {
            let mut out = vec![0.0f32; 997];
            // SAFETY: only paths this CPU supports run.
            unsafe {
                let (g, u) = (&g[..997], &u[..997]);
                match path {
                    #[cfg(target_arch = "x86_64")]
                    Path::Avx512 => products::x86::gelu_tanh_mul_avx512(g, u, &mut out),
                    #[cfg(target_arch = "x86_64")]
                    Path::Avx2 => products::x86::gelu_tanh_mul_avx2(g, u, &mut out),
                    _ => products::gated_lanes::<Portable, true>(g, u, &mut out),
                }
            }
            out
        };
        let want = run(Path::Portable);
        for (x, (&gx, &ux)) in want.iter().zip(g.iter().zip(&u)) {
            let (gx, ux) = (f64::from(gx), f64::from(ux));
            let y = (0.797_884_560_802_865_4 * (gx + 0.044_715 * gx * gx * gx)).tanh();
            let gelu = 0.5 * gx * (1.0 + y) * ux;
            assert!(
                (f64::from(*x) - gelu).abs() < 1e-5 * (1.0 + gelu.abs()),
                "{x} vs {gelu}"
            );
        }
        for path in [Path::Avx2, Path::Avx512] {
            if path.supported() {
                assert_eq!(run(path), want, "{path:?}");
            }
        }
    }

    #[test]
    fn silu_and_dot_give_the_same_bits_on_every_path() {
        let a = values(1000, 21);
        let b = values(1000, 22);
        let g: Vec<f32> = a.iter().map(|x| x * 20.0).collect();
        let run = |path: Path| {
            let mut out = vec![0.0f32; 997];
            // SAFETY: only paths this CPU supports run.
            let d = unsafe {
                match path {
                    #[cfg(target_arch = "x86_64")]
                    Path::Avx512 => {
                        products::x86::silu_mul_avx512(&g[..997], &b[..997], &mut out);
                        products::x86::dot_avx512(&a[..997], &b[..997])
                    }
                    #[cfg(target_arch = "x86_64")]
                    Path::Avx2 => {
                        products::x86::silu_mul_avx2(&g[..997], &b[..997], &mut out);
                        products::x86::dot_avx2(&a[..997], &b[..997])
                    }
                    _ => {
                        silu_mul_lanes::<Portable>(&g[..997], &b[..997], &mut out);
                        dot::<Portable>(&a[..997], &b[..997])
                    }
                }
            };
            (out, d.to_bits())
        };
        let want = run(Path::Portable);
        for (x, (&gx, &u)) in want.0.iter().zip(g.iter().zip(&b)) {
            let silu = f64::from(gx) / (1.0 + (-f64::from(gx)).exp()) * f64::from(u);
            assert!(
                (f64::from(*x) - silu).abs() < 1e-5 * (1.0 + silu.abs()),
                "{x} vs {silu}"
            );
        }
        for path in [Path::Avx2, Path::Avx512] {
            if path.supported() {
                assert_eq!(run(path), want, "{path:?}");
            }
        }
    }
}
