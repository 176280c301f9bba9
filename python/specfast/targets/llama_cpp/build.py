"""Is this llama.cpp build for this CPU?

pip caches the llama-cpp-python wheel it compiled (-march=native) by sdist, not by CPU. Reused
on a CPU without the build's instruction sets it imports fine and then dies with SIGILL, a
crash that no `except` catches, at the first matrix product. These helpers turn that into a
RuntimeError that says what is missing and how to fix it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import platform
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from specfast import _core
from specfast.hardware import proc_cpu_flags
from specfast.targets.base import default_model_path

LLAMA_PIN = "llama-cpp-python==0.3.36"
_FIX = (
    "reinstall llama-cpp-python for this CPU: `bash scripts/install.sh` in a specfast checkout, "
    f"or `pip install --no-cache-dir --force-reinstall {LLAMA_PIN}`"
)
# llama.cpp's names for the x86 instruction sets compiled in (ggml_backend_cpu_get_features) ->
# the /proc/cpuinfo flags each needs. The kernel spells SSE3 "pni" and AVX512_VBMI "avx512vbmi".
BUILD_FLAGS = {
    "SSE3": ("pni",),
    "SSSE3": ("ssse3",),
    "AVX": ("avx",),
    "AVX2": ("avx2",),
    "AVX_VNNI": ("avx_vnni",),
    "F16C": ("f16c",),
    "FMA": ("fma",),
    "BMI2": ("bmi2",),
    "AVX512": ("avx512f",),
    "AVX512_VBMI": ("avx512vbmi",),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
    "AMX_INT8": ("amx_tile", "amx_int8"),
}
# The child that reads the build report. Not this process: the report is compile-time macros,
# but reading it registers ggml's CPU backend, and ggml_cpu_init runs the build's own code. In
# a -march=native AVX-512 build, llama_print_system_info() executes zmm loads and stores inside
# ggml_cpu_init (`python benches/llama_isa_trace.py`, under gdb), so on an AVX2-only CPU the
# report itself dies with SIGILL. `import llama_cpp` alone executes none.
#
# An AMX build can report the right instruction sets and still die: GCC 12 drops the stores that
# fill llama.cpp's AMX tile configuration unless built with -fno-dse (scripts/install.sh adds it),
# and its first batched pass (tile instructions; one-token passes use AVX512-VNNI) is SIGILL. So
# when the report names AMX_INT8, the child also runs one 40-token pass over the GGUF given as its
# argument (the default SmolLM2, about 0.3 s), when there is one.
_PROBE = """import sys, llama_cpp
info = llama_cpp.llama_print_system_info().decode()
sys.stdout.write(info)
sys.stdout.flush()
if "AMX_INT8 = 1" in info and len(sys.argv) > 1:
    llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False).eval(list(range(100, 140)))
"""
_AMX_FIX = (
    "reinstall llama-cpp-python: `bash scripts/install.sh` in a specfast checkout, or "
    '`CMAKE_ARGS="-DCMAKE_C_FLAGS=-fno-dse -DCMAKE_CXX_FLAGS=-fno-dse" '
    f"pip install --no-cache-dir --force-reinstall {LLAMA_PIN}`"
)


def read_cpu_flags() -> frozenset[str] | None:
    """The flags of /proc/cpuinfo on Linux x86-64; None elsewhere (nothing to check)."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return proc_cpu_flags()


def build_instructions(system_info: str) -> list[str]:
    """The x86 instruction sets a llama_print_system_info() string reports as compiled in."""
    return [n for n in re.findall(r"(\w+) = 1\b", system_info) if n in BUILD_FLAGS]


