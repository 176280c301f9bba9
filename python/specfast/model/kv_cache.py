"""A static, preallocated KV cache whose rollback is an integer assignment."""

from __future__ import annotations

import weakref

import torch

from specfast._core import advise_huge_pages
from specfast.targets.base import check_rollback


class KVCache:
    """Per layer, keys and values for positions [0, max_length), and how many are valid.

    Positions index the buffers directly (as in gpt-fast), so a write at position p overwrites
    whatever a rolled-back sequence left there. Attention reads only [0, length + T).
    """

    def __init__(self, n_layers, n_kv_heads, max_length, head_dim, device, dtype, buffers=None):
        shape = (n_layers, n_kv_heads, max_length, head_dim)
        if buffers is None:
            # Always inference tensors: a compiled step guards on that, so a cache made outside
            # inference_mode would be a second graph.
            with torch.inference_mode():
                buffers = (_zeros(shape, device, dtype), _zeros(shape, device, dtype))
        self.k, self.v = buffers  # (n_layers, Hkv, S, hd) each
        # The compiled step writes these in place (index_copy_). Inductor's CUDA graphs skip,
        # silently but for a counter, any graph that mutates an input not marked static; marked,
        # the graph writes the cache where it is. Unguarded: a new cache is no recompile, only
        # a re-recording if its address is new (static_cache keeps addresses few).
        torch._dynamo.mark_static_address(self.k, guard=False)
        torch._dynamo.mark_static_address(self.v, guard=False)
        self.max_length = max_length
        self.length = 0

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor):
        """k, v (Hkv, T, hd) at positions [pos, pos+T) -> views of keys, values over [0, pos+T)."""
        end = pos + k.shape[1]
        kc, vc = self.k[layer], self.v[layer]
        kc[:, pos:end] = k
        vc[:, pos:end] = v
        return kc[:, :end], vc[:, :end]  # (Hkv, end, hd): cost O(length), not O(max_length)

    def rollback(self, length: int) -> None:
        check_rollback(length, self.length)
        self.length = length

    def copy_from(self, src: KVCache) -> None:
        """Holds `src`'s first `src.length` positions (a Session fork); shapes must match."""
        n = src.length
        with torch.inference_mode():
            self.k[:, :, :n].copy_(src.k[:, :, :n])  # (L, Hkv, n, hd)
            self.v[:, :, :n].copy_(src.v[:, :, :n])
        self.length = n

    def clone(self) -> KVCache:
        """A new cache of the same shape holding this one's first `length` positions."""
        L, Hkv, S, hd = self.k.shape
        new = KVCache(L, Hkv, S, hd, self.k.device, self.k.dtype)
        new.copy_from(self)
        return new


def _zeros(shape, device, dtype) -> torch.Tensor:
    """A zeroed buffer; on CPU, on 2 MiB pages where Linux gives them (asked for before the
    zeros touch the memory; bench_runtime.py, docs/benchmarks.md §14)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    t = torch.empty(shape, device=device, dtype=dtype)
    advise_huge_pages(t.data_ptr(), t.nbytes)
    return t.zero_()


# Free buffers of compiled decoders' caches: {model: {(capacity, device, dtype): [(k, v), ...]}}
_FREE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def static_cache(model, capacity: int) -> KVCache:
    """A zeroed KVCache of `capacity` slots for a compiled decoder of `model`, on buffers that
    outlive it: when the decoder goes, its buffers wait for the model's next decoder of that
    capacity. A CUDA graph is recorded for the addresses it writes, so one generate() after
    another reuses the graphs of the first instead of recording new ones (transformers'
    StaticCache is kept for the same reason). Decoders alive at once (a draft that is the
    target, a Session fork) get buffers of their own. The buffers go with the model."""
    c = model.config
    key = (capacity, model.device, model.dtype)
    free = _FREE.setdefault(model, {}).setdefault(key, [])
    buffers = free.pop() if free else None
    if buffers is not None:
        with torch.inference_mode():
            for t in buffers:
                t.zero_()  # as a new cache: stale values are masked, but NaN * 0 is not 0
    cache = KVCache(c.n_layers, c.n_kv_heads, capacity, c.head_dim, *key[1:], buffers=buffers)
    weakref.finalize(cache, free.append, (cache.k, cache.v))
    return cache
