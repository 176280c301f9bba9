"""The core gives the same bits on every SIMD build: whole passes (prefill, a one-token step, a
verify pass) of tiny Llama, Qwen3 and Gemma 3 models with float32, int8 and q4 weights (and a
GGUF of Q4_0 matrices, which q4 keeps as they are), run in subprocesses capped at the AVX2 and
at the portable build (`SPECFAST_SIMD`), equal this process's build (AVX-512 where the CPU has
it) bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import make_hf_model, needs_transformers, write_tiny_gguf

from specfast._core import int8_kernel

pytestmark = [needs_transformers, pytest.mark.slow]

KINDS = ["llama-tied-gqa", "qwen3", "gemma3"]

SCRIPT = """
import sys, numpy as np, torch, specfast
from specfast._core import int8_kernel
folder, out = sys.argv[1], sys.argv[2]
ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(5))
logits = {}
def passes(model):
    assert model.in_core
    dec = model.decoder(64)
    parts = [dec.forward(ids[:25]), dec.forward(ids[25:26]), dec.forward(ids[26:])]
    return torch.cat(parts).numpy()
for kind in __KINDS__:
    for weights in ("float", "int8", "q4"):
        model = specfast.load_model(f"{folder}/{kind}", dtype="float32")
        if weights != "float":
            model.quantize_int8(weights)
        logits[f"{kind}/{weights}"] = passes(model)
q4_0 = specfast.load_model(f"{folder}/q4_0.gguf", weights="q4")
assert q4_0.packed_weights()[0][0].parts()[2] is None  # Q4_0, as the file
logits["q4_0"] = passes(q4_0)
np.savez(out, kernel=int8_kernel(), **logits)
""".replace("__KINDS__", repr(KINDS))


def run(folder: Path, cap: str | None, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SPECFAST_SIMD"}
    if cap:
        env["SPECFAST_SIMD"] = cap
    subprocess.run([sys.executable, "-c", SCRIPT, str(folder), str(out)], check=True, env=env)
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.skipif(int8_kernel() == "scalar", reason="a CPU without AVX2 has one build")
def test_every_simd_build_gives_the_same_bits(tmp_path):
    for i, kind in enumerate(KINDS):
        make_hf_model(kind, seed=i).save_pretrained(tmp_path / kind, safe_serialization=True)
    from gguf import GGMLQuantizationType

    write_tiny_gguf(make_hf_model("qwen3"), tmp_path / "q4_0.gguf", GGMLQuantizationType.Q4_0)
    best = run(tmp_path, None, tmp_path / "best.npz")
    assert str(best.pop("kernel")) == int8_kernel()
    for cap, kernel in (("avx2", "avx2"), ("portable", "scalar")):
        got = run(tmp_path, cap, tmp_path / f"{cap}.npz")
        # The control: the cap reached the core, so these passes ran another build.
        assert str(got.pop("kernel")) == kernel
        assert got.keys() == best.keys()
        for name, want in best.items():
            assert np.isfinite(want).all()
            np.testing.assert_array_equal(got[name], want, err_msg=f"{cap}: {name}")
