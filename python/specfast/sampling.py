"""Sampling transforms and exact speculative acceptance.

- `logits_to_probs`: temperature, top-k, top-p, min-p, in transformers' order and semantics.
- `accept_greedy`, `accept_sampled`: the Rust sampler (CPU numpy arrays or CPU tensors).
- `accept_sampled_torch`: the same rule vectorised in torch, for targets on a GPU.

The rule (Leviathan et al. 2023; Chen et al. 2023): at draft position i accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)); on rejection emit a sample from norm(max(0, p_i - q_i))
and stop; if all k are accepted emit a bonus sample from p_k. A one-hot (n-gram) draft has
q_i = δ(d_i): accept with p_i(d_i), residual = p_i with d_i zeroed. The emitted tokens are then
distributed exactly as sampling the target alone.

Both samplers consume the same uniforms: accept_u (k,) and sample_u (k+1,), taken from the
counter-based SplitMix64 stream of `seed` (`specfast._core.uniforms`). Accept at i iff
accept_u[i] < p_i(d_i) / q_i(d_i); the correction/bonus at j is the first index whose running
sum (float64) exceeds sample_u[j] * total. Given the same seed, the torch path on CPU returns
exactly what Rust returns; on CUDA only a float64 rounding tie in the cumulative sum can differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from specfast import _core

__all__ = [
    "accept_greedy",
    "accept_sampled",
    "accept_sampled_torch",
    "logits_to_probs",
]

# Same tolerance as the Rust core (`ROW_SUM_TOLERANCE`): float32 softmax is off by ~1e-6, logits
# passed by mistake are off by far more.
ROW_SUM_TOLERANCE = 1e-3
_U64 = 1 << 64

accept_greedy = _core.accept_greedy


# ---------------------------------------------------------------------------------------------
# Sampling transforms


def check_sampling_params(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")
    if not isinstance(min_p, (int, float)) or not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {min_p}")


def logits_to_probs(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Turn logits (..., V) into float32 sampling probabilities (..., V) on the same device.

    Same order and semantics as transformers' sampling warpers: temperature, then top-k (ties
    with the k-th value are kept), then top-p (drop the largest set of least likely tokens whose
    mass is <= 1 - top_p; the most likely token always stays), then min-p (drop tokens below
    min_p times the top probability). Removed tokens get probability exactly 0, so a draft token
    outside the kept set has p = 0 and is always rejected.

    temperature=0 returns the one-hot of the argmax (the first index on ties): sampling it is
    greedy decoding, and `accept_sampled` on such rows reduces to greedy verification exactly.

    On CPU, NaN or +inf logits and rows where every logit is -inf raise ValueError. On other
    devices the check would cost a host sync, so it is left to `accept_sampled_torch`, which
    checks the probabilities inside its one sync.
    """
    check_sampling_params(temperature, top_k, top_p, min_p)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    x = logits.float()  # (..., V)
    on_cpu = x.device.type == "cpu"
    if on_cpu:
        if torch.isnan(x).any() or torch.isposinf(x).any():
            raise ValueError("logits contain NaN or +inf")
        if torch.isneginf(x).all(dim=-1).any():
            raise ValueError("every logit in a row is -inf: every token is masked")

    if temperature == 0:
        idx = x.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(x).scatter_(-1, idx, 1.0)
    if temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1:] = False  # keep at least the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    if min_p > 0.0:
        probs = x.softmax(dim=-1)
        # The top token always passes (its probability >= min_p * itself for min_p <= 1).
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
    probs = x.softmax(dim=-1)
    if on_cpu and not torch.isfinite(probs).all():
        raise ValueError(
            f"temperature {temperature} overflows the logits to infinity; use a larger "
            "temperature or 0 for greedy"
        )
    return probs


# ---------------------------------------------------------------------------------------------
# Acceptance


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < _U64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def accept_sampled(
    target_probs: Any,
    draft: Sequence[int],
    draft_probs: Any = None,
    *,
    seed: int,
) -> list[int]:
    """Speculative sampling: the accepted prefix of `draft` plus one correction or bonus token.

    target_probs: (k+1, V) float32/float64 numpy array or torch tensor, already transformed (see
    `logits_to_probs`); row i is the target's distribution after draft[:i]. draft: k token ids.
    draft_probs: (k, V) probabilities the draft tokens were sampled from (same transforms, same
    dtype), or None for a one-hot drafter such as the n-gram drafter. seed: int in [0, 2**64).

    CPU inputs go to the Rust sampler, zero-copy; tensors on another device go to
    `accept_sampled_torch`, which draws the same uniforms for the same seed.
    """
    if isinstance(target_probs, torch.Tensor) and target_probs.device.type != "cpu":
        return accept_sampled_torch(target_probs, draft, draft_probs, seed=seed)
    return _core.accept_sampled(target_probs, draft, draft_probs, seed=_check_seed(seed))


