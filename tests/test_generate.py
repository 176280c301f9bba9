"""generate(): greedy exactness, bookkeeping, seeds and bad input, on tiny random models."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import specfast
from specfast.model import Model, ModelConfig

CONFIGS = {
    "llama-gqa-untied": ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2),
    "llama-mha-tied": ModelConfig(
        vocab_size=80, dim=48, n_layers=3, n_heads=4, n_kv_heads=4, tie_embeddings=True
    ),
    "qwen2-bias": ModelConfig(
        vocab_size=128, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, attn_bias=True, arch="qwen2"
    ),
}


def tiny(name: str = "llama-gqa-untied", seed: int = 0) -> Model:
    return Model.from_config(CONFIGS[name], seed=seed)


def prompt_for(model: Model, n: int = 24, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    # A prompt that repeats itself, so the n-gram drafter finds matches.
    part = [rng.randrange(model.vocab_size) for _ in range(n // 2)]
    return part + part


def plain(model, prompt, n, **kw) -> list[int]:
    return specfast.generate(model, prompt, max_new_tokens=n, drafter=None, **kw).token_ids


class OracleDrafter:
    """Proposes the true greedy continuation, corrupted now and then, so rounds accept long
    blocks, partial blocks and nothing, in a mix that the n-gram drafter rarely gives on random
    weights."""

    def __init__(self, prompt, truth, corrupt=0.3, vocab=2, seed=0, gap_every=0):
        self.seq: list[int] = []  # generate() feeds the prompt, then each committed block
        self.full = list(prompt) + list(truth)
        self.rng = random.Random(seed)
        self.corrupt, self.vocab, self.gap_every = corrupt, vocab, gap_every
        self.calls = 0
        self.lengths_at_propose: list[int] = []

    def extend(self, tokens):
        self.seq.extend(int(t) for t in tokens)

    def propose(self, k):
        self.calls += 1
        self.lengths_at_propose.append(len(self.seq))
        if self.gap_every and self.calls % self.gap_every == 0:
            return []
        out = self.full[len(self.seq) : len(self.seq) + k]
        return [
            (t + 1) % self.vocab if self.rng.random() < self.corrupt / max(k, 1) else t for t in out
        ]


# ----------------------------------------------------------------------------
# greedy exactness


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("k", [1, 2, 4, 8, 16, "auto"])
def test_ngram_greedy_equals_plain(name, k):
    model = tiny(name)
    prompt = prompt_for(model)
    want = plain(model, prompt, 40)
    out = specfast.generate(model, prompt, max_new_tokens=40, num_speculative_tokens=k)
    assert out.token_ids == want
    assert out.stats.new_tokens == 40


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_oracle_drafts_greedy_equals_plain(name, k):
    model = tiny(name, seed=1)
    prompt = prompt_for(model, seed=1)
    want = plain(model, prompt, 48)
    d = OracleDrafter(prompt, want, vocab=model.vocab_size, seed=k)
    out = specfast.generate(model, prompt, max_new_tokens=48, drafter=d, num_speculative_tokens=k)
    assert out.token_ids == want
    assert out.stats.accepted_tokens > 0  # the drafts were really used
    assert out.stats.target_passes < 48 or k == 1


def test_draft_model_greedy_equals_plain():
    target, draft = tiny("llama-gqa-untied", seed=0), tiny("llama-gqa-untied", seed=1)
    draft.tokenizer = target.tokenizer
    prompt = prompt_for(target)
    want = plain(target, prompt, 40)
    for k in (1, 3, 8, "auto"):
        out = specfast.generate(
            target, prompt, max_new_tokens=40, drafter=draft, num_speculative_tokens=k
        )
        assert out.token_ids == want


def test_an_int8_draft_changes_acceptance_not_output():
    target = tiny("llama-gqa-untied", seed=0)
    draft = tiny("llama-gqa-untied", seed=0).quantize_int8()  # the target's weights, in int8
    prompt = prompt_for(target)
    want = plain(target, prompt, 40)
    for k in (4, "auto"):
        out = specfast.generate(
            target, prompt, max_new_tokens=40, drafter=draft, num_speculative_tokens=k
        )
        assert out.token_ids == want
        assert out.stats.accepted_tokens > 0


def test_target_as_its_own_draft_accepts_everything():
    model = tiny()
    prompt = prompt_for(model)
    out = specfast.generate(
        model, prompt, max_new_tokens=31, drafter=model, num_speculative_tokens=4
    )
    assert out.token_ids == plain(model, prompt, 31)
    assert out.stats.accepted_tokens == out.stats.draft_tokens
    assert out.stats.mean_acceptance_length == 5.0


def test_vocabulary_mismatch_is_refused():
    target = tiny("llama-gqa-untied")
    draft = tiny("llama-mha-tied")
    with pytest.raises(ValueError, match="vocabulary"):
        specfast.generate(target, [1, 2, 3], max_new_tokens=4, drafter=draft)


# ----------------------------------------------------------------------------
# bookkeeping


class RecordingDecoder:
    """Wraps a decoder and records its length at every forward."""

    torch_threads, cold_passes = None, 0  # the Decoder protocol's hints

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    @property
    def length(self):
        return self.inner.length

    def forward(self, ids, last_only=False):
        self.log.append((self.inner.length, ids.shape[0]))
        return self.inner.forward(ids, last_only)

    def greedy_ids(self, tokens):
        self.log.append((self.inner.length, len(tokens)))
        return self.inner.greedy_ids(tokens)

    def rollback(self, n):
        self.inner.rollback(n)


def test_cache_length_equals_committed_every_round(monkeypatch):
    import importlib

    generate_module = importlib.import_module("specfast.generate")  # the module, not the function
    model = tiny()
    prompt = prompt_for(model)
    want = plain(model, prompt, 40)
    log: list[tuple[int, int]] = []
    real = generate_module.make_decoder
    monkeypatch.setattr(
        generate_module, "make_decoder", lambda m, n: RecordingDecoder(real(m, n), log)
    )
    d = OracleDrafter(prompt, want, vocab=model.vocab_size, gap_every=3)
    out = specfast.generate(model, prompt, max_new_tokens=40, drafter=d, num_speculative_tokens=6)
    assert out.token_ids == want
    # Round r starts with every committed token but the last in the cache.
    assert log[0] == (0, len(prompt))
    assert [length for length, _ in log[1:]] == [n - 1 for n in d.lengths_at_propose]
    assert any(n == 1 for _, n in log[1:]) and any(n > 1 for _, n in log[1:])


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 8, 13, 21])
def test_max_new_tokens_is_exact_mid_draft(limit):
    model = tiny()
    prompt = prompt_for(model)
    want = plain(model, prompt, 30)
    d = OracleDrafter(prompt, want, corrupt=0.0)
    out = specfast.generate(
        model, prompt, max_new_tokens=limit, drafter=d, num_speculative_tokens=8
    )
    assert out.token_ids == want[:limit]
    assert out.finish_reason == "length"


def test_eos_inside_accepted_block_truncates():
    model = tiny()
    prompt = prompt_for(model)
    want = plain(model, prompt, 30)
    eos = want[9]
    cut = want.index(eos) + 1
    d = OracleDrafter(prompt, want, corrupt=0.0)
    out = specfast.generate(
        model, prompt, max_new_tokens=30, drafter=d, num_speculative_tokens=16, eos_token_id=eos
    )
    assert out.token_ids == want[:cut]
    assert out.finish_reason == "eos"
    assert out.stats.accepted_tokens <= cut


class LetterTokenizer:
    """Token t decodes to one letter: enough to test stop strings without a real vocabulary."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)

    def encode(self, text):
        return [ord(c) - 97 for c in text]


