"""The eager pass: torch runs every layer, with shapes that follow the context (a prefill, and
decode and verify passes on CPU in dtypes the core does not run, or on CUDA without compiled
steps). Attention is chosen per pass: causal for a prefill from position 0, a verify mask
otherwise, and row by row for int8 passes, whose every row must equal a one-row pass."""

from __future__ import annotations

import torch

from specfast.model.attention import (
    attend_rows,
    attention,
    eager_attention_backends,
    row_groups,
    verify_mask,
    window_mask,
)
from specfast.model.kv_cache import KVCache
from specfast.model.layers import final_logits, run_layers
from specfast.model.quantize import INT8_SERIAL_ROWS


def forward_eager(model, ids, cache: KVCache, pos: int, last_only, head, aux_layers):
    """Model.forward's torch path: ids (T,) at [pos, pos + T) -> logits (T, V) (or (1, V)),
    or (logits, features) with aux_layers. Writes the T new keys and values into the cache."""
    c = model.config
    T, g = ids.shape[0], c.n_heads // c.n_kv_heads
    cos, sin = model.rope(pos + T)
    cos, sin = cos[pos : pos + T, None, :], sin[pos : pos + T, None, :]  # (T, 1, hd)
    local = None  # the sliding layers' RoPE
    if c.sliding_layers:
        lc, ls = model.rope(pos + T, local=True)
        local = lc[pos : pos + T, None, :], ls[pos : pos + T, None, :]
    groups = mask = None
    causal = False
    # int8 rounds every activation, so a last-bit difference between a verify pass's row and a
    # one-token pass grows into a different token: those passes attend row by row.
    if model.quantized and T <= INT8_SERIAL_ROWS:
        groups = row_groups(pos, T, cache.k.shape[2], ids.device)
    elif T > 1 and pos == 0:
        causal = True  # keys [0, T): query i sees [0, i]
    elif T > 1:
        mask = verify_mask(T, pos, ids.device)  # (for T == 1 every key: no mask)
    # The sliding layers' own, where some row has keys outside its window.
    local_groups, local_mask = groups, mask
    if c.sliding_layers and pos + T > c.sliding_window:
        if groups:
            local_groups = row_groups(pos, T, cache.k.shape[2], ids.device, c.sliding_window)
        else:
            local_mask = window_mask(T, pos, c.sliding_window, ids.device)
    causal_local = causal and local_mask is mask

    def attend(i, q, k, v) -> torch.Tensor:  # q (H, T, hd); k, v (Hkv, T, hd)
        k_all, v_all = cache.write(i, pos, k, v)  # (Hkv, pos + T, hd)
        sliding = i in c.sliding_layers
        if groups:
            return attend_rows(q, cache.k[i], cache.v[i], local_groups if sliding else groups, g)
        if sliding:
            return attention(q, k_all, v_all, local_mask, causal_local)
        return attention(q, k_all, v_all, mask, causal)

    packed = model.packed_weights()
    aux: dict | None = None if aux_layers is None else dict.fromkeys(aux_layers)
    with eager_attention_backends(ids.device):
        x = run_layers(model, model.embed_tokens(ids), cos, sin, attend, packed, aux, local)
    logits = final_logits(model, x[-1:] if last_only else x, head, packed)
    return logits if aux is None else (logits, model_features(aux, aux_layers))


def model_features(aux: dict, aux_layers) -> torch.Tensor:
    """The inputs of the aux layers, concatenated in the order asked for -> (T, n*D)."""
    return torch.cat([aux[i] for i in aux_layers], dim=-1)