def _check_probs(name: str, t: Any, rows: int, vocab: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 or float64, got {t.dtype}")
    if t.ndim != 2 or t.shape[0] != rows or t.shape[1] == 0 or (vocab and t.shape[1] != vocab):
        want = f"({rows}, {vocab if vocab else 'V'})"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _rule(
    p: torch.Tensor, d: torch.Tensor, q: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The implemented rule, vectorised: (ratio (k,) float64, weights (k+1, V)).

    Accept at i iff u < ratio[i], i.e. with probability min(1, ratio[i]). weights[i] is the
    unnormalised correction distribution at i (the residual, or p_i if the residual is all zero:
    only rounding gets there, see crates/core/src/accept.rs), weights[k] = p_k for the bonus.
    """
    k = d.shape[0]
    rows = torch.arange(k, device=p.device)
    p_d = p[rows, d].double()  # (k,)
    if q is None:
        q_d = torch.ones_like(p_d)
        resid = p[:k].clone()  # (k, V)
        resid[rows, d] = 0
    else:
        q_d = q[rows, d].double()
        resid = (p[:k] - q).clamp_min(0)  # native precision, as in Rust
    weights = torch.cat([resid, p[k:]])  # (k+1, V)
    empty = ~(weights > 0).any(dim=-1, keepdim=True)  # (k+1, 1)
    weights = torch.where(empty, p, weights)
    return p_d / q_d, weights


def _bad_rows(t: torch.Tensor) -> torch.Tensor:
    """Per-tensor error bits, on device: 1 non-finite, 2 negative, 4 all zero, 8 sum != 1."""
    s = t.double().sum(dim=-1)
    finite = torch.isfinite(s).all()
    bits = (~finite).long()
    bits = bits | ((t < 0).any().long() << 1)
    bits = bits | ((s <= 0).any().long() << 2) * finite.long()
    bits = bits | (((s - 1).abs() > ROW_SUM_TOLERANCE).any().long() << 3) * finite.long()
    return bits


_BIT_MESSAGES = {
    1: "contains NaN or infinity; probabilities must be finite",
    2: "contains a negative value; probabilities must be >= 0",
    4: "has a row that is all zero: every token is masked, nothing can be sampled",
    8: "has a row that does not sum to 1; pass probabilities (e.g. from "
    "specfast.logits_to_probs), not logits",
}


def _raise_bits(name: str, bits: int) -> None:
    for bit, message in _BIT_MESSAGES.items():
        if bits & bit:
            raise ValueError(f"{name} {message}")


def _to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        # Pinned + non_blocking: the copy does not wait for the queued forward pass.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def accept_sampled_torch(
    target_probs: torch.Tensor,
    draft: Sequence[int] | torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    uniforms: tuple[Sequence[float], Sequence[float]] | None = None,
) -> list[int]:
    """`accept_sampled` in torch for tensors on any device, with one host sync.

    Every position's correction token is sampled at once (vectorised over the k+1 rows); the
    sequential accept/reject decision is a cumulative product over k booleans. The accepted
    count, the chosen token and the input checks come back in one `.tolist()`.

    Give either `seed` (the same SplitMix64 uniforms as the Rust sampler) or `uniforms` =
    (accept_u of length k, sample_u of length k+1) in [0, 1).
    """
    p = target_probs
    if isinstance(draft, torch.Tensor):
        if draft.ndim != 1 or draft.is_floating_point() or draft.dtype == torch.bool:
            raise TypeError("draft must be a 1-D integer tensor or a sequence of ints")
        k = draft.shape[0]
    else:
        if isinstance(draft, str):
            raise TypeError("draft must be a sequence of int token ids, got str")
        draft = [int(x) for x in draft]
        k = len(draft)
    _check_probs("target_probs", p, k + 1, None)
    vocab = p.shape[1]
    device = p.device
    if draft_probs is not None:
        _check_probs("draft_probs", draft_probs, k, vocab)
        if draft_probs.dtype != p.dtype or draft_probs.device != device:
            raise TypeError("draft_probs must have the same dtype and device as target_probs")
    if isinstance(draft, torch.Tensor):
        d = draft.to(device=device, dtype=torch.long)
        d_in_range = ((d >= 0) & (d < vocab)).all()
        d = d.clamp(0, vocab - 1)  # keeps the gathers valid; out-of-range ids raise below
    else:
        for i, x in enumerate(draft):
            if not 0 <= x < vocab:
                raise ValueError(
                    f"draft[{i}] = {x} is outside the vocabulary: ids must be in [0, {vocab})"
                )
        d = _to_device(draft, torch.long, device)
        d_in_range = None

    if uniforms is None:
        if seed is None:
            raise TypeError("give seed or uniforms")
        accept_u, sample_u = _core.uniforms(_check_seed(seed), k)
    else:
        accept_u, sample_u = (list(map(float, u)) for u in uniforms)
        if len(accept_u) != k or len(sample_u) != k + 1:
            raise ValueError(
                f"need {k} accept uniforms and {k + 1} sample uniforms, "
                f"got {len(accept_u)} and {len(sample_u)}"
            )
        if not all(0.0 <= u < 1.0 for u in accept_u + sample_u):
            raise ValueError("uniforms must be in [0, 1)")
    u = _to_device(accept_u + sample_u, torch.float64, device)  # (2k+1,)
    u_accept, u_sample = u[:k], u[k:]

    ratio, weights = _rule(p, d, draft_probs)  # (k,), (k+1, V)
    samples = sample_rows(weights, u_sample)  # (k+1,)
    n = torch.cumprod((u_accept < ratio).long(), dim=0).sum()  # accepted prefix length
    token = samples.gather(0, n.view(1))  # (1,)

    bits = _bad_rows(p)
    if draft_probs is not None:
        bits = bits | (_bad_rows(draft_probs) << 4)
        q_d = draft_probs[torch.arange(k, device=device), d]
        bits = bits | ((q_d <= 0).any().long() << 8)
    if d_in_range is not None:
        bits = bits | ((~d_in_range).long() << 9)
    payload = torch.cat([n.view(1), token, bits.view(1), d]).tolist()  # the one host sync
    n_host, token_host, bits_host = payload[:3]

    if bits_host:
        _raise_bits("target_probs", bits_host & 15)
        _raise_bits("draft_probs", (bits_host >> 4) & 15)
        if bits_host & 256:
            raise ValueError(
                "a draft token has draft probability 0, so it cannot have been sampled from "
                "draft_probs; pass the (transformed) probabilities the draft was sampled from"
            )
        raise ValueError(f"a draft id is outside the vocabulary: ids must be in [0, {vocab})")
    return [*payload[3 : 3 + n_host], token_host]


# ---------------------------------------------------------------------------------------------
# One-hot drafts: sampling keyed by position


def position_uniforms(seed: int, start: int, n: int) -> torch.Tensor:
    """Uniforms in [0, 1) for absolute positions start..start+n-1 of a generation: SplitMix64 of
    (seed, position), float64 (n,). The draw at a position never depends on how rounds fell."""
    pos = np.arange(start + 1, start + n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + pos * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of each row of weights (n, V) (not necessarily normalised) with
    uniforms (n,) in [0, 1): token ids (n,), on the weights' device, with no host sync.
    Never returns a token of weight 0."""
    cdf = weights.double().cumsum(dim=-1)  # (n, V)
    total = cdf[:, -1:]  # (n, 1)
    # Stay strictly below the total (u * total can round up to it), and take the first index
    # whose cdf exceeds the target (right=True): zero-weight tokens, flat in the cdf, never win.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniforms.to(cdf.device, non_blocking=True)[:, None] * total, below_total)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def copy_generator(g: torch.Generator) -> torch.Generator:
    """A generator on g's device in g's state (a Session fork draws what the parent would)."""
    new = torch.Generator(device=g.device)
    new.set_state(g.get_state())
    return new


def choose_tokens(logits, draft, q, pos, sampling) -> list[int]:
    """The tokens one target pass commits: accepted drafts plus the target's own token.

    `pos` is the absolute output position of the pass's first row; `sampling` is None for
    greedy, else (seed, logits_to_probs keyword arguments).
    """
    if sampling is None:
        return accept_greedy(draft, logits.argmax(dim=-1).tolist())  # one sync: k+1 ids
    seed, params = sampling
    probs = logits_to_probs(logits, **params)  # (k+1, V) float32, on the model's device
    if q is None:
        # One-hot drafts (n-gram, or none): draw every row's token from p with the uniform of
        # its absolute position, and keep drafts while they equal the draw. Accepting d with
        # probability p(d) and otherwise drawing from p with d removed is the residual rule
        # for a one-hot q, so this is exact; and because a position's draw never depends on k,
        # a seed gives the very text plain sampling gives, with or without speculation.
        return accept_greedy(
            draft, sample_rows(probs, position_uniforms(seed, pos, len(probs))).tolist()
        )
    # A draft model's q: the ratio test and the residual max(0, p - q), one seed per round.
    round_seed = int(position_uniforms(seed ^ 0x5EED, pos, 1)[0] * 2**53)
    if probs.device.type == "cpu":
        return _core.accept_sampled(probs.numpy(), draft, q.float().numpy(), seed=round_seed)
    return accept_sampled_torch(probs, draft, q, seed=round_seed)
