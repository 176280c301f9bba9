"""response_format (constraints.py): the grammar's masks keep speculation exact.

On SmolLM2: greedy output equals plain constrained decoding written here straight from
llguidance (one token a target pass, the masked argmax; where the grammar forces a token, that
token), with and without speculation, and is valid; seeded sampling gives the same ids with and
without the n-gram. Negative controls: verify rows past the first left unmasked, and forced
tokens dropped from the cache, are both caught. On a tiny model with a six-token vocabulary: the
joint of the first three tokens under a grammar, with top-k, equals the exact masked joint, for
plain decoding and for drafts drawn from a q (a draft model's, a fixed one); a refused draw cut
like a one-hot draft (its position drawn from p, not the residual) is caught."""

from __future__ import annotations

import importlib
import json
import re
import sys

import numpy as np
import pytest
import torch
from test_generate_distribution import chi2_pvalue, sharpened

import specfast
from specfast.chat import render_chat
from specfast.drafters.base import Proposal

ll = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
constraints = importlib.import_module("specfast.constraints")
generate_module = importlib.import_module("specfast.generate")

N = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}
FACTS = {  # keys that say what to extract, and the model does not follow them unmasked
    "type": "json_schema",
    "json_schema": {
        "schema": {
            "type": "object",
            "properties": {k: {"type": "string"} for k in ("city", "employer")},
            "required": ["city", "employer"],
            "additionalProperties": False,
        }
    },
}
DATE = {"type": "regex", "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}
OBJECT = {"type": "json_object"}
ASK = {
    "person": "Extract the person's name, age and city as JSON.\n\nMaria Lopez is a 34-year-old "
    "architect who lives in Valencia, Spain. She designs libraries.",
    "date": "On what date was the invoice issued? Answer as YYYY-MM-DD.\n\nInvoice 2231 was "
    "issued on March 5, 2021 to Acme Ltd and paid on April 2, 2021.",
    "object": "Describe this book as a JSON object with title and year.\n\nThe Hobbit, by J. R. R. "
    "Tolkien, was published in 1937.",
    "facts": "Extract the facts as JSON.\n\nMaria Lopez is a 34-year-old architect at Foster and "
    "Partners who lives in Valencia, Spain.",
}
FORMATS = {"person": PERSON, "date": DATE, "object": OBJECT, "facts": FACTS}


def valid(name: str, text: str) -> bool:
    rf = FORMATS[name]
    if rf["type"] == "regex":
        return re.fullmatch(rf["regex"], text) is not None
    schema = rf["json_schema"]["schema"] if rf["type"] == "json_schema" else {"type": "object"}
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def model(smollm_gguf):
    return specfast.load_model(smollm_gguf)  # the default weights: the core's, row-count exact


@pytest.fixture(scope="module")
def prompts(model) -> dict[str, list[int]]:
    chat = {name: [{"role": "user", "content": ask}] for name, ask in ASK.items()}
    return {
        n: model.tokenizer.encode(render_chat(m, model.chat_template)).ids for n, m in chat.items()
    }


def reference(model, ids: list[int], response_format: dict) -> list[int]:
    """Plain constrained greedy decoding, one token a target pass, straight from llguidance."""
    tokenizer = ll.LLTokenizer(model.tokenizer.to_str(), n_vocab=model.vocab_size, eos_token=[2])
    matcher = ll.LLMatcher(tokenizer, constraints.grammar_text(response_format))
    decoder = model.decoder(len(ids) + N)
    logits = decoder.forward(torch.tensor(ids))[-1]
    out: list[int] = []
    while len(out) < N and 2 not in out:
        forced = matcher.compute_ff_tokens()
        if forced:
            t = forced[0]
        else:
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            refused = np.unpackbits(bits, bitorder="little")[: model.vocab_size] == 0
            t = int(logits.masked_fill(torch.from_numpy(refused), -torch.inf).argmax())
        assert matcher.consume_token(t)
        out.append(t)
        logits = decoder.forward(torch.tensor([t]))[-1]
    return out


@pytest.fixture(scope="module")
def want(model, prompts) -> dict[str, list[int]]:
    return {name: reference(model, prompts[name], FORMATS[name]) for name in prompts}


@pytest.fixture(scope="module")
def person_runs(model, prompts):
    kinds = {
        "plain": (None, "auto"),
        "k2": ("ngram", 2),
        "k4": ("ngram", 4),
        "auto": ("ngram", "auto"),
    }
    return {
        kind: specfast.generate(
            model, prompts["person"], max_new_tokens=N, drafter=d, num_speculative_tokens=k,
            response_format=PERSON,
        )
        for kind, (d, k) in kinds.items()
    }  # fmt: skip


def test_greedy_json_schema_equals_plain_constrained_decoding(want, person_runs):
    for kind, out in person_runs.items():
        assert out.token_ids == want["person"], kind
        assert out.finish_reason == "eos" and valid("person", out.text), (kind, out.text)
    assert json.loads(person_runs["plain"].text)["age"] == 34
    plain = person_runs["plain"].stats.accepted_tokens  # its forced tokens only
    assert all(person_runs[k].stats.accepted_tokens > plain for k in ("k2", "k4", "auto"))


@pytest.mark.parametrize("name", ["date", "object", "facts"])
def test_greedy_regex_and_json_object_equal_plain_constrained_decoding(model, prompts, want, name):
    for drafter, k in [(None, "auto"), ("ngram", 2), ("ngram", 4), ("ngram", "auto")]:
        out = specfast.generate(
            model, prompts[name], max_new_tokens=N, drafter=drafter, num_speculative_tokens=k,
            response_format=FORMATS[name],
        )  # fmt: skip
        assert out.token_ids == want[name], (drafter, k)
        assert out.finish_reason == "eos" and valid(name, out.text), out.text


def test_sampling_gives_the_same_ids_with_and_without_the_ngram(model, prompts):
    for name, seed in [("person", 3), ("date", 1)]:
        runs = [
            specfast.generate(
                model, prompts[name], max_new_tokens=N, temperature=0.8, top_k=40, seed=seed,
                drafter=drafter, num_speculative_tokens=k, response_format=FORMATS[name],
            )
            for drafter, k in [(None, "auto"), ("ngram", 4), ("ngram", "auto")]
        ]  # fmt: skip
        assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids, name
        assert runs[1].stats.accepted_tokens > 0
        assert runs[0].finish_reason == "eos" and valid(name, runs[0].text), runs[0].text


def test_forced_tokens_are_counted_and_ride_in_the_pass(want, person_runs):
    plain = person_runs["plain"]  # no drafter: forced tokens are its only drafts
    assert plain.stats.forced_tokens == 3  # "name", "age", "city": each key after its quote
    assert plain.stats.draft_tokens == plain.stats.accepted_tokens == 3
    # The prefill gives the first token and each round one, and each forced token saves a pass.
    assert plain.stats.target_passes == len(want["person"]) - 3
    assert all(out.stats.forced_tokens > 0 for out in person_runs.values())
    assert plain.stats.as_dict()["forced_tokens"] == 3


# ----------------------------------------------------------------------------
# drafts are cut where the grammar refuses them

IM_START = 1  # a special token: no grammar here allows it


class Scripted:
    """Proposes the next `ahead` tokens of a known reply, then `tail`."""

    wants_features, feature_layers = False, ()

    def __init__(self, reply: list[int], prompt_length: int, ahead: int, tail=()):
        self.reply, self.prompt_length, self.ahead, self.tail = reply, prompt_length, ahead, tail
        self.seq: list[int] = []
        self.accepted: list[int] = []

    def extend(self, tokens):
        self.seq.extend(tokens)

    def prefill(self, features=None):
        pass

    def start_turn(self, seed, params):
        pass

    def propose(self, budget):
        i = len(self.seq) - self.prompt_length
        return Proposal([*self.reply[i : i + self.ahead], *self.tail][:budget])

    def observe(self, proposal, n_accepted, verify_seconds, verified):
        self.accepted.append(n_accepted)

    def rollback(self, kept):
        self.seq = list(kept)


def recording_plans(monkeypatch) -> list:
    plans, real = [], constraints.Constraint.plan

    def plan(self, draft, q, budget):
        plans.append(real(self, draft, q, budget))
        return plans[-1]

    monkeypatch.setattr(constraints.Constraint, "plan", plan)
    return plans


def test_drafts_are_cut_before_the_first_refused_token(model, prompts, want, monkeypatch):
    plans, passes = recording_plans(monkeypatch), []
    real = model.decoder

    def decoder(max_length):
        inner = real(max_length)
        forward = inner.forward
        inner.forward = lambda ids, **kw: passes.append(ids.tolist()) or forward(ids, **kw)
        return inner

    monkeypatch.setattr(model, "decoder", decoder)
    drafter = Scripted(want["person"], len(prompts["person"]), 2, tail=[IM_START, IM_START])
    out = specfast.generate(
        model, prompts["person"], max_new_tokens=N, drafter=drafter, response_format=PERSON
    )
    assert out.token_ids == want["person"]
    rounds = passes[1:]  # the first pass is the prompt's, the first plan its last row's mask
    assert len(rounds) == len(plans) - 1 and all(IM_START not in ids for ids in rounds)
    for ids, plan in zip(rounds, plans[1:], strict=True):
        assert plan.proposed <= 2 and len(ids) == 1 + plan.proposed + plan.forced  # rows counted
    assert sum(p.proposed for p in plans) > 0 and max(drafter.accepted) == 2


# ----------------------------------------------------------------------------
# negative controls: each bug must change the output


def test_negative_control_verify_rows_left_unmasked_is_caught(model, prompts, want, monkeypatch):
    # Drafts of the right tokens, two a round, put rows past the first at every position. (The
    # n-gram's drafts land where SmolLM2 follows these grammars unmasked too: not caught there.)
    def run(name):
        drafter = Scripted(want[name], len(prompts[name]), ahead=2)
        return specfast.generate(
            model, prompts[name], max_new_tokens=N, drafter=drafter, response_format=FORMATS[name]
        )

    assert all(run(name).token_ids == want[name] for name in ("person", "facts"))
    real = constraints.Constraint.plan

    def first_row_only(self, draft, q, budget):
        plan = real(self, draft, q, budget)
        plan.allowed[1:] = True  # the bug: rows after the first see the unmasked target
        return plan

    monkeypatch.setattr(constraints.Constraint, "plan", first_row_only)
    for name in ("person", "facts"):
        try:
            out = run(name)
        except RuntimeError as e:  # an unmasked row's token broke the grammar
            assert "broke the grammar" in str(e)
        else:
            assert out.token_ids != want[name], name


class ForgetsForced:
    """The bug: after each pass the cache drops the rows of the forced tokens it accepted, so
    they are in the reply but not in the context the target sees."""

    torch_threads, cold_passes = None, 0

    def __init__(self, inner, plans):
        self.inner, self.plans, self.base, self.rows = inner, plans, 0, 0

    length = property(lambda self: self.inner.length)

    def forward(self, ids, last_only=False):
        self.base, self.rows = self.inner.length, len(ids)
        return self.inner.forward(ids, last_only)

    def rollback(self, n):
        forced = self.plans[-1].forced if self.plans else 0
        kept_forced = max(0, n - self.base - (self.rows - forced))
        self.inner.rollback(n - kept_forced)


def test_negative_control_forced_tokens_missing_from_the_cache_is_caught(
    model, prompts, want, monkeypatch
):
    plans = recording_plans(monkeypatch)
    real = generate_module.make_decoder
    monkeypatch.setattr(
        generate_module, "make_decoder", lambda m, n: ForgetsForced(real(m, n), plans)
    )
    for name in ("date", "facts"):  # ("person" is written the same without its keys' tokens)
        plans.clear()
        out = specfast.generate(
            model, prompts[name], max_new_tokens=N, drafter=None, response_format=FORMATS[name]
        )
        assert out.stats.forced_tokens > 0 and out.token_ids != want[name], name


# ----------------------------------------------------------------------------
# bad input, and a Session turn


@pytest.mark.parametrize(
    "bad, match",
    [
        ("json", "must be a dict"),
        ({"type": "json"}, "must be one of"),
        (SCHEMA, "must be one of"),  # a bare schema is refused: the OpenAI shapes only
        ({"type": "json_schema", "schema": SCHEMA}, "not \\['schema'\\]"),
        ({"type": "json_schema", "json_schema": SCHEMA}, "'schema' is a JSON schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": 1}}, "bool"),
        ({"type": "regex", "regex": ""}, "non-empty str"),
        ({"type": "regex", "regex": "(("}, "unclosed group"),
        ({"type": "grammar", "grammar": "start: nothing_here"}, "unknown name"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "nonsense"),
        ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}, "/nope"),
    ],
)
def test_bad_response_formats_are_refused_naming_response_format(model, bad, match):
    with pytest.raises((ValueError, TypeError), match=match) as e:
        specfast.generate(model, "Hi", max_new_tokens=2, response_format=bad)
    assert "response_format" in str(e.value)


