"""Time per target pass against the memory-bandwidth bound, eager against compiled steps.

A decode step must read every weight once, so weight bytes / read bandwidth is a floor on its
time. Read bandwidth is taken as half the rate of a large tensor copy (which reads and writes).
Each model is timed over n new tokens after 500 tokens of context, for the verify buckets
n = 1..32, as the median of interleaved repeats, eager and (with --compile) compiled.

    python benches/bench_runtime.py                          # SmolLM2 from its GGUF, auto dtype
    python benches/bench_runtime.py --dtype float32 bfloat16 --compile
    python benches/bench_runtime.py --device cuda --shapes smollm2-135m qwen2.5-1.5b \\
        --compile --json out.json                            # random weights of real shapes

Time per pass does not depend on the weights' values, so a GPU machine with no model file
measures random-weight models of the real shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import specfast
from specfast.hardware import cpu_flags_label
from specfast.model import Model, ModelConfig, resolve_dtype

NS = (1, 2, 4, 8, 16, 32)
CONTEXT = 500
SHAPES = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
        intermediate_size=1536, rope_theta=100000.0, max_context=8192, tie_embeddings=True,
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2,
        intermediate_size=8960, rope_theta=1000000.0, max_context=32768, attn_bias=True,
        tie_embeddings=True, arch="qwen2",
    ),
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """Bytes per second moved by a large copy, counting both the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model) -> int:
    # What a decode step reads: every matrix once (prepacked copies are the same size).
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> Model:
    """A model of a real shape with N(0, 0.02) weights made on the device (fast, no file)."""
    with torch.device("meta"):
        model = Model(SHAPES[shape])
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.02)
    return model


def pass_times(model, repeats: int, no_sync_check: bool = False) -> dict[int, float]:
    """Median seconds of one pass over n tokens after CONTEXT tokens, for each n in NS."""
    device = model.device
    dec = model.decoder(CONTEXT + max(NS))
    ids = torch.randint(0, model.vocab_size, (CONTEXT + max(NS),), device=device)
    dec.forward(ids[:CONTEXT], last_only=True)
    feeds = {n: ids[CONTEXT : CONTEXT + n] for n in NS}
    for n in NS:  # warm-up: compiles each bucket and records its CUDA graph
        for _ in range(3):
            dec.rollback(CONTEXT)
            dec.forward_greedy(feeds[n])
    if no_sync_check and device.type == "cuda":
        # Any hidden device->host sync inside a step raises here.
        torch.cuda.set_sync_debug_mode("error")
        try:
            for n in NS:
                dec.rollback(CONTEXT)
                dec.forward_greedy(feeds[n])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    samples: dict[int, list[float]] = {n: [] for n in NS}
    for _ in range(repeats):
        for n in NS:
            dec.rollback(CONTEXT)
            sync(device)
            t = time.perf_counter()
            dec.forward_greedy(feeds[n])
            sync(device)
            samples[n].append(time.perf_counter() - t)
    return {n: statistics.median(s) for n, s in samples.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", nargs="+", default=["auto"])
    p.add_argument("--shapes", nargs="+", default=["gguf"], help="gguf (SmolLM2 file) or shapes")
    p.add_argument("--compile", action="store_true", help="also time compiled steps")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    bw = copy_bandwidth(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_flags_label()
    print(f"{device} ({where}): copy {bw / 1e9:.1f} GB/s (read + write); bound uses half")
    print()
    print("| model | dtype | step | weights | bound | " + " | ".join(f"n={n}" for n in NS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(NS))
    results = {"device": str(device), "where": where, "copy_bytes_per_s": bw, "rows": []}
    for shape in args.shapes:
        for dtype_name in args.dtype:
            dtype = resolve_dtype(dtype_name, device)
            if shape == "gguf":
                model = specfast.load_model(device=device, dtype=dtype, compile="off")
            else:
                model = random_model(shape, device, dtype)
            wb = weight_bytes(model)
            bound = wb / (bw / 2)
            for step in ("eager", "compiled") if args.compile else ("eager",):
                torch._dynamo.reset()
                model.compile_steps(step == "compiled")
                t0 = time.perf_counter()
                t = pass_times(model, args.repeats, no_sync_check=step == "compiled")
                cells = [f"{t[1] * 1e3:.2f} ms ({t[1] / bound:.2f}× bound)"]
                cells += [f"×{t[n] / t[1]:.2f}" for n in NS[1:]]
                name = str(dtype).removeprefix("torch.")
                print(
                    f"| {shape} | {name} | {step} | {wb / 1e6:.0f} MB | {bound * 1e3:.2f} ms | "
                    + " | ".join(cells)
                    + " |",
                    flush=True,
                )
                results["rows"].append(
                    {
                        "model": shape,
                        "dtype": name,
                        "step": step,
                        "weight_bytes": wb,
                        "bound_seconds": bound,
                        "pass_seconds": {str(n): s for n, s in t.items()},
                        "fraction_of_bound": bound / t[1],
                        "wall_seconds_incl_compile": time.perf_counter() - t0,
                    }
                )
                print(f"  ({time.perf_counter() - t0:.0f}s incl. compile)", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
