"""A static, preallocated KV cache whose rollback is an integer assignment."""

from __future__ import annotations

import torch


class KVCache:
    """Per layer, keys and values for positions [0, max_length), and how many are valid.

    Positions index the buffers directly (as in gpt-fast), so a write at position p overwrites
    whatever a rolled-back sequence left there. Attention reads only [0, length + T).
    """

    def __init__(self, n_layers, n_kv_heads, max_length, head_dim, device, dtype):
        shape = (n_layers, n_kv_heads, max_length, head_dim)
        # Always inference tensors: a compiled step guards on that, so a cache made outside
        # inference_mode would be a second graph.
        with torch.inference_mode():
            self.k = torch.zeros(shape, device=device, dtype=dtype)  # (n_layers, Hkv, S, hd)
            self.v = torch.zeros(shape, device=device, dtype=dtype)
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


def check_rollback(length, current: int) -> None:
    """What every decoder's rollback accepts: an int in [0, current]."""
    if not isinstance(length, int) or isinstance(length, bool):
        raise TypeError(f"rollback length must be an int, got {type(length).__name__}")
    if not 0 <= length <= current:
        raise ValueError(f"can only roll back to a length in [0, {current}], got {length}")
