"""Soak: many generate() calls, mixing greedy and sampled, n-gram / draft-model / no drafter and
stop strings, sampling RSS (and CUDA memory where present) every 100 calls. Reports the memory
slope after warm-up, least squares, in MB per 1,000 calls. Goal: under 1 MB / 1,000 calls.

    python benches/soak.py                      # tiny model, 10,000 calls; SmolLM2, 500 calls
    python benches/soak.py --tiny-calls 2000 --smollm-calls 0 --json soak.json

The tiny models are random-weight ones built here; SmolLM2 drafts with itself as the draft model.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

import specfast
from specfast.model import Model, ModelConfig


def rss_mb() -> float:
    """Resident set size of this process, in MB (from /proc; ru_maxrss is a peak, not now)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None  # not glibc: RSS is noisier, the slope still holds over long runs


_LIBC = _libc()  # loaded once: a CDLL per sample would itself grow the Python heap


def settle() -> None:
    """Collects garbage and hands freed heap pages back to the OS (glibc's malloc_trim), so RSS
    shows what is live rather than what the allocator kept after its thresholds moved: without
    it RSS rises in one-off steps of a few MB that look like a slope over a short run."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def cuda_mb() -> float | None:
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None


def slope_per_1000(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs, times 1,000."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    return 1000 * sxy / sxx if sxx else 0.0


class ByteTokenizer:
    """ids -> one printable character each: enough for stop strings on a tokenizer-less model."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(33 + i % 90) for i in ids)

    def encode(self, text):
        return [ord(c) - 33 for c in text]


def tiny_model(seed: int = 0) -> Model:
    config = ModelConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
        max_context=256,
    )  # fmt: skip
    return Model.from_config(config, seed=seed)


def call_mix(model, draft_model, prompts, max_new_tokens, tokenizer=None):
    """An endless cycle of generate() keyword sets covering the loop's paths."""
    drafters = ["ngram", "draft", None]
    modes = [dict(), dict(temperature=0.8, top_p=0.95), dict(temperature=1.0, top_k=20)]
    stops = [None, ["!!", "ab"]]
    for i, (drafter, mode, stop) in enumerate(
        itertools.cycle(itertools.product(drafters, modes, stops))
    ):
        kw = dict(mode, max_new_tokens=max_new_tokens, seed=i)
        kw["drafter"] = draft_model if drafter == "draft" else drafter
        if stop is not None:
            kw["stop_strings"] = stop
            kw["tokenizer"] = tokenizer if tokenizer is not None else ByteTokenizer()
        yield prompts[i % len(prompts)], kw


def soak(
    model,
    draft_model,
    prompts,
    calls: int,
    every: int = 100,
    max_new_tokens: int = 24,
    tokenizer=None,
    after_call: Callable[[int], None] | None = None,
    on_sample: Callable[[tuple], None] | None = None,
) -> dict:
    """Runs `calls` generate() calls; every `every` calls, after gc, samples (call, RSS MB,
    CUDA MB or None, Python heap MB as tracemalloc traces it or None when it is not tracing)."""
    import tracemalloc

    samples = []
    mix = call_mix(model, draft_model, prompts, max_new_tokens, tokenizer)
    start = time.perf_counter()
    for i in range(1, calls + 1):
        prompt, kw = next(mix)
        specfast.generate(model, prompt, **kw)
        if after_call is not None:
            after_call(i)
        if i % every == 0:
            settle()
            traced = (
                tracemalloc.get_traced_memory()[0] / 2**20 if tracemalloc.is_tracing() else None
            )
            samples.append((i, rss_mb(), cuda_mb(), traced))
            if on_sample is not None:
                on_sample(samples[-1])
    return {"calls": calls, "seconds": time.perf_counter() - start, "samples": samples}


def summarize(result: dict, warmup_fraction: float = 0.2) -> dict:
    """Slope (MB / 1,000 calls) over the samples after the first `warmup_fraction` of calls."""
    kept = [s for s in result["samples"] if s[0] > warmup_fraction * result["calls"]]
    xs = [s[0] for s in kept]
    out = {
        "calls": result["calls"],
        "seconds": round(result["seconds"], 1),
        "rss_first_mb": round(result["samples"][0][1], 1) if result["samples"] else None,
        "rss_last_mb": round(result["samples"][-1][1], 1) if result["samples"] else None,
        "rss_slope_mb_per_1000": slope_per_1000(xs, [s[1] for s in kept]),
    }
    if kept and kept[0][2] is not None:
        out["cuda_slope_mb_per_1000"] = slope_per_1000(xs, [s[2] for s in kept])
    if kept and kept[0][3] is not None:
        out["python_heap_slope_mb_per_1000"] = slope_per_1000(xs, [s[3] for s in kept])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny-calls", type=int, default=10_000)
    ap.add_argument("--smollm-calls", type=int, default=500)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: shared machine)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report = {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}
    if args.tiny_calls:
        prompts = [[5, 6, 7, 8] * 4, list(range(30, 70)), [1, 2, 3, 1, 2, 3, 1, 2]]
        res = soak(tiny_model(0), tiny_model(1), prompts, args.tiny_calls, args.every,
                   on_sample=lambda s: print("tiny sample", *s, flush=True))  # fmt: skip
        report["tiny"] = summarize(res) | {"samples": res["samples"]}
        print("tiny:", json.dumps({k: v for k, v in report["tiny"].items() if k != "samples"}))
    if args.smollm_calls:
        model = specfast.load_model(specfast.default_model_path(), dtype="float32")
        tok = model.tokenizer
        texts = [
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
            "Shall I compare thee to a summer's day? Thou art more lovely",
            "The capital of France is",
        ]
        prompts = [tok.encode(t).ids for t in texts]
        res = soak(model, model, prompts, args.smollm_calls, args.every, 16, tokenizer=tok,
                   on_sample=lambda s: print("smollm sample", *s, flush=True))  # fmt: skip
        report["smollm"] = summarize(res) | {"samples": res["samples"]}
        print("smollm:", json.dumps({k: v for k, v in report["smollm"].items() if k != "samples"}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
