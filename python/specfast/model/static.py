"""Static-shape, compiled target steps: what makes a batch-1 step fast on a GPU.

At batch 1 an eager step is bound by kernel launches, not by memory (gpt-fast: Llama-7B at 25
tok/s eager, 107 compiled with a static cache). So the compiled step has one shape per bucket:
a decode step is [1], a verify step over k+1 tokens is padded up to the next bucket, the cache
has a fixed capacity, positions are a device tensor and attention masks come from positions
(`forward_static`). Under `mode="reduce-overhead"` each bucket replays as a CUDA graph.

On CPU the eager step with oneDNN-prepacked weights is the fast one (see README), so
compile="auto" compiles on CUDA only.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from specfast.model.attention import attention
from specfast.model.kv_cache import static_cache
from specfast.model.layers import final_logits, run_layers

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


# ----------------------------------------------------------------------------
# the static pass


def forward_static(model, ids, positions, k_cache, v_cache, cos_table, sin_table):
    """Model.forward_static: the pass with every shape fixed, for torch.compile and CUDA graphs.

    ids (B,) and positions (B,) on the device; k_cache, v_cache (n_layers, Hkv, C, hd) written
    at `positions` (index_copy_, no host arithmetic); cos/sin tables (C, hd). Attention reads
    all C slots and masks key j for query i unless j <= positions[i], so stale slots past the
    live length never count and rollback stays one integer. Padding rows (positions C - 1)
    write into a slot no live query sees. -> (logits (B, V), argmax ids (B,)).
    """
    C = k_cache.shape[2]
    cos, sin = cos_table[positions, None, :], sin_table[positions, None, :]  # (B, 1, hd)
    slots = torch.arange(C, device=ids.device)
    mask = slots[None, :] <= positions[:, None]  # (B, C)

    def attend(i, q, k, v):  # q (H, B, hd); k, v (Hkv, B, hd)
        k_cache[i].index_copy_(1, positions, k)
        v_cache[i].index_copy_(1, positions, v)
        return attention(q, k_cache[i], v_cache[i], mask)

    # oneDNN-prepacked weights are opaque to the compiler; inductor lays out its own.
    packed = None if torch.compiler.is_compiling() else model.packed_weights()
    x = run_layers(model, model.embed_tokens(ids), cos, sin, attend, packed)
    logits = final_logits(model, x, None, packed)
    return logits, logits.argmax(dim=-1)


class StaticStep:
    """A decoder's compiled passes: a fixed-capacity cache (one per model and capacity, so the
    CUDA graphs recorded for its addresses replay for the next decoder too), the rope tables
    as static inputs, and ids padded to a bucket."""

    def __init__(self, model, max_length: int):
        self.model = model
        self.step = model.compiled_step
        model._restore_plain()  # a compiled step reads the plain weights, not the packed
        capacity = max(model.static_capacity, static_capacity(max_length))
        self.cache = static_cache(model, capacity)
        # The same tensors every pass, marked static: CUDA graphs read them in place instead
        # of copying them in before each replay.
        self.tables = tuple(t[:capacity] for t in model.rope(capacity))
        for t in self.tables:
            torch._dynamo.mark_static_address(t, guard=False)
        self.cold_passes = 0  # passes that compiled a graph or recorded a CUDA graph

    def takes(self, ids, last_only, head) -> bool:
        """Whether the compiled step can run this pass (all rows, the full head, a bucket)."""
        return not last_only and head is None and len(ids) <= BUCKETS[-1]

    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled step over ids padded to a bucket -> (logits (T, V), argmax (T,))."""
        cache = self.cache
        T, pos = ids.shape[0], cache.length
        B, C = bucket(T), cache.k.shape[2]
        cos, sin = self.tables  # (C, hd) each
        with torch.inference_mode():  # inputs made here are inference tensors, like the cache
            padded = torch.zeros(B, dtype=torch.long, device=ids.device)
            padded[:T] = ids
            # Padding rows sit at slot C - 1, which no live query sees. No host arithmetic on
            # device values, so no sync.
            positions = torch.arange(pos, pos + B, device=ids.device).clamp_max_(C - 1)
            logits, top = self.step(padded, positions, cache.k, cache.v, cos, sin)
        cache.length = pos + T
        m = self.model
        key = (B, id(cache.k))  # buffers are kept objects (static_cache): one id each
        m._step_runs[key] = m._step_runs.get(key, 0) + 1
        if m._step_runs[key] <= m.cold_runs:
            self.cold_passes += 1
        # CUDA graphs reuse their output buffers on the next replay: hand out copies.
        return logits[:T].clone(), top[:T].clone()
