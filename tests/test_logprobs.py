"""logprobs / top_logprobs (specfast/logprobs.py): the target's own numbers, read from the verify
pass, equal to plain decoding's.

On a tiny float32 model and on SmolLM2 (passes in the core, whose rows do not depend on the row
count), speculation gives plain decoding's logprobs bit for bit, and they match a teacher-forced
reference pass (log-softmax of the raw logits, before temperature), greedy and sampled. Negative
controls: reading each token's logprob from the next row of the verify pass, and reading the
previous token's, are each caught."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from test_generate import OracleDrafter

import specfast
from specfast.model import Model, ModelConfig
from specfast.session import Session

generate_module = importlib.import_module("specfast.generate")
logprobs_module = importlib.import_module("specfast.logprobs")  # where the loop reads rows

CONFIG = ModelConfig(
    vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
    max_context=256,
)  # fmt: skip
N = 60


@pytest.fixture(scope="module")
def tiny() -> Model:
    return Model.from_config(CONFIG, seed=1)  # its greedy text varies, yet repeats enough


def prompt_for(n: int = 12, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    part = [rng.randrange(CONFIG.vocab_size) for _ in range(n // 2)]
    return part * 6  # repeats itself: the n-gram drafter finds matches


REPEAT = [  # SmolLM2 copies this back: the n-gram accepts long drafts
    {
        "role": "user",
        "content": "Repeat this list exactly: apples, pears, plums, figs, apples, pears, plums, "
        "figs, apples, pears, plums, figs.",
    }
]


def both(model, prompt, **kw):
    """(speculative output, plain output) of the same call."""
    kw = dict(max_new_tokens=N, logprobs=True, top_logprobs=5) | kw
    spec = specfast.generate(model, prompt, **kw)
    return spec, specfast.generate(model, prompt, **(kw | {"drafter": None}))


def reference(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Teacher-forced raw logits, float64 (len(out), V): row i is the one out[i] was drawn from."""
    decoder = model.decoder(len(prompt) + len(out))
    return decoder.forward(torch.tensor(prompt + out[:-1]))[len(prompt) - 1 :].double()


def chosen(logprobs: torch.Tensor, tokens: list[int]) -> list[float]:
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def next_row(monkeypatch):
    """The bug: token i's logprobs are read from row i + 1 of the verify pass."""
    real = logprobs_module.token_logprobs
    monkeypatch.setattr(
        logprobs_module,
        "token_logprobs",
        lambda logits, tokens, n: real(torch.cat([logits[1:], logits[-1:]]), tokens, n),
    )


def previous_token(monkeypatch):
    """The bug: each row reports the logprob of the token before the one it chose."""
    real = logprobs_module.token_logprobs
    monkeypatch.setattr(
        logprobs_module,
        "token_logprobs",
        lambda logits, tokens, n: real(logits, [tokens[0], *tokens[:-1]], n),
    )


# ----------------------------------------------------------------------------
# the same numbers with and without speculation


@pytest.mark.parametrize("k", [4, "auto"])
def test_ngram_gives_plain_decodings_logprobs_on_a_tiny_model(tiny, k):
    spec, plain = both(tiny, prompt_for(), num_speculative_tokens=k)
    assert spec.stats.accepted_tokens >= 10  # many rows past the first were read
    assert spec.token_ids == plain.token_ids
    assert len(spec.logprobs) == len(spec.top_logprobs) == len(spec.token_ids)
    assert spec.logprobs == plain.logprobs  # bit for bit: the core's rows ignore the row count
    assert spec.top_logprobs == plain.top_logprobs


@pytest.mark.smollm
def test_ngram_gives_plain_decodings_logprobs_on_smollm(smollm):
    spec, plain = both(smollm, REPEAT, max_new_tokens=40)
    assert spec.stats.accepted_tokens >= 10
    assert spec.text == plain.text
    assert spec.logprobs == plain.logprobs and spec.top_logprobs == plain.top_logprobs


