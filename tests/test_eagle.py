"""EAGLE-3: the target's aux features, the head's loader, and exact drafting with it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import needs_transformers
from test_cli import run_main, tiny_model_dir  # noqa: F401  (tiny_model_dir: a fixture)

from specfast.model import Model, ModelConfig
from specfast.targets.base import default_aux_layers

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


# ----------------------------------------------------------------------------
# heads for tests

TARGET = ModelConfig(
    vocab_size=300, dim=64, n_layers=5, n_heads=4, n_kv_heads=2, intermediate_size=96,
    max_context=256,
)  # fmt: skip
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3


def fit_head(target, head, seq: list[int], steps: int = 100, ttt: int = 3, lr: float = 1e-2):
    """Teaches `head` the target's greedy next tokens along `seq`, with EAGLE-3's training-time
    test through `EagleHead.forward` (step s reads step s-1's out_hidden at position t + s and
    sees step 0's keys causally plus its own chain's). A head that learns this way drafts
    well at inference only if the two views of the head agree."""
    ids = torch.tensor(seq)
    feats = target.decoder(len(seq)).forward(ids, features=head.aux_layers)[1].clone()
    labels = target.decoder(len(seq)).forward(ids).argmax(-1).clone()  # row t: token t + 1
    to_draft = torch.full((target.vocab_size,), -100)  # target id -> draft id (-100: none)
    to_draft[head.target_ids] = torch.arange(len(head.target_ids))
    labels = to_draft[labels]
    head.requires_grad_(True)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits (5x slower when busy)
    try:
        for _ in range(steps):
            _fit_step(head, opt, feats, ids, labels, ttt)
    finally:
        torch.set_num_threads(threads)
    return head.requires_grad_(False)


def _fit_step(head, opt, feats, ids, labels, ttt: int) -> None:
    T = len(ids) - 1
    pos = torch.arange(T)
    causal, eye = torch.ones(T, T, dtype=torch.bool).tril(), torch.eye(T, dtype=torch.bool)
    """One Adam step on the training-time-test loss (steps weighted 0.8^s)."""
    hidden, tokens, ks, vs, loss = head.fc(feats[:T]), ids[1:], [], [], 0.0
    for s in range(ttt):
        if s == 0:
            out, logits, k, v = head(hidden, tokens, pos)
        else:
            mask = torch.cat([causal] + [eye] * s, dim=1)  # (T, (s + 1) T)
            kp, vp = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
            out, logits, k, v = head(hidden, tokens, pos + s, kp, vp, mask)
        ks, vs = [*ks, k], [*vs, v]
        n = T - 1 - s  # row t at step s predicts token t + 2 + s = labels[t + 1 + s]
        loss = loss + 0.8**s * torch.nn.functional.cross_entropy(
            logits[:n], labels[1 + s : 1 + s + n]
        )
        # Step s + 1 at row t reads token t + 2 + s (the sequence's; padding past its end).
        tokens = torch.cat([ids[2 + s :], ids[-1:].repeat(s + 1)])[:T]
        hidden = out
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.fixture(scope="module")
def target() -> Model:
    return Model.from_config(TARGET, seed=0)


@pytest.fixture(scope="module")
def plain(target) -> list[int]:
    import specfast

    return specfast.generate(target, PROMPT, max_new_tokens=60, drafter=None).token_ids


@pytest.fixture(scope="module")
def fitted_head(target, plain):
    """A head of part of the vocabulary (200 of 300 ids, shuffled) that learned `plain`."""
    from specfast.drafters.eagle.head import EagleConfig, random_head

    config = EagleConfig.for_target(target, draft_vocab_size=200, aux_layers=(1, 2, 4))
    head = random_head(config, seed=1)
    head.bind_embedding(target.embed.weight)
    needed = sorted(set(PROMPT + plain))
    rest = [t for t in torch.randperm(300, generator=torch.Generator().manual_seed(2)).tolist()]
    vocab = (needed + [t for t in rest if t not in needed])[:200]
    head.set_draft_vocab(vocab[::-1])  # draft id order != target id order: d2t matters
    return fit_head(target, head, PROMPT + plain)


# ----------------------------------------------------------------------------
# greedy exactness


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_with_an_eagle_head_is_plain_greedy(target, plain, fitted_head, k):
    import specfast

    out = specfast.generate(
        target, PROMPT, max_new_tokens=60, drafter=fitted_head, num_speculative_tokens=k
    )
    assert out.token_ids == plain
    s = out.stats
    assert s.draft_tokens > 0
    if k != "auto":  # auto k weighs measured times, so how much it drafts varies with load
        assert s.mean_acceptance_length > 1.5  # the head drafts, and the drafts count


def test_a_head_over_an_int8_target_drafts_in_int8_and_stays_exact(fitted_head):
    """A target with int8 weights runs the head's products in the int8 kernel too (a float32
    head step cost a fifth of a q4 pass on an AVX2 CPU); the output stays its plain greedy."""
    import specfast
    from specfast.drafters.eagle import EagleDraft

    q = Model.from_config(TARGET, seed=0)  # the fixture target's weights
    q.quantize_int8("int8")
    want = specfast.generate(q, PROMPT, max_new_tokens=60, drafter=None).token_ids
    out = specfast.generate(
        q, PROMPT, max_new_tokens=60, drafter=fitted_head, num_speculative_tokens=4
    )
    assert out.token_ids == want and out.stats.draft_tokens > 0
    fast = EagleDraft(fitted_head, q, 4, 128).fast
    assert fast.int8 is not None
    assert EagleDraft(fitted_head, q, 4, 128).fast is fast  # made once for these weights
    float_target = Model.from_config(TARGET, seed=0)
    assert EagleDraft(fitted_head, float_target, 4, 128).fast.int8 is None
    head = copy.deepcopy(fitted_head)
    fast = EagleDraft(head, q, 4, 128).fast
    with torch.no_grad():
        head.lm_head.weight.mul_(2.0)  # new weights: a new copy
    assert EagleDraft(head, q, 4, 128).fast is not fast


def test_greedy_with_a_random_head_is_plain_greedy(target, plain):
    """Mostly rejected drafts, and a prompt that is not what any head saw."""
    import specfast
    from specfast.drafters.eagle.head import EagleConfig, random_head

    head = random_head(EagleConfig.for_target(target, draft_vocab_size=50), seed=3, scale=10)
    prompt = [7, 3, 250, 11, 4]
    want = specfast.generate(target, prompt, max_new_tokens=30, drafter=None).token_ids
    for k in (2, "auto"):
        out = specfast.generate(
            target, prompt, max_new_tokens=30, drafter=head, num_speculative_tokens=k
        )
        assert out.token_ids == want


def test_session_turns_with_an_eagle_head_equal_generate(target, fitted_head):
    """Two turns: the second prefills only its new tokens, and the head takes the features of
    those positions; both replies equal plain greedy over the whole context."""
    import specfast

    s = specfast.Session(target, drafter=fitted_head, num_speculative_tokens=4)
    first = s.send(PROMPT[:20], max_new_tokens=20)
    second = s.send([5, 6, 7], max_new_tokens=20)
    ctx = PROMPT[:20]
    want1 = specfast.generate(target, ctx, max_new_tokens=20, drafter=None).token_ids
    ctx = ctx + want1 + [5, 6, 7]
    want2 = specfast.generate(target, ctx, max_new_tokens=20, drafter=None).token_ids
    assert (first.token_ids, second.token_ids) == (want1, want2)


@pytest.mark.parametrize("k", [4, "auto"])
def test_eagle_plus_ngram_is_plain_greedy(target, plain, fitted_head, k):
    """CombinedDrafter(head): the n-gram drafts where the context repeats (the prompt is one
    phrase three times), the head elsewhere; its features catch up after n-gram rounds."""
    import specfast

    combined = specfast.CombinedDrafter(fitted_head, min_match=2)
    out = specfast.generate(
        target, PROMPT, max_new_tokens=60, drafter=combined, num_speculative_tokens=k
    )
    assert out.token_ids == plain
    assert out.stats.draft_tokens > 0


def test_a_long_catch_up_restarts_the_head_on_the_newest_rows(target, plain, fitted_head):
    """Past CATCH_UP pending rows the head starts over on the newest of them: each catch-up
    feeds at most that many, the output stays plain greedy, and the restarted head drafts what
    a fresh head given only those rows drafts."""
    import specfast
    import specfast.drafters.eagle.draft as eagle

    window, fed_rows = 5, []
    real_feed = eagle.EagleDraft._feed

    def feed(self, features):
        fed_rows.append(features.shape[0])
        return real_feed(self, features)

    mp = pytest.MonkeyPatch()
    mp.setattr(eagle, "CATCH_UP", window)
    mp.setattr(eagle.EagleDraft, "_feed", feed)
    try:
        out = specfast.generate(
            target, PROMPT, max_new_tokens=60, drafter=fitted_head, num_speculative_tokens=4
        )
        assert out.token_ids == plain and out.stats.draft_tokens > 0
        assert fed_rows[0] == window < len(PROMPT) and max(fed_rows) <= window

        layers = tuple(fitted_head.aux_layers)
        with torch.inference_mode():
            feats = target.decoder(128).forward(torch.tensor(PROMPT), features=layers)[1]

        def first_draft(ids, rows):
            d = eagle.EagleDraft(fitted_head, target, 4, 128)
            d.start_turn(0, {"temperature": 1.0})  # sampled: q, the head's whole output, shows
            d.extend(ids)
            d.prefill(rows)
            return d.propose(4).tokens, d.draft_probs

        with torch.inference_mode():
            # Features of positions [0, n - 1) for the whole prompt; the restart keeps the last
            # `window` of them, which a fresh drafter gets as a sequence of its own.
            long = first_draft(PROMPT, feats[:-1])
            short = first_draft(PROMPT[-window - 1 :], feats[-window - 1 : -1])
    finally:
        mp.undo()
    with torch.inference_mode():  # one row more, under the usual CATCH_UP: all of it is read
        off = first_draft(PROMPT[-window - 2 :], feats[-window - 2 : -1])
    assert long[0] == short[0] and len(long[0]) == 4
    torch.testing.assert_close(long[1], short[1], atol=0, rtol=0)
    # Negative control: a context one row longer drafts from another q, so the comparison
    # sees which rows the restarted head read.
    assert (off[1] - short[1]).abs().max() > 1e-4


def test_eagle_and_ngram_both_draft_with_a_fixed_k(target, fitted_head, monkeypatch):
    import specfast
    import specfast.drafters.eagle

    sources = []
    real = specfast.drafters.eagle.EagleDraft.draft

    def count(self, k):
        sources.append("head")
        return real(self, k)

    monkeypatch.setattr(specfast.drafters.eagle.EagleDraft, "draft", count)
    prompt = PROMPT[:12] + PROMPT[:12]  # repeats, then not
    want = specfast.generate(target, prompt, max_new_tokens=40, drafter=None).token_ids
    combined = specfast.CombinedDrafter(fitted_head, min_match=3)
    out = specfast.generate(
        target, prompt, max_new_tokens=40, drafter=combined, num_speculative_tokens=3
    )
    assert out.token_ids == want
    assert sources and len(sources) < out.stats.target_passes - 1  # some rounds were n-gram


# ----------------------------------------------------------------------------
# files: SpecForge's layout, round trip and bad files


def small_head(target, vd: int = 40, **kw):
    from specfast.drafters.eagle.head import EagleConfig, random_head

    head = random_head(EagleConfig.for_target(target, draft_vocab_size=vd, **kw), seed=5)
    head.set_draft_vocab(list(range(300 - vd, 300)))  # d2t = 300 - vd for every id
    return head


SPECFORGE_NAMES = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d",
}  # fmt: skip


def test_save_and_load_round_trip(target, tmp_path):
    import json

    from safetensors import safe_open

    import specfast
    from specfast.drafters.eagle.files import save_eagle

    head = small_head(target)
    save_eagle(head, tmp_path, dtype="float32")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == SPECFORGE_NAMES  # no embed_tokens: the target's is shared
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 2]
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (40, 64)
    loaded = specfast.load_eagle(tmp_path, target)
    for name, t in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert loaded.aux_layers == (2, 2, 2)  # default_aux_layers(5)
    # The loaded head drafts exactly as the one saved.
    runs = []
    for h in (head, loaded):
        out = specfast.generate(target, PROMPT, max_new_tokens=12, drafter=h, temperature=1.0,
                                seed=4, num_speculative_tokens=3)  # fmt: skip
        runs.append((out.token_ids, out.stats.accepted_tokens, out.stats.draft_tokens))
    assert runs[0] == runs[1]


def test_bf16_file_and_model_prefix_and_own_embedding(target, tmp_path):
    from safetensors.torch import load_file, save_file

    import specfast
    from specfast.drafters.eagle.files import save_eagle
    from specfast.drafters.eagle.head import EagleHead

    head = small_head(target)
    save_eagle(head, tmp_path, dtype="bfloat16")
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert sd["fc.weight"].dtype == torch.bfloat16
    # SpecForge checkpoints sometimes carry a "model." prefix, and their own embedding.
    sd = {f"model.{k}": v for k, v in sd.items()}
    sd["model.embed_tokens.weight"] = torch.randn(300, 64).bfloat16()
    save_file(sd, str(tmp_path / "model.safetensors"))
    loaded = specfast.load_eagle(tmp_path, target)
    assert isinstance(loaded, EagleHead)
    assert loaded.fc.weight.dtype == torch.float32  # the target's dtype
    assert loaded.embed_tokens is not None
    torch.testing.assert_close(loaded.embed_tokens.weight, sd["model.embed_tokens.weight"].float())
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight, atol=1e-2, rtol=1e-2)


def write_head(target, path, edit=None, config_edit=None):
    """A saved head with its tensors (and config) edited."""
    import json

    from safetensors.torch import load_file, save_file

    from specfast.drafters.eagle.files import save_eagle

    save_eagle(small_head(target), path, dtype="float32")
    sd = load_file(str(path / "model.safetensors"))
    if edit:
        edit(sd)
        save_file(sd, str(path / "model.safetensors"))
    if config_edit:
        config = json.loads((path / "config.json").read_text())
        config_edit(config)
        (path / "config.json").write_text(json.dumps(config))
    return path


def _set(d, k, v):
    d[k] = v


AUX_IDS = "eagle_aux_hidden_state_layer_ids"
BAD_FILES = {
    "missing tensor": (lambda sd: sd.pop("midlayer.mlp.up_proj.weight"), None,
                       "missing tensor 'midlayer.mlp.up_proj.weight'"),
    "wrong shape": (lambda sd: _set(sd, "fc.weight", torch.zeros(64, 100)), None,
                    r"'fc.weight' has shape \(64, 100\); this config needs \(64, 192\)"),
    "d2t out of range": (lambda sd: sd["d2t"].__setitem__(3, 10_000), None,
                         r"draft id 3 to target id 10003, outside .*\[0, 300\)"),
    "d2t negative": (lambda sd: sd["d2t"].__setitem__(0, -300), None, "outside"),
    "d2t duplicate": (lambda sd: sd["d2t"].__setitem__(1, sd["d2t"][0] - 1), None, "same target"),
    "t2d length": (lambda sd: _set(sd, "t2d", torch.ones(299, dtype=torch.bool)), None,
                   r"'t2d' has shape \(299,\); this config needs \(300,\)"),
    "t2d disagrees": (lambda sd: sd["t2d"].__setitem__(0, True), None, "does not mark exactly"),
    "float d2t": (lambda sd: _set(sd, "d2t", sd["d2t"].float()), None, "integer tensor"),
    "vocabulary": (None, lambda c: _set(c, "vocab_size", 301),
                   "vocabulary of 301 tokens; the target has 300"),
    "hidden size": (None, lambda c: _set(c, "target_hidden_size", 32),
                    "hidden size 32; the target's is 64"),
    "aux layers": (None, lambda c: _set(c, "eagle_config", {AUX_IDS: [1, 2, 5]}),
                   r"reads target layers \[1, 2, 5\]; the target has 5 layers"),
    "two layers": (None, lambda c: _set(c, "num_hidden_layers", 2), "num_hidden_layers must be 1"),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_files_raise_clear_errors(target, tmp_path, kind):
    import specfast

    edit, config_edit, message = BAD_FILES[kind]
    path = write_head(target, tmp_path, edit, config_edit)
    with pytest.raises(ValueError, match=message):
        specfast.load_eagle(path, target)


def test_pickle_is_refused_with_how_to_convert(tmp_path):
    import specfast

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match=r"pickle.*weights_only=True.*save_file"):
        specfast.load_eagle(tmp_path, None)
    with pytest.raises(FileNotFoundError, match="no EAGLE head"):
        specfast.load_eagle(tmp_path / "nowhere", None)
    (tmp_path / "pytorch_model.bin").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        specfast.load_eagle(tmp_path, None)


def test_default_aux_layers_and_targets_without_features(target, tmp_path):
    import specfast

    path = write_head(target, tmp_path, None, lambda c: c.pop("eagle_config"))
    assert specfast.load_eagle(path, target).aux_layers == (2, 2, 2)  # 2, 5 // 2, 5 - 3
    with pytest.raises(TypeError, match="specfast Model"):
        specfast.load_eagle(path, object())


@needs_transformers
def test_transformers_target_is_refused_with_a_reason(hf_and_ours):
    import specfast

    hf, ours = hf_and_ours
    head = small_head(ours)
    with pytest.raises(ValueError, match=r"specfast\.load_model"):
        specfast.generate(hf, [1, 2, 3], max_new_tokens=3, drafter=head)


def test_eagle_string_without_a_shipped_head_says_so(target, monkeypatch, tmp_path):
    import specfast
    import specfast.drafters.eagle

    monkeypatch.setattr(specfast.drafters.eagle.files, "DEFAULT_HEAD", tmp_path / "absent")
    with pytest.raises(ValueError, match="not there"):
        specfast.generate(target, [1, 2, 3], max_new_tokens=3, drafter="eagle")
    path = write_head(target, tmp_path / "h")
    out = specfast.generate(target, [1, 2, 3], max_new_tokens=3, drafter=f"eagle:{path}")
    assert len(out.token_ids) == 3


def test_cli_generate_and_bench_with_a_head(tiny_model_dir, tmp_path, capsys):  # noqa: F811
    import json

    import specfast
    from specfast.drafters.eagle.files import save_eagle
    from specfast.drafters.eagle.head import EagleConfig, random_head

    model = specfast.load_model(str(tiny_model_dir), dtype="float32")
    config = EagleConfig.for_target(model, draft_vocab_size=100, aux_layers=(0, 1, 1))
    head_dir = save_eagle(random_head(config, seed=0), tmp_path / "head", dtype="float32")
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "abcabcabc"]
    argv += ["--max-new-tokens", "8", "--dtype", "float32"]
    outputs = []
    for drafter in ("none", f"eagle:{head_dir}", f"ngram+eagle:{head_dir}"):
        rc, out, err = run_main([*argv, "--drafter", drafter], capsys)
        assert rc == 0, err
        outputs.append(out)
    assert outputs[1] == outputs[0] == outputs[2]  # the same text, whichever drafter
    out_dir = tmp_path / "bench"
    argv = ["bench", "--model", str(tiny_model_dir), "--workloads", "open", "--dtype", "float32"]
    argv += ["--engines", "specfast-plain,specfast-eagle,specfast-eagle+ngram"]
    argv += ["--eagle", str(head_dir), "--prompts-per-workload", "1", "--repeats", "1"]
    argv += ["--max-new-tokens", "8", "--out", str(out_dir)]
    rc, _, err = run_main(argv, capsys)
    assert rc == 0, err
    doc = json.loads((out_dir / "results.json").read_text())
    for engine in ("specfast-eagle", "specfast-eagle+ngram"):
        assert doc["summary"]["open"][engine]["identical"] == 1
    assert doc["meta"]["eagle"] == str(head_dir)


# ----------------------------------------------------------------------------
# SmolLM2 with the shipped head


@pytest.mark.smollm
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_smollm_greedy_with_the_shipped_head_is_plain_greedy(smollm, k):
    import specfast
    from specfast.drafters.eagle.files import DEFAULT_HEAD, WEIGHTS
    from specfast.generate import render_chat

    if not (DEFAULT_HEAD / WEIGHTS).is_file():
        pytest.skip(f"no shipped EAGLE head at {DEFAULT_HEAD} yet (the trainer delivers it)")
    head = specfast.load_eagle(None, smollm)
    question = "Why do leaves change colour in autumn? Answer in three sentences."
    text = render_chat([{"role": "user", "content": question}], smollm.chat_template)
    ids = smollm.tokenizer.encode(text).ids
    plain = specfast.generate(smollm, ids, max_new_tokens=40, drafter=None).token_ids
    out = specfast.generate(smollm, ids, max_new_tokens=40, drafter=head, num_speculative_tokens=k)
    assert out.token_ids == plain
    if k != "auto":  # auto k may judge the head not worth its cost here: wall-clock timings
        assert out.stats.accepted_tokens > 0  # the head drafted, and some drafts were right
    if k == "auto":  # "eagle" is the same head, loaded by name
        by_name = specfast.generate(smollm, ids, max_new_tokens=40, drafter="eagle")
        assert by_name.token_ids == plain
