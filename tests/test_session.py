"""Session: a conversation keeps the KV cache and the drafter, and says exactly what generate()
says on the full history; only new tokens are prefilled; an interrupted turn is wholly absent."""

from __future__ import annotations

import random

import pytest
import torch

import specfast
from specfast.model import Model, ModelConfig, ModelDecoder
from specfast.session import Session

CONFIG = ModelConfig(
    vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_context=512
)  # fmt: skip


def tiny(seed: int = 0) -> Model:
    return Model.from_config(CONFIG, seed=seed)


def messages(n_turns: int = 5, seed: int = 0) -> list[list[int]]:
    """Token-id turns that repeat each other, so the n-gram drafter finds matches."""
    rng = random.Random(seed)
    base = [rng.randrange(CONFIG.vocab_size) for _ in range(10)]
    return [base[: 4 + i] + [rng.randrange(CONFIG.vocab_size) for _ in range(3)] + base
            for i in range(n_turns)]  # fmt: skip


def plain(model, ids, n, **kw) -> list[int]:
    return specfast.generate(model, ids, max_new_tokens=n, drafter=None, **kw).token_ids


def context_of(session: Session, out) -> list[int]:
    """The full history the turn continued: the conversation minus its reply."""
    ids = session.token_ids
    return ids[: len(ids) - len(out.token_ids)]


# ----------------------------------------------------------------------------
# greedy: a session says what generate() says on the full history


@pytest.mark.parametrize("drafter,k", [(None, "auto"), ("ngram", "auto"), ("ngram", 4)])
def test_session_greedy_equals_generate_on_the_full_history(drafter, k):
    model = tiny()
    s = Session(model, drafter=drafter, num_speculative_tokens=k, max_new_tokens=20)
    accepted = 0
    for i, msg in enumerate(messages()):
        out = s.send(msg, ignore_eos=True)
        history = context_of(s, out)
        assert out.token_ids == plain(model, history, 20, ignore_eos=True)
        # Turn n prefills its message plus the previous reply's last token, nothing more.
        assert out.stats.prefill_tokens == (len(msg) + 1 if i else len(msg))
        assert out.stats.reused_tokens == len(history) - out.stats.prefill_tokens
        accepted += out.stats.accepted_tokens
    assert len(s.history) == 5
    assert (accepted > 0) == (drafter is not None)


def test_a_q4_session_over_its_float16_cache_equals_generate_and_forks():
    """A 4-bit model keeps a float16 cache across turns and forks: each turn is generate() over
    the whole history (whose prefill rounds the same keys the same way)."""
    model = tiny().quantize_int8("q4")
    s = Session(model, drafter="ngram", max_new_tokens=16, ignore_eos=True)
    msgs = messages(4, seed=8)
    for msg in msgs[:2]:
        out = s.send(msg)
        assert out.token_ids == plain(model, context_of(s, out), 16, ignore_eos=True)
    assert s._decoder.cache.k.dtype == torch.float16
    f = s.fork()
    a, b = s.send(msgs[2]), f.send(msgs[3])
    assert a.token_ids == plain(model, context_of(s, a), 16, ignore_eos=True)
    assert b.token_ids == plain(model, context_of(f, b), 16, ignore_eos=True)
    assert b.stats.reused_tokens > 0


def test_session_greedy_equals_generate_after_rewind_and_reset():
    model = tiny()
    s = Session(model, max_new_tokens=16, ignore_eos=True)
    msgs = messages(6, seed=3)
    for msg in msgs[:4]:
        s.send(msg)
    before = s.token_ids
    s.rewind(2)
    assert len(s.history) == 2
    assert s.token_ids == before[: s.history[-1].start + len(s.history[-1].prompt_ids) + 16]
    for msg in msgs[4:]:
        out = s.send(msg)
        assert out.token_ids == plain(model, context_of(s, out), 16, ignore_eos=True)
    s.reset()
    assert s.history == [] and s.token_ids == [] and s.cached_tokens == 0
    out = s.send(msgs[0])
    assert out.token_ids == plain(model, msgs[0], 16, ignore_eos=True)
    assert out.stats.reused_tokens == 0


