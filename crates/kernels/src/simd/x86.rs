//! The AVX-512 and AVX2 builds of [`Lanes`].

#![allow(clippy::wildcard_imports)]

use super::{Lanes, EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO};
use half::f16;
use std::arch::x86_64::*;

#[derive(Clone, Copy)]
pub(crate) struct Avx512(__m512);

impl Lanes for Avx512 {
    const WIDE: bool = true;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx512(_mm512_setzero_ps())
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Avx512(_mm512_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Avx512(_mm512_loadu_ps(p))
    }
    #[inline(always)]
    unsafe fn load_half(p: *const f16) -> Self {
        Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast())))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm512_storeu_ps(p, self.0);
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Avx512(_mm512_fmadd_ps(a.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx512(_mm512_add_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx512(_mm512_sub_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Avx512(_mm512_mul_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn div(a: Self, b: Self) -> Self {
        Avx512(_mm512_div_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Avx512(_mm512_max_ps(a.0, b.0))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        let lo = _mm512_castps512_ps256(self.0);
        let hi = _mm512_extractf32x8_ps::<1>(self.0);
        Avx2([lo, hi]).sum()
    }
    #[inline(always)]
    unsafe fn sums_scaled(a: &[Self; 16], scale: f32, out: *mut f32) {
        sums_scaled_avx512(a, scale, out);
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        let x = self.0;
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_MIN));
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)),
            _mm512_set1_ps(EXP_MAX),
        );
        let t = _mm512_fmadd_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
            _mm512_set1_ps(0.5),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(
            _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
            _mm512_set1_ps(1.0),
        );
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvttps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        let e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
        Avx512(_mm512_mask_mov_ps(e, small, _mm512_setzero_ps()))
    }
}

/// `sum`'s tree for 16 registers at once, each level in whole registers: 45 shuffles
/// and adds for 16 sums where one at a time takes about 8 a sum.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn sums_scaled_avx512(a: &[Avx512; 16], scale: f32, out: *mut f32) {
    // l + l+8: register p holds a[2p]'s 8 pair sums, then a[2p+1]'s.
    let mut v = [_mm512_setzero_ps(); 8];
    for (p, vp) in v.iter_mut().enumerate() {
        let (x, y) = (a[2 * p].0, a[2 * p + 1].0);
        *vp = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(x, y),
            _mm512_shuffle_f32x4::<0xEE>(x, y),
        );
    }
    // l + l+4: quarter i of register r holds a[4r + i]'s 4 sums.
    let mut w = [_mm512_setzero_ps(); 4];
    for (r, wr) in w.iter_mut().enumerate() {
        let (x, y) = (v[2 * r], v[2 * r + 1]);
        *wr = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        );
    }
    // l + l+2: quarter i of register s holds a[8s + i]'s 2 sums, then a[8s + 4 + i]'s.
    let mut z = [_mm512_setzero_ps(); 2];
    for (s, zs) in z.iter_mut().enumerate() {
        let (x, y) = (_mm512_castps_pd(w[2 * s]), _mm512_castps_pd(w[2 * s + 1]));
        *zs = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
        );
    }
    // l + l+1: lane 4i + j holds a[4j + i]'s sum; a permute puts lane k at k.
    let t = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(z[0], z[1]),
        _mm512_shuffle_ps::<0xDD>(z[0], z[1]),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let t = _mm512_permutexvar_ps(order, t);
    _mm512_storeu_ps(out, _mm512_mul_ps(t, _mm512_set1_ps(scale)));
}

/// Lanes 0-7 in the first register, 8-15 in the second.
#[derive(Clone, Copy)]
pub(crate) struct Avx2(pub(crate) [__m256; 2]);

impl Lanes for Avx2 {
    // 16 ymm: four lane-groups' 16 accumulators would spill
    const WIDE: bool = false;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx2([_mm256_setzero_ps(); 2])
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Avx2([_mm256_set1_ps(x); 2])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        Avx2([_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))])
    }
    #[inline(always)]
    unsafe fn load_half(p: *const f16) -> Self {
        Avx2([
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())),
        ])
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        _mm256_storeu_ps(p, self.0[0]);
        _mm256_storeu_ps(p.add(8), self.0[1]);
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Avx2([
            _mm256_fmadd_ps(a.0[0], b.0[0], c.0[0]),
            _mm256_fmadd_ps(a.0[1], b.0[1], c.0[1]),
        ])
    }
    #[inline(always)]
    unsafe fn add(a: Self, b: Self) -> Self {
        Avx2([_mm256_add_ps(a.0[0], b.0[0]), _mm256_add_ps(a.0[1], b.0[1])])
    }
    #[inline(always)]
    unsafe fn sub(a: Self, b: Self) -> Self {
        Avx2([_mm256_sub_ps(a.0[0], b.0[0]), _mm256_sub_ps(a.0[1], b.0[1])])
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        Avx2([_mm256_mul_ps(a.0[0], b.0[0]), _mm256_mul_ps(a.0[1], b.0[1])])
    }
    #[inline(always)]
    unsafe fn div(a: Self, b: Self) -> Self {
        Avx2([_mm256_div_ps(a.0[0], b.0[0]), _mm256_div_ps(a.0[1], b.0[1])])
    }
    #[inline(always)]
    unsafe fn max(a: Self, b: Self) -> Self {
        Avx2([_mm256_max_ps(a.0[0], b.0[0]), _mm256_max_ps(a.0[1], b.0[1])])
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        let h8 = _mm256_add_ps(self.0[0], self.0[1]); // l + l+8
        let h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps::<1>(h8));
        let h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4)); // (0+2, 1+3)
        let h1 = _mm_add_ss(h2, _mm_shuffle_ps::<0b01>(h2, h2));
        _mm_cvtss_f32(h1)
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        Avx2([exp8(self.0[0]), exp8(self.0[1])])
    }
}

#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    let small = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN));
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
        _mm256_set1_ps(EXP_MAX),
    );
    let t = _mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    );
    let n = _mm256_floor_ps(t);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(
        _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
        _mm256_set1_ps(1.0),
    );
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvttps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    _mm256_andnot_ps(small, e)
}
