"""The CPU matrix kernels a decode or verify pass can use, on a model's real matrix shapes.

A pass streams every weight matrix of the model once, so each candidate is timed over a whole
model's worth of distinct random matrices (time does not depend on the values), for 1-32 rows.
Beside them: this machine's read bandwidth (a sum over filled memory), its float32 FMA rate
(a large sgemm) and its int8 multiply-add rate (fbgemm on many rows), measured here, and the
bounds they set on a pass.

    python benches/bench_linear.py                          # SmolLM2-135M shapes
    python benches/bench_linear.py --shapes qwen2.5-1.5b --json linear.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from specfast import _core
from specfast.hardware import cpu_has_native_bf16, proc_cpu_flags

# (dim, intermediate, layers, q heads, kv heads, head dim, vocab, tied head)
SHAPES = {
    "smollm2-135m": (576, 1536, 30, 9, 3, 64, 49152, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 128, 151936, True),
}
ROWS = (1, 2, 4, 8, 16, 32)


def model_matrices(name: str) -> list[tuple[int, int]]:
    """(out, in) of every matrix a pass reads: per layer fused qkv, o, fused gate-up, down; then
    the vocabulary projection."""
    d, f, n_layers, h, hkv, hd, v, _ = SHAPES[name]
    layer = [((h + 2 * hkv) * hd, d), (d, h * hd), (2 * f, d), (d, f)]
    return layer * n_layers + [(v, d)]


def read_bandwidth() -> float:
    """GB/s of a sum over 512 MB of filled memory (an untouched tensor reads the zero page)."""
    x = torch.rand(128 * 2**20)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def fma_rate() -> float:
    """float32 multiply-adds per second of a 2048^3 sgemm (compute-bound)."""
    a, b = torch.rand(2048, 2048), torch.rand(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(3))
    return 2048**3 / best


def int8_mac_rate() -> float | None:
    """int8 multiply-adds per second of fbgemm's dynamic int8 linear on 256 rows of a 2048^2
    matrix (compute-bound; fbgemm is tuned for the CPU's int8 dot products, with one
    activation scale per call and so no per-group float work). None without fbgemm."""
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of quantized tensors
        build, run = _fbgemm()
        packed = build([torch.randn(2048, 2048) * 0.02])
        x = [(2048, torch.randn(256, 2048))]
        run(packed, x)
        best = min(_timed(lambda: run(packed, x)) for _ in range(5))
    return 256 * 2048**2 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -----------------------------------------------------------------------------
# candidates: each builds its packed weights from float32 ones, and runs one pass


def _onednn(dtype):
    def build(ws):
        return [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 16) for w in ws]

    def run(packed, x):
        for p, (_, xin) in zip(packed, x, strict=True):
            torch.ops.mkldnn._linear_pointwise(xin.to(dtype), p, None, "none", [], "")

    return build, run


def _mkl():
    def run(ws, x):
        for w, (_, xin) in zip(ws, x, strict=True):
            F.linear(xin, w)

    return (lambda ws: ws), run


def _openblas():
    def build(ws):
        return [np.ascontiguousarray(w.numpy().T) for w in ws]

    def run(ws, x):
        for w, (_, xin) in zip(ws, x, strict=True):
            xin.numpy() @ w

    return build, run


def _fbgemm():
    """torch's dynamically quantized int8 linear: one activation scale for the whole input."""

    def build(ws):
        out = []
        for w in ws:
            s = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
            zero = torch.zeros(w.shape[0], dtype=torch.long)
            q = torch.quantize_per_channel(w, s, zero, 0, torch.qint8)
            out.append(torch.ops.quantized.linear_prepack(q, None))
        return out

    def run(packed, x):
        for p, (_, xin) in zip(packed, x, strict=True):
            torch.ops.quantized.linear_dynamic(xin, p, True)

    return build, run


def _specfast(matrix, kernel):
    """specfast's core products: matrix is _core.Int8Matrix, _core.Q4Matrix or
    _core.FloatMatrix."""

    def build(ws):
        return [matrix(w.numpy()) for w in ws]

    def run(mats, x):
        for m, (_, xin) in zip(mats, x, strict=True):
            out = torch.empty(xin.shape[0], m.rows)
            m.matmul(xin.numpy(), out.numpy(), kernel)

    return build, run


Q4_BYTES = 0.625  # bytes a weight of Q4_1: (16 + 2 + 2) per 32


def candidates(native_bf16: bool) -> dict:
    out = {
        "float32 oneDNN": (_onednn(torch.float32), 4),
        "float32 MKL": (_mkl(), 4),
        "float32 OpenBLAS": (_openblas(), 4),
    }
    if native_bf16:
        out["bfloat16 oneDNN"] = (_onednn(torch.bfloat16), 2)
    if hasattr(torch.ops.quantized, "linear_dynamic"):
        out["int8 fbgemm (per-tensor x)"] = (_fbgemm(), 1)
    # specfast's float32 products (rows computed on their own), on this CPU's best build and,
    # where that is AVX-512, on the AVX2 build too (what an AVX2-only CPU runs)
    out[f"float32 specfast {_core.int8_kernel()}"] = (_specfast(_core.FloatMatrix, "auto"), 4)
    if _core.int8_kernel() == "avx512vnni":
        out["float32 specfast avx2"] = (_specfast(_core.FloatMatrix, "avx2"), 4)
    for kernel in ("avx512vnni", "avxvnni", "avx2", "scalar"):
        if kernel == _core.int8_kernel() or (kernel == "avx2" and _core.int8_kernel() != "scalar"):
            out[f"int8 specfast {kernel}"] = (_specfast(_core.Int8Matrix, kernel), 1)
            # Q4_1: 4 bits a weight, and an f16 scale and minimum per 32
            out[f"q4 specfast {kernel}"] = (_specfast(_core.Q4Matrix, kernel), Q4_BYTES)
            if kernel != _core.int8_kernel():
                break
    return out


