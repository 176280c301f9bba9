"""The Python face of the n-gram drafter: accepted inputs, results, and bad input."""

import copy
import random
import threading

import numpy as np
import pytest
import torch

import specfast
from specfast import NgramDrafter

POLICIES = ["earliest", "recent", "frequent"]


# ---- a brute-force reference for the live sequence (the Rust proptests cover the corpus)


def reference(seq: list[int], k: int, policy: str) -> list[int]:
    n = len(seq)
    for length in range(n - 1, 0, -1):
        suffix = seq[n - length :]
        ends = [j for j in range(length - 1, n - 1) if seq[j - length + 1 : j + 1] == suffix]
        if not ends:
            continue
        if policy == "frequent":
            out: list[int] = []
            w = list(suffix)
            while len(out) < k:
                counts: dict[int, int] = {}
                m = len(w)
                for j in range(m - 1, n - 1):
                    if seq[j - m + 1 : j + 1] == w:
                        counts[seq[j + 1]] = counts.get(seq[j + 1], 0) + 1
                if not counts:
                    break
                t = min(counts, key=lambda t: (-counts[t], t))
                out.append(t)
                w.append(t)
            return out
        end = ends[-1] if policy == "recent" else ends[0]
        ext = list(seq)
        for i in range(k):
            ext.append(ext[end + 1 + i])
        return ext[n:]
    return []


@pytest.mark.parametrize("policy", POLICIES)
def test_matches_reference(policy: str) -> None:
    rng = random.Random(0)
    for _ in range(40):
        seq = [rng.randrange(4) * 65_537 for _ in range(rng.randrange(1, 60))]
        d = NgramDrafter(policy=policy)
        for i, t in enumerate(seq):
            d.extend([t])
            k = rng.randrange(0, 10)
            assert d.propose(k) == reference(seq[: i + 1], k, policy)


def test_exported_and_defaults() -> None:
    d = specfast.NgramDrafter()
    assert d.policy == "earliest"
    assert d.min_match == 1
    assert d.k_factor == float("inf")
    assert len(d) == 0
    assert d.propose(8) == []
    assert d.match_length == 0
    assert "NgramDrafter(" in repr(d)


def test_proposes_continuation_and_overlap() -> None:
    d = NgramDrafter()
    d.extend([1, 2, 3, 4, 1, 2])
    assert d.match_length == 2
    assert d.propose(2) == [3, 4]
    # Past the end, the copy continues from itself: a repeating pattern goes on.
    assert d.propose(5) == [3, 4, 1, 2, 3]
    assert d.propose(0) == []


def test_policies_differ() -> None:
    seq = [1, 6, 2, 1, 6, 3, 1, 5, 4, 1]
    got = {}
    for policy in POLICIES:
        d = NgramDrafter(policy=policy)
        d.extend(seq)
        got[policy] = d.propose(1)
    assert got == {"earliest": [6], "recent": [5], "frequent": [6]}


def test_min_match_and_evidence_cap() -> None:
    d = NgramDrafter(min_match=3, k_factor=1.0, k_offset=1.0)
    d.extend([1, 2, 3, 4, 5, 6, 7, 1, 2])
    assert d.propose(8) == []
    d.extend([3])
    assert d.propose(8) == [4, 5, 6, 7]  # floor(1.0 * 3 + 1) = 4
    assert d.propose(2) == [4, 5]


def test_input_kinds_agree() -> None:
    big = [5, 9, 5, 9, 300_000, 5, 9]
    small = [5, 9, 5, 9, 200, 5, 9]
    cases = [
        (big, big),
        (tuple(big), big),
        (np.array(big, dtype=np.int64), big),
        (np.array(big, dtype=np.uint32), big),
        (np.array(big, dtype=np.int32), big),
        (np.array(big, dtype=np.uint64), big),
        (torch.tensor(big), big),
        (torch.tensor(big, dtype=torch.int32), big),
        (np.array(small, dtype=np.uint8), small),
        (np.array(small, dtype=np.int16), small),
        (torch.tensor(small, dtype=torch.int16), small),
        (torch.tensor(small, dtype=torch.uint8), small),
    ]
    for tokens, seq in cases:
        d = NgramDrafter()
        d.extend(tokens)
        assert len(d) == len(seq)
        assert d.propose(4) == reference(seq, 4, "earliest") == [5, 9, seq[4], 5]


def test_noncontiguous_array() -> None:
    arr = np.arange(40, dtype=np.int64) % 5
    d = NgramDrafter()
    d.extend(arr[::2])
    e = NgramDrafter()
    e.extend(list(arr[::2]))
    assert d.propose(4) == e.propose(4)


def test_empty_inputs() -> None:
    d = NgramDrafter()
    d.extend([])
    d.extend(np.array([], dtype=np.int64))
    d.add_document([])
    assert len(d) == 0
    assert d.propose(4) == []


def test_corpus_and_reset() -> None:
    d = NgramDrafter()
    d.add_document([10, 11, 12, 13])
    d.add_document(np.array([20, 21], dtype=np.int64))
    assert d.corpus_tokens == 6
    d.extend([11, 12])
    assert d.propose(5) == [13]
    d.extend([13, 20])
    assert d.match_length == 1  # [13, 20] spans a document boundary
    assert d.propose(5) == [21]
    d.reset()
    assert len(d) == 0
    assert d.corpus_tokens == 6  # the corpus survives reset
    d.extend([10])
    assert d.propose(2) == [11, 12]


