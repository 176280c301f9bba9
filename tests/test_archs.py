"""Architectures beyond Llama and Qwen2, each against transformers on a tiny random model made
in the test: logits from an HF folder and from a GGUF, through every way a pass runs (the core,
torch's eager layers), each with a negative control that drops what the architecture adds."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_model, needs_transformers, write_tiny_gguf

import specfast

pytestmark = needs_transformers

IDS = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(11))


def reference(hf_model, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None]).logits[0].float()


def passes(model, ids) -> torch.Tensor:
    """Logits of a prefill, a one-token step and a verify pass over the rest."""
    dec = model.decoder(64)
    return torch.cat([dec.forward(ids[:25]), dec.forward(ids[25:26]), dec.forward(ids[26:])])


def load(kind, tmp_path, source):
    hf_model = make_hf_model(kind)
    if source == "gguf":
        path = write_tiny_gguf(hf_model, tmp_path / "tiny.gguf")
    else:
        hf_model.save_pretrained(tmp_path, safe_serialization=True)
        path = tmp_path
    return hf_model, specfast.load_model(path, dtype="float32")


def through(model, way: str):
    """The model set to run its passes `way`: "core" (one call into the Rust core) or "eager"
    (torch's layers)."""
    model.prepack = way == "core"
    model.unpack()
    assert model.in_core == (way == "core")
    return model


# ----------------------------------------------------------------------------
# Qwen3: an RMSNorm on every query and key head before RoPE, heads wider than dim / heads


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("way", ["core", "eager"])
def test_qwen3_matches_transformers(tmp_path, source, way):
    hf_model, model = load("qwen3", tmp_path, source)
    assert model.config.qk_norm and model.config.head_dim == 24
    torch.testing.assert_close(
        passes(through(model, way), IDS), reference(hf_model, IDS), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("way", ["core", "eager"])
def test_negative_control_qwen3_without_its_qk_norm_is_caught(tmp_path, way):
    hf_model, model = load("qwen3", tmp_path, "hf")
    model.config.qk_norm = False  # the bug: the per-head norms skipped
    out, ref = passes(through(model, way), IDS), reference(hf_model, IDS)
    assert not torch.allclose(out, ref, atol=1e-2, rtol=1e-2)


def test_qwen3_speculative_greedy_is_plain_greedy(tmp_path):
    _, model = load("qwen3", tmp_path, "hf")
    prompt = IDS[:12].tolist() * 3  # repeats: the n-gram drafts
    plain = specfast.generate(model, prompt, max_new_tokens=24, drafter=None, ignore_eos=True)
    for k in (1, 4, "auto"):
        out = specfast.generate(
            model, prompt, max_new_tokens=24, num_speculative_tokens=k, ignore_eos=True
        )
        assert out.token_ids == plain.token_ids
