"""scripts/gpu_eagle.sh rehearsed on this CPU (DEVICE=cpu QUICK=1) on a tiny GGUF: every stage
runs, the head and its figures land in OUT, and the held-out comparison is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_eagle.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
]


def test_rehearsal_trains_a_head_and_measures_it(tmp_path):
    pytest.importorskip("transformers")
    from conftest import tiny_llama_gguf

    gguf = tiny_llama_gguf(tmp_path / "t.gguf", max_positions=512)
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "MODEL": str(gguf), "OUT": str(out)}
    env |= {"CORPUS_TOKENS": "400", "STEPS": "4", "DOCS_PER_STEP": "2", "DRAFT_VOCAB": "64"}
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for f in ("config.json", "model.safetensors", "training.json", "TRAINING.md", "train.log"):
        assert (out / f).is_file(), f
    held_out = json.loads((out / "heldout.json").read_text())
    assert set(held_out) == {"new"}  # the shipped head is SmolLM2's: another vocabulary
    assert set(held_out["new"]) == {"open", "complete"}
    assert all(t >= 1.0 for by_k in held_out["new"].values() for t in by_k.values())
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 320