def check_copy(copier) -> None:
    """copier(d) has d's options, corpus and live sequence, and afterwards neither sees the
    other's tokens."""
    d = NgramDrafter(min_match=2, policy="recent", k_factor=2.0, max_corpus_tokens=1000)
    d.add_document([10, 11, 12, 13, 14])
    d.extend([1, 2, 3, 1, 2])
    c = copier(d)
    assert (c.min_match, c.policy, c.k_factor, c.max_corpus_tokens) == (2, "recent", 2.0, 1000)
    assert len(c) == len(d) == 5 and c.corpus_tokens == d.corpus_tokens == 5
    before = d.propose(8)
    assert before[0] == 3 and c.propose(8) == before
    c.extend([7, 8, 9, 7, 8])
    assert c.propose(8)[0] == 9 and d.propose(8) == before and len(d) == 5
    d.add_document([7, 8, 50])
    assert c.corpus_tokens == 5
    c.reset()
    c.extend([11, 12])
    assert c.propose(3) == [13, 14]  # the corpus came along


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy])
def test_a_copy_is_equal_and_independent(copier) -> None:
    check_copy(copier)  # copy.copy is Rust's Clone


def _rebuilt_without_corpus(d):
    new = NgramDrafter(min_match=d.min_match, policy=d.policy, k_factor=d.k_factor,
                       max_corpus_tokens=d.max_corpus_tokens)  # fmt: skip
    new.extend([1, 2, 3, 1, 2])
    return new


@pytest.mark.parametrize("wrong", [lambda d: d, _rebuilt_without_corpus])
def test_negative_control_a_shared_or_corpusless_copy_is_caught(wrong) -> None:
    with pytest.raises(AssertionError):
        check_copy(wrong)


def test_corpus_eviction() -> None:
    d = NgramDrafter(max_corpus_tokens=100)
    for i in range(50):
        d.add_document(list(range(i * 1000, i * 1000 + 30)))
        assert d.corpus_tokens <= 100
    d.extend([49_000])
    assert d.propose(3) == [49_001, 49_002, 49_003]
    d.extend([0])  # the first document was evicted
    assert d.propose(3) == []


def test_long_extend_releases_and_counts() -> None:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 50, size=100_000, dtype=np.int64)
    d = NgramDrafter()
    t = threading.Thread(target=d.extend, args=(arr,))
    t.start()
    t.join()
    assert len(d) == 100_000
    assert 0 < d.memory_bytes() / len(d) < 200


# ---- bad input: ValueError or TypeError that says what is allowed, never a panic

ALLOWED = "a list or tuple of ints"


@pytest.mark.parametrize(
    ("tokens", "exc"),
    [
        ([-1], ValueError),
        ([2**32], ValueError),
        ([2**70], ValueError),
        (np.array([-3], dtype=np.int64), ValueError),
        (np.array([2**32], dtype=np.int64), ValueError),
        (np.array([2**63], dtype=np.uint64), ValueError),
        (torch.tensor([-1]), ValueError),
        ([1.0], TypeError),
        ([1, "2"], TypeError),
        ([None], TypeError),
        ([True], TypeError),
        ("abc", TypeError),
        (b"abc", TypeError),
        (5, TypeError),
        (None, TypeError),
        ({1, 2}, TypeError),
        (np.zeros(3), TypeError),
        (np.zeros(3, dtype=np.float32), TypeError),
        (np.zeros(3, dtype=bool), TypeError),
        (np.array(["a"]), TypeError),
        (np.zeros((2, 2), dtype=np.int64), ValueError),
        (np.int64(3), TypeError),
        (np.zeros((), dtype=np.int64), ValueError),
        (torch.zeros(3), TypeError),
        (torch.zeros(3, dtype=torch.bool), TypeError),
        (torch.zeros((2, 2), dtype=torch.long), ValueError),
    ],
)
@pytest.mark.parametrize("method", ["extend", "add_document"])
def test_bad_tokens(tokens: object, exc: type, method: str) -> None:
    d = NgramDrafter()
    with pytest.raises(exc) as info:
        getattr(d, method)(tokens)
    msg = str(info.value)
    assert method in msg
    assert ALLOWED in msg or "[0, 2**32)" in msg
    assert len(d) == 0
    assert d.corpus_tokens == 0


def test_bad_tokens_leave_state_unchanged() -> None:
    d = NgramDrafter()
    d.extend([1, 2, 1])
    with pytest.raises(ValueError):
        d.extend([1, 2, -5])
    assert len(d) == 3
    assert d.propose(2) == [2, 1]


@pytest.mark.parametrize(
    ("k", "exc"),
    [
        (-1, ValueError),
        (2**20 + 1, ValueError),
        (2**64, ValueError),
        (1.5, TypeError),
        ("8", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_bad_k(k: object, exc: type) -> None:
    d = NgramDrafter()
    d.extend([1, 2, 1])
    with pytest.raises(exc, match=r"k must be an int in \[0, 1048576\]"):
        d.propose(k)  # type: ignore[arg-type]


def test_largest_k_is_fine() -> None:
    d = NgramDrafter()
    d.extend([7, 7])
    assert d.propose(2**20) == [7] * 2**20


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"policy": "best"}, ValueError),
        ({"policy": 3}, TypeError),
        ({"min_match": 0}, ValueError),
        ({"min_match": -2}, ValueError),
        ({"min_match": 1.5}, TypeError),
        ({"k_factor": -1.0}, ValueError),
        ({"k_factor": float("nan")}, ValueError),
        ({"k_offset": float("inf")}, ValueError),
        ({"k_factor": "x"}, TypeError),
        ({"max_corpus_tokens": -1}, ValueError),
        ({"max_corpus_tokens": 2**40}, ValueError),
    ],
)
def test_bad_options(kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        NgramDrafter(**kwargs)


def test_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        NgramDrafter(2)  # type: ignore[misc]