def test_a_draft_model_session_equals_generate_after_rewind():
    target, draft = tiny(0), tiny(1)
    s = Session(target, drafter=draft, num_speculative_tokens=3, max_new_tokens=16, ignore_eos=True)
    msgs = messages(5, seed=4)
    for msg in msgs[:3]:
        s.send(msg)
    s.rewind(1)
    for msg in msgs[3:]:
        out = s.send(msg)
        assert out.token_ids == plain(target, context_of(s, out), 16, ignore_eos=True)
        assert out.stats.draft_tokens > 0


def test_sampled_turns_equal_generate_with_the_same_seed():
    # One-hot drafts draw every position with its own uniform, so a seed gives one text.
    model = tiny()
    s = Session(model, temperature=0.8, top_k=20, max_new_tokens=16, ignore_eos=True)
    for i, msg in enumerate(messages(4, seed=5)):
        out = s.send(msg, seed=100 + i)
        want = specfast.generate(
            model, context_of(s, out), max_new_tokens=16, temperature=0.8, top_k=20,
            seed=100 + i, drafter=None, ignore_eos=True,
        )  # fmt: skip
        assert out.token_ids == want.token_ids


def test_send_context_keeps_the_shared_prefix_and_equals_generate():
    # A server's requests: each the whole context, which may continue or cut back the session.
    model = tiny()
    s = Session(model, max_new_tokens=12, ignore_eos=True)
    a, b, c = messages(3, seed=9)
    first = s.send_context(a)
    assert first.token_ids == plain(model, a, 12, ignore_eos=True)
    grown = s.token_ids + b  # the next turn: everything kept
    out = s.send_context(grown)
    assert out.token_ids == plain(model, grown, 12, ignore_eos=True)
    assert out.stats.reused_tokens == len(a) + 12 - 1 and len(s.history) == 2
    cut = a[:5] + c  # parts inside the first turn: both turns go, the prefix's cache stays
    out = s.send_context(cut)
    assert out.token_ids == plain(model, cut, 12, ignore_eos=True)
    assert out.stats.reused_tokens == 5 and len(s.history) == 1
    assert s.history[0].start == 0 and s.token_ids == cut + out.token_ids
    s.rewind(1)
    assert s.token_ids == [] and s.cached_tokens == 0


def test_negative_control_send_context_that_appends_is_caught():
    # Appending (what send() does with ids) instead of replacing gives another context.
    model = tiny()
    s = Session(model, max_new_tokens=12, ignore_eos=True)
    a, c = messages(2, seed=9)
    s.send(a)
    out = s.send(a[:5] + c)
    assert out.token_ids != plain(model, a[:5] + c, 12, ignore_eos=True)


def test_fork_continues_independently():
    model = tiny()
    s = Session(model, max_new_tokens=12, ignore_eos=True)
    msgs = messages(4, seed=6)
    s.send(msgs[0])
    s.send(msgs[1])
    f = s.fork()
    a, b = s.send(msgs[2]), f.send(msgs[3])
    assert a.token_ids == plain(model, context_of(s, a), 12, ignore_eos=True)
    assert b.token_ids == plain(model, context_of(f, b), 12, ignore_eos=True)
    assert b.stats.reused_tokens == a.stats.reused_tokens > 0  # the fork kept the cache
    assert len(s.history) == len(f.history) == 3


# ----------------------------------------------------------------------------
# fork with a draft model or an EAGLE head: the fork's drafter is a copy sharing nothing


def eagle_head(target):
    from specfast.drafters.eagle.head import EagleConfig, random_head

    config = EagleConfig.for_target(target, draft_vocab_size=60, aux_layers=(0, 1, 1))
    return random_head(config, seed=3)  # the tiny target has 2 layers


# A draft with the target's weights (another object) accepts nearly everything when its cache is
# right, so a draft cache that a fork shares with its parent shows in the acceptance counts.
DRAFTERS = {
    "draft-model": lambda target: tiny(0),
    "draft-vocabulary": lambda target: tiny(0),  # with draft_vocabulary=40: a DraftVocabulary
    "combined": lambda target: specfast.CombinedDrafter(tiny(0)),
    "eagle": eagle_head,
    "eagle+ngram": lambda target: specfast.CombinedDrafter(eagle_head(target)),
}