def test_stop_string_inside_accepted_block_truncates():
    model = tiny()
    prompt = prompt_for(model)
    want = plain(model, prompt, 30)
    tok = LetterTokenizer()
    stop = tok.decode(want[10:13])
    text = tok.decode(want)
    cut = text.index(stop) + len(stop)  # one letter per token
    d = OracleDrafter(prompt, want, corrupt=0.0)
    out = specfast.generate(
        model,
        prompt,
        max_new_tokens=30,
        drafter=d,
        num_speculative_tokens=16,
        stop_strings=[stop],
        tokenizer=tok,
    )
    assert out.token_ids == want[:cut]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop_string"


def test_drafter_after_rejections_equals_one_rebuilt():
    model = tiny()
    prompt = prompt_for(model)
    d = specfast.NgramDrafter()
    out = specfast.generate(model, prompt, max_new_tokens=40, drafter=d, num_speculative_tokens=4)
    rebuilt = specfast.NgramDrafter()
    rebuilt.extend(prompt + out.token_ids)
    assert len(d) == len(rebuilt) == len(prompt) + 40
    for k in (1, 4, 16):
        assert d.propose(k) == rebuilt.propose(k)


def test_streamer_receives_every_committed_token():
    model = tiny()
    prompt = prompt_for(model)
    chunks: list[str] = []
    tok = LetterTokenizer()
    out = specfast.generate(model, prompt, max_new_tokens=25, streamer=chunks.append, tokenizer=tok)
    assert "".join(chunks) == out.text == tok.decode(out.token_ids)


