"""Attention for the eager passes: fused SDPA calls shaped for batch-1 decoding, the masks a
verify pass needs, and the row-by-row path int8 passes take so a verify row equals a one-row
pass. One sequence: q (H, T, hd) against a layer's keys and values (Hkv, L, hd)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

# Keys a row attends over are padded to a multiple of this (masked), so that a row sees the
# same key length in a verify pass as in a one-token pass at its position.
KEY_BUCKET = 64


def row_groups(
    pos: int, T: int, capacity: int, device, window: int | None = None
) -> list[tuple[int, int, torch.Tensor]]:
    """For T query rows at positions pos..: (first row, end row, mask (n, 1, 1, keys)) per run of
    rows whose key length (their position + 1, padded to a KEY_BUCKET multiple) is the same.
    With `window`, a row at position p sees only keys (p - window, p]."""
    groups = []
    t = 0
    while t < T:
        keys = min(capacity, -(-(pos + t + 1) // KEY_BUCKET) * KEY_BUCKET)
        end = min(T, keys - pos) if keys < capacity else T
        slots = torch.arange(keys, device=device)
        at = torch.arange(pos + t, pos + end, device=device)[:, None]
        seen = slots[None, :] <= at
        if window is not None:
            seen &= slots[None, :] > at - window
        groups.append((t, end, seen[:, None, None, :]))  # (n, 1, 1, keys)
        t = end
    return groups


def attend_rows(q, k_cache, v_cache, groups, g: int) -> torch.Tensor:
    """Attention of T query rows over a layer's cache, each row computed exactly as a one-row
    pass computes it: as one item of a batch, over its group's padded key length, masked past
    its position (row_groups).

    q (H, T, hd); k_cache, v_cache (Hkv, S, hd) -> (H, T, hd).
    """
    H, T, hd = q.shape
    Hkv = H // g
    rows = q.view(Hkv, g, T, hd).permute(2, 0, 1, 3)  # (T, Hkv, g, hd): one item a row
    outs = []
    for t, end, seen in groups:
        keys = seen.shape[-1]
        k = k_cache[None, :, :keys].expand(end - t, Hkv, keys, hd)
        v = v_cache[None, :, :keys].expand(end - t, Hkv, keys, hd)
        outs.append(F.scaled_dot_product_attention(rows[t:end], k, v, attn_mask=seen))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.permute(1, 2, 0, 3).reshape(H, T, hd)


# SDPA reads each kv head once for its g query heads itself from torch 2.5 on (enable_gqa, in the
# fused kernels on CUDA and on CPU); before, a stride-0 expand gives them the same keys uncopied.
SDPA_GQA = torch.__version__ >= "2.5"


def attention(q, k, v, mask=None, causal: bool = False) -> torch.Tensor:
    """q (H, T, hd) over a layer's keys and values k, v (Hkv, L, hd) -> (H, T, hd).

    4-D, as SDPA's fused kernels need (flash, memory-efficient and cuDNN on CUDA, flash on CPU):
    given 3-D tensors it takes the math path, several kernels a layer around a float32 score
    tensor of every query row against every key. `mask` (T, L) bool, True = may attend (or
    verify_mask's causal bias on CUDA);
    `causal` instead when query i sees keys [0, i] (a prefill from position 0), which lets the
    fused kernels skip the blocks above the diagonal rather than compute and mask them.
    """
    H, T, hd = q.shape
    Hkv, L = k.shape[:2]
    g = H // Hkv  # head h uses kv head h // g
    if q.device.type == "cpu" and not causal:
        # Decode and verify passes on a CPU: a kv head's g query heads as one (g*T)-row batch
        # item, the faster form for 2-9 rows (benches/bench_attention.py; docs/benchmarks.md
        # §14); a causal prefill, faster in the 4-D call, still takes that.
        mask = None if mask is None else mask.repeat(g, 1)  # (g*T, L)
        y = F.scaled_dot_product_attention(q.reshape(Hkv, g * T, hd), k, v, attn_mask=mask)
        return y.reshape(H, T, hd)
    if SDPA_GQA:
        y = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=causal, enable_gqa=True
        )  # (1, H, T, hd)
        return y[0]
    k = k[:, None].expand(Hkv, g, L, hd)  # (Hkv, g, L, hd), stride 0 over g
    v = v[:, None].expand(Hkv, g, L, hd)
    y = F.scaled_dot_product_attention(
        q.view(Hkv, g, T, hd), k, v, attn_mask=mask, is_causal=causal
    )
    return y.reshape(H, T, hd)


# SDPA's backends for an eager pass on CUDA: all but cuDNN's, which torch prefers on Hopper. cuDNN
# builds an execution graph for each new shape, and an eager decode step's key length is new every
# step. The compiled steps keep it: their shapes are fixed, one graph a bucket.
EAGER_CUDA_SDPA = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def window_mask(T: int, pos: int, window: int, device) -> torch.Tensor:
    """(T, pos + T) bool: row t, at position pos + t, sees keys (pos + t - window, pos + t]."""
    keys = torch.arange(pos + T, device=device)
    at = torch.arange(pos, pos + T, device=device)[:, None]
    return (keys <= at) & (keys > at - window)


def verify_mask(T: int, pos: int, device: torch.device) -> torch.Tensor | CausalBias:
    """Which of the keys [0, pos+T) each of T query rows at positions pos.. sees: row i sees
    [0, pos+i]. A (T, pos+T) bool tensor; on CUDA SDPA's lower-right causal bias, the same mask
    unwritten, which the flash kernel takes with grouped-query heads. A written mask there goes
    to the math path (flash takes none, cuDNN is off in eager passes): several kernels a layer,
    and a verify pass cost 2-3 plain steps on an H200."""
    if device.type == "cuda":
        return causal_lower_right(T, pos + T)
    return torch.ones(T, pos + T, dtype=torch.bool, device=device).tril_(pos)


def eager_attention_backends(device: torch.device):
    """The context an eager pass runs its layers in: on CUDA, SDPA limited to EAGER_CUDA_SDPA."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(EAGER_CUDA_SDPA))
