"""Time per target pass against the memory-bandwidth bound, eager against compiled steps.

A decode step must read every weight once, so weight bytes / copy bandwidth (the bytes a large
copy reads and writes per second, measured with the model in memory) is a floor on its time.
Each model is timed over n new tokens after 500 tokens of context, for the verify buckets n,
bucket by bucket (warm-up, which compiles and records the bucket's CUDA graph, then the median
of --repeats passes), eager rows before compiled ones. Every (model, step, n) is a row: with
--jsonl it is appended there as one JSON line the moment it is measured, and a failure is a row
too, so a slow compile or an out-of-memory loses only its own row.

    python benches/bench_runtime.py                          # SmolLM2 from its GGUF, auto dtype
    python benches/bench_runtime.py --dtype float32 bfloat16 --compile
    python benches/bench_runtime.py --weights float int8 q4 --ns 1 2 4 8 9 16  # CPU int8, q4
    python benches/bench_runtime.py --weights q4 --ns 1 9 --interleave   # t(9)/t(1), side by side
    python benches/bench_runtime.py --device cuda --shapes smollm2-135m qwen2.5-1.5b \\
        --steps eager compiled --jsonl rows.jsonl            # random weights of real shapes

Time per pass does not depend on the weights' values, so a GPU machine with no model file
measures random-weight models of the real shapes (scripts/gpu_check.sh does).

On CPU each row also gives the threads' round trip (`round_trip`): where the OS or a VM puts
the core's two threads on cores far apart, passes of several rows take longer. With
--interleave, rounds whose round trip is well above the least are reported apart
(`far_rounds`), and the row's figures come from the others.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch

from specfast.hardware import cpu_flags_label
from specfast.model import Model, ModelConfig
from specfast.model.config import resolve_dtype

NS = (1, 2, 4, 8, 16, 32)
CONTEXT = 500
STEPS = ("eager", "compiled")
SHAPES = {
    # A few MB: the CPU rehearsal of scripts/gpu_check.sh and its CI test.
    "tiny": ModelConfig(
        vocab_size=2048, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=384,
        max_context=2048, tie_embeddings=True,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
        intermediate_size=1536, rope_theta=100000.0, max_context=8192, tie_embeddings=True,
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2,
        intermediate_size=8960, rope_theta=1000000.0, max_context=32768, attn_bias=True,
        tie_embeddings=True, arch="qwen2",
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        intermediate_size=14336, rope_theta=500000.0, max_context=131072,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    ),
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """Bytes per second moved by a large copy, counting both the read and the write. Both
    buffers are written first, so the copy runs on memory that is really there."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model) -> int:
    """What a decode step reads: every matrix once (prepacked copies are the same size; int8
    ones are their bytes and scales)."""
    if model.quantized:
        packed = model.packed_weights()
        return sum(m.nbytes for layer in packed[:-1] for m in layer) + packed[-1].nbytes
    return sum(p.numel() * p.element_size() for p in model.parameters())


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> Model:
    """A model of a real shape with N(0, 0.02) weights, allocated once, in `dtype` on `device`:
    built on the meta device and cast there (free), so no float32 copy ever exists (an 8B model
    built in float32 and then cast would need 48 GB on the way)."""
    with torch.device("meta"):
        model = Model(SHAPES[shape])
    model = model.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.02)
    return model


def peak_bytes(device: torch.device) -> int:
    """Peak device memory since the last reset (CUDA), or the process's peak RSS (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cudagraph_skips() -> int:
    """Graphs inductor ran without CUDA graphs (mutated or non-static inputs, CPU ops, ...): it
    says so only in this counter and a hidden log, so the bench reads it."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def warm_up(dec, feed: torch.Tensor, sync_check: bool) -> float:
    """Seconds of 3 passes over `feed` after CONTEXT tokens, which compile the bucket and
    record its CUDA graph."""
    device = feed.device
    t0 = time.perf_counter()
    for _ in range(3):
        dec.rollback(CONTEXT)
        dec.forward_greedy(feed)
    sync(device)
    warmup = time.perf_counter() - t0
    if sync_check and device.type == "cuda":
        # Any hidden device->host sync inside a step raises here.
        torch.cuda.set_sync_debug_mode("error")
        try:
            dec.rollback(CONTEXT)
            dec.forward_greedy(feed)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return warmup


def pass_time(dec, feed: torch.Tensor) -> float:
    """Seconds of one pass over `feed` after CONTEXT tokens."""
    dec.rollback(CONTEXT)
    sync(feed.device)
    t = time.perf_counter()
    dec.forward_greedy(feed)
    sync(feed.device)
    return time.perf_counter() - t


def bucket_time(dec, feed: torch.Tensor, repeats: int, sync_check: bool) -> tuple[float, float]:
    """(warm-up seconds, median seconds of one pass) for the pass over `feed`."""
    warmup = warm_up(dec, feed, sync_check)
    return warmup, statistics.median(pass_time(dec, feed) for _ in range(repeats))


