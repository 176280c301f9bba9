"""Helpers for scripts/install.sh's llama-cpp-python wheel cache, keyed by the CPU.

pip caches the wheel it compiled (-march=native) under the sdist, so a wheel built on an
AVX-512 machine is reused on an AVX2-only one and dies there with SIGILL. install.sh keeps its
own wheels in ~/.cache/specfast/llama-wheels/<key>/, the key a hash of the CPU flags that change
what -march=native emits, plus the build's CMake arguments.

    python3 scripts/llama_wheel.py key [CMAKE_ARGS]   # prints the key ('' off Linux x86-64)
    python3 scripts/llama_wheel.py status WHEEL       # same | different | absent (installed)
    python3 scripts/llama_wheel.py find               # pip's cached wheel that is installed
    python3 scripts/llama_wheel.py check              # fits | other-cpu | unchecked (installed)
    python3 scripts/llama_wheel.py has-amx            # exit status 0 when the CPU has AMX-INT8

Only `check` imports specfast (and torch); the rest is the standard library, so the install's
no-op path stays fast.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

DIST = "llama-cpp-python"
# /proc/cpuinfo flags that change the code -march=native makes of ggml (instruction sets, not
# mitigations or hypervisor flags, which differ between VMs of one CPU model).
_KEY_FLAGS = (
    "pni ssse3 sse4_1 sse4_2 popcnt abm movbe aes pclmulqdq avx avx2 fma f16c bmi1 bmi2 adx "
    "sha_ni avx_vnni avx_vnni_int8 avx_ifma avx512f avx512cd avx512bw avx512dq avx512vl "
    "avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq "
    "avx512_bf16 avx512_fp16 gfni vaes vpclmulqdq amx_tile amx_int8 amx_bf16 amx_fp16"
)
KEY_FLAGS = frozenset(_KEY_FLAGS.split())


def cpu_flags() -> set[str] | None:
    """/proc/cpuinfo's flags on Linux x86-64, else None. specfast.hardware.proc_cpu_flags reads
    the same line; this copy keeps install.sh's no-op path free of torch's import."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def wheel_key(flags, build_args: str = "") -> str:
    """12 hex digits naming the CPU's build-relevant flags (any order) and the build args."""
    text = " ".join(sorted(set(flags) & KEY_FLAGS)) + "\n" + build_args.strip()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _library_hashes(record: str) -> set[str]:
    # RECORD lines of the compiled libraries: pip copies them verbatim, so their hashes match
    # between a wheel and its installation (scripts and RECORD itself are rewritten).
    return {line for line in record.splitlines() if ".so" in line.split(",")[0]}


def wheel_status(wheel: Path, installed_record: str | None) -> str:
    """'same' when the installed libraries are the wheel's, 'different', or 'absent'."""
    if installed_record is None:
        return "absent"
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        ours = _library_hashes(z.read(name).decode())
    return "same" if ours and ours == _library_hashes(installed_record) else "different"


def installed_record() -> str | None:
    try:
        return importlib.metadata.distribution(DIST).read_text("RECORD")
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else ""
    if cmd == "key":
        flags = cpu_flags()
        print("" if flags is None else wheel_key(flags, " ".join(argv[1:])))
    elif cmd == "status" and len(argv) == 2:
        print(wheel_status(Path(argv[1]), installed_record()))
    elif cmd == "find":
        # pip's cache may hold several builds; the one installed is the one that was checked.
        out = subprocess.run(
            [sys.executable, "-m", "pip", "cache", "list", "llama_cpp_python", "--format=abspath"],
            capture_output=True,
            text=True,
        ).stdout.split()
        record = installed_record()
        found = [w for w in out if w.endswith(".whl") and wheel_status(Path(w), record) == "same"]
        print(found[0] if found else "")
    elif cmd == "has-amx":
        return 0 if {"amx_tile", "amx_int8"} <= (cpu_flags() or set()) else 1
    elif cmd == "check":
        from specfast.targets.llama_cpp import check_llama_build

        # A report that could not be read (llama_cpp not importable, say) is no pass.
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            try:
                check_llama_build()
                print("fits")
            except RuntimeWarning as e:
                print(e, file=sys.stderr)
                print("unchecked")
            except RuntimeError as e:
                print(e, file=sys.stderr)
                print("other-cpu")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