def test_response_format_needs_eos_and_a_tokenizers_tokenizer(model):
    with pytest.raises(ValueError, match="ignore_eos"):
        specfast.generate(model, "Hi", max_new_tokens=2, ignore_eos=True, response_format=OBJECT)
    tiny = specfast.Model.from_config(
        specfast.ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2), seed=0
    )
    with pytest.raises(ValueError, match=r"tokenizers\.Tokenizer"):
        specfast.generate(tiny, [1, 2], max_new_tokens=2, eos_token_id=0, response_format=OBJECT)


def test_without_llguidance_only_response_format_fails(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises
    assert specfast.generate(model, "Hi", max_new_tokens=2).token_ids
    with pytest.raises(ValueError, match="response_format needs llguidance: pip install"):
        specfast.generate(model, "Hi", max_new_tokens=2, response_format=OBJECT)


def test_a_session_turn_takes_response_format(model, want):
    session = specfast.Session(model, max_new_tokens=N)
    out = session.send(ASK["person"], response_format=PERSON)
    assert out.token_ids == want["person"] and valid("person", out.text)
    free = session.send("Thanks! Now say hello.", max_new_tokens=8)  # the grammar was one turn's
    assert not free.text.startswith("{")


# ----------------------------------------------------------------------------
# the distribution, on a tiny model over a six-token vocabulary

EOS, V = 0, 6  # tokens: <eos> a b c ab x
TINY_PROMPT = [1, 2, 5, 3, 4]
ABX = {"type": "regex", "regex": "(a|b|xc)+"}  # x forces c; c alone, and EOS first, are refused
TOP_K = 3  # after the mask: top-k of the allowed tokens
SAMPLES = 1500
ALPHA = 1e-4


@pytest.fixture(scope="module")
def tiny():
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "x": 5}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tokenizer.add_special_tokens(["<eos>"])
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])

    def config(n_layers):
        return specfast.ModelConfig(vocab_size=V, dim=32, n_layers=n_layers, n_heads=2)

    return sharpened(config(2), 3), sharpened(config(1), 11), tokenizer


