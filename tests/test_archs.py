"""Architectures beyond Llama and Qwen2, each against transformers on a tiny random model made
in the test: logits from an HF folder and from a GGUF, through both ways a float32 pass runs on
CPU (the core, torch's eager layers), each with a negative control that drops what the
architecture adds."""

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


def load(kind, tmp_path, source, **overrides):
    hf_model = make_hf_model(kind, **overrides)
    if source == "gguf":
        path = write_tiny_gguf(hf_model, tmp_path / "tiny.gguf")
    else:
        hf_model.save_pretrained(tmp_path, safe_serialization=True)
        path = tmp_path
    return hf_model, specfast.load_model(path, dtype="float32")


def through(model, way: str):
    """The model set to run its passes `way`: "core" (one call into the Rust core) or
    "eager-plain" (torch's layers on the plain weights)."""
    model.prepack = way != "eager-plain"
    model.unpack()
    assert model.in_core == (way == "core")
    return model


# ----------------------------------------------------------------------------
# Qwen3: an RMSNorm on every query and key head before RoPE, heads wider than dim / heads


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("way", ["core", "eager-plain"])
def test_qwen3_matches_transformers(tmp_path, source, way):
    hf_model, model = load("qwen3", tmp_path, source)
    assert model.config.qk_norm and model.config.head_dim == 24
    torch.testing.assert_close(
        passes(through(model, way), IDS), reference(hf_model, IDS), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("way", ["core", "eager-plain"])
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


# ----------------------------------------------------------------------------
# Gemma 3 (text): the embedding scaled by sqrt(dim), RMSNorm with 1 + w, norms before and after
# attention and the MLP, GELU(tanh), q/k norms, sliding-window layers with their own RoPE base
# between global ones, the query scale from the config.

GEMMA_IDS = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(12))


@pytest.mark.parametrize("way", ["core", "eager-plain"])
def test_gemma3_matches_transformers(tmp_path, way):
    hf_model, model = load("gemma3", tmp_path, "hf")
    c = model.config
    assert c.sliding_layers == (0, 1, 2, 3, 4) and c.sliding_window == 8 and c.attn_scale
    # 40 tokens: past the window of 8, so the sliding layers' masks decide what is seen
    out = passes(through(model, way), GEMMA_IDS)
    torch.testing.assert_close(out, reference(hf_model, GEMMA_IDS), atol=1e-4, rtol=1e-4)


def test_gemma3_from_gguf_matches_transformers(tmp_path):
    # llama.cpp's GGUF has no query scale; it uses 1/sqrt(head_dim), as this model does
    hf_model, model = load("gemma3", tmp_path, "gguf", query_pre_attn_scalar=16)
    assert model.config.sliding_layers == (0, 1, 2, 3, 4) and model.config.attn_scale is None
    out = passes(through(model, "core"), GEMMA_IDS)
    torch.testing.assert_close(out, reference(hf_model, GEMMA_IDS), atol=1e-4, rtol=1e-4)


GEMMA_BUGS = {
    "no q/k norm": dict(qk_norm=False),
    "no post norms": dict(post_norms=False),
    "no window": dict(sliding_layers=()),
    "SiLU for GELU": dict(act="silu"),
    "one RoPE base": dict(rope_local_theta=1000000.0),
    "no embedding scale": dict(embed_scale=1.0),
    "default query scale": dict(attn_scale=None),
}


@pytest.mark.parametrize("way", ["core", "eager-plain"])
@pytest.mark.parametrize("bug", sorted(GEMMA_BUGS))
def test_negative_control_gemma3_without_each_of_its_parts_is_caught(tmp_path, bug, way):
    hf_model, model = load("gemma3", tmp_path, "hf")
    for name, value in GEMMA_BUGS[bug].items():
        setattr(model.config, name, value)
    model._rope_cache = {}
    out = passes(through(model, way), GEMMA_IDS)
    assert not torch.allclose(out, reference(hf_model, GEMMA_IDS), atol=1e-2, rtol=1e-2)


def test_gemma3_speculative_greedy_is_plain_greedy(tmp_path):
    _, model = load("gemma3", tmp_path, "hf")
    prompt = GEMMA_IDS[:10].tolist() * 3  # repeats, and runs past the window
    plain = specfast.generate(model, prompt, max_new_tokens=24, drafter=None, ignore_eos=True)
    for k in (1, 4, "auto"):
        out = specfast.generate(
            model, prompt, max_new_tokens=24, num_speculative_tokens=k, ignore_eos=True
        )
        assert out.token_ids == plain.token_ids


def test_gemma3_refuses_compiled_steps_clearly(tmp_path):
    _, model = load("gemma3", tmp_path, "hf")
    with pytest.raises(ValueError, match="eager steps only"):
        model.compile_steps()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_gemma3_quantized_weights(tmp_path, weights, dtype):
    """int8 and q4 matrices: in float32 the whole pass runs in the core; in bfloat16 torch runs
    the layers around the core's matrix products, attending row by row. int8 comes out close
    to the float model, with the sliding window applied (dropping it costs much more than
    quantizing), and speculative = plain."""
    hf_model, model = load("gemma3", tmp_path, "hf")
    ref = reference(hf_model, GEMMA_IDS)
    model.to(getattr(torch, dtype)).quantize_int8(weights)
    assert model.quantized and model.in_core == (dtype == "float32")

    def error():
        model.unpack()  # the core's stack again, from the config as it is now
        dec = model.decoder(64)  # one-row passes past the window
        out = torch.cat(
            [dec.forward(GEMMA_IDS[:8])] + [dec.forward(t[None]) for t in GEMMA_IDS[8:]]
        )
        return (out.float() - ref).abs().max().item()

    if weights == "int8":  # (q4 of a tiny random model is too coarse for this comparison)
        err = error()
        model.config.sliding_layers = ()  # the control: the window dropped
        assert err < 0.5 * error()
        model.config.sliding_layers = (0, 1, 2, 3, 4)
        model.unpack()
    prompt = GEMMA_IDS[:10].tolist() * 3
    plain = specfast.generate(model, prompt, max_new_tokens=24, drafter=None, ignore_eos=True)
    for k in (1, 4):
        out = specfast.generate(
            model, prompt, max_new_tokens=24, num_speculative_tokens=k, ignore_eos=True
        )
        assert out.token_ids == plain.token_ids
