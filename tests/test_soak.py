"""A short soak: 200 generate() calls on a tiny model, mixing greedy and sampled, n-gram / draft
model / no drafter and stop strings, with two memory-slope checks. The long runs are
`python benches/soak.py` (10,000 tiny calls, 500 SmolLM2 calls).

- The Python heap as tracemalloc traces it: no allocator noise, so a tight tolerance (2 KB a
  call) catches a list that keeps a few KB per call.
- RSS, which also sees torch and Rust memory but moves in one-off steps of about 3 MB (the
  allocator and huge pages), so over 200 calls only a tolerance of 100 KB a call is safe.

Each check has its negative control: the same run with a leak of that size's double.
"""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

from soak import soak, summarize, tiny_model

CALLS, EVERY = 200, 20
HEAP_TOLERANCE = 2.0  # MB / 1,000 calls = 2 KB a call
RSS_TOLERANCE = 100.0  # MB / 1,000 calls = 100 KB a call

PROMPTS = [[5, 6, 7, 8] * 4, list(range(30, 70)), [1, 2, 3, 1, 2, 3, 1, 2]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only spins on a shared machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    model, draft = tiny_model(0), tiny_model(1)
    soak(model, draft, PROMPTS, 40, EVERY, max_new_tokens=8)  # warm-up: caches, allocator
    return model, draft


def _slopes(models, after_call=None) -> dict:
    tracemalloc.start()
    try:
        res = soak(*models, PROMPTS, CALLS, EVERY, max_new_tokens=8, after_call=after_call)
    finally:
        tracemalloc.stop()
    return summarize(res, warmup_fraction=0.0)


def test_short_soak_memory_slopes(models):
    s = _slopes(models)
    assert s["python_heap_slope_mb_per_1000"] < HEAP_TOLERANCE, s
    assert s["rss_slope_mb_per_1000"] < RSS_TOLERANCE, s


def test_short_soak_python_heap_catches_a_small_leak(models):
    kept: list[bytes] = []
    s = _slopes(models, after_call=lambda i: kept.append(b"%d" % i * 800))  # ~4 KB a call
    assert s["python_heap_slope_mb_per_1000"] >= HEAP_TOLERANCE, s
    assert s["rss_slope_mb_per_1000"] < RSS_TOLERANCE, s  # too small for RSS to see


def test_short_soak_rss_catches_a_leak(models):
    kept: list[bytearray] = []
    s = _slopes(models, after_call=lambda i: kept.append(bytearray(b"x" * 200_000)))  # resident
    assert s["rss_slope_mb_per_1000"] >= RSS_TOLERANCE, s
