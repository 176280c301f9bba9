"""EAGLE-3: the target's aux features, the head's loader, and exact drafting with it."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_transformers

from specfast.model import Model, ModelConfig, default_aux_layers

# ----------------------------------------------------------------------------
# the target's aux features


def hf_llama(n_layers: int = 5, seed: int = 0):
    """A tiny transformers Llama with weights large enough that layers differ visibly."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    pytest.importorskip("transformers")
    import specfast

    hf = hf_llama()
    path = tmp_path_factory.mktemp("hf5")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, specfast.load_model(path, dtype="float32")


def hf_layer_inputs(hf, ids: torch.Tensor) -> list[torch.Tensor]:
    """transformers' hidden_states[i] for i < L: the input of decoder layer i (i = 0: the
    embeddings). Its last entry is after the final norm, so it is left out."""
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states[: hf.config.num_hidden_layers]]


@needs_transformers
def test_features_are_the_inputs_of_the_given_layers(hf_and_ours):
    hf, ours = hf_and_ours
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(0))
    want = hf_layer_inputs(hf, ids)
    layers = (3, 0, 4)  # any order, as given
    logits, feats = ours.decoder(64).forward(ids, features=layers)
    assert feats.shape == (12, 3 * 64)
    for j, i in enumerate(layers):
        torch.testing.assert_close(feats[:, 64 * j : 64 * (j + 1)], want[i], atol=1e-4, rtol=1e-4)
    # The same pass: its logits are the plain forward's.
    torch.testing.assert_close(logits, ours.decoder(64).forward(ids), atol=0, rtol=0)
    # Negative control: one layer off (the output of layer i instead of its input) differs.
    for j, i in enumerate(layers[:2]):
        off = feats[:, 64 * j : 64 * (j + 1)]
        assert (off - want[i + 1]).abs().max() > 1e-2


@needs_transformers
def test_features_of_cached_steps_equal_one_full_pass(hf_and_ours):
    """Prefill with last_only, then greedy verify steps and a rollback: each row's features are
    those a single pass over the whole sequence gives at that position."""
    _, ours = hf_and_ours
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1))
    full = ours.decoder(64).forward(ids, features=True)[1]
    dec = ours.decoder(64)
    logits, f0 = dec.forward(ids[:8], last_only=True, features=True)
    assert logits.shape == (1, 300) and f0.shape == (8, 3 * 64)  # every row's features
    top, f1 = dec.forward_greedy(ids[8:13], features=True)
    assert top.shape == (5,)
    dec.rollback(10)  # rows 10..12 rejected: the next pass overwrites them
    _, f2 = dec.forward_greedy(ids[10:20], features=True)
    torch.testing.assert_close(torch.cat([f0, f1[:2], f2]), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f1[4], full[12], atol=1e-5, rtol=1e-5)  # rolled back, same row
    # Negative control: the features of the row before (a position off) differ.
    assert (f2[1:] - full[10:19]).abs().max() > 1e-2


def test_features_argument_is_checked(tiny_model):
    dec = tiny_model.decoder(32)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        dec.forward(ids, features=(0, 2))
    with pytest.raises(ValueError, match="in"):
        dec.forward(ids, features=True)  # default (2, 1, -1) does not fit a 2-layer model
    with pytest.raises(TypeError, match="sequence of layer ids"):
        dec.forward(ids, features="all")
    assert dec.length == 0  # nothing ran
    assert default_aux_layers(30) == (2, 15, 27)
    out = dec.forward(ids)
    assert isinstance(out, torch.Tensor)  # no features asked: plain logits, as before


def test_compiled_decoder_gives_features_through_the_eager_pass(tiny_model):
    model = Model.from_config(tiny_model.config, seed=0).compile_steps(backend="eager")
    ids = torch.tensor([5, 6, 7, 8])
    want_logits, want = tiny_model.decoder(32).forward(ids, features=(1, 0))
    dec = model.decoder(32)
    top, feats = dec.forward_greedy(ids, features=(1, 0))
    torch.testing.assert_close(feats, want)
    assert torch.equal(top, want_logits.argmax(-1))


_ = ModelConfig  # used by later sections
