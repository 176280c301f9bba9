"""The runtime against transformers on tiny random models, and the transformers adapter."""

import pytest
import torch
from conftest import make_hf_model

import specfast
from specfast import HFDecoder, make_decoder

pytest.importorskip("transformers")


def hf_full(model, ids):
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


IDS = torch.randint(0, 320, (48,), generator=torch.Generator().manual_seed(7))


def test_hf_folder_logits_match_transformers(hf_tiny):
    hf_model, folder, kind = hf_tiny
    model = specfast.load_model(folder, dtype="float32")
    assert model.config.tie_embeddings == (model.lm_head is None)
    assert model.config.attn_bias == (kind == "qwen2-bias")
    ref = hf_full(hf_model, IDS)
    dec = model.decoder(64)
    out = torch.cat([dec.forward(IDS[:30]), dec.forward(IDS[30:31]), dec.forward(IDS[31:])])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_hf_folder_bfloat16(hf_tiny):
    hf_model, folder, kind = hf_tiny
    model = specfast.load_model(folder, dtype=torch.bfloat16)
    ref = hf_full(hf_model, IDS)
    out = model.decoder(64).forward(IDS)
    assert out.dtype == torch.float32
    # bf16 may be off by 5 % of the largest logit, or, where transformers' own bf16 pass is
    # off by more (the tiny Gemma 3: its six post-normed layers compound the rounding), by
    # half as much again as that.
    theirs = (hf_full(make_hf_model(kind).to(torch.bfloat16), IDS) - ref).abs().max()
    assert (out - ref).abs().max() < max(0.05 * ref.abs().max(), 1.5 * theirs)


def test_hf_decoder_matches_full_forward_with_rollback(hf_tiny):
    hf_model, _, _ = hf_tiny
    ref = hf_full(hf_model, IDS)
    dec = make_decoder(hf_model, 64)
    assert isinstance(dec, HFDecoder)
    dec.forward(IDS[:20])
    dec.forward(IDS[:7])  # a rejected draft
    dec.rollback(20)
    out = torch.cat([dec.forward(IDS[20:21]), dec.forward(IDS[21:40])])
    torch.testing.assert_close(out, ref[20:40], atol=1e-4, rtol=1e-4)
    dec.rollback(10)
    torch.testing.assert_close(dec.forward(IDS[10:12]), ref[10:12], atol=1e-4, rtol=1e-4)
    assert dec.length == 12


def test_hf_decoders_are_independent():
    from conftest import make_hf_model

    hf_model = make_hf_model("llama-tied-gqa")
    ref = hf_full(hf_model, IDS)
    a, b = HFDecoder(hf_model, 64), HFDecoder(hf_model, 64)
    a.forward(IDS[:10])
    b.forward(IDS[30:45])
    torch.testing.assert_close(a.forward(IDS[10:20]), ref[10:20], atol=1e-4, rtol=1e-4)


def test_hf_decoder_bad_input():
    from conftest import make_hf_model

    dec = HFDecoder(make_hf_model("qwen2-bias"), 16)
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        dec.forward(torch.tensor([320]))
    with pytest.raises(TypeError):
        dec.forward(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="non-empty"):
        dec.forward(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="max_length"):
        dec.forward(torch.zeros(17, dtype=torch.long))
    with pytest.raises(ValueError, match="context"):
        HFDecoder(dec.model, 10_000)
    with pytest.raises(ValueError):
        dec.rollback(1)
    assert dec.length == 0


def test_make_decoder_dispatch(tiny_model):
    assert isinstance(make_decoder(tiny_model, 8), specfast.ModelDecoder)
    with pytest.raises(TypeError, match="specfast Model"):
        make_decoder(object(), 8)
