"""The core's CPU weight matrices: the Rust kernels' glue, and which weights "auto" picks on
this CPU.

float32 weights (`specfast._core.FloatMatrix`) keep their values, and each output is one fixed
sum whatever the number of rows. Quantized weights are int8 with one scale per output row
(`specfast._core.Int8Matrix`), 4-bit as llama.cpp's Q4_1 (`specfast._core.Q4Matrix`: per
group of 32 inputs a scale and a minimum), or a GGUF file's own blocks, each tensor at its ggml
type (`specfast._core.GgufMatrix`: the types of `gguf_block_types()`); each activation row is
quantized with its own scales at every call. So a row's logits never depend on the other rows
of a pass: a verify pass over k+1 tokens gives exactly what k+1 one-token passes give, which
keeps the model's speculative output equal to its own plain output.

`load_model(weights="auto")` keeps whichever of the float weights (at the dtype "auto" chose)
and its quantized candidates a timed decode step says is fastest. The candidates are int8, or
for a quantized GGUF its own blocks ("file"), with int8 too only where every layer matrix of the
file has under 8 bits a weight: auto never stores fewer bits than the file (but for its 16- and
32-bit tensors, which "file" holds as Q8_0). On a CPU with AMX, dtype "auto" is itself timed:
bfloat16 (oneDNN's tiles) against float32 (the core). The choices are kept per CPU and model
shape (weights) or model file (dtype) in `~/.cache/specfast/weights.json` (`SPECFAST_CACHE` moves
it), so each is timed once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specfast._core import FloatMatrix, GgufMatrix, Int8Matrix, Q4Matrix, int8_kernel
from specfast.hardware import proc_cpu_flags

WEIGHTS_CHOICES = ("auto", "float", "int8", "q4", "file")
# The weight kinds the core runs, with int8 activations ("file": a GGUF's own blocks).
QUANTIZED = ("int8", "q4", "file")
# The core's matrices, and those a quantized model's products run on.
CoreMatrix = Int8Matrix | Q4Matrix | GgufMatrix | FloatMatrix
CORE_MATRICES = (Int8Matrix, Q4Matrix, GgufMatrix, FloatMatrix)
# Part of the cache key of "auto"'s timings: bump it when the int8 path's speed changes.
KERNEL_VERSION = 8
# Passes of up to this many tokens run torch's own ops on one thread: the core splits its
# products with its own helper thread (kernels' helper.rs), and torch's OpenMP workers spinning
# between ops beside it made a SmolLM2 decode step 300+ ms instead of 20 (2 cores).
# (benches/bench_linear.py times the kernel alone.)
INT8_SERIAL_ROWS = 64


# "auto" considers int8 only for models with at least this many weights: below it a pass runs
# from the CPU's caches, not memory, and the bytes int8 saves matter little.
AUTO_MIN_WEIGHTS = 32_000_000


def quantize(weight: torch.Tensor, kind: str = "int8") -> Int8Matrix | Q4Matrix | GgufMatrix:
    """(N, K) float weight -> int8 (one scale per row), q4 (Q4_1: per group of 32), or "file":
    float values have no file blocks, so Q8_0 (a scale per 32: the nearest ggml layout to
    float), or int8 where K is not whole blocks of 32."""
    w = weight.detach().float().contiguous().numpy()
    if kind == "file" and w.shape[1] % 32 == 0:
        return GgufMatrix.from_tensors([("Q8_0", q8_0_blocks(w))], w.shape[1])
    return Q4Matrix(w) if kind == "q4" else Int8Matrix(w)


def q8_0_blocks(w: np.ndarray) -> np.ndarray:
    """(N, K) float32 -> gguf's Q8_0 blocks of it, (N, K / 32 * 34) uint8."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    return gguf_quantize(w, GGMLQuantizationType.Q8_0)


def dequantize(m: CoreMatrix) -> torch.Tensor:
    """The float32 (N, K) matrix a core matrix stands for."""
    if isinstance(m, FloatMatrix):
        return torch.from_numpy(m.weights())
    if isinstance(m, GgufMatrix):
        return torch.from_numpy(m.dequantize())
    if isinstance(m, Q4Matrix):
        q, d, mins = m.parts()  # (N, K), (N, G), (N, G) or None (Q4_0)
        groups = torch.arange(m.cols) // 32
        scale = torch.from_numpy(d)[:, groups]
        if mins is None:
            return (torch.from_numpy(q).float() - 8) * scale
        return torch.from_numpy(q).float() * scale + torch.from_numpy(mins)[:, groups]
    q8, scales = m.weights()
    return torch.from_numpy(q8).float() * torch.from_numpy(scales)[:, None]


def core_linear(x: torch.Tensor, m: CoreMatrix) -> torch.Tensor:
    """x (..., K) @ W.T -> (..., N) in x's dtype, through the core's product of `m`; the
    product runs in float32 activations."""
    x2 = x.reshape(-1, m.cols)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    out = torch.empty(x2.shape[0], m.rows)
    m.matmul(x2.numpy(), out.numpy())
    out = out.view(*x.shape[:-1], m.rows)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def check_weights(weights) -> str:
    if weights not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {WEIGHTS_CHOICES}, got {weights!r}")
    return weights


# -----------------------------------------------------------------------------
# "auto": time a decode step both ways, once per CPU and model shape