def forked_conversation(kind: str, k="3"):
    """Parent and fork continue with different messages, interleaved. Returns, per session, its
    turns' (token ids, drafted, accepted) and the same for a replay: a fresh session sent that
    session's messages (no fork). Every turn is checked against generate() on its history."""
    target = tiny(0)
    k = int(k) if k.isdigit() else k
    opts = dict(num_speculative_tokens=k, max_new_tokens=12, ignore_eos=True)
    if kind == "draft-vocabulary":
        opts["draft_vocabulary"] = 40
    msgs = messages(6, seed=11)

    def new():
        return Session(target, drafter=DRAFTERS[kind](target), **opts)

    def turn(session, msg):
        out = session.send(msg)
        assert out.token_ids == plain(target, context_of(session, out), 12, ignore_eos=True)
        return out.token_ids, out.stats.draft_tokens, out.stats.accepted_tokens

    parent = new()
    for msg in msgs[:2]:
        parent.send(msg)
    child = parent.fork()
    sent = {"parent": msgs[:2], "child": msgs[:2]}
    got: dict[str, list] = {"parent": [], "child": []}
    for a, b in ((2, 3), (4, 5), (3, 2)):
        got["parent"].append(turn(parent, msgs[a]))
        got["child"].append(turn(child, msgs[b]))
        sent["parent"] = sent["parent"] + [msgs[a]]
        sent["child"] = sent["child"] + [msgs[b]]
    replay = {}
    for name, session in (("parent", parent), ("child", child)):
        r = new()
        replay[name] = [turn(r, m) for m in sent[name]][2:]
        # With a fixed k the draft's cache holds, bit for bit, what a never-forked session's
        # holds (auto k drafts by measured times, so two runs draft differently).
        if k != "auto":
            assert same_draft_cache(session, r), f"{name}: the draft cache differs from a replay"
    return parent, child, got, replay


def same_draft_cache(a: Session, b: Session) -> bool:
    import torch

    def cache(s):
        d = getattr(s._drafter, "chain", s._drafter)  # a CombinedDrafter's: its chain drafter
        return d.cache if hasattr(d, "cache") else d.decoder.cache

    ca, cb = cache(a), cache(b)
    n = ca.length
    return (
        n == cb.length
        and torch.equal(ca.k[:, :, :n], cb.k[:, :, :n])
        and torch.equal(ca.v[:, :, :n], cb.v[:, :, :n])
    )


def shared_state(a, b) -> list[str]:
    """Paths of mutable objects that drafter `a` and drafter `b` both hold (weights and the
    target's pass costs, shared on purpose, are not walked)."""
    import torch

    from specfast.drafters.eagle.head import EagleHead, FastLinears
    from specfast.model.packing import OutputRows
    from specfast.targets.torch import ModelTarget

    # Weights (OutputRows: a model's projection rows, cached per model; a model's target
    # adapter) and immutables.
    skip = (Model, ModelTarget, OutputRows, EagleHead, FastLinears, torch.nn.Module, torch.Tensor,
            torch.device, tuple)  # fmt: skip
    seen_a: dict[int, str] = {}

    def walk(obj, path, out, depth=0):
        if depth > 6 or isinstance(obj, (int, float, str, bool, type(None), *skip)):
            return
        out[id(obj)] = path
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, list):
            items = list(enumerate(obj))
        elif hasattr(obj, "__dict__"):
            items = [(k, v) for k, v in vars(obj).items() if k != "_sums"]
        else:
            return
        for key, value in items:
            walk(value, f"{path}.{key}", out, depth + 1)

    walk(a, "drafter", seen_a)
    seen_b: dict[int, str] = {}
    walk(b, "drafter", seen_b)
    return sorted(seen_a[i] for i in set(seen_a) & set(seen_b))


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_a_fork_with_a_model_drafter_continues_like_an_unforked_session(kind):
    parent, child, got, replay = forked_conversation(kind)
    # Same drafts and acceptances as sessions that were never forked: neither one's drafter
    # saw the other's turns.
    assert got == replay
    assert shared_state(parent._drafter, child._drafter) == []
    if kind != "eagle":  # a random head drafts little that is accepted
        assert sum(t[2] for t in got["child"]) > 0


