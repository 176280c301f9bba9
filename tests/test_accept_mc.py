"""Level 1: Monte Carlo χ² tests of the emitted-token distribution, with negative controls.

Each scenario draws N = 50,000 rounds from the Rust sampler and checks a χ² goodness of fit
against the exact target distribution at α = 1e-4 (bins with expected count < 5 merged). In the
same test, at the same N, each known-wrong rule (implemented here, vectorised in numpy, never in
the package) must be rejected at the same α, or emit a token with p = 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specfast

N = 50_000
ALPHA = 1e-4
MUTANTS = ("resample_p", "inverted", "abs_residual", "wrong_bonus")


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float, int]:
    """(statistic, p-value, dof) of counts against probs over the p > 0 bins, small bins merged."""
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    support = probs > 0
    n = counts[support].sum()
    expected, observed = probs[support] * n, counts[support]
    order = np.argsort(expected)
    expected, observed = expected[order], observed[order]
    # Merge the smallest bins into one until it holds at least 5 expected counts.
    cut = 0
    while cut < len(expected) and expected[:cut].sum() < 5 and expected[cut] < 5:
        cut += 1
    if cut:
        if cut == len(expected) or expected[:cut].sum() < 5:
            cut += 1
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
        observed = np.concatenate([[observed[:cut].sum()], observed[cut:]])
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    pvalue = float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2))
    )
    return stat, pvalue, dof


def simulate(rule, p, q, drafts, rng):
    """A vectorised numpy sampler of the rule `rule` ('correct' or a mutant).

    p (k+1, V), q (k, V) or None (one-hot), drafts (N, k). Returns emitted tokens (N, k+1), -1
    past the end of each round.
    """
    n, k = drafts.shape
    v = p.shape[1]
    out = np.full((n, k + 1), -1)
    alive = np.ones(n, bool)
    for i in range(k):
        d = drafts[:, i]
        p_d = p[i, d]
        q_d = np.ones(n) if q is None else q[i, d]
        with np.errstate(divide="ignore"):
            ratio = q_d / p_d if rule == "inverted" else p_d / q_d
        accepted = rng.random(n) < ratio
        # Correction distribution for each draft value, (V, V): row = draft token.
        q_rows = np.eye(v) if q is None else np.broadcast_to(q[i], (v, v))
        if rule == "resample_p":
            resid = np.broadcast_to(p[i], (v, v)).copy()
        elif rule == "abs_residual":
            resid = np.abs(p[i] - q_rows)
        else:
            resid = np.maximum(p[i] - q_rows, 0)
        totals = resid.sum(1, keepdims=True)
        resid = np.where(totals > 0, resid, p[i])
        cdf = np.cumsum(resid, 1)
        cdf /= cdf[:, -1:]
        u = rng.random(n)
        corr = (u[:, None] >= cdf[d]).sum(1)
        rejected = alive & ~accepted
        out[rejected, i] = corr[rejected]
        alive &= accepted
        out[alive, i] = d[alive]
    bonus_row = k - 1 if rule == "wrong_bonus" and k > 0 else k
    cdf = np.cumsum(p[bonus_row]) / p[bonus_row].sum()
    bonus = (rng.random(n)[:, None] >= cdf).sum(1)
    out[alive, k] = bonus[alive]
    return out


def rust_rounds(p, q, drafts):
    """N rounds from the Rust sampler, seed = round index, padded with -1 like `simulate`."""
    n, k = drafts.shape
    out = np.full((n, k + 1), -1)
    for r in range(n):
        emitted = specfast.accept_sampled(p, drafts[r].tolist(), q, seed=r)
        out[r, : len(emitted)] = emitted
    return out


def position_counts(out, position, draft_prefix, v):
    """Counts of the token at `position` in rounds that accepted `draft_prefix` before it."""
    mask = np.all(out[:, :position] == draft_prefix, axis=1) & (out[:, position] >= 0)
    return np.bincount(out[mask, position], minlength=v)


def check(name, p_row, counts_by_rule):
    """Asserts the correct rule passes and every mutant fails; returns the statistics."""
    report = {}
    for rule, counts in counts_by_rule.items():
        stat, pvalue, dof = chi2_pvalue(counts, p_row)
        zero_emitted = int(counts[p_row == 0].sum())
        report[rule] = (stat, pvalue, dof, zero_emitted, int(counts.sum()))
    print(f"\n{name}")
    for rule, (stat, pvalue, dof, zero_emitted, n) in report.items():
        print(
            f"  {rule:>13}: n={n} chi2={stat:.1f} dof={dof} p={pvalue:.2e} "
            f"p0_emitted={zero_emitted}"
        )
    for rule in ("rust", "numpy_correct"):
        _, pvalue, _, zero_emitted, _ = report[rule]
        assert zero_emitted == 0, f"{name}: {rule} emitted a token with p = 0"
        assert pvalue > ALPHA, f"{name}: the correct rule ({rule}) failed, p = {pvalue:.2e}"
    for rule, (_, pvalue, _, zero_emitted, _) in report.items():
        if rule in MUTANTS:
            assert pvalue < ALPHA or zero_emitted > 0, (
                f"{name}: negative control {rule} not detected (p = {pvalue:.2e})"
            )
    return report


def _run_all(p, q, drafts, mutants, seed):
    rng = np.random.default_rng(seed)
    outs = {
        "rust": rust_rounds(p, q, drafts),
        "numpy_correct": simulate("correct", p, q, drafts, rng),
    }
    p64 = p.astype(np.float64)
    q64 = None if q is None else q.astype(np.float64)
    for rule in mutants:
        outs[rule] = simulate(rule, p64, q64, drafts, rng)
    return outs


# ---------------------------------------------------------------------------------------------
# Scenarios


def test_draft_model_dirichlet():
    rng = np.random.default_rng(10)
    v = 8
    p = rng.dirichlet(np.ones(v), size=2)
    q = rng.dirichlet(np.ones(v), size=1)
    drafts = rng.choice(v, size=(N, 1), p=q[0])
    outs = _run_all(p, q, drafts, ("resample_p", "inverted", "abs_residual"), 11)
    check(
        "draft model, Dirichlet p and q",
        p[0],
        {r: np.bincount(o[:, 0], minlength=v) for r, o in outs.items()},
    )


@pytest.mark.parametrize("p_d", [0.9, 0.5, 0.1])
def test_one_hot_draft(p_d):
    v, d = 6, 2
    rest = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    p0 = np.insert(rest * (1 - p_d), d, p_d)
    p = np.stack([p0, np.full(v, 1 / v)])
    drafts = np.full((N, 1), d)
    outs = _run_all(p, None, drafts, ("resample_p", "inverted", "abs_residual"), 12)
    check(
        f"one-hot draft, p(d) = {p_d}",
        p0,
        {r: np.bincount(o[:, 0], minlength=v) for r, o in outs.items()},
    )


def test_filtered_target():
    """top-k/top-p/min-p targets: tokens outside the kept set (p = 0) are never emitted, even
    when the draft (sampled from a draft model under the same transform) proposes them."""
    torch.manual_seed(13)
    v = 12
    params = dict(temperature=0.8, top_k=7, top_p=0.9, min_p=0.02)
    p = specfast.logits_to_probs(torch.randn(2, v) * 2, **params).numpy()
    q = specfast.logits_to_probs(torch.randn(1, v) * 2, **params).numpy()
    assert (p[0] == 0).sum() >= 5
    rng = np.random.default_rng(14)
    q64 = q.astype(np.float64)
    drafts = rng.choice(v, size=(N, 1), p=q64[0] / q64[0].sum())
    assert (p[0, drafts[:, 0]] == 0).mean() > 0.05  # the draft often proposes a removed token
    outs = _run_all(p, q, drafts, ("resample_p", "inverted", "abs_residual"), 15)
    p0 = p[0].astype(np.float64) / p[0].astype(np.float64).sum()
    check(
        "filtered target, draft model",
        p0,
        {r: np.bincount(o[:, 0], minlength=v) for r, o in outs.items()},
    )
    # One-hot draft of a removed token: always rejected, never emitted.
    removed = int(np.flatnonzero(p[0] == 0)[0])
    out = rust_rounds(p, None, np.full((2_000, 1), removed))
    assert (out[:, 0] != removed).all() and (p[0, out[:, 0]] > 0).all()


def test_second_and_bonus_positions():
    v = 6
    rng = np.random.default_rng(16)
    d = np.array([1, 4])
    p = rng.dirichlet(np.ones(v), size=3)
    p[0] = np.insert(rng.dirichlet(np.ones(v - 1)) * 0.3, 1, 0.7)
    p[1] = np.insert(rng.dirichlet(np.ones(v - 1)) * 0.4, 4, 0.6)
    p[2] = np.array([0.05, 0.1, 0.15, 0.2, 0.25, 0.25])
    drafts = np.broadcast_to(d, (N, 2))
    outs = _run_all(p, None, drafts, MUTANTS, 17)
    second = {r: position_counts(o, 1, d[:1], v) for r, o in outs.items()}
    bonus = {r: position_counts(o, 2, d[:2], v) for r, o in outs.items()}
    # wrong_bonus only changes position 2; the other mutants are detected at position 1.
    check("second position", p[1], {r: c for r, c in second.items() if r != "wrong_bonus"})
    check("bonus position", p[2], {r: bonus[r] for r in ("rust", "numpy_correct", "wrong_bonus")})
