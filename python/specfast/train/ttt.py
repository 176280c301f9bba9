"""EAGLE-3's training-time test (fit.py's module docstring has the recipe): one step of the
head's layer (`ttt_step`) and one document's loss over every step (`ttt_loss`), with the
statistics a run reports."""

from __future__ import annotations

import math

import torch

from specfast.drafters.eagle.head import EagleHead


def ttt_step(head: EagleHead, tokens, hidden, positions, keys: list, values: list) -> torch.Tensor:
    """One training-time-test step of the head's layer over T positions -> out_hidden (T, H).
    tokens (T,) are read through the bound embedding; positions (T,) are the RoPE positions.
    Appends this step's keys and values (Hkv, T, hd) to `keys`/`values`: keys[0] is step 0
    (causal over positions), keys[j > 0] the chain's step j at the same position (a diagonal),
    which is what drafting sees, without a (T, (s + 1)·T) mask."""
    cos_t, sin_t = head.rope(int(positions.max()) + 1)
    cos, sin = cos_t[positions].unsqueeze(-2), sin_t[positions].unsqueeze(-2)  # (T, 1, hd)
    T = hidden.shape[0]

    def attend(q, k, v):  # q (Hkv, g*T, hd), k and v (Hkv, T, hd)
        keys.append(k)
        values.append(v)
        Hkv, _, hd = q.shape
        qg = q.view(Hkv, -1, T, hd)  # (Hkv, g, T, hd): query head kv*g + i reads kv head kv
        scale = 1.0 / math.sqrt(hd)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril_()
        scores = (qg @ keys[0].unsqueeze(1).transpose(-1, -2)).float() * scale  # (Hkv, g, T, T)
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(qg * kj.unsqueeze(1)).sum(-1, keepdim=True).float() * scale for kj in keys[1:]]
        w = torch.cat([scores, *diag], dim=-1).softmax(dim=-1).to(q.dtype)
        y = w[..., :T] @ values[0].unsqueeze(1)  # (Hkv, g, T, hd)
        for j, vj in enumerate(values[1:]):
            y = y + w[..., T + j : T + j + 1] * vj.unsqueeze(1)
        return y.reshape(Hkv, -1, hd)

    return head.layer(hidden, tokens, cos, sin, attend)


# ---------------------------------------------------------------------------- one document


def ttt_loss(
    head: EagleHead,
    doc: dict[str, torch.Tensor],
    embed: torch.Tensor,
    out_rows: torch.Tensor,
    steps: int,
    decay: float = 0.8,
) -> tuple[torch.Tensor, dict]:
    """The training-time-test loss of one document of N positions, and its counts.

    doc: tokens (N,), features (N, 3Ht), normed (N, Ht), argmax (N,) from the target.
    embed (V, H) is the target's embedding, out_rows (Vd, Ht) its output rows of the draft
    vocabulary. Position t in [0, N-1) at step s feeds token t+1+s and is scored against the
    target's distribution at position t+1+s (which predicts token t+2+s).
    """
    tokens = doc["tokens"].long()
    N = tokens.shape[0]
    T = N - 1
    dtype = head.fc.weight.dtype
    with torch.no_grad():
        p_target = (doc["normed"].float() @ out_rows.float().T).softmax(dim=-1)  # (N, Vd)
        top = doc["argmax"].long()
        in_draft = head.t2d[top]  # (N,) SpecForge's mask: target argmax in the draft vocab
    head.bind_embedding(embed)
    hidden = head.fc(doc["features"].to(dtype)[:T])  # (T, H)
    pos = torch.arange(T, device=tokens.device)
    keys: list = []
    values: list = []
    total = torch.zeros((), device=tokens.device)
    agree = []
    for s in range(steps):
        idx = (pos + 1 + s).clamp_max(N - 1)
        valid = pos + 1 + s <= N - 1
        hidden = ttt_step(head, tokens[idx], hidden, pos + s, keys, values)
        logp = head.logits(hidden).float().log_softmax(dim=-1)  # (T, Vd)
        mask = (valid & in_draft[idx]).float()
        total = total + decay**s * -(mask * (p_target[idx] * logp).sum(-1)).sum() / T
        with torch.no_grad():
            drafted = head.target_ids[logp.argmax(dim=-1)]
            agree.append((drafted == top[idx]) & valid)
    with torch.no_grad():
        full = pos + steps <= N - 1  # positions every step can score
        run = torch.stack(agree).long().cumprod(dim=0)  # (S, T): still accepted after step s
        stats = {
            "positions": T,
            "agree": [int(a.sum()) for a in agree],
            "valid": [int((pos + 1 + s <= N - 1).sum()) for s in range(steps)],
            "chain": int(run[:, full].sum()),
            "chain_positions": int(full.sum()),
        }
    return total, stats


def merge_stats(acc: dict | None, s: dict) -> dict:
    if acc is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in s.items()}
    for k, v in s.items():
        acc[k] = (
            [a + b for a, b in zip(acc[k], v, strict=True)] if isinstance(v, list) else acc[k] + v
        )
    return acc


def summary(stats: dict) -> dict:
    """acc per step (top-1 agreement with the target) and tau: 1 + the mean run of agreeing
    steps from step 0, an estimate of the mean acceptance length at k = steps (greedy)."""
    acc = [a / max(v, 1) for a, v in zip(stats["agree"], stats["valid"], strict=True)]
    tau = 1 + stats["chain"] / max(stats["chain_positions"], 1)
    return {"acc": [round(a, 4) for a in acc], "tau": round(tau, 4)}
