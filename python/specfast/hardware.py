"""What the hardware is good at: the dtype "auto" picks, and the CPU flags every figure names.

Also `torch_threads`, torch's thread count for a block.

On a CPU without native bf16 (AVX2 only), torch emulates bf16 arithmetic, several times slower
than float32. And a float32 model's passes run in the core at the memory's rate (kernels' float.rs),
exact to themselves, which beat torch's bf16 (oneDNN) on AVX512-BF16 CPUs though it reads half
the bytes (docs/benchmarks.md §14). So "auto" starts from bf16 on a CPU only with AMX, whose
bf16 tiles oneDNN runs, and load_model then times it against float32 for the model at hand
(model/quantize.py: auto_float_dtype).
"""

from __future__ import annotations

import contextlib
from functools import cache
from pathlib import Path

import torch

# The CPU features that decide bf16 speed, and those figures name, in their order: bf16's and
# the int8 dot products the core's kernels run on (VNNI) or AMX could.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
SHOWN_FLAGS = ("avx2", "avx_vnni", "avx512_f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@cache
def cpu_features() -> dict[str, bool]:
    """{flag: present} for SHOWN_FLAGS, from torch's cpuinfo probe (else /proc/cpuinfo)."""
    probe = getattr(getattr(torch._C, "_cpu", None), "_get_cpu_capability", None)
    if probe is not None:
        try:
            caps = probe()
            return {f: bool(caps.get(f, False)) for f in SHOWN_FLAGS}
        except (RuntimeError, TypeError):
            pass
    flags: frozenset[str] = proc_cpu_flags() or frozenset()
    # /proc/cpuinfo spells avx512_f as avx512f
    return {f: f in flags or f.replace("_", "", 1) in flags for f in SHOWN_FLAGS}


@cache
def proc_cpu_flags() -> frozenset[str] | None:
    """The flags of /proc/cpuinfo (Linux x86-64); None where there is no such line."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16)."""
    feats = cpu_features()
    return any(feats.get(f, False) for f in BF16_FLAGS)


def cpu_flags_label() -> str:
    """The CPU flags that matter for speed, e.g. 'avx2 avx512_f avx512_vnni avx512_bf16'."""
    present = [f for f, on in cpu_features().items() if on]
    return " ".join(present) or "no avx2"


def cpu_has_amx_bf16() -> bool:
    """True when the CPU has AMX-BF16 tiles (Intel Sapphire Rapids and later)."""
    return cpu_features().get("amx_bf16", False)


def auto_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (fp16 where bf16 is unsupported); on CPU bf16 only with AMX-BF16 (where
    load_model times it against float32)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_amx_bf16() else torch.float32


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to n inside the block."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
