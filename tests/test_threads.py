"""Threads: an NgramDrafter shared by 8 threads serialises call by call; generate() runs in
parallel threads on separate models and on one shared model.

Where the GIL is released: only inside NgramDrafter.extend / add_document of more than 4096
tokens, and while a call waits for the drafter's lock. The acceptance functions never release it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import specfast
from specfast import NgramDrafter
from specfast.model import Model, ModelConfig

THREADS = 8
CHUNK = 5000  # above the 4096 tokens past which extend releases the GIL


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Several generate() threads on 2 cores: torch's own intra-op threads would only oversubscribe.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_threads(target, n=THREADS):
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def wrapped(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # recorded, so a failure in a thread fails the test
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.mark.parametrize("policy", ["earliest", "recent", "frequent"])
def test_shared_ngram_drafter_serialises(policy):
    # Every thread extends with the same chunk, so whatever the interleaving the sequence after m
    # extends is the chunk m times: every proposal seen must be a single-thread run's proposal
    # after some m, and the final state must equal the single-thread one. Before the drafter sat
    # behind a lock, calls overlapping a detached extend raised "RuntimeError: Already borrowed".
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 40, CHUNK).astype(np.uint32)
    rounds = 3
    single = NgramDrafter(policy=policy)
    allowed = {tuple(single.propose(8))}
    for _ in range(THREADS * rounds):
        single.extend(chunk)
        allowed.add(tuple(single.propose(8)))

    shared = NgramDrafter(policy=policy)
    seen: list[tuple[int, ...]] = []

    def work(i):
        for _ in range(rounds):
            if i % 2:
                shared.extend(chunk)  # detached: the other threads run meanwhile
            else:
                shared.extend(chunk.tolist())  # a list: converted, then detached the same way
            for _ in range(5):
                seen.append(tuple(shared.propose(8)))
                assert len(shared) % CHUNK == 0  # never half an extend
                repr(shared)
                _ = shared.match_length

    assert _run_threads(work) == []
    assert len(shared) == len(single) == THREADS * rounds * CHUNK
    assert shared.propose(16) == single.propose(16)
    assert shared.match_length == single.match_length
    assert set(seen) <= allowed


def test_shared_drafter_reset_and_documents_from_threads():
    # reset / add_document / extend / propose racing: no exception, no crash, and the end state
    # is one a serial order could produce (the corpus holds every document).
    d = NgramDrafter(max_corpus_tokens=1 << 20)
    doc = np.arange(CHUNK, dtype=np.uint32) % 97

    def work(i):
        for j in range(4):
            if i == 0:
                d.reset()
            elif i % 3 == 1:
                d.add_document(doc)
            else:
                d.extend(doc[: 10 + j])
            d.propose(4)

    assert _run_threads(work) == []
    docs = sum(1 for i in range(THREADS) if i % 3 == 1) * 4
    assert d.corpus_tokens == docs * CHUNK
    assert len(d) <= (THREADS - 1) * sum(10 + j for j in range(4))


def _tiny(seed):
    config = ModelConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
        max_context=256,
    )  # fmt: skip
    return Model.from_config(config, seed=seed)


PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


def _gen(model, **kw):
    return specfast.generate(model, PROMPT, max_new_tokens=40, ignore_eos=True, **kw).token_ids


def test_generate_on_two_models_in_two_threads():
    models = [_tiny(1), _tiny(2)]
    kinds = [dict(), dict(temperature=0.8, seed=3), dict(drafter=None)]
    expected = [[_gen(m, **kw) for kw in kinds] for m in models]
    got: dict[int, list] = {}

    def work(i):
        got[i] = [_gen(models[i], **kw) for kw in kinds for _ in range(3)]

    assert _run_threads(work, n=2) == []
    for i in range(2):
        assert got[i] == [e for e in expected[i] for _ in range(3)]


def test_generate_on_one_model_from_four_threads():
    # A Model holds no per-call state (each generate() makes its own decoder and KV cache).
    model = _tiny(4)
    expected = _gen(model)
    got: dict[int, list] = {}

    def work(i):
        got[i] = _gen(model)

    assert _run_threads(work, n=4) == []
    assert all(v == expected for v in got.values())


def test_save_while_other_threads_add_documents(tmp_path):
    # save() runs detached under the lock: every file written mid-race holds whole documents.
    d = NgramDrafter()
    doc = (np.arange(CHUNK, dtype=np.uint32) * 7) % 1000

    def work(i):
        for j in range(3):
            if i % 2:
                d.add_document(doc)
            else:
                d.save(tmp_path / f"c{i}-{j}.bin")

    assert _run_threads(work) == []
    files = sorted(tmp_path.glob("*.bin"))
    assert len(files) == THREADS // 2 * 3
    for f in files:
        assert NgramDrafter.load(f).corpus_tokens % CHUNK == 0
    assert d.corpus_tokens == THREADS // 2 * 3 * CHUNK
