//! What the core's CPU kernels reach on this machine, against what its cores can issue.
//!
//!     cargo run --release --example core_rates
//!
//! - the peak rate of one core: vpmaddubsw (32 int8 multiply-adds) and float32 FMA (8), each in
//!   independent chains, so throughput and not latency is timed; and vpmaddubsw with the i16
//!   add and the broadcast operand that the q4 kernel needs beside each one; on AVX-512 VNNI
//!   CPUs, vpdpbusd on zmm (64) and zmm FMA (16), the instructions of the VNNI kernels, and the
//!   q4 VNNI kernel's arithmetic at 9 rows with and without its per-group float epilogue (the
//!   ceiling that exact Q4_1 groups put on a verify pass's products);
//! - SmolLM2-135M's 120 layer matrices in 4-bit (q4) and its output matrix in int8, at 1-16
//!   rows, with both threads (`helper`), distinct matrices so that the weights come from memory;
//!   then the same matrices in float32 (`FloatMatrix`);
//! - attention of 9 query heads over 3 kv heads (head size 64) at 1 and 9 rows after 500 and
//!   2000 cached tokens, one layer, over a float32 and a float16 cache.
//!
//! It first prints the threads' round trip (`helper::round_trip`), which tells how far apart
//! their cores sit.
//!
//! `benches/bench_linear.py` and `benches/bench_runtime.py` time the same kernels through the
//! Python package beside torch's; this is the core alone, for work on the kernels.

use std::time::Instant;