@pytest.mark.parametrize("kind", ["draft-model", "eagle+ngram"])
def test_a_forked_auto_k_drafter_owns_its_auto_k_and_equals_generate(kind):
    parent, child, _, _ = forked_conversation(kind, k="auto")
    assert child._drafter.auto is not parent._drafter.auto
    assert child._drafter.auto._sums is parent._drafter.auto._sums  # the target's pass costs
    assert shared_state(parent._drafter, child._drafter) == []


@pytest.mark.parametrize("kind", ["draft-model", "eagle"])
def test_negative_control_a_fork_sharing_the_draft_cache_is_caught(kind, monkeypatch):
    from specfast.drafters.eagle import EagleDraft
    from specfast.drafters.model import DraftModelDrafter

    # The bug: the fork's draft model (or EAGLE head) writes the parent's cache.
    cls, cache = (DraftModelDrafter, "decoder") if kind == "draft-model" else (EagleDraft, "cache")
    real = cls.fork

    def sharing(self, *args):
        new = real(self, *args)
        setattr(new, cache, getattr(self, cache))
        return new

    monkeypatch.setattr(cls, "fork", sharing)
    # The draft cache then differs from a replay's (or a rollback finds it too short).
    with pytest.raises((AssertionError, ValueError)):
        forked_conversation(kind)


def test_negative_control_a_fork_sharing_auto_k_is_caught(monkeypatch):
    import specfast.drafters.chain as drafters_module

    monkeypatch.setattr(drafters_module, "copy_auto", lambda auto: auto)
    parent, child, _, _ = forked_conversation("draft-model", k="auto")
    assert any("auto" in p for p in shared_state(parent._drafter, child._drafter))


@pytest.mark.parametrize("drafter", ["ngram", None])
def test_an_ngram_or_plain_fork_shares_no_drafter_state(drafter):
    s = Session(tiny(), drafter=drafter, max_new_tokens=8, ignore_eos=True)
    s.send(messages()[0])
    f = s.fork()
    assert shared_state(s._drafter, f._drafter) == []
    if drafter == "ngram":
        assert f._drafter.inner is not s._drafter.inner and len(f._drafter.inner) == len(
            s.token_ids
        )


def test_a_fork_of_a_corpus_session_drafts_from_the_corpus_but_never_writes_it(tmp_path):
    model = tiny()
    path = tmp_path / "chat.corpus"
    msgs = messages(4, seed=12)
    s = Session(model, corpus=path, max_new_tokens=12, ignore_eos=True)
    s.send(msgs[0])
    s.send(msgs[1])
    saved = path.read_bytes()
    f = s.fork()
    assert f._drafter.inner.corpus_tokens == s._drafter.inner.corpus_tokens > 0
    out = f.send(msgs[2])
    assert out.token_ids == plain(model, context_of(f, out), 12, ignore_eos=True)
    assert path.read_bytes() == saved  # the fork wrote nothing
    assert f._drafter.inner.corpus_tokens == s._drafter.inner.corpus_tokens  # nor added a turn
    s.send(msgs[3])
    assert path.read_bytes() != saved  # the parent still writes


def test_a_transformers_draft_model_session_forks():
    pytest.importorskip("transformers")
    from conftest import make_hf_model

    target, draft = make_hf_model("qwen2-bias"), make_hf_model("qwen2-bias")
    s = Session(target, drafter=draft, num_speculative_tokens=3, max_new_tokens=10, ignore_eos=True)
    msgs = [[5, 9, 17, 5, 9, 17], [5, 9, 30, 31], [17, 5, 9]]
    s.send(msgs[0])
    f = s.fork()
    assert f._drafter.decoder.cache is not s._drafter.decoder.cache
    for a, b in ((s, f), (f, s)):
        for session, msg in ((a, msgs[1]), (b, msgs[2])):
            out = session.send(msg)
            assert out.token_ids == plain(target, context_of(session, out), 10, ignore_eos=True)
            assert out.stats.accepted_tokens > 0  # the draft has the target's weights


def test_fork_refuses_a_drafter_it_cannot_copy():
    class Oracle:  # any object with extend/propose is a drafter, but fork cannot copy it
        def extend(self, tokens):
            pass

        def propose(self, k):
            return []

    s = Session(tiny(), drafter=Oracle(), max_new_tokens=4)
    with pytest.raises(TypeError, match="fork\\(\\) supports the n-gram drafter, a draft model"):
        s.fork()


