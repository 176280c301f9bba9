"""specfast.vllm on replays of vLLM's calls, without vLLM: the V1 runner's hooks and proposer
call (the V2 speculator's are in test_vllm_v2.py), request ids through new, extended, moved,
preempted, resubmitted and finished requests, and the draft cap by batch size. Every draft is
checked against a fresh NgramDrafter over the row's whole history; planted faults (no history
check, no runner hook, a cap blind to the batch) are the negative controls.

The fakes stand in for vLLM's classes by the names and signatures the plugin reads: GPUModelRunner
(`_update_states`, `propose_draft_token_ids`, `input_batch`), the V2 RequestState and InputBatch,
BaseSpeculator, SpeculatorConfig and `register_speculative_method` (vLLM 0.32-0.34's). The real
vLLM runs in scripts/vllm_check.sh.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import logging
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

import specfast.vllm as sv
import specfast.vllm.plugin
from specfast._core import NgramDrafter
from specfast.vllm.drafts import (
    FREE_TOKENS,
    FREE_TOKENS_ENV,
    MIN_MATCH,
    RequestDrafts,
    draft_cap,
)
from specfast.vllm.v1 import SpecfastProposer, wrap_runner

K = 4
MAX_LEN = 4096


def text_ids(module) -> np.ndarray:
    """A real token stream: the bytes of a standard-library module (repetitive, as code is)."""
    return np.frombuffer(inspect.getsource(module).encode(), np.uint8).astype(np.int32)


STREAMS = [text_ids(m) for m in (types, logging, inspect, importlib)]
STREAM = {"a": STREAMS[0], "b": STREAMS[1], "c": STREAMS[2], "b2": STREAMS[3]}


def oracle(history: np.ndarray, k: int, batch: int = 1, free: int = FREE_TOKENS) -> list[int]:
    """A fresh drafter over the whole history: what an incremental index must propose."""
    d = NgramDrafter(min_match=MIN_MATCH)
    d.extend(np.ascontiguousarray(history, np.uint32))
    cap = draft_cap(k, d.match_length, batch, free)
    return d.propose(cap) if cap > 0 else []


def module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_vllm(monkeypatch):
    """Installs fake `vllm` modules (version and the V2 interface) and forgets what the plugin
    registered; returns the dict `register_speculative_method` fills."""
    registered: dict[str, object] = {}

    class BaseSpeculator:  # vLLM's is an ABC of these methods; the plugin must define them all
        pass

    class SpeculatorConfig:
        speculator_class = None

        @classmethod
        def configure(cls, spec):
            spec.draft_model_config = spec.target_model_config

    def register_speculative_method(name, config_cls):
        if name in registered and registered[name] != config_cls:
            raise ValueError(f"Speculative method '{name}' is already registered.")
        registered[name] = config_cls

    base = "vllm.v1.worker.gpu.spec_decode"
    mods = {
        "vllm": module("vllm", __version__="0.32.0"),
        "vllm.v1": module("vllm.v1"),
        "vllm.v1.worker": module("vllm.v1.worker"),
        "vllm.v1.worker.gpu": module("vllm.v1.worker.gpu"),
        base: module(base),
        f"{base}.speculator": module(f"{base}.speculator", BaseSpeculator=BaseSpeculator),
        f"{base}.speculator_config": module(
            f"{base}.speculator_config",
            SpeculatorConfig=SpeculatorConfig,
            register_speculative_method=register_speculative_method,
        ),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "specfast.vllm.v2", raising=False)
    monkeypatch.setattr(specfast.vllm.plugin, "_registered", None)
    return SimpleNamespace(modules=mods, registered=registered)


def vllm_config(k=K, max_len=MAX_LEN, max_seqs=8):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
    )


# --- V1: a runner as vLLM's GPUModelRunner calls a custom_class proposer ---


class FakeRunner:
    """The slice of vLLM's V1 GPUModelRunner the plugin touches: finished requests leave the
    persistent batch in `_update_states`, the rest condense to the front (rows move), and
    `propose_draft_token_ids` calls `drafter.propose` with rows only."""

    def __init__(self, drafter, max_seqs=8):
        self.drafter = drafter
        self.input_batch = SimpleNamespace(
            req_ids=[],
            token_ids_cpu=np.zeros((max_seqs, MAX_LEN), np.int32),
            num_tokens_no_spec=np.zeros(max_seqs, np.int32),
        )
        self.histories: dict[str, np.ndarray] = {}
        self.streams: dict[str, np.ndarray] = {}

    def _update_states(self, scheduler_output):
        for req_id in scheduler_output.finished_req_ids:
            self.histories.pop(req_id, None)
        for req_id, (stream, n) in scheduler_output.new.items():  # new, resumed or resubmitted
            self.streams[req_id], self.histories[req_id] = stream, stream[:n]
        batch = self.input_batch
        batch.req_ids = list(scheduler_output.order)
        for row, req_id in enumerate(batch.req_ids):
            history = self.histories[req_id]
            batch.token_ids_cpu[row, : len(history)] = history
            batch.num_tokens_no_spec[row] = len(history)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *rest):
        batch = self.input_batch
        return self.drafter.propose(
            sampled_token_ids, batch.num_tokens_no_spec, batch.token_ids_cpu, slot_mappings=None
        )

    def step(self, order, *, grow, finished=(), new=None, prefill=()):
        """One engine step: requests in `order` each gain `grow` tokens (the sampled ones, not
        for those still in prefill); returns {req_id: draft}."""
        for req_id in order:
            if req_id in self.histories and req_id not in prefill:
                n = len(self.histories[req_id]) + grow
                self.histories[req_id] = self.streams[req_id][:n]
        out = SimpleNamespace(finished_req_ids=set(finished), new=new or {}, order=order)
        self._update_states(out)
        sampled = [[] if r in prefill else [int(self.histories[r][-1])] for r in order]
        drafts = self.propose_draft_token_ids(out, sampled, None)
        return dict(zip(order, drafts, strict=True))


def replay_v1(runner: FakeRunner) -> list[tuple[str, list[int], list[int]]]:
    """A request life cycle; returns (request, draft, oracle's draft) for every draft made."""
    seen = []

    def check(drafts, prefill=()):
        batch = len(drafts) - len(prefill)  # the rows that decode
        for req_id, draft in drafts.items():
            history = runner.histories[req_id]
            budget = min(K, MAX_LEN - len(history) - 1)
            want = [] if req_id in prefill else oracle(history, budget, batch)
            seen.append((req_id, draft, want))

    check(runner.step(["a", "b"], grow=0, new={"a": (STREAM["a"], 300), "b": (STREAM["b"], 500)}))
    for _ in range(3):
        check(runner.step(["a", "b"], grow=3))
    # c arrives mid-prefill (nothing sampled, no draft), then a finishes: b moves to row 0.
    new_c = {"c": (STREAM["c"], 200)}
    check(runner.step(["a", "b", "c"], grow=2, new=new_c, prefill={"c"}), {"c"})
    check(runner.step(["b", "c"], grow=2, finished={"a"}))
    # c is preempted (leaves the batch, not finished) and resumed with its history so far.
    check(runner.step(["b"], grow=4))
    check(runner.step(["c", "b"], grow=1, new={"c": (STREAM["c"], len(runner.histories["c"]))}))
    # b finishes and its id comes back with another prompt (aborted and resubmitted).
    check(runner.step(["c", "b"], grow=0, finished={"b"}, new={"b": (STREAM["b2"], 400)}))
    check(runner.step(["c", "b"], grow=2))
    return seen


@pytest.fixture
def v1_proposer(fake_vllm):
    fake_vllm.modules["vllm"].__version__ = "0.32.0"

    def make(drafts=None):
        return SpecfastProposer(vllm_config(), drafts=drafts)

    return make


def hooked_runner(proposer):
    runner_cls = type("Runner", (FakeRunner,), {})
    assert wrap_runner(runner_cls)
    assert not wrap_runner(runner_cls)  # hooking twice is a no-op
    return runner_cls(proposer)


def test_v1_drafts_match_the_whole_history_through_a_request_life_cycle(v1_proposer):
    proposer = v1_proposer()
    runner = hooked_runner(proposer)
    seen = replay_v1(runner)
    assert [(r, d) for r, d, _ in seen] == [(r, w) for r, _, w in seen]
    assert sum(len(d) for _, d, _ in seen) > 20  # the replay drafts, it is not all []
    # a (finished) and the first b are gone; c survived preemption; the new b is indexed.
    assert set(proposer.drafts.requests) == {"b", "c"}
    # Indexed from scratch: a, b, c on arrival and b's new prompt, nothing on moves or resume.
    assert proposer.drafts.rebuilds == 4


class Unchecked(RequestDrafts):
    """Planted fault: extends whatever it holds, without checking the history still agrees."""

    def sync(self, req_id, history):
        state = self.requests.get(req_id)
        if state is None:
            return super().sync(req_id, history)
        if len(history) > state.length:
            state.drafter.extend(np.ascontiguousarray(history[state.length :], np.uint32))
            state.length = len(history)


def test_v1_without_the_runner_hook_keys_rows_and_stays_right(v1_proposer, caplog):
    proposer = v1_proposer()
    runner = FakeRunner(proposer)  # not hooked: the proposer sees rows only
    with caplog.at_level(logging.WARNING):
        seen = replay_v1(runner)
    assert "runner hook is not installed" in caplog.text
    # Rows are checked against what was indexed, so drafts stay right; moves cost rebuilds.
    assert [(r, d) for r, d, _ in seen] == [(r, w) for r, _, w in seen]
    assert all(key.startswith("row ") for key in proposer.drafts.requests)
    assert proposer.drafts.rebuilds > 4


def test_v1_negative_control_no_history_check_drafts_from_another_request(v1_proposer):
    runner = FakeRunner(v1_proposer(Unchecked()))  # rows move, and nothing notices
    seen = replay_v1(runner)
    assert [(r, d) for r, d, _ in seen] != [(r, w) for r, _, w in seen]


def test_v1_negative_control_finished_requests_leak_without_the_hook(v1_proposer):
    proposer = v1_proposer()
    runner_cls = type("Runner", (FakeRunner,), {})
    wrap_runner(runner_cls)
    runner_cls._update_states = FakeRunner._update_states  # the finish hook removed
    seen = replay_v1(runner_cls(proposer))
    assert [(r, d) for r, d, _ in seen] == [(r, w) for r, _, w in seen]
    assert "a" in proposer.drafts.requests  # finished, never freed


def test_v1_drafts_stop_short_of_max_model_len(fake_vllm):
    proposer = SpecfastProposer(vllm_config(max_len=104))
    history = np.tile(np.arange(10, dtype=np.int32), 11)[:100]  # matches everywhere
    rows = np.zeros((1, 104), np.int32)
    rows[0, :100] = history
    proposer.set_batch(["r"])
    assert proposer.propose([[9]], np.array([100]), rows) == [oracle(history, 3)]
    assert len(oracle(history, 3)) == 3
    rows[0, 100:103] = history[:3]
    proposer.set_batch(["r"])
    assert proposer.propose([[2]], np.array([103]), rows) == [[]]  # no room left


def test_v1_refuses_a_vllm_it_was_not_made_for(fake_vllm, caplog):
    fake_vllm.modules["vllm"].__version__ = "0.21.1"
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.22-0\.33.*this is vLLM 0\.21\.1"):
        SpecfastProposer(vllm_config())
    with caplog.at_level(logging.WARNING):
        sv.register()
        sv.register()
    assert caplog.text.count("not registering") == 1
    assert fake_vllm.registered == {}


def test_interface_by_release(fake_vllm):
    assert sv.interface("0.22.0") == "v1"
    assert sv.interface("0.33.1") == "v1"
    assert sv.interface("0.34.0") == "v2"
    assert sv.interface("0.34.2rc1") == "v2"
    assert sv.interface("0.35.0") is None
    assert sv.interface("1.0.0") is None


# --- the draft cap: full drafts where verification is free, the match length where it costs ---


def test_draft_cap_rule():
    # (k, match, batch, free tokens) -> draft tokens
    cases = {
        (4, 2, 1, 8): 4,  # batch 1, a pass of 5 tokens costs about one: all K on any match
        (4, 1, 1, 8): 0,  # below MIN_MATCH: no draft
        (4, 0, 1, 8): 0,
        (0, 9, 1, 8): 0,
        (4, 2, 2, 8): 3,  # 8 // 2 - 1 free draft tokens a row
        (4, 2, 4, 8): 2,  # 1 free a row: the match length caps
        (4, 3, 8, 8): 3,
        (4, 9, 8, 8): 4,  # a long match drafts K at any batch
        (4, 2, 64, 8): 2,
        (4, 2, 1, 1): 2,  # verification never free: the match-length cap at batch 1 too
        (8, 2, 1, 8): 7,  # 8 free tokens hold 7 drafts and the sampled token
        (4, 2, 0, 8): 4,  # a batch of 0 counts as 1
    }
    for (k, match, batch, free), want in cases.items():
        assert draft_cap(k, match, batch, free) == want, (k, match, batch, free)
    grid = [(m, b, f) for m in range(12) for b in range(1, 20) for f in (1, 5, 8, 40)]
    for m, b, f in grid:
        cap = draft_cap(4, m, b, f)
        assert 0 <= cap <= 4
        assert cap >= draft_cap(4, m, b + 1, f)  # tighter as the batch grows
        assert cap <= draft_cap(4, m + 1, b, f) and cap <= draft_cap(4, m, b, f + 1)
        assert cap == 0 or cap >= min(4, m)  # never below the match-length cap


def two_token_match() -> np.ndarray:
    """A history whose longest earlier match is 2 tokens (1, 2), followed there by 3 4 5 6."""
    return np.array([1, 2, 3, 4, 5, 6, 7, 9, 9, 8, 1, 2], np.int32)


class BatchBlind(RequestDrafts):
    """Planted fault: the old rule, the match-length cap whatever the batch."""

    def propose(self, req_id, k, batch=1):
        return super().propose(req_id, k, batch=1 << 20)


@pytest.mark.parametrize("drafts, want_at_1", [(RequestDrafts, 4), (BatchBlind, 2)])
def test_v1_drafts_all_k_at_batch_1_and_the_match_length_in_a_batch(fake_vllm, drafts, want_at_1):
    history = two_token_match()
    rows = np.zeros((8, 64), np.int32)
    rows[:, : len(history)] = history
    proposer = SpecfastProposer(vllm_config(), drafts=drafts(free_tokens=8))
    # One row decodes, one is mid-prefill: a batch of 1 verifies, so the draft is all K.
    proposer.set_batch(["a", "p"])
    got = proposer.propose([[2], []], np.array([12, 12]), rows)
    assert got[0] == [3, 4, 5, 6][:want_at_1] and got[1] == []  # negative control: 2, not 4
    # Eight rows decode: a draft token is no longer free, so the match length caps it.
    proposer.set_batch([f"r{i}" for i in range(8)])
    got = proposer.propose([[2]] * 8, np.full(8, 12), rows)
    assert got == [[3, 4]] * 8


def test_free_tokens_from_the_environment(monkeypatch):
    monkeypatch.delenv(FREE_TOKENS_ENV, raising=False)
    assert RequestDrafts().free_tokens == FREE_TOKENS
    monkeypatch.setenv(FREE_TOKENS_ENV, "40")
    assert RequestDrafts().free_tokens == 40
    assert RequestDrafts(free_tokens=3).free_tokens == 3
    for bad in ("0", "-2", "many", ""):
        monkeypatch.setenv(FREE_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=FREE_TOKENS_ENV):
            RequestDrafts()
