"""Host syncs per generate() round on CUDA, counted on this CPU machine under FakeTensorMode
(test_fake_cuda.FakeCuda): a value read back (.tolist(), .item()) or a blocking host-to-device
copy (a copy from pageable memory waits for the queued pass) is one. A round should have one:
its k+1 ids (or accepted tokens) coming back. The `cuda` tests count the same with
torch.cuda.set_sync_debug_mode on a real GPU."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from test_fake_cuda import DRAFT, FakeCuda, cuda_head, cuda_model, run

from specfast.model import Model
from specfast.targets import base

generate_module = importlib.import_module("specfast.generate")
decoder_module = importlib.import_module("specfast.model.decoder")


def blocking(values, device, dtype=torch.long):
    """An upload as it was before base.to_device: from pageable memory, so it waits."""
    return torch.tensor(values, dtype=dtype, device=device)


def rounds(drafter, temperature=0.0, static=False, **kw) -> FakeCuda:
    with FakeCuda() as fc:
        target = cuda_model(static=static)
        d = {"draft-model": lambda: cuda_model(DRAFT), "eagle": lambda: cuda_head(target)}
        run(
            target, drafter=d[drafter]() if drafter in d else drafter, temperature=temperature, **kw
        )
    assert len(fc.rounds) >= 3
    return fc


@pytest.mark.parametrize("static", [False, True], ids=["eager-step", "static-step"])
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_greedy_round_syncs_once(drafter, static):
    """The round's k+1 argmax ids coming back (Decoder.greedy_ids), and nothing else."""
    fc = rounds(drafter, static=static)
    assert all(r == ["tolist"] for r in fc.rounds), fc.rounds


def test_control_a_greedy_round_with_a_blocking_upload_syncs_twice(monkeypatch):
    """greedy_ids uploading the round's ids with torch.tensor(device=...), as it once did."""
    monkeypatch.setattr(decoder_module, "to_device", blocking)
    fc = rounds("ngram")
    assert all(r == ["upload", "tolist"] for r in fc.rounds), fc.rounds


@pytest.mark.parametrize("static", [False, True], ids=["eager-step", "static-step"])
@pytest.mark.parametrize("drafter", ["ngram", "draft-model", "eagle"])
def test_the_target_pass_of_a_sampled_round_syncs_once(drafter, static):
    fc = rounds(drafter, temperature=0.8, seed=1, static=static)
    assert all(v == ["tolist"] for v in fc.verify_syncs), fc.verify_syncs


@pytest.mark.parametrize("static", [False, True], ids=["eager-step", "static-step"])
def test_the_target_pass_of_a_greedy_eagle_round_syncs_once(static):
    """An EAGLE head needs the target's features, so its rounds upload in generate.py."""
    fc = rounds("eagle", static=static)
    assert all(v == ["tolist"] for v in fc.verify_syncs), fc.verify_syncs


def test_control_a_blocking_upload_is_counted(monkeypatch):
    """generate.py's upload made blocking again (as before base.to_device): two syncs."""
    monkeypatch.setattr(generate_module, "to_device", blocking)
    fc = rounds("ngram", temperature=0.8, seed=1)
    assert all(v == ["upload", "tolist"] for v in fc.verify_syncs), fc.verify_syncs


def test_control_an_item_inside_a_step_is_counted(monkeypatch):
    real = Model.pass_for

    def planted(self, cache):
        run = real(self, cache)

        def read_back(ids, *args):
            _ = ids.max().item()  # the bug: a value read back inside the pass
            return run(ids, *args)

        return read_back

    monkeypatch.setattr(Model, "pass_for", planted)
    fc = rounds("ngram", temperature=0.8, seed=1)
    assert all(v == ["read", "tolist"] for v in fc.verify_syncs), fc.verify_syncs


def test_to_device_copies_without_waiting_only_on_cuda():
    ids = base.to_device([1, 2, 3], torch.device("cpu"))
    assert ids.tolist() == [1, 2, 3] and ids.dtype == torch.long
    with FakeCuda() as fc:
        on_cuda = base.to_device([4, 5], torch.device("cuda"))
        assert on_cuda.device.type == "cuda" and fc.syncs == []


# ----------------------------------------------------------------------------
# real CUDA (scripts/gpu_check.sh): torch's own sync debug mode


def cuda_round_syncs(model, **kw) -> list[int]:
    """Synchronising CUDA calls per round, as torch.cuda.set_sync_debug_mode("warn") sees them."""
    counts: list[int] = []
    real = generate_module.speculate

    def counted(*args, **kwargs):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            real(*args, **kwargs)
        counts.append(sum("synchroniz" in str(w.message) for w in seen))

    generate_module.speculate = counted
    torch.cuda.set_sync_debug_mode("warn")
    try:
        run(model, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        generate_module.speculate = real
    return counts


@pytest.mark.cuda
def test_cuda_sampled_rounds_sync_once():
    model = Model.from_config(DRAFT, seed=1, device="cuda")
    counts = cuda_round_syncs(model, drafter="ngram", temperature=0.8, seed=1)
    assert counts and set(counts) == {1}, counts


@pytest.mark.cuda
def test_cuda_greedy_rounds_sync_once():
    model = Model.from_config(DRAFT, seed=1, device="cuda")
    counts = cuda_round_syncs(model, drafter="ngram")
    assert counts and set(counts) == {1}, counts