use specfast_kernels::attention::{attend, Dims};
use specfast_kernels::float::FloatMatrix;
use specfast_kernels::int8::{Int8Matrix, Kernel, Product};
use specfast_kernels::q4::Q4Matrix;

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// The fastest of `tries` timings of `f`, in seconds.
fn fastest(tries: usize, mut f: impl FnMut()) -> f64 {
    (0..tries)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::{
        __m256, __m256i, __m512, __m512i, _mm256_add_epi16, _mm256_add_ps, _mm256_fmadd_ps,
        _mm256_maddubs_epi16, _mm256_set1_epi32, _mm256_set1_epi8, _mm256_set1_ps,
        _mm256_setzero_si256, _mm512_add_epi32, _mm512_add_ps, _mm512_cvtepi32_ps,
        _mm512_dpbusd_epi32, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_set1_epi32, _mm512_set1_epi8,
        _mm512_set1_ps, _mm512_setzero_ps, _mm512_setzero_si512,
    };

    /// n rounds of 8 independent vpmaddubsw chains.
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs(n: usize) -> __m256i {
        let x = _mm256_set1_epi8(std::hint::black_box(1));
        let mut acc = [_mm256_set1_epi8(1); 8];
        for _ in 0..n {
            for a in &mut acc {
                *a = _mm256_maddubs_epi16(*a, x);
            }
        }
        acc.iter().fold(acc[0], |s, &a| _mm256_add_epi16(s, a))
    }

    /// n rounds of the q4 kernel's inner step without its unpacking and epilogue: 8 vpmaddubsw,
    /// each with the vpaddw into its i16 sums, on 4 weight registers and 2 broadcast operands.
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs_step(n: usize, xs: &[i32; 64]) -> __m256i {
        let w = [3, 5, 7, 9].map(|v| _mm256_set1_epi8(std::hint::black_box(v)));
        let mut acc = [_mm256_setzero_si256(); 8];
        for i in 0..n {
            let x = [
                _mm256_set1_epi32(xs[i & 63]),
                _mm256_set1_epi32(xs[(i + 1) & 63]),
            ];
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_epi16(*a, _mm256_maddubs_epi16(w[j & 3], x[(j >> 2) ^ (j & 1)]));
            }
        }
        acc.iter().fold(acc[0], |s, &a| _mm256_add_epi16(s, a))
    }

    /// n rounds of 12 independent zmm vpdpbusd chains.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dpbusd_zmm(n: usize) -> __m512i {
        let x = _mm512_set1_epi8(std::hint::black_box(1));
        let mut acc = [_mm512_set1_epi8(1); 12];
        for _ in 0..n {
            for a in &mut acc {
                *a = _mm512_dpbusd_epi32(*a, x, x);
            }
        }
        acc.iter().fold(acc[0], |s, &a| _mm512_add_epi32(s, a))
    }

    /// n groups of the q4 AVX-512 VNNI kernel's arithmetic at 9 rows, with the weights in a
    /// register: per row, 8 vpdpbusd of broadcast activations into a fresh i32 sum, then
    /// either the kernel's per-group float epilogue (convert, multiply by d · sx, add,
    /// multiply m by the row's scaled Σx, add: 3 of its 5 float operations are multiplies,
    /// on the pipes vpdpbusd issues on) or, with `EPILOGUE` false, one integer add.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn q4_groups<const EPILOGUE: bool>(
        n: usize,
        xs: &[i32; 72],
        sx: &[f32; 9],
        xsum: &[f32; 9],
    ) -> (__m512, __m512i) {
        let w = _mm512_set1_epi8(std::hint::black_box(3));
        let d = _mm512_set1_ps(std::hint::black_box(0.5));
        let m = _mm512_set1_ps(std::hint::black_box(0.25));
        let mut total = [_mm512_setzero_ps(); 9];
        let mut whole = [_mm512_setzero_si512(); 9];
        for _ in 0..n {
            // Read each group's activations and scales, as the kernel does.
            let (sx, xsum) = (std::hint::black_box(sx), std::hint::black_box(xsum));
            let xs = std::hint::black_box(xs);
            let mut sums = [_mm512_setzero_si512(); 9];
            for run in 0..8 {
                for (i, s) in sums.iter_mut().enumerate() {
                    *s = _mm512_dpbusd_epi32(*s, w, _mm512_set1_epi32(xs[i * 8 + run]));
                }
            }
            for i in 0..9 {
                if EPILOGUE {
                    let exact = _mm512_cvtepi32_ps(sums[i]);
                    let t = _mm512_mul_ps(exact, _mm512_mul_ps(d, _mm512_set1_ps(sx[i])));
                    let t = _mm512_add_ps(total[i], t);
                    total[i] = _mm512_add_ps(t, _mm512_mul_ps(m, _mm512_set1_ps(xsum[i])));
                } else {
                    whole[i] = _mm512_add_epi32(whole[i], sums[i]);
                }
            }
        }
        (
            total.iter().fold(total[0], |s, &a| _mm512_add_ps(s, a)),
            whole.iter().fold(whole[0], |s, &a| _mm512_add_epi32(s, a)),
        )
    }

    /// n rounds of 12 independent zmm FMA chains.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_zmm(n: usize) -> __m512 {
        let x = _mm512_set1_ps(std::hint::black_box(1.0));
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..n {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(*a, x, x);
            }
        }
        acc.iter().fold(acc[0], |s, &a| _mm512_add_ps(s, a))
    }

    /// n rounds of 10 independent FMA chains.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma(n: usize) -> __m256 {
        let x = _mm256_set1_ps(std::hint::black_box(1.0));
        let mut acc = [_mm256_set1_ps(1.0); 10];
        for _ in 0..n {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(*a, x, x);
            }
        }
        acc.iter().fold(acc[0], |s, &a| _mm256_add_ps(s, a))
    }
}