def bench(shapes: str, rows=ROWS, repeats: int = 5, only: list[str] | None = None) -> dict:
    flags = proc_cpu_flags() or frozenset()
    native_bf16 = cpu_has_native_bf16()
    bw = read_bandwidth()
    fma = fma_rate()
    int8_rate = int8_mac_rate()
    mats = model_matrices(shapes)
    n_weights = sum(o * i for o, i in mats)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) * 0.02 for o, i in mats]
    result = {
        "shapes": shapes,
        "cpu": platform.processor() or platform.machine(),
        "cpu_vendor": _vendor(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "int8_kernel": _core.int8_kernel(),
        "read_gb_s": bw,
        "fma_per_s": fma,
        "int8_mac_per_s": int8_rate,
        "weights": n_weights,
        "rows": list(rows),
        "bound_ms": {},
        "kernels": {},
    }
    for bytes_per, label in ((4, "float32"), (2, "bfloat16"), (1, "int8"), (Q4_BYTES, "q4")):
        result["bound_ms"][label] = n_weights * bytes_per / bw / 1e9 * 1e3
    result["fma_bound_ms"] = {str(n): n * n_weights / fma * 1e3 for n in rows}
    if int8_rate:
        result["int8_mac_bound_ms"] = {str(n): n * n_weights / int8_rate * 1e3 for n in rows}
    chosen = {
        name: c
        for name, c in candidates(native_bf16).items()
        if not only or any(o in name for o in only)
    }
    packed = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of quantized tensors
        for name, ((build, _), _) in chosen.items():
            packed[name] = build(ws)
    del ws
    # Round-robin: every candidate is timed once per repeat, so a busy spell of the machine
    # falls on all of them alike; the fastest of the repeats is what the kernel can do.
    times: dict[str, dict[str, list[float]]] = {name: {} for name in chosen}
    for n in rows:
        xs = {k: torch.randn(n, k, generator=g) for k in {i for _, i in mats}}
        x = [(i, xs[i]) for _, i in mats]
        for name, ((_, run), _) in chosen.items():
            run(packed[name], x)
        for _ in range(repeats):
            for name, ((_, run), _) in chosen.items():
                t = _timed(lambda run=run, p=packed[name], x=x: run(p, x))
                times[name].setdefault(str(n), []).append(t)
    for name, (_, bytes_per) in chosen.items():
        best = {n: min(ts) for n, ts in times[name].items()}
        result["kernels"][name] = {
            "ms": {n: t * 1e3 for n, t in best.items()},
            "median_ms": {n: statistics.median(ts) * 1e3 for n, ts in times[name].items()},
            "gb_s": {n: n_weights * bytes_per / t / 1e9 for n, t in best.items()},
        }
        print(_row(name, best, rows, result["bound_ms"][_label(bytes_per)]), flush=True)
    return result


def _label(bytes_per: int) -> str:
    return {4: "float32", 2: "bfloat16", 1: "int8", Q4_BYTES: "q4"}[bytes_per]


def _row(name, times, rows, bound) -> str:
    ms = " ".join(f"{times[str(n)] * 1e3:8.2f}" for n in rows)
    t1 = times[str(rows[0])]
    ratio = f"   t(1)/bound {t1 * 1e3 / bound:4.2f}"
    if "9" in times or "8" in times:
        n = "9" if "9" in times else "8"
        ratio += f"  t({n})/t(1) {times[n] / t1:4.2f}"
    return f"{name:30s}{ms}{ratio}"


def _vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("vendor_id", "model name")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", nargs="*", help="run the kernels whose name holds one of these")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    print(
        f"{a.shapes}: rows {a.rows}; ms per pass over every matrix "
        f"(fastest of {a.repeats}, round-robin)"
    )
    r = bench(a.shapes, a.rows, a.repeats, a.only)
    print(
        f"{r['cpu_vendor']}; {' '.join(r['cpu_flags'])}; torch {r['torch']}, "
        f"{r['threads']} threads; int8 kernel {r['int8_kernel']}"
    )
    print(
        f"read {r['read_gb_s']:.1f} GB/s, FMA {r['fma_per_s'] / 1e9:.0f} G/s; "
        f"{r['weights'] / 1e6:.0f}M weights: bound float32 {r['bound_ms']['float32']:.1f} ms, bf16 "
        f"{r['bound_ms']['bfloat16']:.1f}, int8 {r['bound_ms']['int8']:.1f}, "
        f"q4 {r['bound_ms']['q4']:.1f}; FMA bound "
        + ", ".join(f"{n} rows {t:.1f}" for n, t in r["fma_bound_ms"].items())
    )
    if r.get("int8_mac_bound_ms"):
        print(
            f"int8 multiply-adds {r['int8_mac_per_s'] / 1e9:.0f} G/s (fbgemm, 256 rows); int8 "
            "compute bound "
            + ", ".join(f"{n} rows {t:.1f}" for n, t in r["int8_mac_bound_ms"].items())
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
