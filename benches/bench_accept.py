"""Cost of one acceptance call: Rust vs a numpy reference vs the torch path.

Run: pytest benches/bench_accept.py --benchmark-enable --benchmark-group-by=param:vocab,param:k
Inputs: float32 target probs (k+1, V) from a Dirichlet, a one-hot draft (n-gram) of k tokens,
each call fully validates the inputs and samples the correction/bonus token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specfast


def numpy_reference(p: np.ndarray, draft: list[int], seed: int) -> list[int]:
    """The same rule in plain numpy, with the same validation, for comparison."""
    if not np.isfinite(p).all() or (p < 0).any():
        raise ValueError("bad probabilities")
    sums = p.sum(-1, dtype=np.float64)
    if (np.abs(sums - 1) > 1e-3).any():
        raise ValueError("rows must sum to 1")
    rng = np.random.default_rng(seed)
    for i, d in enumerate(draft):
        if rng.random() < p[i, d]:
            continue
        r = p[i].astype(np.float64)
        r[d] = 0
        cdf = np.cumsum(r)
        return [*draft[:i], int(np.searchsorted(cdf, rng.random() * cdf[-1], "right"))]
    cdf = np.cumsum(p[-1], dtype=np.float64)
    return [*draft, int(np.searchsorted(cdf, rng.random() * cdf[-1], "right"))]


@pytest.fixture(scope="module", params=[49_152, 151_936], ids=lambda v: f"V={v}")
def vocab(request):
    return request.param


@pytest.mark.parametrize("k", [4, 8, 16])
@pytest.mark.parametrize("impl", ["rust", "numpy", "torch"])
def test_accept_call(benchmark, vocab, k, impl):
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(vocab), size=k + 1).astype(np.float32)
    # Draft the argmax at half the positions: a mix of acceptances and rejections.
    draft = [int(p[i].argmax()) if i % 2 == 0 else int(rng.integers(vocab)) for i in range(k)]
    pt = torch.from_numpy(p)
    benchmark.group = f"accept V={vocab} k={k}"
    if impl == "rust":
        benchmark(lambda: specfast.accept_sampled(p, draft, seed=1))
    elif impl == "numpy":
        benchmark(lambda: numpy_reference(p, draft, 1))
    else:
        benchmark(lambda: specfast.accept_sampled_torch(pt, draft, seed=1))