@pytest.fixture(scope="module")
def exact(tiny) -> np.ndarray:
    return exact_masked_joint(tiny[0], tiny[2])


def exact_masked_joint(model, tokenizer) -> np.ndarray:
    """The first three tokens' joint under ABX with top-k after the mask, EOS-padded, float64."""
    lt = ll.LLTokenizer(tokenizer.to_str(), n_vocab=V, eos_token=[EOS])
    matcher = ll.LLMatcher(lt, constraints.grammar_text(ABX))
    joint = np.zeros((V, V, V))

    def walk(prefix: list[int], prob: float):
        if len(prefix) == 3:
            joint[tuple(prefix)] += prob
            return
        if prefix and prefix[-1] == EOS:
            return walk([*prefix, EOS], prob)
        logits = model.decoder(16).forward(torch.tensor(TINY_PROMPT + prefix))[-1].double()
        forced = matcher.compute_ff_tokens()
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.eye(V, dtype=bool)[forced[0]] if forced else bits[:V] == 1
        logits[~torch.from_numpy(allowed)] = -torch.inf
        logits[logits < logits.topk(TOP_K).values[-1]] = -torch.inf
        p = torch.softmax(logits, -1).numpy()
        for t in map(int, np.nonzero(p)[0]):
            if t != EOS:
                assert matcher.consume_token(t)
            walk([*prefix, t], prob * p[t])
            if t != EOS:
                matcher.rollback(1)

    walk([], 1.0)
    return joint