@pytest.mark.parametrize("where", ["tiny", pytest.param("smollm", marks=pytest.mark.smollm)])
def test_negative_control_the_next_rows_logprobs_are_caught(where, tiny, request, monkeypatch):
    model, prompt = (
        (request.getfixturevalue("smollm"), REPEAT) if where == "smollm" else (tiny, prompt_for())
    )
    next_row(monkeypatch)
    spec, plain = both(model, prompt, max_new_tokens=40, num_speculative_tokens=4)
    assert spec.token_ids == plain.token_ids  # the text is right; its numbers are not
    assert spec.logprobs != plain.logprobs


def test_a_block_cut_by_max_new_tokens_keeps_one_logprob_per_token(tiny):
    for n in (1, 7, 23):
        spec, plain = both(tiny, prompt_for(), max_new_tokens=n)
        assert len(spec.logprobs) == len(spec.token_ids) == n
        assert spec.logprobs == plain.logprobs


# ----------------------------------------------------------------------------
# which numbers: each token's row, the raw distribution


def test_greedy_logprob_is_its_rows_best_and_the_reference(tiny):
    prompt = prompt_for()
    out = specfast.generate(tiny, prompt, max_new_tokens=N, logprobs=True, top_logprobs=5)
    ref = torch.log_softmax(reference(tiny, prompt, out.token_ids), dim=-1)
    for i, (t, lp, top) in enumerate(
        zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True)
    ):
        assert len(top) == 5 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert lp == top[0][1] and t == top[0][0]  # greedy: the row's most likely token
        want = torch.topk(ref[i], 5)
        assert [u for u, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-5)
        assert lp == pytest.approx(ref[i, t].item(), abs=1e-5)


def test_negative_control_the_previous_tokens_logprob_is_caught(tiny, monkeypatch):
    previous_token(monkeypatch)
    out = specfast.generate(tiny, prompt_for(), max_new_tokens=N, logprobs=True, top_logprobs=5)
    assert out.stats.accepted_tokens > 0
    assert any(lp != top[0][1] for lp, top in zip(out.logprobs, out.top_logprobs, strict=True))


@pytest.mark.parametrize("drafter", [None, "oracle", "draft"])
def test_sampled_logprobs_are_the_emitted_tokens_before_temperature(tiny, drafter):
    prompt = prompt_for()
    kw = dict(max_new_tokens=N, temperature=0.7, top_k=40, seed=5, logprobs=True)
    plain = specfast.generate(tiny, prompt, drafter=None, **kw)
    if drafter == "oracle":  # one-hot drafts of plain sampling's tokens, some corrupted
        drafter = OracleDrafter(prompt, plain.token_ids, vocab=CONFIG.vocab_size)
    elif drafter == "draft":  # a q that agrees with p: long accepted blocks, drawn by ratio
        drafter = Model.from_config(CONFIG, seed=1)
    out = specfast.generate(tiny, prompt, drafter=drafter, num_speculative_tokens=4, **kw)
    assert drafter is None or out.stats.accepted_tokens > 10
    assert out.top_logprobs is None  # top_logprobs=0 asks for none
    logits = reference(tiny, prompt, out.token_ids)
    raw = chosen(torch.log_softmax(logits, dim=-1), out.token_ids)
    assert out.logprobs == pytest.approx(raw, abs=1e-5)
    # Control: the distribution after temperature gives other numbers.
    tempered = chosen(torch.log_softmax(logits / 0.7, dim=-1), out.token_ids)
    assert out.logprobs != pytest.approx(tempered, abs=1e-3)
    if isinstance(drafter, OracleDrafter):  # draws keyed by position: plain sampling's text
        assert (plain.token_ids, plain.logprobs) == (out.token_ids, out.logprobs)


@pytest.mark.smollm
def test_under_a_grammar_the_masked_distribution_is_reported(smollm):
    pytest.importorskip("llguidance")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"schema": schema}}
    ask = [{"role": "user", "content": "Ana Ruiz is 41. Give her name and age as JSON."}]
    spec, plain = both(smollm, ask, max_new_tokens=30, response_format=rf)
    assert spec.stats.forced_tokens > 0
    assert (spec.token_ids, spec.logprobs, spec.top_logprobs) == (
        plain.token_ids,
        plain.logprobs,
        plain.top_logprobs,
    )
    forced = [i for i, top in enumerate(spec.top_logprobs) if len(top) == 1]
    assert forced and all(spec.logprobs[i] == 0.0 for i in forced)  # certain under the grammar
    assert all(lp == top[0][1] for lp, top in zip(spec.logprobs, spec.top_logprobs, strict=True))
    # Control: unconstrained, the model is not certain of those tokens.
    free = specfast.generate(smollm, ask, max_new_tokens=1, logprobs=True)
    assert free.logprobs[0] < 0.0