def _cache_path() -> Path:
    root = os.environ.get("SPECFAST_CACHE") or Path.home() / ".cache" / "specfast"
    return Path(root) / "weights.json"


def _key(*what) -> str:
    """A cache key for `what` on this CPU, kernel, torch and thread count."""
    flags = " ".join(sorted(proc_cpu_flags() or ()))
    raw = f"{KERNEL_VERSION}|{flags}|{torch.__version__}|{int8_kernel()}|"
    raw += f"{torch.get_num_threads()}|" + "|".join(map(str, what))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _step_seconds(model, steps: int = 6) -> float:
    """The fastest of `steps` decode steps after a 32-token prefill."""
    dec = model.decoder(64)
    dec.forward(torch.arange(32) % model.vocab_size)
    best = float("inf")
    for i in range(steps):
        t = time.perf_counter()
        dec.forward(torch.tensor([i % model.vocab_size]))
        best = min(best, time.perf_counter() - t)
        dec.rollback(32)
    return best


def auto_weights(
    model, load: Callable[[str], Any], kinds: tuple[str, ...] = ("int8",)
) -> tuple[Any, dict]:
    """The fastest of `model` (float weights, at its dtype) and `load(kind)` for each kind in
    `kinds` on this CPU, and the timings behind the choice. Timed once per CPU, model shape and
    kinds, then read from the cache."""
    if sum(p.numel() for p in model.parameters()) < AUTO_MIN_WEIGHTS:
        return model, {"weights": "float", "reason": f"under {AUTO_MIN_WEIGHTS} weights"}
    loaders: dict[str, Callable[[], Any]] = {"float": lambda: model}
    for kind in kinds:
        loaders[kind] = functools.partial(load, kind)
    choice, fastest, entry = _fastest(_weights_key(model.dtype, model.config, kinds), loaders)
    entry = {"weights": choice, "float_dtype": str(model.dtype), **entry}
    if choice == "float":
        return model, entry
    return (load(choice) if fastest is None else fastest), entry


def cached_weights(dtype: torch.dtype, config, kinds: tuple[str, ...]) -> str | None:
    """auto_weights' choice for a model of `config` at `dtype` among `kinds` on this CPU, where
    it was timed before: the loader can then load that kind alone, not the float model first
    (a 1.5B model's float32 copy takes most of a minute to build)."""
    hit = _read_cache().get(_weights_key(dtype, config, kinds))
    return hit.get("choice") if isinstance(hit, dict) else None


def _weights_key(dtype: torch.dtype, config, kinds: tuple[str, ...]) -> str:
    c = config
    shape = (c.dim, c.intermediate_size, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size)
    return _key(dtype, shape, kinds)


def auto_float_dtype(source: Path, load: Callable[[torch.dtype], Any]) -> tuple[Any, dict]:
    """The faster of `load(torch.bfloat16)` and `load(torch.float32)` on this CPU, by a timed
    decode step, once per CPU and model file (then only the one kept is loaded). On AMX,
    oneDNN's bf16 tiles read half the bytes, but the core's float32 products (kernels' float.rs)
    reach the memory's rate where oneDNN's skinny products do not, so which wins depends on
    the model (docs/benchmarks.md §12, the Xeon). A float32 copy that would take over half the
    memory left is not tried."""
    try:
        stat = source.stat()
    except OSError:  # the loader says what is wrong with the path
        return load(torch.bfloat16), {"dtype": "bfloat16", "reason": "no such file"}
    key = _key("dtype", source.resolve(), stat.st_size, stat.st_mtime_ns)
    hit = _read_cache().get(key)
    if isinstance(hit, dict) and hit.get("choice") in ("bfloat16", "float32"):
        timings = {k: v for k, v in hit.items() if k != "choice"}
        return load(getattr(torch, hit["choice"])), {"dtype": hit["choice"], **timings}
    model = load(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    if n < AUTO_MIN_WEIGHTS:
        return model, {"dtype": "bfloat16", "reason": f"under {AUTO_MIN_WEIGHTS} weights"}
    if 4 * n > available_memory() / 2:
        return model, {"dtype": "bfloat16", "reason": "no room for a float32 copy"}
    loaders = {"bfloat16": lambda: model, "float32": lambda: load(torch.float32)}
    choice, fastest, entry = _fastest(key, loaders)
    return fastest, {"dtype": choice, **entry}


def available_memory() -> int:
    """Bytes of memory free for use now (Linux's MemAvailable; elsewhere: unbounded)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _read_cache() -> dict:
    try:
        cache = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _fastest(key: str, loaders: dict[str, Callable[[], Any]]) -> tuple[str, Any, dict]:
    """(name, its model or None where read from the cache, timings) of the candidate whose decode
    step is fastest: read from the cache by `key`, else each loaded and timed in turn."""
    cache = _read_cache()
    hit = cache.get(key)
    if isinstance(hit, dict) and hit.get("choice") in loaders:
        return hit["choice"], None, {k: v for k, v in hit.items() if k != "choice"}
    models, entry = {}, {}
    with torch.inference_mode():
        for name, load in loaders.items():
            models[name] = load()
            entry[f"{name}_ms"] = _step_seconds(models[name]) * 1e3
    choice = min(models, key=lambda name: entry[f"{name}_ms"])
    cache[key] = {"choice": choice, **entry}
    path = _cache_path()
    try:  # best effort: an unwritable cache only means timing again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return choice, models[choice], entry