# ----------------------------------------------------------------------------
# prefill covers only the new tokens


def prefill_sizes(monkeypatch, drop_cache: bool) -> list[tuple[int, int]]:
    """(tokens the target ran before each turn's first new token, the turn's new tokens)."""
    sizes: list[int] = []
    real_forward = ModelDecoder.forward

    def forward(self, ids, last_only=False, head=None):
        if last_only:  # the target's prefill is the only last_only pass of a turn
            sizes.append(ids.shape[0])
        return real_forward(self, ids, last_only, head=head)

    monkeypatch.setattr(ModelDecoder, "forward", forward)
    if drop_cache:  # the bug: a session that re-prefills the whole history every turn
        monkeypatch.setattr(Session, "_reusable", lambda self, ids, keep: 0)
    model = tiny()
    s = Session(model, drafter=None, max_new_tokens=8, ignore_eos=True)
    new = []
    for msg in messages(4, seed=7):
        before = len(s.token_ids)
        out = s.send(msg)
        assert out.token_ids == plain(model, context_of(s, out), 8, ignore_eos=True)
        new.append(len(context_of(s, out)) - max(before - 1, 0))
        sizes.append(-1)  # a marker after the reference run's prefill
    turns = [x for i, x in enumerate(sizes) if i % 3 == 0]  # session, reference, marker
    return list(zip(turns, new, strict=True))


def test_prefill_covers_only_the_new_tokens(monkeypatch):
    pairs = prefill_sizes(monkeypatch, drop_cache=False)
    assert all(ran == new for ran, new in pairs), pairs


def test_negative_control_a_session_that_drops_its_cache_is_caught(monkeypatch):
    pairs = prefill_sizes(monkeypatch, drop_cache=True)
    assert not all(ran == new for ran, new in pairs)


def test_generate_is_a_one_turn_session_in_its_stats():
    model = tiny()
    out = specfast.generate(model, messages()[0], max_new_tokens=4)
    assert out.stats.prefill_tokens == len(messages()[0]) and out.stats.reused_tokens == 0
    d = out.stats.as_dict()
    assert d["prefill_tokens"] == len(messages()[0]) and d["reused_tokens"] == 0


# ----------------------------------------------------------------------------
# interrupts: the turn is wholly absent


class Boom(Exception):
    pass


def interrupted_then_resent(
    exc: type[BaseException], restore: bool, monkeypatch, draft_model: bool = False
):
    """Runs 2 turns, interrupts the 3rd from its streamer, then sends the 3rd again. Returns
    (was the turn wholly absent?, did the re-sent turn equal a clean session's?). With
    `draft_model`, both sessions draft with a draft model (the target's weights, k = 3), and the
    re-sent turn must also draft and accept exactly as the clean session's."""
    if not restore:  # the bug: an interrupted turn leaves its tokens in cache and drafter
        monkeypatch.setattr(Session, "_restore", lambda self, *a: None)
    model = tiny()
    msgs = messages(3, seed=8)
    opts: dict = dict(max_new_tokens=16, ignore_eos=True)
    if draft_model:
        opts.update(drafter=tiny(0), num_speculative_tokens=3)
    s = Session(model, **opts)
    if draft_model:
        opts["drafter"] = tiny(0)
    clean = Session(model, **opts)
    for msg in msgs[:2]:
        s.send(msg)
        clean.send(msg)
    before = s.token_ids
    calls = []

    class Streamer:
        def put(self, value):
            calls.append(value)
            if len(calls) == 3:  # the prompt, the first token, then one round
                raise exc("stop")

        def end(self):
            pass

    with pytest.raises(exc):
        s.send(msgs[2], streamer=Streamer())
    # Absent: no turn, no tokens, and neither the cache nor the drafter holds any of it.
    absent = (
        len(s.history) == 2
        and s.token_ids == before
        and s.cached_tokens <= len(before) - 1
        and len(getattr(s._drafter, "inner", s._drafter)) == len(before)  # n-gram or draft
    )
    again, want = s.send(msgs[2]), clean.send(msgs[2])
    same = again.token_ids == want.token_ids
    if draft_model:
        same = same and (again.stats.draft_tokens, again.stats.accepted_tokens) == (
            want.stats.draft_tokens,
            want.stats.accepted_tokens,
        )
    return absent, same and again.stats.reused_tokens == want.stats.reused_tokens


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("draft_model", [False, True])
def test_an_interrupted_turn_is_wholly_absent(exc, draft_model, monkeypatch):
    assert interrupted_then_resent(exc, True, monkeypatch, draft_model) == (True, True)


