"""The CPU copy of a Model's matrices that its passes read, and what replaces the plain ones.

On CPU every matrix a pass multiplies by is packed once: quantized for the Rust core (int8, q4,
or a GGUF's own blocks), a `FloatMatrix` for float32 passes in the core, or oneDNN-blocked for
bfloat16. The packed copy replaces the plain weight (left as a shape-only placeholder), so
packing never doubles the model's memory; `unpack()` brings the plain weights back.
`PackedWeights` holds this for `Model`; `OutputRows` is a packed slice of the vocabulary
projection (a draft model's rows).
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specfast.model.layers import linear
from specfast.model.quantize import CORE_MATRICES, QUANTIZED, FloatMatrix, dequantize, quantize


def trim_heap() -> None:
    """Hands freed heap memory back to the OS (glibc's malloc_trim). glibc keeps large freed
    blocks for reuse, so without this the weights packing replaced (or a loader's temporaries)
    stay in the process's resident memory. A no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _to_placeholder(m: nn.Linear) -> None:
    """Drops a matrix's values, keeping its shape and dtype (a meta tensor)."""
    w = torch.empty(m.weight.shape, dtype=m.weight.dtype, device="meta")
    m.weight = nn.Parameter(w, requires_grad=False)


class PackedWeights:
    """Model's packed matrices: built on first use, replacing the plain ones (see the module)."""

    # set by Model.__init__
    _packed: list | None
    _plain_released: bool
    _rows_cache: dict[int, OutputRows]
    _stack: tuple
    weight_kind: str
    layers: Any
    lm_head: Any
    embed: Any
    compiled_step: Any

    if TYPE_CHECKING:  # Model's

        @property
        def quantized(self) -> bool: ...
        @property
        def in_core(self) -> bool: ...
        @property
        def dtype(self) -> torch.dtype: ...
        def _packing(self) -> str | None: ...

    def packed_weights(self) -> list | None:
        """Per layer (wqkv, wo, w_gate_up, w_down) and then lm_head, as the core's matrices where
        passes run in the core (float32 on CPU: FloatMatrix, or quantized after
        `quantize_int8()`), else as oneDNN-blocked weights (`_packing`).

        On CPU, a plain F.linear makes oneDNN re-lay out a bf16 weight on every call, and MKL's
        fp32 GEMM gets slow for 2-16 rows. Prepacked weights make a forward over 1-16 tokens cost
        about the same, which is what verification needs. None off CPU or with
        `prepack = False`.

        The packed copy replaces the plain weights of those matrices (they become shape-only
        placeholders on the meta device), so packing does not double the model's memory.
        `unpack()` restores them exactly (oneDNN's reorder is lossless; int8 ones come back
        dequantized); call it before reading or editing a matrix in place, and before
        `state_dict()`. A model with compiled steps keeps the plain weights, which they read.
        """
        if self._packed is not None:
            return self._packed or None
        packed: list = []
        # Each plain matrix goes as soon as its packed copy exists, so the peak is one copy.
        release = self.compiled_step is None
        released: list[tuple[nn.Linear, torch.Tensor]] = []

        def pack(m: nn.Linear, head: bool = False):
            p = self._pack(m.weight, head)
            if release:
                released.append((m, p))
                _to_placeholder(m)
            return p

        if self._packing() is not None:
            try:
                for layer in self.layers:
                    packed.append(
                        [pack(m) for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
                    )
                # A tied head is the embedding, which the lookup still needs: kept.
                packed.append(
                    pack(self.lm_head, head=True)
                    if self.lm_head is not None
                    else self._pack(self.embed.weight, head=True)
                )
            except RuntimeError:  # a oneDNN build that cannot pack this dtype: plain F.linear
                for m, p in released:
                    m.weight = nn.Parameter(p.to_dense(), requires_grad=False)
                packed, released = [], []
        self._packed = packed
        self._plain_released = bool(released)
        if released:
            trim_heap()
        return packed or None

    def _packed_modules(self) -> list[tuple[nn.Linear, int, int | None]]:
        """(module, layer index or -1 for the head, matrix index) for every packed matrix."""
        out: list[tuple[nn.Linear, int, int | None]] = [
            (m, i, j)
            for i, layer in enumerate(self.layers)
            for j, m in enumerate((layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
        ]
        return out + ([(self.lm_head, -1, None)] if self.lm_head is not None else [])

    def _restore_plain(self) -> None:
        if not self._plain_released:
            return
        packed = self._packed or []
        for m, i, j in self._packed_modules():
            w = self._unpacked(packed[i][j] if j is not None else packed[-1])
            m.weight = nn.Parameter(w, requires_grad=False)
        self._plain_released = False

    def _pack(self, w: torch.Tensor, head: bool = False):
        """One matrix as packed_weights() holds it: quantized (the head int8), FloatMatrix, or
        oneDNN-blocked for 16 rows (no slower than unpacked for 1 row, faster for 4-16)."""
        if self.quantized:
            return quantize(w, "int8" if head else self.weight_kind)
        if self.in_core:
            return FloatMatrix(w.detach().contiguous().numpy())
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)

    def _unpacked(self, p) -> torch.Tensor:
        """The plain matrix a packed one stands for."""
        if isinstance(p, CORE_MATRICES):
            return dequantize(p).to(self.dtype)
        return p.to_dense()

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, D): the vocabulary projection (the embedding when they are tied)."""
        if self.lm_head is None:
            return self.embed.weight
        if self._plain_released and self._packed:  # a dense copy for the caller, not kept
            return self._unpacked(self._packed[-1])
        return self.lm_head.weight

    def output_rows(self, ids: torch.Tensor) -> OutputRows:
        """The vocabulary projection for the tokens `ids` only, packed as the model's own is."""
        return OutputRows(self, ids)

    def first_rows(self, n: int) -> OutputRows:
        """output_rows(arange(n)), built once per model (a draft model's common tokens)."""
        if n not in self._rows_cache:
            self._rows_cache[n] = OutputRows(self, torch.arange(n))
        return self._rows_cache[n]

    def adopt_quantized(self, kind: str, packed: list) -> None:
        """Runs on `packed` (per layer the core's wqkv, wo, w_gate_up and w_down, then the
        head's), quantized as `kind` by a loader; the plain matrices are already placeholders,
        which `unpack()` refills from these."""
        if kind not in QUANTIZED or len(packed) != len(self.layers) + 1:
            raise ValueError(f"adopt_quantized needs {QUANTIZED} matrices for every layer")
        self.weight_kind = kind
        self._packed, self._plain_released = packed, True
        self._rows_cache, self._stack = {}, (None, None)

    def unpack(self) -> None:
        """Drops the packed copy and restores the plain weights it replaced."""
        self._restore_plain()
        self._packed = None
        self._rows_cache = {}
        self._stack = (None, None)


class OutputRows:
    """A model's vocabulary projection restricted to the tokens `ids`: hidden (T, D) -> logits
    (T, len(ids)), row i for token ids[i]. A copy of those rows, packed like the model's."""

    def __init__(self, model: Any, ids: torch.Tensor):  # a Model
        self.ids = ids.to(model.device)
        if model.lm_head is None:  # the embedding's rows: a lookup, whatever its storage
            self.weight = model.embed(self.ids).contiguous()  # (S, D)
        else:
            self.weight = model.output_weight[self.ids].contiguous()
        self.packed = model._pack(self.weight) if model.packed_weights() else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed)
