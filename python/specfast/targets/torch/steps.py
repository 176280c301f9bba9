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


def warmup(model, max_length: int, buckets=BUCKETS, log=sys.stderr) -> dict[int, float]:
    """Compiles every bucket for the capacity `max_length` needs, printing progress; returns
    {bucket: seconds}. Later decoders of that capacity start at full speed."""
    decoder = model.decoder(max_length)
    seconds = {}
    for b in buckets:
        t0 = time.perf_counter()
        decoder.reset()
        decoder.forward(torch.zeros(b, dtype=torch.long, device=model.device))
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds[b] = time.perf_counter() - t0
        if log is not None:
            print(f"compiled step [{b}] in {seconds[b]:.1f}s", file=log, flush=True)
    return seconds