def round_trip(device: torch.device) -> float | None:
    """Seconds for an empty job to reach the core's helper thread and come back (None on a GPU
    or one CPU). On a VM whose host moves its vCPUs between nearer and farther cores it tells
    the two states apart: on a Zen 4, 0.05-0.08 µs or 0.19-0.21 µs, with 9-row passes 1.3 ×
    as long in the second."""
    if device.type != "cpu":
        return None
    from specfast import _core

    return _core.thread_round_trip()


def interleaved_rounds(
    dec, feeds: list[torch.Tensor], repeats: int, device: torch.device
) -> tuple[list[list[float]], list[float | None]]:
    """Seconds of each pass over each of `feeds` (warmed up), the passes taken in turn, one of
    each per round: on a machine whose speed drifts from minute to minute every bucket then sees
    the same minutes, so their ratios hold where their times do not. Also each round's
    `round_trip`, measured before it."""
    samples: list[list[float]] = [[] for _ in feeds]
    trips: list[float | None] = []
    for _ in range(repeats):
        trips.append(round_trip(device))
        for feed, times in zip(feeds, samples, strict=True):
            times.append(pass_time(dec, feed))
    return samples, trips


def by_rounds(
    samples: list[list[float]], trips: list[float | None], far: list[bool], ns: list[int]
) -> tuple[list[dict], list[dict] | None]:
    """Per bucket, its median seconds, its ratio to n=1 (where there is an n=1) and the median
    round trip, over the rounds that `far` leaves out; then the same over those it marks (None
    if none)."""
    one = ns.index(1) if 1 in ns else None

    def median_of(keep: list[bool]) -> list[dict]:
        seconds = [
            statistics.median(t for t, k in zip(ts, keep, strict=True) if k) for ts in samples
        ]
        known = [t for t, k in zip(trips, keep, strict=True) if k and t is not None]
        trip = statistics.median(known) if known else None
        return [
            {
                "seconds": t,
                "vs_n1": None if one is None else t / seconds[one],
                "round_trip_seconds": trip,
            }
            for t in seconds
        ]

    near = median_of([not f for f in far])
    return near, median_of(far) if any(far) else None


def far_rounds(trips: list[float | None]) -> list[bool]:
    """Which rounds ran with the threads farther apart than in the closest: a round trip more
    than 2.5 × the least (with the threads near, they vary by up to 1.6 ×; far, 2.5-4 × the
    least)."""
    known = [t for t in trips if t is not None]
    least = min(known, default=None)
    return [least is not None and t is not None and t > 2.5 * least for t in trips]


def summary(row: dict) -> str:
    """The one line a row prints."""
    head = f"{row['model']} {row['dtype']} {row.get('weights', 'float')} weights {row['step']}"
    head += f" n={row.get('n', '-')}"
    if "error" in row:
        return f"{head}: FAILED {row['error']}"
    line = (
        f"{head}: {row['seconds'] * 1e3:.3f} ms"
        + (f" (x{row['vs_n1']:.2f} n=1)" if row.get("vs_n1") is not None else "")
        + f", {row['fraction_of_bound']:.0%} of the bandwidth bound"
        + f" ({row['bound_seconds'] * 1e3:.3f} ms), peak {row['peak_bytes'] / 1e9:.2f} GB,"
        + f" warm-up {row['warmup_seconds']:.1f} s"
    )
    if row["step"] == "compiled":
        line += f", cudagraph_skips {row['cudagraph_skips']}"
    if row.get("round_trip_seconds") is not None:
        line += f", threads' round trip {row['round_trip_seconds'] * 1e6:.2f} µs"
    if row.get("far_rounds"):
        far = row["far"]
        line += (
            f"; {row['far_rounds']} of {row['rounds']} rounds with the threads farther apart"
            f" ({far['round_trip_seconds'] * 1e6:.2f} µs): {far['seconds'] * 1e3:.3f} ms"
            + (f" (x{far['vs_n1']:.2f} n=1)" if far.get("vs_n1") is not None else "")
        )
    return line


class Rows:
    """Rows as they are measured: printed, appended to a JSON-lines file, kept."""

    def __init__(self, jsonl: str | None):
        self.jsonl = jsonl
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(summary(row), flush=True)
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")


def finished(row: dict, t: float, first: float | None, warmup: float, device, bw: float) -> dict:
    """`row` with its pass time `t` and what follows from it (first: the n=1 time, if any)."""
    return {
        **row,
        "seconds": t,
        "vs_n1": None if first is None else t / first,
        "fraction_of_bound": row["bound_seconds"] / t,
        "warmup_seconds": warmup,
        "peak_bytes": peak_bytes(device),
        "cudagraph_skips": cudagraph_skips(),
        "copy_bytes_per_s": bw,
    }


