"""specfast.vllm's V2 speculator (vLLM 0.34's method "specfast") on replays of the V2 runner's
calls, without vLLM: fakes and the oracle come from test_vllm_plugin.py."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import torch
from test_vllm_plugin import (
    MAX_LEN,
    STREAMS,
    K,
    fake_vllm,  # noqa: F401  (a fixture)
    oracle,
    vllm_config,
)

import specfast.vllm as sv

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


def test_v2_speculator_through_a_request_life_cycle(fake_vllm):  # noqa: F811
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
            want = [] if r in prefill else oracle(hist[r], K, free=8 * (K + 1))
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


def test_v2_dummy_runs_and_empty_batches_draft_nothing(fake_vllm):  # noqa: F811
    fake_vllm.modules["vllm"].__version__ = "0.34.0"
    v2 = importlib.import_module("specfast.vllm.v2")
    states = FakeRequestState()
    spec = v2.SpecfastSpeculator(vllm_config(), torch.device("cpu"), states)
    batch = SimpleNamespace(req_ids=["x"], num_reqs=1, idx_mapping_np=np.array([0]))
    out = spec.propose(batch, *[None] * 4, torch.ones(1), torch.zeros(1), torch.zeros(8),
                       None, None, None, dummy_run=True)  # fmt: skip
    assert out.shape == (1, K) and len(spec.drafts) == 0
