"""The core pass: where a model runs float32 activations on CPU (float32, int8 or q4 weights),
the whole stack, head included, is one call into the Rust core (kernels' layer.rs) over the
decoder's cache. `forward_in_core` is Model.forward's form of it (torch tensors in and out);
`CoreGreedy` is a greedy decoder's, with NumPy between passes and no torch op at all."""

from __future__ import annotations

import numpy as np
import torch

from specfast._core import CoreLayers
from specfast.model.eager import model_features
from specfast.model.kv_cache import KVCache
from specfast.model.layers import final_logits
from specfast.model.quantize import INT8_SERIAL_ROWS
from specfast.targets.base import argmax_array, check_ids

# Caches a model's passes run in the core over (kernels' attention.rs): float16 halves what a pass
# reads at long context; each value is rounded once, when written.
CORE_CACHE_DTYPES = (torch.float16, torch.float32)


def runs_in_core(model, cache: KVCache) -> bool:
    """True where a pass of `model` over `cache` is one call into the core."""
    return model.in_core and cache.k.dtype in CORE_CACHE_DTYPES


def forward_in_core(model, ids, cache: KVCache, pos: int, last_only, head, aux_layers):
    """Model.forward in the core: the stack in one call, in place on the embedded rows; the
    head's logits from the same call unless `head` (OutputRows) replaces the projection."""
    T = ids.shape[0]
    cos, sin = model.rope(pos + T)
    cos, sin = cos[pos : pos + T], sin[pos : pos + T]  # (T, hd)
    local = local_tables(model, pos + T)
    if local is not None:
        local = tuple(t[pos : pos + T].contiguous().numpy() for t in local)
    packed = model.packed_weights()
    aux: dict | None = None if aux_layers is None else dict.fromkeys(aux_layers)
    rows = 1 if last_only else T
    logits = None if head is not None else torch.empty(rows, model.vocab_size)
    x = model.embed_tokens(ids).float().contiguous()  # (T, D)
    ids_aux = list(aux or ())
    feats = torch.empty(len(ids_aux), *x.shape)  # (n, T, D): the input of each aux layer
    out = None if logits is None else logits.numpy()
    stack = core_stack(model, packed)
    stack.forward(
        x.numpy(), cos.contiguous().numpy(), sin.contiguous().numpy(), cache.k.numpy(),
        cache.v.numpy(), pos, ids_aux, feats.numpy(), out, local,
    )  # fmt: skip
    if aux is not None:
        for i, f in zip(ids_aux, feats, strict=True):
            aux[i] = f
    if logits is None:
        logits = final_logits(model, x[-1:] if last_only else x, head, packed)
    return logits if aux is None else (logits, model_features(aux, aux_layers))


def local_tables(model, length: int):
    """The sliding layers' (cos, sin) tables of at least `length` rows, where they differ from
    the global ones (gemma3: another RoPE base), else None."""
    c = model.config
    if not c.sliding_layers or not c.rope_local_theta:
        return None
    return model.rope(length, local=True)


def core_stack(model, packed) -> CoreLayers:
    """The core's stack of the model's layers, made once per packing (making the arguments of
    30 layer calls is a measurable part of a small model's pass)."""
    if model._stack[0] is not packed:
        args = []
        for layer, (qkv, o, gate_up, down) in zip(model.layers, packed, strict=False):
            bias = layer.wqkv.bias
            bias = None if bias is None else bias.detach().numpy()
            attn, ffn = layer.attn_norm.detach().numpy(), layer.ffn_norm.detach().numpy()
            args.append((attn, qkv, bias, o, ffn, gate_up, down))
        c, norm, layers = model.config, model.norm.detach().numpy(), model.layers

        def pairs(a: str, b: str) -> list:  # per layer, its gains a and b
            return [
                (getattr(x, a).detach().numpy(), getattr(x, b).detach().numpy()) for x in layers
            ]

        stack = CoreLayers(
            args, c.n_heads, c.norm_eps, norm, packed[-1],
            qk_norms=pairs("q_norm", "k_norm") if c.qk_norm else None,
            post_norms=pairs("post_attn_norm", "post_ffn_norm") if c.post_norms else None,
            act=c.act, attn_scale=c.attn_scale, sliding_layers=list(c.sliding_layers),
            window=c.sliding_window or 0,
        )  # fmt: skip
        model._stack = (packed, stack)
    return model._stack[1]


class CoreGreedy:
    """A decoder's greedy passes in the core, over NumPy views of its arrays: a pass streams
    the weights through the caches, so a torch op between passes runs cold, and the dozen in
    Model.forward cost a one-row pass a measurable share (benches/bench_runtime.py). The same
    call into the core on the same values, so the same ids as ModelDecoder.forward's argmax."""

    def __init__(self):
        # (No reference to the decoder: a cycle would keep a compiled decoder's cache buffers
        # from going back to kv_cache.static_cache's free list when the decoder goes.)
        self._arrays: tuple | None = None  # (packing, embedding, arrays)
        self._logits = np.empty((0, 0), np.float32)  # one-row and verify passes reuse it

    def arrays(self, d) -> tuple | None:
        """(the core's layer stack, embedding (V, D), cos and sin tables (at least max_length
        rows), keys, values, the sliding layers' tables or None) where a pass runs wholly in
        the core, else None. Kept while the packing and the embedding stay the same objects."""
        m, cache = d.model, d.cache
        if d.step is not None or not runs_in_core(m, cache):
            return None
        packed = m.packed_weights()
        # The float table's rows by indexing; a FileEmbedding's dequantized as they are read.
        float_table = isinstance(m.embed, torch.nn.Embedding)
        embed = m.embed.weight if float_table else m.embed
        if self._arrays is None or self._arrays[0] is not packed or self._arrays[1] is not embed:
            cos, sin = m.rope(d.max_length)
            local = local_tables(m, d.max_length)
            local = None if local is None else (local[0].numpy(), local[1].numpy())
            stack = core_stack(m, packed)
            keys, values = cache.k.numpy(), cache.v.numpy()
            rows = embed.detach().numpy().__getitem__ if float_table else embed.rows
            arrays = (stack, rows, cos.numpy(), sin.numpy(), keys, values, local)
            self._arrays = (packed, embed, arrays)
        return self._arrays[2]

    def greedy(self, d, ids, stack, embed_rows, cos, sin, k, v, local) -> torch.Tensor:
        """ids (T,) -> the argmax id of each row (T,); appends T tokens to decoder d."""
        m, pos = d.model, d.cache.length
        check_ids(ids, m.device, m.vocab_size, pos, d.max_length)
        rows, T = ids.numpy(), ids.shape[0]
        if T > INT8_SERIAL_ROWS:  # a prefill's logits: not worth keeping
            logits = np.empty((T, m.vocab_size), np.float32)
        else:
            if self._logits.shape[0] < T:
                self._logits = np.empty((T, m.vocab_size), np.float32)
            logits = self._logits[:T]
        x = embed_rows(rows)  # (T, D): a copy, which the core turns into the last hidden states
        if m.config.embed_scale != 1.0:  # gemma3: as Model.embed_tokens, in float32
            x *= np.float32(m.config.embed_scale)
        if local is not None:
            local = (local[0][pos : pos + T], local[1][pos : pos + T])
        stack.forward(
            x, cos[pos : pos + T], sin[pos : pos + T], k, v, pos, logits=logits, local=local
        )
        d.cache.length = pos + T
        return argmax_array(logits)
