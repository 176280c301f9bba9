#!/usr/bin/env bash
# One prepared check for a CUDA machine with no network (the tree that travels there is at most
# 64 MiB, so no model file goes along). Run from the repository root:
#
#   OUT=/tmp/gpu bash scripts/gpu_check.sh      # figures land in $OUT (default: bench-results/gpu)
#
# 1. builds and installs specfast if it is not importable (needs maturin + Rust there);
# 2. runs the `cuda`-marked tests (compiled step exactness and no host sync on CUDA);
# 3. times plain and verify passes, eager against compiled (CUDA graphs), on random-weight
#    models of real shapes (SmolLM2-135M, Qwen2.5-1.5B) in bf16, against the HBM bound
#    (weight bytes / half the measured copy rate), with torch.cuda.set_sync_debug_mode("error")
#    around the compiled steps.
# Everything is bounded by `timeout` so the whole script ends well inside 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench-results/gpu}"
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$OUT/inductor-cache}"
python3 -c "import specfast" 2>/dev/null || \
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv >"$OUT/gpu.csv" 2>&1
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.txt" | tail -5
timeout 270 python3 benches/bench_runtime.py --device cuda --dtype bfloat16 \
    --shapes smollm2-135m qwen2.5-1.5b --compile --repeats 20 --json "$OUT/runtime.json" \
    2>&1 | tee "$OUT/runtime.txt"
echo "figures: $OUT/runtime.json $OUT/cuda_tests.txt"