def sample_masked_joint(tiny, drafter, **kwargs) -> np.ndarray:
    model, _, tokenizer = tiny
    counts = np.zeros((V, V, V))
    for seed in range(SAMPLES):
        out = specfast.generate(
            model, TINY_PROMPT, max_new_tokens=5, temperature=1.0, top_k=TOP_K, seed=seed,
            drafter=drafter(), tokenizer=tokenizer, eos_token_id=EOS, response_format=ABX,
            **kwargs,
        )  # fmt: skip
        ids = (out.token_ids + [EOS] * 3)[:3]
        counts[tuple(ids)] += 1
    return counts


class RandomDrafts(Scripted):
    """One-hot drafts of random tokens: some allowed, some refused, some forced."""

    def __init__(self, seed: int):
        super().__init__([], 0, 0)
        self.rng = np.random.default_rng(seed)

    def propose(self, budget):
        return Proposal(self.rng.integers(0, V, size=min(3, budget)).tolist())


def test_sampled_joint_equals_the_exact_masked_joint(tiny, exact):
    counts = sample_masked_joint(tiny, lambda: None)
    assert chi2_pvalue(counts, exact) > ALPHA


def test_one_hot_drafts_give_the_ids_plain_sampling_gives(tiny):
    # Any one-hot drafts, refused ones included: each position's token is the same draw.
    model, _, tokenizer = tiny
    for seed in range(100):
        runs = [
            specfast.generate(
                model, TINY_PROMPT, max_new_tokens=8, temperature=1.0, top_k=TOP_K, seed=seed,
                drafter=drafter, tokenizer=tokenizer, eos_token_id=EOS, response_format=ABX,
            ).token_ids
            for drafter in (None, RandomDrafts(seed))
        ]  # fmt: skip
        assert runs[0] == runs[1], seed