def test_transformers_style_streamer_gets_prompt_then_tokens():
    model = tiny()
    prompt = prompt_for(model)

    class Streamer:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    s = Streamer()
    out = specfast.generate(model, prompt, max_new_tokens=20, streamer=s)
    assert s.puts[0] == prompt
    assert [t for put in s.puts[1:] for t in put] == out.token_ids and s.ended


def test_stats_add_up():
    model = tiny()
    prompt = prompt_for(model)
    out = specfast.generate(model, prompt, max_new_tokens=40, num_speculative_tokens=4)
    s = out.stats
    assert s.new_tokens == 40
    assert sum(s.acceptance_histogram) == s.target_passes - 1
    assert sum(i * n for i, n in enumerate(s.acceptance_histogram)) >= s.accepted_tokens
    # Every pass but the prefill commits 1 + accepted tokens (less where the limit cut a block).
    assert s.target_passes - 1 + s.accepted_tokens + 1 >= 40
    assert s.mean_acceptance_length == pytest.approx(1 + s.accepted_tokens / (s.target_passes - 1))


# ----------------------------------------------------------------------------
# sampling: seeds


def test_same_seed_same_output():
    model = tiny()
    prompt = prompt_for(model)
    runs = [
        specfast.generate(
            model, prompt, max_new_tokens=30, temperature=0.9, top_p=0.95, seed=7
        ).token_ids
        for _ in range(5)
    ]
    assert all(r == runs[0] for r in runs)
    other = specfast.generate(model, prompt, max_new_tokens=30, temperature=0.9, seed=8).token_ids
    assert other != runs[0]


