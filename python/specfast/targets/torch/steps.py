"""Static-shape, compiled target steps: what makes a batch-1 step fast on a GPU.

At batch 1 an eager step is bound by kernel launches, not by memory (gpt-fast: Llama-7B at 25
tok/s eager, 107 compiled with a static cache). So the compiled step has one shape per bucket:
a decode step is [1], a verify step over k+1 tokens is padded up to the next bucket, the cache
has a fixed capacity, positions are a device tensor and attention masks come from positions
(`Model.forward_static`). Under `mode="reduce-overhead"` each bucket replays as a CUDA graph.

On CPU the eager step with oneDNN-prepacked weights is the fast one (see README), so
compile="auto" compiles on CUDA only.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

# Rows of a verify step are padded up to one of these; a decode step is bucket 1.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
COMPILE_CHOICES = ("auto", "on", "off")
MIN_CAPACITY = 256
# A compiled model's KV slots unless it is given a max_length (Model.compile_steps).
STATIC_SLOTS = 4096


def bucket(n: int) -> int:
    """The smallest bucket holding n rows."""
    for b in BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"a static step holds at most {BUCKETS[-1]} tokens, got {n}")


def static_capacity(max_length: int) -> int:
    """KV slots for a compiled decoder of `max_length` tokens: a power of two above it, so few
    distinct cache shapes exist (each is a compile), and slot capacity - 1 is never live (padding
    rows write there)."""
    return max(MIN_CAPACITY, 1 << max_length.bit_length())


def model_capacity(max_context: int, max_length: int | None = None) -> int:
    """The KV slots of a compiled model's decoders: enough for `max_length` tokens, by default
    for its whole context up to STATIC_SLOTS - 1. One capacity per model, since each capacity
    is a compile of every bucket: generate() calls of any length up to it reuse the graphs that
    warmup() made, and none compiles midway. The cost: every pass attends over all the slots
    (masked), so a capacity far above what a generation holds reads keys for nothing."""
    if max_length is None:
        max_length = min(max_context, STATIC_SLOTS - 1)
    return static_capacity(max_length)


def resolve_compile(compile, device: torch.device) -> bool:
    """compile "auto" | "on" | "off" (or a bool) -> whether to compile the step."""
    if isinstance(compile, bool):
        return compile
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {COMPILE_CHOICES} or a bool, got {compile!r}")
    if compile == "auto":
        return device.type == "cuda"
    return compile == "on"


def allow_graphs_per_bucket(limit: int = 64) -> None:
    """One graph per (bucket, capacity) is by design: let dynamo keep that many for
    forward_static before it falls back to eager (its default is 8)."""
    dynamo_config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


def compile_step(model, mode: str | None = None, backend: str = "inductor"):
    """torch.compile of `model.forward_static`: fullgraph (a graph break is an error),
    dynamic=False (one graph per bucket and capacity), CUDA graphs on CUDA. backend="eager"
    traces without generating code (tests)."""
    # Compiled kernels are reused across processes: keep the cache somewhere that lasts.
    cache_dir = Path.home() / ".cache" / "specfast" / "inductor"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    allow_graphs_per_bucket()
    if backend != "inductor":
        return torch.compile(model.forward_static, fullgraph=True, dynamic=False, backend=backend)
    if mode is None:
        mode = "reduce-overhead" if model.device.type == "cuda" else "default"
    return torch.compile(model.forward_static, fullgraph=True, dynamic=False, mode=mode)


def warmup(model, max_length: int | None = None, buckets=BUCKETS, log=True) -> dict:
    """Runs every bucket's step until it is warm (compiled; on CUDA its graph recorded too) for
    the capacity of a decoder of `max_length` tokens (None: the model's own capacity), printing
    progress; returns {bucket: seconds}. Later decoders of that capacity start at full speed,
    so no generate() pays a compile inside its clock. `log`: True for stderr, None for none, or
    a file."""
    log = sys.stderr if log is True else log
    if max_length is None:
        max_length = model.static_capacity - 1
    decoder = model.decoder(max_length)
    seconds = {}
    for i, b in enumerate(buckets):
        t0 = time.perf_counter()
        for _ in range(model.cold_runs):
            decoder.reset()
            decoder.forward(torch.zeros(b, dtype=torch.long, device=model.device))
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds[b] = time.perf_counter() - t0
        if log is not None:
            bar = "#" * (i + 1) + "." * (len(buckets) - i - 1)
            print(
                f"warming compiled steps [{bar}] {b} tokens in {seconds[b]:.1f} s",
                file=log,
                flush=True,
            )
    return seconds