# ----------------------------------------------------------------------------
# Session, streaming, cost when off, bad input


def test_session_turns_give_generates_logprobs(tiny):
    s = Session(tiny, max_new_tokens=20, logprobs=True, top_logprobs=3)
    for msg in (prompt_for(seed=1), prompt_for(seed=2)):
        out = s.send(msg)
        history = s.token_ids[: len(s.token_ids) - len(out.token_ids)]
        want = specfast.generate(
            tiny, history, max_new_tokens=20, drafter=None, logprobs=True, top_logprobs=3
        )
        assert (out.logprobs, out.top_logprobs) == (want.logprobs, want.top_logprobs)
    assert s.send(prompt_for(seed=3), logprobs=False, top_logprobs=0).logprobs is None  # per turn


class Recorder:
    """A callable streamer that also takes logprobs: records the order it hears things in."""

    def __init__(self):
        self.events: list[tuple[str, object]] = []

    def __call__(self, text):
        self.events.append(("text", text))

    def put_logprobs(self, ids, logprobs, top):
        self.events.append(("logprobs", (list(ids), list(logprobs), top)))


@pytest.mark.smollm
def test_a_streamer_gets_each_blocks_logprobs_before_its_text(smollm):
    rec = Recorder()
    out = specfast.generate(smollm, REPEAT, max_new_tokens=30, logprobs=True, streamer=rec)
    blocks = [v for kind, v in rec.events if kind == "logprobs"]
    assert [t for ids, _, _ in blocks for t in ids] == out.token_ids
    assert [lp for _, lps, _ in blocks for lp in lps] == out.logprobs
    assert rec.events[0][0] == "logprobs" and len(blocks) < len(out.token_ids)  # blocks, not tokens
    kinds = [kind for kind, _ in rec.events]
    assert all(kinds[i - 1] == "logprobs" for i, k in enumerate(kinds) if k == "text")


def test_off_reads_no_logits_in_greedy_rounds(tiny, monkeypatch):
    calls = {"greedy_ids": 0, "forward": 0}
    real = generate_module.make_decoder

    def counting(model, n):
        d = real(model, n)
        for name in calls:
            inner = getattr(d, name)

            def spy(*a, _inner=inner, _name=name, **k):
                calls[_name] += 1
                return _inner(*a, **k)

            setattr(d, name, spy)
        return d

    monkeypatch.setattr(generate_module, "make_decoder", counting)
    out = specfast.generate(tiny, prompt_for(), max_new_tokens=N)
    assert out.logprobs is None and out.top_logprobs is None
    assert calls == {"greedy_ids": out.stats.decode_steps, "forward": 1}  # the prefill's only
    # Control: asked for, every round reads its logits.
    calls.update(greedy_ids=0, forward=0)
    out = specfast.generate(tiny, prompt_for(), max_new_tokens=N, logprobs=True)
    assert calls == {"greedy_ids": 0, "forward": out.stats.target_passes}


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(logprobs=True, top_logprobs=21), ValueError, r"top_logprobs must be in \[0, 20\]"),
        (dict(logprobs=True, top_logprobs=-1), ValueError, "top_logprobs"),
        (dict(top_logprobs=3), ValueError, "needs logprobs=True"),
        (dict(logprobs="yes"), TypeError, "logprobs must be True or False"),
        (dict(logprobs=1), TypeError, "logprobs must be True or False"),
        (dict(logprobs=True, top_logprobs=2.5), TypeError, "top_logprobs must be an int"),
        (dict(logprobs=True, top_logprobs=True), TypeError, "top_logprobs must be an int"),
    ],
)
def test_bad_logprob_options_are_refused(tiny, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        specfast.generate(tiny, [1, 2, 3], max_new_tokens=2, **kwargs)
    with pytest.raises(exc, match=match):
        Session(tiny).send([1, 2, 3], max_new_tokens=2, **kwargs)