def llama_system_info() -> str | None:
    """llama_print_system_info() of the installed llama_cpp, read in a child process.

    For a build with AMX the child also runs one batched pass (see _PROBE). None when llama_cpp
    is not installed or the child failed without crashing (with a warning).
    Raises RuntimeError when the child was killed by a signal: the build crashed on this CPU.
    """
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    # The child imports the very package this process would, wherever it came from.
    where = str(Path(spec.origin).parent.parent)
    code = f"import sys; sys.path.insert(0, {where!r}); {_PROBE}"
    try:
        gguf = [str(default_model_path())]
    except FileNotFoundError:
        gguf = []
    try:
        run = subprocess.run(
            [sys.executable, "-c", code, *gguf], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(
            f"could not check the llama.cpp build for this CPU: {e}", RuntimeWarning, stacklevel=2
        )
        return None
    if run.returncode < 0:
        try:
            name = signal.Signals(-run.returncode).name
        except ValueError:
            name = f"signal {-run.returncode}"
        if "AMX_INT8 = 1" in run.stdout:  # the report was read: the AMX pass crashed
            raise RuntimeError(
                f"llama-cpp-python at {Path(spec.origin).parent}: its AMX kernels killed a child "
                f"process with {name} on a 40-token pass over {gguf[0]}, and a batched pass "
                "would crash this process the same way (GCC 12 drops their tile configuration "
                f"unless llama.cpp is built with -fno-dse); {_AMX_FIX}"
            )
        raise RuntimeError(
            f"llama-cpp-python at {Path(spec.origin).parent} was built for another CPU: "
            f"reading its build report killed a child process with {name} (an instruction this "
            f"CPU lacks), and a model would crash this process the same way; {_FIX}"
        )
    if run.returncode != 0:
        tail = run.stderr.strip().splitlines()[-1:] or ["no output"]
        warnings.warn(
            f"could not check the llama.cpp build for this CPU: {tail[0]}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return run.stdout


def check_llama_build(
    system_info: str | None = None, cpu_flags: set[str] | frozenset[str] | None = None
) -> None:
    """Raises RuntimeError when llama.cpp was compiled for instructions this CPU lacks.

    With no arguments: the installed llama_cpp's build report against /proc/cpuinfo, checked
    once per process; a no-op off Linux x86-64. The report names only the instruction sets ggml
    asks about, so a build that uses others (-march=native may emit AVX512-FP16, say) can still
    pass here; installs through scripts/install.sh, whose wheel cache is keyed by the CPU's
    flags, are covered for those too.
    """
    if isinstance(cpu_flags, str) or isinstance(system_info, bytes):
        raise TypeError(
            "check_llama_build takes system_info as str (llama_print_system_info().decode()) "
            "and cpu_flags as a set of /proc/cpuinfo flag names"
        )
    if system_info is None and cpu_flags is None:
        problem = _this_build_problem()
    else:
        flags = read_cpu_flags() if cpu_flags is None else cpu_flags
        info = llama_system_info() if system_info is None else system_info
        problem = None if flags is None or info is None else _build_problem(info, flags)
    if problem is not None:
        raise RuntimeError(problem)


def _this_build_problem() -> str | None:
    return _this_build()[1]


@functools.cache
def _this_build() -> tuple[str | None, str | None]:
    """(the installed llama_cpp's build report, the problem with it on this CPU), read once."""
    flags = read_cpu_flags()
    if flags is None:
        return None, None
    try:
        info = llama_system_info()
    except RuntimeError as e:
        return None, str(e)
    return info, None if info is None else _build_problem(info, flags)


@functools.cache
def tile_restorer() -> Callable[[int], None] | None:
    """restore(n_threads), which reloads ggml's AMX tile configuration on this thread and on the
    OpenMP threads of a team of n_threads; None for a llama.cpp built without AMX kernels.

    ggml loads the configuration once per thread; torch's oneDNN releases the tiles after each
    bf16 matrix product, on the same OpenMP threads (crates/kernels/src/tiles.rs). Without this,
    a llama_decode after a torch bf16 matmul in the same process dies with SIGILL. Costs
    microseconds a call.
    """
    info = _this_build()[0]
    if info is None or "AMX_INT8 = 1" not in info or not _core.amx_usable():
        return None
    restore = ctypes.c_void_p(_core.ggml_tile_restorer())
    if "OPENMP = 1" not in info:  # ggml's own thread pool: only the calling thread is shared
        on_this_thread = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(restore.value or 0)
        return lambda n_threads: on_this_thread(None)
    # The libgomp that libggml-cpu and torch share: the first libgomp.so.1 loaded.
    gomp_parallel = ctypes.CDLL("libgomp.so.1").GOMP_parallel
    gomp_parallel.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
    gomp_parallel.restype = None
    return lambda n_threads: gomp_parallel(restore, None, max(1, n_threads), 0)


def llama_threads(llama) -> int:
    """The most threads a llama_decode of this Llama runs on."""
    return max(int(llama.n_threads), int(llama.n_threads_batch))


def _build_problem(system_info: str, flags: set[str] | frozenset[str]) -> str | None:
    """The error message for a build that needs flags missing from `flags`, else None."""
    missing = {}
    for name in build_instructions(system_info):
        lacks = [f for f in BUILD_FLAGS[name] if f not in flags]
        if lacks:
            missing[name] = lacks
    if not missing:
        return None
    needs = ", ".join(f"{n} ({' '.join(f)})" for n, f in missing.items())
    return (
        f"llama-cpp-python was compiled for instruction sets this CPU lacks: {needs}. "
        "Using it would crash the process (SIGILL) at the first matrix product; " + _FIX
    )
