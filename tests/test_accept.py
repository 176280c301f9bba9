"""Acceptance: greedy verification, Level 0 exact enumeration, Rust/torch agreement, errors.

Level 1 (Monte Carlo with negative controls) is in test_accept_mc.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import specfast
from specfast import _core
from specfast.sampling import _rule

# ---------------------------------------------------------------------------------------------
# Greedy


def test_greedy():
    assert specfast.accept_greedy([1, 2, 3], [1, 2, 9, 4]) == [1, 2, 9]
    assert specfast.accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert specfast.accept_greedy([1, 2, 3], [5, 2, 3, 4]) == [5]
    assert specfast.accept_greedy([], [7]) == [7]
    assert specfast.accept_greedy(np.array([1, 2]), torch.tensor([1, 2, 3])) == [1, 2, 3]


@pytest.mark.parametrize(
    ("draft", "target", "exc", "match"),
    [
        ([1, 2], [1, 2], ValueError, "len\\(draft\\) \\+ 1"),
        ([1], [1, 2, 3], ValueError, "len\\(draft\\) \\+ 1"),
        ([-1], [1, 2], ValueError, "not a valid token id"),
        ([1], [1, 2**40], ValueError, "not a valid token id"),
        ("ab", [1, 2, 3], TypeError, "got str"),
        ([1.5], [1, 2], TypeError, "int token ids"),
    ],
)
def test_greedy_bad_input(draft, target, exc, match):
    with pytest.raises(exc, match=match):
        specfast.accept_greedy(draft, target)


# ---------------------------------------------------------------------------------------------
# Level 0: exact enumeration of the implemented rule, float64


def _dirichlet(rng, v, alpha=1.0, zeros=0):
    w = rng.dirichlet(np.full(v, alpha))
    if zeros:
        w[rng.choice(v, zeros, replace=False)] = 0.0
        w /= w.sum()
    return w


def _scenarios():
    rng = np.random.default_rng(0)
    v = 10
    p, p2 = _dirichlet(rng, v), _dirichlet(rng, v)
    out = {
        "dirichlet": (p, _dirichlet(rng, v), p2),
        "sparse": (_dirichlet(rng, v, 0.3, zeros=5), _dirichlet(rng, v, 0.3, zeros=4), p2),
        "equal": (p, p.copy(), p2),
        "one_hot": (p, None, p2),
        "one_hot_sparse": (_dirichlet(rng, v, 0.5, zeros=6), None, p2),
    }
    disjoint_p, disjoint_q = np.zeros(v), np.zeros(v)
    disjoint_p[:5] = _dirichlet(rng, 5)
    disjoint_q[5:] = _dirichlet(rng, 5)
    out["disjoint"] = (disjoint_p, disjoint_q, p2)
    return out


SCENARIOS = _scenarios()


def _implied(tables, p, q):
    """Σ_d q(d)[a(d) δ_d + (1 − a(d)) r_d], plus the bonus distribution, from per-d tables."""
    v = len(p)
    drafts = [(d, q[d]) for d in range(v) if q[d] > 0] if q is not None else None
    first = np.zeros(v)
    if drafts is None:  # one-hot: conditioned on every draft token in turn, each must give p
        results = []
        for d in range(v):
            a, dists = tables(d)
            row = (1 - a) * dists[0]
            row[d] += a
            results.append(row)
        return results, dists[1]
    for d, qd in drafts:
        a, dists = tables(d)
        first += qd * (1 - a) * dists[0]
        first[d] += qd * a
    return [first], dists[1]


def _rust_tables(p, q, p2):
    target = np.stack([p, p2])
    draft_probs = None if q is None else q[None, :]

    def tables(d):
        a, dists = _core.rule_tables(target, [d], draft_probs)
        return a[0], dists

    return tables


def _torch_tables(p, q, p2):
    target = torch.tensor(np.stack([p, p2]))
    draft_probs = None if q is None else torch.tensor(q[None, :])

    def tables(d):
        ratio, weights = _rule(target, torch.tensor([d]), draft_probs)
        dists = (weights / weights.sum(-1, keepdim=True)).numpy()
        return min(1.0, ratio.item()), dists

    return tables


@pytest.mark.parametrize("impl", ["rust", "torch"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_level0_exact(impl, name):
    p, q, p2 = SCENARIOS[name]
    tables = (_rust_tables if impl == "rust" else _torch_tables)(p, q, p2)
    firsts, bonus = _implied(tables, p, q)
    for first in firsts:
        np.testing.assert_allclose(first, p, rtol=0, atol=1e-12)
    np.testing.assert_allclose(bonus, p2, rtol=0, atol=1e-12)


# The known-wrong rules, as tables, for the Level 0 negative controls.
def _mutant_tables(rule, p, q, p2):
    def tables(d):
        qd = 1.0 if q is None else q[d]
        qrow = np.eye(len(p))[d] if q is None else q
        a = min(1.0, qd / p[d]) if rule == "inverted" and p[d] > 0 else min(1.0, p[d] / qd)
        if rule == "inverted" and p[d] == 0:
            a = 1.0
        if rule == "resample_p":
            r = p.copy()
        elif rule == "abs_residual":
            r = np.abs(p - qrow)
        else:
            r = np.maximum(p - qrow, 0)
        r = r / r.sum() if r.sum() > 0 else p
        bonus = p if rule == "wrong_bonus" else p2  # row k − 1 instead of row k
        return a, np.stack([r, bonus])

    return tables


@pytest.mark.parametrize("rule", ["resample_p", "inverted", "abs_residual", "wrong_bonus"])
@pytest.mark.parametrize("name", ["dirichlet", "one_hot"])
def test_level0_negative_controls_detected(rule, name):
    p, q, p2 = SCENARIOS[name]
    firsts, bonus = _implied(_mutant_tables(rule, p, q, p2), p, q)
    worst = max(max(np.abs(f - p).max() for f in firsts), np.abs(bonus - p2).max())
    assert worst > 1e-3, f"{rule} on {name} not detected: max deviation {worst:.2e}"


# ---------------------------------------------------------------------------------------------
# The sampler follows the tables, and torch agrees with Rust exactly on identical uniforms


def _random_case(rng, v, k, dtype, with_q, sparse):
    def rows(n):
        w = rng.dirichlet(np.full(v, 0.3 if sparse else 1.0), size=n)
        if sparse:
            w[rng.random(w.shape) < 0.5] = 0
            w[np.arange(n), rng.integers(0, v, n)] += 0.1
            w /= w.sum(-1, keepdims=True)
        return w.astype(dtype)

    p = rows(k + 1)
    q = rows(k) if with_q else None
    if with_q:
        q64 = q.astype(np.float64)
        draft = [int(rng.choice(v, p=q64[i] / q64[i].sum())) for i in range(k)]
    else:
        # Bias towards likely tokens so that long accepted prefixes happen too.
        draft = [
            int(np.argmax(p[i])) if rng.random() < 0.7 else int(rng.integers(v)) for i in range(k)
        ]
    return p, q, draft


def _reference(p, q, draft, accept_u, sample_u):
    """The sampler rebuilt from the Rust rule tables (accept iff u < a; inverse CDF)."""
    a, dists = _core.rule_tables(p, draft, q)
    for i in range(len(draft)):
        if accept_u[i] >= a[i]:
            return [*draft[:i], int(np.searchsorted(np.cumsum(dists[i]), sample_u[i], "right"))]
    return [*draft, int(np.searchsorted(np.cumsum(dists[-1]), sample_u[-1], "right"))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("with_q", [False, True])
def test_torch_equals_rust_on_identical_uniforms(dtype, with_q):
    rng = np.random.default_rng(1)
    seen = set()
    for case in range(300):
        v = [3, 17, 400][case % 3]
        k = [0, 1, 3, 8][case % 4]
        p, q, draft = _random_case(rng, v, k, dtype, with_q, sparse=case % 2 == 0)
        accept_u, sample_u = rng.random(k).tolist(), rng.random(k + 1).tolist()
        rust = _core.accept_sampled_with_uniforms(p, draft, q, accept_u, sample_u)
        qt = None if q is None else torch.from_numpy(q)
        tch = specfast.accept_sampled_torch(
            torch.from_numpy(p), draft, qt, uniforms=(accept_u, sample_u)
        )
        assert rust == tch, (case, rust, tch)
        assert rust == _reference(p, q, draft, accept_u, sample_u)
        # Seeded entry points draw the same uniforms in both.
        seed = int(rng.integers(2**63))
        assert specfast.accept_sampled(p, draft, q, seed=seed) == specfast.accept_sampled_torch(
            torch.from_numpy(p), torch.tensor(draft, dtype=torch.long), qt, seed=seed
        )
        seen.add((len(rust) - 1, k))
    assert any(n == k > 0 for n, k in seen)  # full acceptance, bonus token
    assert {1, 2, 3} <= {n for n, k in seen if n < k}  # rejections at several depths


def test_same_seed_same_result():
    rng = np.random.default_rng(2)
    p, q, draft = _random_case(rng, 1000, 8, np.float32, True, sparse=False)
    pt, qt = torch.from_numpy(p), torch.from_numpy(q)
    for seed in (0, 1, 2**64 - 1):
        first = specfast.accept_sampled(p, draft, q, seed=seed)
        for _ in range(20):
            assert specfast.accept_sampled(p, draft, q, seed=seed) == first
            assert specfast.accept_sampled(pt, draft, qt, seed=seed) == first
            assert specfast.accept_sampled_torch(pt, draft, qt, seed=seed) == first
    outs = {tuple(specfast.accept_sampled(p, draft, q, seed=s)) for s in range(50)}
    assert len(outs) > 5  # the seed matters


# ---------------------------------------------------------------------------------------------
# Numerics corner cases


def test_corner_cases():
    # p == q: accepted whatever the uniform.
    p = np.array([[0.3, 0.7], [0.5, 0.5]])
    assert _core.accept_sampled_with_uniforms(p, [1], p[:1], [0.999999], [0.0, 0.0]) == [1, 0]
    # Disjoint supports: always rejected, the correction comes from p.
    p = np.array([[0.0, 0.0, 1.0], [1 / 3] * 3])
    q = np.array([[0.5, 0.5, 0.0]])
    for s in range(50):
        assert specfast.accept_sampled(p, [0], q, seed=s) == [2]
    # A zero-probability draft token (one-hot) is rejected even at u = 0.
    p = np.array([[0.0, 1.0], [1.0, 0.0]], np.float32)
    assert _core.accept_sampled_with_uniforms(p, [0], None, [0.0], [0.0, 0.0]) == [1]
    # All-zero residual (only rounding gets there): falls back to p.
    p = np.array([[0.5, 0.4999], [1.0, 0.0]])
    q = np.array([[0.5, 0.5]])
    _, dists = _core.rule_tables(p, [1], q)
    np.testing.assert_allclose(dists[0], p[0] / p[0].sum(), atol=1e-15)
    assert _core.accept_sampled_with_uniforms(p, [1], q, [0.9999], [0.9, 0.0]) == [1]


# ---------------------------------------------------------------------------------------------
# Bad input: ValueError / TypeError with a clear message, never a panic

P3 = np.full((3, 4), 0.25, np.float32)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((P3, [1]), {}, ValueError, "shape \\(len\\(draft\\) \\+ 1, V\\)"),
        ((P3, [1, 4]), {}, ValueError, "outside the vocabulary"),
        ((P3, [1, -2]), {}, ValueError, "not a valid token id"),
        ((P3, [1, 2], P3[:2, :3]), {}, ValueError, "V = 3"),
        ((P3, [1, 2], P3[:1]), {}, ValueError, "draft_probs must have shape"),
        ((P3, [1, 2], P3[:2].astype(np.float64)), {}, TypeError, "same dtype"),
        (
            (np.where(np.eye(3, 4) > 0, np.nan, P3).astype(np.float32), [1, 2]),
            {},
            ValueError,
            "NaN",
        ),
        (
            (np.where(np.eye(3, 4) > 0, np.inf, P3).astype(np.float32), [1, 2]),
            {},
            ValueError,
            "NaN or inf",
        ),
        ((P3 - 0.25 * np.eye(3, 4, dtype=np.float32) + 0.1, [1, 2]), {}, ValueError, "sums to"),
        ((P3 * 0, [1, 2]), {}, ValueError, "all zero"),
        ((P3 * 3, [1, 2]), {}, ValueError, "not logits"),
        ((P3 * np.array([-1, 3, 1, 1], np.float32) / 1, [1, 2]), {}, ValueError, "negative"),
        (
            (P3, [0, 1], np.array([[0, 1, 0, 0], [0.25] * 4], np.float32)),
            {},
            ValueError,
            "draft probability 0",
        ),
        ((P3[0], [1, 2]), {}, ValueError, "2-D"),
        ((P3[None], [1, 2]), {}, ValueError, "2-D"),
        ((P3.astype(np.float16), [1, 2]), {}, TypeError, "float32 or float64"),
        ((P3.astype(np.int64), [1, 2]), {}, TypeError, "float32 or float64"),
        ((P3.tolist(), [1, 2]), {}, TypeError, "numpy array or a CPU torch tensor"),
        ((torch.from_numpy(P3).bfloat16(), [1, 2]), {}, TypeError, "float32 or float64"),
        ((np.zeros((3, 0), np.float32), [1, 2]), {}, ValueError, "shape"),
        ((P3, "ab"), {}, TypeError, "str"),
    ],
)
def test_accept_sampled_bad_input(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        specfast.accept_sampled(*args, **{"seed": 0, **kwargs})
    if args[0].__class__ is np.ndarray and args[0].dtype in (np.float32, np.float64):
        # The torch path reports the same kind of error.
        t_args = [
            torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
            for a in args
        ]
        with pytest.raises((ValueError, TypeError)):
            specfast.accept_sampled_torch(*t_args, seed=0)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, None])
def test_bad_seed(seed):
    with pytest.raises((ValueError, TypeError), match="seed"):
        specfast.accept_sampled(P3, [1, 2], seed=seed)


def test_bad_uniforms():
    with pytest.raises(ValueError, match="uniform"):
        _core.accept_sampled_with_uniforms(P3, [1, 2], None, [0.1, 1.0], [0.1] * 3)
    with pytest.raises(ValueError, match="uniforms"):
        _core.accept_sampled_with_uniforms(P3, [1, 2], None, [0.1], [0.1] * 3)
    with pytest.raises(ValueError, match="uniforms"):
        specfast.accept_sampled_torch(
            torch.from_numpy(P3), [1, 2], uniforms=([0.1, 1.0], [0.1] * 3)
        )
    with pytest.raises(ValueError, match="too large"):
        _core.uniforms(0, 2**40)


def test_fuzz_never_panics():
    """Random garbage through every entry point: only ValueError / TypeError / OverflowError."""
    rng = np.random.default_rng(3)
    values = [0.0, 0.25, 1.0, -1.0, np.nan, np.inf, 1e-45, 3.0]
    for _ in range(400):
        rows, v = int(rng.integers(0, 4)), int(rng.integers(0, 4))
        p = rng.choice(values, size=(rows, v)).astype(rng.choice([np.float32, np.float64]))
        if rng.random() < 0.3:
            p = p.T  # non-contiguous
        draft = rng.integers(-2, 5, size=int(rng.integers(0, 4))).tolist()
        q = None if rng.random() < 0.5 else p[: max(rows - 1, 0)]
        seed = int(rng.integers(2**63))
        calls = [
            (_core.accept_sampled, (p, draft, q), {"seed": seed}),
            (_core.rule_tables, (p, draft, q), {}),
            (_core.accept_greedy, (draft, [*draft[::-1], 1]), {}),
        ]
        for fn, args, kwargs in calls:
            with contextlib.suppress(ValueError, TypeError, OverflowError):
                fn(*args, **kwargs)


def test_non_contiguous_and_cpu_tensor_inputs():
    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.ones(6), size=3)  # (3, 6)
    pf = np.asfortranarray(p)
    assert not pf.flags.c_contiguous
    for seed in range(20):
        want = specfast.accept_sampled(p, [1, 2], seed=seed)
        assert specfast.accept_sampled(pf, [1, 2], seed=seed) == want
        assert (
            specfast.accept_sampled(torch.from_numpy(p).requires_grad_(), [1, 2], seed=seed) == want
        )


# ---------------------------------------------------------------------------------------------
# logits_to_probs


def test_logits_to_probs_matches_transformers():
    lp = pytest.importorskip("transformers.generation.logits_process")
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    logits[0, :10] = 4.0  # ties at the top-k boundary
    logits[1, 5] = -torch.inf
    cases = [
        dict(temperature=0.7),
        dict(top_k=10),
        dict(top_p=0.8),
        dict(min_p=0.1),
        dict(temperature=1.3, top_k=50, top_p=0.9, min_p=0.05),
        dict(temperature=0.5, top_k=5, top_p=0.3),
    ]
    for kw in cases:
        want = logits.clone()
        if kw.get("temperature", 1.0) != 1.0:
            want = lp.TemperatureLogitsWarper(kw["temperature"])(None, want)
        if kw.get("top_k", 0):
            want = lp.TopKLogitsWarper(kw["top_k"])(None, want)
        if kw.get("top_p", 1.0) < 1.0:
            want = lp.TopPLogitsWarper(kw["top_p"])(None, want)
        if kw.get("min_p", 0.0):
            want = lp.MinPLogitsWarper(kw["min_p"])(None, want)
        got = specfast.logits_to_probs(logits, **kw)
        assert got.dtype == torch.float32 and got.shape == logits.shape
        torch.testing.assert_close(got, want.softmax(-1), rtol=0, atol=1e-7)
        assert torch.equal(got > 0, want.softmax(-1) > 0), kw


def test_logits_to_probs_semantics():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    one_hot = specfast.logits_to_probs(logits, temperature=0)
    assert one_hot.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    # top-k keeps ties with the k-th value.
    assert (specfast.logits_to_probs(logits[:1], top_k=1) > 0).tolist() == [
        [False, True, True, False]
    ]
    # top_p keeps at least the most likely token.
    assert (specfast.logits_to_probs(logits[:1], top_p=1e-9) > 0).sum() >= 1
    # Any leading shape, float64/bfloat16 in, float32 out.
    out = specfast.logits_to_probs(torch.randn(2, 3, 7, dtype=torch.float64))
    assert out.shape == (2, 3, 7) and out.dtype == torch.float32
    assert specfast.logits_to_probs(torch.randn(7).bfloat16()).dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": 1e-45}, ValueError, "overflows"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"top_k": 2.5}, TypeError, "top_k"),
        ({"min_p": 1.5}, ValueError, "min_p"),
    ],
)
def test_logits_to_probs_bad_params(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        specfast.logits_to_probs(torch.tensor([[1e3, -1e3, 0.0]]), **kwargs)


def test_logits_to_probs_bad_logits():
    with pytest.raises(ValueError, match="NaN"):
        specfast.logits_to_probs(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="\\+inf"):
        specfast.logits_to_probs(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="masked"):
        specfast.logits_to_probs(torch.tensor([[0.0, 1.0], [-float("inf")] * 2]))
    with pytest.raises(TypeError):
        specfast.logits_to_probs(torch.tensor([1, 2]))
    with pytest.raises(TypeError):
        specfast.logits_to_probs(np.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="V >= 1"):
        specfast.logits_to_probs(torch.zeros(2, 0))


# ---------------------------------------------------------------------------------------------
# CUDA: one host sync per round


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path_agrees_and_syncs_once():
    rng = np.random.default_rng(5)
    p, q, draft = _random_case(rng, 151936, 8, np.float32, True, sparse=False)
    pc, qc = torch.from_numpy(p).cuda(), torch.from_numpy(q).cuda()
    for seed in range(20):
        # float64 cumsum on the GPU is a parallel scan: agreement holds except at rounding ties.
        assert specfast.accept_sampled(pc, draft, qc, seed=seed) == specfast.accept_sampled(
            p, draft, q, seed=seed
        )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning) as record:
            specfast.accept_sampled_torch(pc, draft, qc, seed=1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in record if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