class FixedQ(Scripted):
    """A stochastic drafter: two drafts a round, each drawn from Q, which puts half its mass on
    c (refused but after x) and most of the rest on b: far from p, so a wrong rule shows."""

    Q = torch.tensor([0.02, 0.02, 0.4, 0.5, 0.02, 0.04])

    def __init__(self, seed: int):
        super().__init__([], 0, 0)
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, budget):
        k = min(2, budget)
        if k == 0:
            return Proposal([])
        tokens = torch.multinomial(self.Q, k, replacement=True, generator=self.generator)
        return Proposal(tokens.tolist(), self.Q.expand(k, V).clone())


@pytest.mark.parametrize("kind", ["draft model", "fixed q"])
def test_a_drafts_q_under_the_grammar_is_exact(tiny, exact, kind):
    counts = sample_with_q(tiny, kind)
    assert chi2_pvalue(counts, exact) > ALPHA


def sample_with_q(tiny, kind):
    if kind == "draft model":
        return sample_masked_joint(tiny, lambda: tiny[1], num_speculative_tokens=2)
    seeds = iter(range(10**6))
    return sample_masked_joint(tiny, lambda: FixedQ(next(seeds)))


def test_negative_control_a_refused_draw_cut_like_a_one_hot_draft_is_caught(
    tiny, exact, monkeypatch
):
    real = constraints.Constraint.plan

    def cut(self, draft, q, budget):
        if q is None:
            return real(self, draft, q, budget)
        n = real(self, draft, None, budget).proposed  # the bug: cut before the refused draw,
        return real(self, draft[:n], q[:n] if n else None, budget)  # so p, not the residual

    monkeypatch.setattr(constraints.Constraint, "plan", cut)
    counts = sample_with_q(tiny, "fixed q")
    assert chi2_pvalue(counts, exact) < ALPHA