#[cfg(target_arch = "x86_64")]
fn peak_rates() {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        return;
    }
    let n = 20_000_000;
    // SAFETY: the features were checked above.
    let t = fastest(3, || {
        std::hint::black_box(unsafe { peak::maddubs(n) });
    });
    println!(
        "one core: {:.2} G vpmaddubsw/s ({:.0} G int8 multiply-adds/s)",
        8.0 * n as f64 / t / 1e9,
        256.0 * n as f64 / t / 1e9
    );
    let xs: [i32; 64] = std::array::from_fn(|i| i32::try_from(i).unwrap_or(0));
    // SAFETY: as above.
    let t = fastest(3, || {
        std::hint::black_box(unsafe { peak::maddubs_step(n, &xs) });
    });
    println!(
        "one core: {:.2} G vpmaddubsw/s with their i16 adds and broadcasts (the q4 step)",
        8.0 * n as f64 / t / 1e9,
    );
    // SAFETY: as above.
    let t = fastest(3, || {
        std::hint::black_box(unsafe { peak::fma(n) });
    });
    println!(
        "one core: {:.2} G ymm FMA/s ({:.0} G float32 multiply-adds/s)",
        10.0 * n as f64 / t / 1e9,
        80.0 * n as f64 / t / 1e9
    );
    if !(is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")) {
        return;
    }
    // SAFETY: as above.
    let t = fastest(3, || {
        std::hint::black_box(unsafe { peak::dpbusd_zmm(n) });
    });
    println!(
        "one core: {:.2} G zmm vpdpbusd/s ({:.0} G int8 multiply-adds/s)",
        12.0 * n as f64 / t / 1e9,
        768.0 * n as f64 / t / 1e9
    );
    // SAFETY: as above.
    let t = fastest(3, || {
        std::hint::black_box(unsafe { peak::fma_zmm(n) });
    });
    println!(
        "one core: {:.2} G zmm FMA/s ({:.0} G float32 multiply-adds/s)",
        12.0 * n as f64 / t / 1e9,
        192.0 * n as f64 / t / 1e9
    );
    let (sx, xsum) = ([0.01f32; 9], [0.02f32; 9]);
    let xs: [i32; 72] = std::array::from_fn(|i| i32::try_from(i).unwrap_or(0) * 0x0101_0101);
    let groups = n / 8;
    // SAFETY: as above.
    let bare = fastest(3, || {
        std::hint::black_box(unsafe { peak::q4_groups::<false>(groups, &xs, &sx, &xsum) });
    });
    // SAFETY: as above.
    let full = fastest(3, || {
        std::hint::black_box(unsafe { peak::q4_groups::<true>(groups, &xs, &sx, &xsum) });
    });
    let rate = |t: f64| 72.0 * groups as f64 / t / 1e9;
    println!(
        "one core, the q4 kernel's arithmetic at 9 rows: {:.2} G zmm vpdpbusd/s with its \
         per-group float epilogue, {:.2} G without ({:.0} %)",
        rate(full),
        rate(bare),
        100.0 * bare / full
    );
}

#[cfg(not(target_arch = "x86_64"))]
fn peak_rates() {}

/// (seed, (rows, cols)) of SmolLM2-135M's 120 layer matrices: qkv, o, gate-up, down.
fn layer_matrices() -> impl Iterator<Item = (u64, (usize, usize))> {
    let layer = [(960usize, 576usize), (576, 576), (3072, 576), (576, 1536)];
    (0..30u64).flat_map(move |l| {
        layer
            .into_iter()
            .enumerate()
            .map(move |(i, rc)| (l * 4 + i as u64, rc))
    })
}

/// Seconds of n rows through every matrix of `mats` in turn (SmolLM2's widths: 576 or 1536
/// inputs), the fastest of `tries`.
fn pass_time<M: Product>(mats: &[M], n: usize, tries: usize) -> f64 {
    let (x576, x1536) = (values(1, n * 576), values(2, n * 1536));
    fastest(tries, || {
        for m in mats {
            let x = if m.cols() == 576 { &x576 } else { &x1536 };
            let mut out = vec![0.0f32; n * m.rows()];
            m.matmul(x, &mut out, Kernel::best()).unwrap();
        }
    })
}