def measure(
    rows: Rows, shape, dtype_name, step, device, ns, repeats, weights="float", interleave=False
) -> None:
    """Every bucket of one (model, dtype, step, weights), a row each; any failure becomes a
    row. int8 and q4 weights run with float32 activations, whatever `dtype_name` says. With
    `interleave`, the buckets' timed passes alternate (`interleaved_times`) and their rows come
    at the end."""
    from torch._dynamo.utils import counters

    import specfast

    quantized = weights in ("int8", "q4")  # float32 activations
    dtype = torch.float32 if quantized else resolve_dtype(dtype_name, device)
    name = str(dtype).removeprefix("torch.")
    base = {"model": shape, "dtype": name, "weights": weights, "step": step, "device": str(device)}
    model = dec = None
    try:
        torch._dynamo.reset()
        counters.clear()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if shape == "gguf":
            model = specfast.load_model(device=device, dtype=dtype, compile="off", weights=weights)
        else:
            model = random_model(shape, device, dtype)
            if quantized:
                model.quantize_int8(weights)
        model.compile_steps(step == "compiled", max_length=CONTEXT + max(ns))
        bw = copy_bandwidth(device)  # with the weights in memory, as a pass runs
        wb = weight_bytes(model)
        bound = wb / bw
        dec = model.decoder(CONTEXT + max(ns))
        ids = torch.randint(0, model.vocab_size, (CONTEXT + max(ns),), device=device)
        dec.forward(ids[:CONTEXT], last_only=True)
    except Exception as e:  # the row's failure is the figure: record it, go on
        rows.add({**base, "error": f"{type(e).__name__}: {e}"[:500]})
        return
    first = None
    warm: list[tuple[dict, float]] = []  # (row so far, warm-up seconds), with --interleave
    for n in ns:
        row = {**base, "n": n, "weight_bytes": wb, "bound_seconds": bound}
        feed = ids[CONTEXT : CONTEXT + n]
        try:
            if interleave:
                warm.append((row, warm_up(dec, feed, step == "compiled")))
                continue
            row["round_trip_seconds"] = round_trip(device)
            warmup, t = bucket_time(dec, feed, repeats, step == "compiled")
        except Exception as e:
            rows.add({**row, "error": f"{type(e).__name__}: {e}"[:500]})
            if isinstance(e, torch.cuda.OutOfMemoryError):
                break
            continue
        first = t if n == 1 else first
        rows.add(finished(row, t, first, warmup, device, bw))
    if warm:
        feeds = [ids[CONTEXT : CONTEXT + row["n"]] for row, _ in warm]
        try:
            samples, trips = interleaved_rounds(dec, feeds, repeats, device)
        except Exception as e:
            for row, _ in warm:
                rows.add({**row, "error": f"{type(e).__name__}: {e}"[:500]})
        else:
            # The rounds with the threads at their closest give the rows' figures; any others
            # are reported beside them (`far_rounds`).
            far = far_rounds(trips)
            timed_ns = [row["n"] for row, _ in warm]
            near, apart = by_rounds(samples, trips, far, timed_ns)
            first = near[timed_ns.index(1)]["seconds"] if 1 in timed_ns else None
            for i, (row, warmup) in enumerate(warm):
                row = {**row, "rounds": len(far), "far_rounds": sum(far)}
                row["round_trip_seconds"] = near[i]["round_trip_seconds"]
                if apart:
                    row["far"] = apart[i]
                rows.add(finished(row, near[i]["seconds"], first, warmup, device, bw))
    del model, dec
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", nargs="+", default=["auto"])
    p.add_argument("--shapes", nargs="+", default=["gguf"], help="gguf (SmolLM2 file) or shapes")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=["eager"])
    p.add_argument("--compile", action="store_true", help="same as --steps eager compiled")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--ns", type=int, nargs="+", default=list(NS), help="tokens per pass")
    p.add_argument("--weights", nargs="+", choices=("float", "int8", "q4"), default=["float"])
    p.add_argument("--json", help="write every row here at the end")
    p.add_argument("--jsonl", help="append each row here, as one JSON line, once measured")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="time the buckets' passes in turn (n=1, n=2, ..., then again), so that their ratios "
        "hold on a machine whose speed drifts; rows then come once all are timed",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    steps = [s for s in STEPS if s in (STEPS if args.compile else args.steps)]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_flags_label()
    print(f"{device} ({where})", file=sys.stderr)
    rows = Rows(args.jsonl)
    for step in steps:  # eager rows first: compiled ones cost compiles, and may not finish
        for shape in args.shapes:
            for dtype_name in args.dtype:
                for weights in args.weights:
                    ns = tuple(args.ns)
                    measure(
                        rows, shape, dtype_name, step, device, ns, args.repeats, weights,
                        args.interleave,
                    )  # fmt: skip
    results = {"device": str(device), "where": where, "rows": rows.rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