@pytest.mark.parametrize("draft_model", [False, True])
def test_negative_control_an_interrupt_without_restore_is_caught(draft_model, monkeypatch):
    assert interrupted_then_resent(Boom, False, monkeypatch, draft_model)[0] is False


# ----------------------------------------------------------------------------
# bad input


def test_outgrowing_the_context_is_a_clear_error():
    s = Session(tiny(), max_length=40, max_new_tokens=8, ignore_eos=True)
    s.send(messages()[0])
    with pytest.raises(ValueError, match="max_length of 40"):
        s.send(messages()[1])
    assert len(s.history) == 1  # the refused turn left nothing behind
    s.rewind(1)
    s.send(messages()[1])


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda s: s.send([1, 2], num_speculative_tokens=4), TypeError, "fixed when"),
        (lambda s: s.send([1, 2], nonsense=1), TypeError, "unknown send"),
        (lambda s: s.send([]), ValueError, "empty"),
        (lambda s: s.send([1, 999]), ValueError, r"\[0, 96\)"),
        (lambda s: s.send("hi"), ValueError, "tokenizer"),
        (lambda s: s.rewind(1), ValueError, r"\[0, 0\]"),
        (lambda s: s.rewind(True), TypeError, "int"),
        (lambda s: s.send([1, 2], temperature=-1), ValueError, "temperature"),
    ],
)
def test_bad_input_is_refused(call, exc, match):
    with pytest.raises(exc, match=match):
        call(Session(tiny(), max_new_tokens=4))


def test_bad_session_options_are_refused():
    with pytest.raises(TypeError, match="unknown Session option"):
        Session(tiny(), nonsense=1)
    with pytest.raises(ValueError, match="max_length"):
        Session(tiny(), max_length=10_000)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Session(tiny(), num_speculative_tokens=0)


# ----------------------------------------------------------------------------
# str turns: the chat template, on SmolLM2


@pytest.mark.smollm
def test_smollm_str_turns_equal_generate_and_reuse_the_cache(smollm):
    s = Session(smollm, system="You are a terse assistant.", max_new_tokens=24)
    asks = [
        "Write a Python function add(a, b) that returns a + b.",
        "Rename it to plus.",
        "Add a docstring.",
        "Now add type hints.",
    ]
    before: list[int] = []
    for i, ask in enumerate(asks):
        out = s.send(ask)
        history = context_of(s, out)
        assert out.token_ids == plain(smollm, history, 24)
        if i:  # the whole earlier conversation came from the cache
            assert out.stats.reused_tokens == len(before) - 1
        before = s.token_ids
    assert s.messages()[-1]["content"] == s.history[-1].reply_text


# ----------------------------------------------------------------------------
# specfast chat, fed from stdin

from test_cli import tiny_model_dir  # noqa: E402,F401  (the fixture: a tiny HF folder)


def test_chat_streams_replies_and_obeys_commands(tiny_model_dir, monkeypatch, capsys):  # noqa: F811
    import io

    from specfast.cli import main

    lines = ["hello there", "/stats", "/rewind", "/rewind 5", "hello there", "again", "/bogus",
             "/reset", "/quit", "never sent"]  # fmt: skip
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    argv = [
        "chat",
        "--model",
        str(tiny_model_dir),
        "--max-new-tokens",
        "6",
        "--system",
        "Be brief.",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()

    model = specfast.load_model(tiny_model_dir)
    s = Session(model, system="Be brief.", max_new_tokens=6)
    first = s.send("hello there").text
    second = s.send("again").text
    # "hello there" twice (the first was rewound), then "again" on top of the second.
    assert out == f"{first}\n{first}\n{second}\n"
    assert "prefill" in err and "reused" in err
    assert "rewound 1 turn(s); 0 left" in err
    assert "n_turns must be in [0, 0]" in err
    assert "unknown command '/bogus'" in err and "conversation reset" in err