fn products() {
    let mats: Vec<Q4Matrix> = layer_matrices()
        .map(|(seed, (r, c))| Q4Matrix::quantize(&values(seed, r * c), r, c).unwrap())
        .collect();
    let head = Int8Matrix::quantize(&values(999, 49_152 * 576), 49_152, 576).unwrap();
    let bytes: usize = mats.iter().map(Q4Matrix::nbytes).sum();
    let kernel = Kernel::best();
    println!(
        "q4 layers ({} MB) and the int8 output matrix, {}:",
        bytes >> 20,
        kernel.name()
    );
    for n in [1usize, 2, 4, 8, 9, 16] {
        let t = pass_time(&mats, n, 9);
        let x576 = values(1, n * 576);
        let th = fastest(9, || {
            let mut out = vec![0.0f32; n * 49_152];
            head.matmul(&x576, &mut out, kernel).unwrap();
        });
        println!(
            "  {n:2} rows: layers {:6.2} ms ({:4.1} GB/s), output matrix {:5.2} ms",
            t * 1e3,
            bytes as f64 / t / 1e9,
            th * 1e3
        );
    }
    // Each layer matrix of SmolLM2 (0.2-1.7 MB in q4) again and again: from L2, so the kernel's
    // own rate with each call's fixed costs (rounding the activations, the split between the
    // threads), to set beside the cores' vpdpbusd peak above. `taskset -c 0` gives one thread
    // (no helper).
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(2));
    println!("q4 from L2, multiply-adds/s on {threads} thread(s):");
    for (r, c) in [(3072usize, 576usize), (960, 576), (576, 1536), (576, 576)] {
        let m = Q4Matrix::quantize(&values(7, r * c), r, c).unwrap();
        print!("  {r:4}x{c:<4}");
        for n in [1usize, 9, 12] {
            let x = values(1, n * c);
            let mut out = vec![0.0f32; n * r];
            let t = fastest(5, || {
                for _ in 0..200 {
                    m.matmul(&x, &mut out, kernel).unwrap();
                }
            }) / 200.0;
            print!("  {n:2} rows {:3.0} G", (n * r * c) as f64 / t / 1e9);
        }
        println!();
    }
}

fn attention() {
    let capacity = 2016;
    let (k, v) = (values(3, 3 * capacity * 64), values(4, 3 * capacity * 64));
    let half = |x: &[f32]| {
        x.iter()
            .map(|&a| half::f16::from_f32(a))
            .collect::<Vec<_>>()
    };
    let (kh, vh) = (half(&k), half(&v));
    println!(
        "attention, 9 heads over 3 kv heads, head size 64, one layer, float32 / float16 cache:"
    );
    for (rows, pos) in [(1usize, 500usize), (9, 500), (1, 2000), (9, 2000)] {
        let d = Dims {
            rows,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            capacity,
            pos,
            window: 0,
            scale: None,
        };
        let q = values(5, 9 * rows * 64);
        let mut out = vec![0.0f32; q.len()];
        let t = fastest(20, || {
            for _ in 0..10 {
                attend(&q, &k, &v, &mut out, &d).unwrap();
            }
        }) / 10.0;
        let th = fastest(20, || {
            for _ in 0..10 {
                attend(&q, &kh, &vh, &mut out, &d).unwrap();
            }
        }) / 10.0;
        println!(
            "  {rows} rows after {pos} tokens: {:6.1} / {:6.1} us",
            t * 1e6,
            th * 1e6
        );
    }
}

/// The same 120 layer matrices and the output matrix in float32 (`FloatMatrix`): the product of
/// a float model, at 1-16 rows.
fn float_products() {
    let mut mats: Vec<FloatMatrix> = layer_matrices()
        .map(|(seed, (r, c))| FloatMatrix::new(&values(seed, r * c), r, c).unwrap())
        .collect();
    mats.push(FloatMatrix::new(&values(999, 49_152 * 576), 49_152, 576).unwrap());
    let bytes: usize = mats.iter().map(FloatMatrix::nbytes).sum();
    println!("float32 layers and output matrix ({} MB):", bytes >> 20);
    for n in [1usize, 2, 4, 8, 9, 16] {
        let t = pass_time(&mats, n, 7);
        println!(
            "  {n:2} rows: {:6.2} ms ({:4.1} GB/s)",
            t * 1e3,
            bytes as f64 / t / 1e9
        );
    }
}

fn main() {
    // Every figure below that splits work between the threads depends on how far apart their
    // cores are; a VM's host may move them (docs/benchmarks.md, "The VM's two states").
    if let Some(trip) = specfast_kernels::helper::round_trip(101) {
        println!("threads' round trip: {:.2} µs", trip.as_secs_f64() * 1e6);
    }
    peak_rates();
    products();
    float_products();
    attention();
}
