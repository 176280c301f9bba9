"""specfast.vllm on replays of vLLM's calls, without vLLM: the V1 runner's hooks and proposer
call, the V2 speculator's, request ids through new, extended, moved, preempted, resubmitted and
finished requests. Every draft is checked against a fresh NgramDrafter over the row's whole
history; planted faults (no history check, no runner hook) are the negative controls.

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
import torch

import specfast.vllm as sv
import specfast.vllm.plugin
from specfast._core import NgramDrafter
from specfast.vllm.drafts import K_FACTOR, MIN_MATCH, RequestDrafts
from specfast.vllm.v1 import SpecfastProposer, wrap_runner

K = 4
MAX_LEN = 4096


def text_ids(module) -> np.ndarray:
    """A real token stream: the bytes of a standard-library module (repetitive, as code is)."""
    return np.frombuffer(inspect.getsource(module).encode(), np.uint8).astype(np.int32)


STREAMS = [text_ids(m) for m in (types, logging, inspect, importlib)]
STREAM = {"a": STREAMS[0], "b": STREAMS[1], "c": STREAMS[2], "b2": STREAMS[3]}


def oracle(history: np.ndarray, k: int) -> list[int]:
    """A fresh drafter over the whole history: what an incremental index must propose."""
    d = NgramDrafter(min_match=MIN_MATCH, k_factor=K_FACTOR)
    d.extend(np.ascontiguousarray(history, np.uint32))
    return d.propose(k) if k > 0 else []


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
        for req_id, draft in drafts.items():
            history = runner.histories[req_id]
            want = [] if req_id in prefill else oracle(history, min(K, MAX_LEN - len(history) - 1))
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


# --- V2: the registered method, as vLLM 0.34's V2 runner drives a speculator ---


class FakeRequestState:
    """vLLM's V2 RequestState by the fields the speculator reads: token history per slot."""

    def __init__(self, max_seqs=8):
        self.all_token_ids = SimpleNamespace(gpu=torch.zeros(max_seqs, MAX_LEN, dtype=torch.int32))
        self.total_len = SimpleNamespace(gpu=torch.zeros(max_seqs, dtype=torch.int32))
        self.req_id_to_index: dict[str, int] = {}
        self.free = list(range(max_seqs))

    def add(self, req_id, history):
        slot = self.free.pop()
        self.req_id_to_index[req_id] = slot
        self.write(req_id, history)
        return slot

    def write(self, req_id, history):
        slot = self.req_id_to_index[req_id]
        self.all_token_ids.gpu[slot, : len(history)] = torch.from_numpy(history)
        self.total_len.gpu[slot] = len(history)

    def remove(self, req_id):
        self.free.append(self.req_id_to_index.pop(req_id))


def v2_propose(spec, states, order, sampled):
    slots = np.array([states.req_id_to_index[r] for r in order], np.int32)
    last = torch.zeros(len(states.free) + len(states.req_id_to_index), dtype=torch.int64)
    for slot in slots:
        last[slot] = int(states.all_token_ids.gpu[slot, int(states.total_len.gpu[slot]) - 1])
    batch = SimpleNamespace(req_ids=list(order), num_reqs=len(order), idx_mapping_np=slots)
    none = None
    return spec.propose(
        batch, none, none, none, none, torch.tensor(sampled), torch.zeros(len(order)),
        last, none, none, none,
    )  # fmt: skip


def test_v2_speculator_through_a_request_life_cycle(fake_vllm):
    fake_vllm.modules["vllm"].__version__ = "0.34.0"
    sv.register()
    sv.register()  # twice: one registration, not an error
    assert fake_vllm.registered == {"specfast": "specfast.vllm.v2.SpecfastSpeculatorConfig"}
    v2 = importlib.import_module("specfast.vllm.v2")
    config = SimpleNamespace(target_model_config="target", num_speculative_tokens=None)
    v2.SpecfastSpeculatorConfig.configure(config)
    assert config.draft_model_config == "target" and config.num_speculative_tokens == v2.DEFAULT_K
    assert v2.SpecfastSpeculatorConfig.speculator_class == "specfast.vllm.v2.SpecfastSpeculator"

    states = FakeRequestState()
    ranks = [v2.SpecfastSpeculator(vllm_config(), torch.device("cpu"), states) for _ in range(2)]
    hist = {"a": STREAMS[0][:300], "b": STREAMS[1][:500]}
    for r, h in hist.items():
        slot = states.add(r, h)
        for spec in ranks:
            spec.add_request(slot)
    drafted = 0

    def step(order, grow, prefill=()):
        nonlocal drafted
        for r in order:
            if r not in prefill:
                full = STREAMS[["a", "b", "c"].index(r[0]) % len(STREAMS)]
                hist[r] = full[: len(hist[r]) + grow]
                states.write(r, hist[r])
        sampled = [0 if r in prefill else 1 + grow for r in order]
        outs = [v2_propose(spec, states, order, sampled) for spec in ranks]
        assert torch.equal(outs[0], outs[1])  # every tensor-parallel rank drafts the same
        out = outs[0]
        assert out.shape == (len(order), K) and out.dtype == torch.int64
        for row, r in enumerate(order):
            last = int(hist[r][-1])
            want = [] if r in prefill else oracle(hist[r], K)
            drafted += len(want)
            assert out[row].tolist() == want + [last] * (K - len(want)), r

    step(["a", "b"], 0)
    step(["a", "b"], 3)
    hist["c"] = STREAMS[2][:200]
    states.add("c", hist["c"])
    step(["a", "b", "c"], 2, prefill={"c"})
    for spec in ranks:
        spec.on_requests_finished({"a"})
    states.remove("a")
    step(["c", "b"], 2)
    assert set(ranks[0].drafts.requests) == {"b", "c"}
    step(["b"], 1)  # c preempted: kept
    step(["c", "b"], 1)
    assert ranks[0].drafts.rebuilds == 3
    assert drafted > 10
    for spec in ranks:
        spec.reset_state()
    assert len(ranks[0].drafts) == 0
    step(["c", "b"], 1)  # after a reset, rebuilt from the history: the same drafts
    assert ranks[0].drafts.rebuilds == 5


def test_v2_dummy_runs_and_empty_batches_draft_nothing(fake_vllm):
    fake_vllm.modules["vllm"].__version__ = "0.34.0"
    v2 = importlib.import_module("specfast.vllm.v2")
    states = FakeRequestState()
    spec = v2.SpecfastSpeculator(vllm_config(), torch.device("cpu"), states)
    batch = SimpleNamespace(req_ids=["x"], num_reqs=1, idx_mapping_np=np.array([0]))
    out = spec.propose(batch, *[None] * 4, torch.ones(1), torch.zeros(1), torch.zeros(8),
                       None, None, None, dummy_run=True)  # fmt: skip
    assert out.shape == (1, K) and len(spec.drafts) == 0
