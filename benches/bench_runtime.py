"""Time per target pass against the memory-bandwidth bound, and the cost of verifying n tokens.

A decode step must read every weight once, so weight bytes / memory bandwidth is a floor on its
time. Bandwidth is measured here as a large tensor copy (read + write, so read bandwidth is about
twice the copy rate). Then SmolLM2-135M's forward over n new tokens after 500 tokens of context
is timed for n = 1..32, in bfloat16 and float32, with the median of interleaved repeats.

    python benches/bench_runtime.py
"""

from __future__ import annotations

import statistics
import time

import torch

import specfast

NS = (1, 2, 4, 8, 16, 32)
CONTEXT = 500
REPEATS = 7


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes per second moved by a large copy, counting both the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model) -> int:
    # The parameters a decode step reads: every matrix once (prepacked copies are the same size).
    return sum(p.numel() * p.element_size() for p in model.parameters())


def pass_times(model) -> dict[int, float]:
    dec = model.decoder(CONTEXT + max(NS))
    ids = torch.randint(0, model.vocab_size, (CONTEXT + max(NS),))
    with torch.inference_mode():
        dec.forward(ids[:CONTEXT])
        samples: dict[int, list[float]] = {n: [] for n in NS}
        for _ in range(REPEATS):
            for n in NS:
                dec.rollback(CONTEXT)
                t = time.perf_counter()
                dec.forward(ids[CONTEXT : CONTEXT + n])
                samples[n].append(time.perf_counter() - t)
    return {n: statistics.median(s) for n, s in samples.items()}


def main() -> None:
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw / 1e9:.1f} GB/s; read-only floor uses half of it")
    print()
    print("| dtype | weights | bound per pass | " + " | ".join(f"n={n}" for n in NS) + " |")
    print("|---|---|---|" + "---|" * len(NS))
    for dtype in ("bfloat16", "float32"):
        model = specfast.load_model(specfast.default_model_path(), dtype=dtype)
        wb = weight_bytes(model)
        bound = wb / (bw / 2)
        t = pass_times(model)
        cells = [f"{t[1] * 1e3:.1f} ms ({t[1] / bound:.2f}× bound)"]
        cells += [f"×{t[n] / t[1]:.2f}" for n in NS[1:]]
        print(f"| {dtype} | {wb / 1e6:.0f} MB | {bound * 1e3:.1f} ms | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