# ----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(prompt=[]), ValueError, "empty"),
        (dict(prompt=[1, 96]), ValueError, "in \\[0, 96\\)"),
        (dict(prompt=[-1]), ValueError, "in \\[0, 96\\)"),
        (dict(prompt=[1.5]), TypeError, "ints"),
        (dict(prompt=torch.tensor([1.0, 2.0])), TypeError, "integer"),
        (dict(prompt=np.zeros((2, 2), dtype=np.int64)), TypeError, "1-D"),
        (dict(prompt="hello"), ValueError, "tokenizer"),
        (dict(prompt=object()), TypeError, "prompt must be"),
        (dict(max_new_tokens=0), ValueError, ">= 1"),
        (dict(max_new_tokens=5000), ValueError, "context"),
        (dict(temperature=-0.1), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature=1.0, top_p=0.0), ValueError, "top_p"),
        (dict(temperature=1.0, top_p=1.5), ValueError, "top_p"),
        (dict(temperature=1.0, top_k=-1), ValueError, "top_k"),
        (dict(temperature=1.0, min_p=2.0), ValueError, "min_p"),
        (dict(num_speculative_tokens=0), ValueError, "num_speculative_tokens"),
        (dict(num_speculative_tokens=-3), ValueError, "num_speculative_tokens"),
        (dict(num_speculative_tokens="many"), TypeError, "num_speculative_tokens"),
        (dict(drafter="suffix"), ValueError, "drafter"),
        (dict(drafter=42), TypeError, "drafter"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(stop_strings=[""]), ValueError, "stop_strings"),
    ],
)
def test_bad_input_is_refused(kwargs, exc, match):
    model = tiny()
    args = dict(prompt=[1, 2, 3], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        specfast.generate(model, **args)


def test_not_a_model_is_refused():
    with pytest.raises(TypeError, match="model"):
        specfast.generate("SmolLM2", [1, 2, 3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_prompt_on_another_device_is_refused():
    with pytest.raises(ValueError, match="device"):
        specfast.generate(tiny(), torch.tensor([1, 2, 3], device="cuda"))


@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
def test_sampled_ngram_gives_plain_sampling_text_for_the_same_seed(k):
    # Draws are keyed by output position, so speculation with one-hot drafts changes the speed
    # of sampling, never its result. A per-round seed (the obvious design) fails this.
    model = tiny("qwen2-bias")
    prompt = prompt_for(model)
    kw = dict(max_new_tokens=40, temperature=0.8, top_k=50, seed=11)
    want = specfast.generate(model, prompt, drafter=None, **kw).token_ids
    d = OracleDrafter(prompt, [], vocab=model.vocab_size)
    d.full = list(prompt) + want  # propose the very tokens plain sampling drew
    out = specfast.generate(model, prompt, drafter=d, num_speculative_tokens=k, **kw)
    assert out.token_ids == want
    assert out.stats.accepted_tokens > 0
    ngram = specfast.generate(model, prompt, num_speculative_tokens=k, **kw)
    assert ngram.token_ids == want


# ----------------------------------------------------------------------------
# draft models: combined drafting, and the draft's own cache


def test_combined_drafter_greedy_equals_plain():
    target, draft = tiny("llama-gqa-untied", seed=0), tiny("llama-gqa-untied", seed=2)
    prompt = prompt_for(target)
    want = plain(target, prompt, 40)
    for k in (2, 8, "auto"):
        d = specfast.CombinedDrafter(draft, min_match=2)
        out = specfast.generate(
            target, prompt, max_new_tokens=40, drafter=d, num_speculative_tokens=k
        )
        assert out.token_ids == want


class ContentDecoder:
    """Wraps a decoder and tracks what its cache holds: forward writes at length, rollback cuts."""

    torch_threads, cold_passes = None, 0  # the Decoder protocol's hints

    def __init__(self, inner, skip_rollback=False):
        self.inner, self.content, self.skip_rollback = inner, [], skip_rollback
        self._length = 0

    @property
    def length(self):
        return self._length

    def forward(self, ids, last_only=False):
        self.content[self._length :] = ids.tolist()
        self._length += ids.shape[0]
        return self.inner.forward(ids, last_only)

    def rollback(self, n):
        if not self.skip_rollback:
            self._length = n
            self.inner.rollback(n)


def draft_cache_violations(monkeypatch, skip_rollback: bool) -> int:
    """Rounds at which the draft cache held a token that was never committed, before drafting."""
    import specfast.drafters.model

    real_make, real_propose = (
        specfast.drafters.model.make_decoder,
        specfast.drafters.model.DraftModelDrafter.propose,
    )
    decoders: list[ContentDecoder] = []

    def make(m, n):
        decoders.append(ContentDecoder(real_make(m, n + 256), skip_rollback))
        return decoders[-1]

    bad = []

    def propose(self, k):
        dec = self.decoder
        real_forward = dec.forward

        def first_forward(ids, last_only=False):
            # The catch-up feed: the cache must hold committed tokens only, and be fed the rest.
            bad.append(dec.content[: dec.length] != self.committed[: dec.length])
            dec.forward = real_forward
            return real_forward(ids, last_only)

        dec.forward = first_forward
        return real_propose(self, k)

    monkeypatch.setattr(specfast.drafters.model, "make_decoder", make)
    monkeypatch.setattr(specfast.drafters.model.DraftModelDrafter, "propose", propose)
    target, draft = tiny("llama-gqa-untied", seed=0), tiny("llama-gqa-untied", seed=3)
    prompt = prompt_for(target)
    specfast.generate(target, prompt, max_new_tokens=40, drafter=draft, num_speculative_tokens=4)
    assert len(bad) > 5
    return sum(bad)


def test_draft_cache_holds_only_committed_tokens(monkeypatch):
    assert draft_cache_violations(monkeypatch, skip_rollback=False) == 0


def test_negative_control_draft_cache_without_rollback_is_caught(monkeypatch):
    assert draft_cache_violations(monkeypatch, skip_rollback=True) > 0


# ----------------------------------------------------------------------------
# a transformers model as target, and as draft


def test_transformers_target_ngram_equals_its_own_greedy():
    pytest.importorskip("transformers")
    from conftest import make_hf_model

    hf = make_hf_model("qwen2-bias")
    prompt = [5, 9, 17, 5, 9, 17, 5, 9, 30, 31, 5, 9]
    ids = torch.tensor([prompt])
    want = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, 12:]
    for drafter, k in ((None, "auto"), ("ngram", 4), ("ngram", "auto")):
        out = specfast.generate(
            hf,
            prompt,
            max_new_tokens=24,
            drafter=drafter,
            num_speculative_tokens=k,
            ignore_eos=True,
        )
        assert out.token_ids == want.tolist()


def test_transformers_model_as_draft_for_a_transformers_target():
    pytest.importorskip("transformers")
    from conftest import make_hf_model

    target, draft = make_hf_model("llama-tied-gqa", seed=0), make_hf_model("mistral", seed=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = plain(target, prompt, 20, ignore_eos=True)
    out = specfast.generate(
        target,
        prompt,
        max_new_tokens=20,
        drafter=draft,
        num_speculative_tokens=3,
        ignore_eos=True,
    )
    assert out.token_ids == want
    assert out.stats.draft_tokens > 0


def test_a_drafter_proposing_ids_outside_the_vocabulary_is_refused():
    class Bad:
        def extend(self, tokens):
            pass

        def propose(self, k):
            return [96] * k

    with pytest.raises(ValueError, match="drafter proposed"):
        specfast.generate(
            tiny(), [1, 2, 3], max_new_tokens=4, drafter=Bad(), num_speculative_tokens=2
        )


def test_last_only_logits_equal_the_last_row():
    model = tiny()
    ids = torch.tensor(prompt_for(model))
    full = model.decoder(64).forward(ids)
    last = model.decoder(64).forward(ids, last_only=True)
    assert last.shape == (1, model.vocab_size)
    torch.testing.assert_close(last, full[-1:], rtol=0, atol=1e-5)


def proposals_outside(monkeypatch, draft_vocabulary) -> tuple[int, int]:
    """(drafts a draft model proposed outside its allowed tokens, drafts accepted), with the
    target as its own draft; allowed = ids below `draft_vocabulary` plus tokens seen so far."""
    import specfast.drafters.model

    real_draft = specfast.drafters.model.DraftModelDrafter.draft
    outside = []

    def draft(self, k):
        proposal = real_draft(self, k)
        outside.extend(t for t in proposal.tokens if t >= 16 and t not in self.committed)
        return proposal

    monkeypatch.setattr(specfast.drafters.model.DraftModelDrafter, "draft", draft)
    target = tiny("llama-gqa-untied", seed=0)
    prompt = prompt_for(target)
    out = specfast.generate(
        target, prompt, max_new_tokens=40, drafter=target, draft_vocabulary=draft_vocabulary
    )
    assert out.token_ids == plain(target, prompt, 40)
    return len(outside), out.stats.accepted_tokens


def test_a_draft_of_part_of_the_vocabulary_proposes_only_those_tokens(monkeypatch):
    outside, accepted = proposals_outside(monkeypatch, 16)
    assert outside == 0 and accepted > 0


def test_negative_control_a_draft_of_the_whole_vocabulary_is_seen_outside(monkeypatch):
    assert proposals_outside(monkeypatch, None)[0] > 0


def test_draft_vocabulary_is_checked():
    target = tiny("llama-gqa-untied", seed=0)
    for bad in (0, -3, 2.5, "all", True):
        with pytest.raises(ValueError, match="draft_vocabulary"):
            specfast.generate(target, [1, 2], max_new_tokens=2, draft_vocabulary=bad)


def test_generate_takes_check_settings_options_with_the_same_defaults():
    # check_settings' keywords are the one list of per-call options (Session.send takes them);
    # generate() spells them out for its users, and must not drift from them.
    import inspect

    from specfast.settings import check_settings

    ours = inspect.signature(specfast.generate).parameters
    options = {
        name: p.default
        for name, p in inspect.signature(check_settings).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert options and {name: ours[name].default for name in options} == options
