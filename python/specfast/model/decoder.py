"""One sequence over a specfast Model: a preallocated KV cache and the length of what it holds.

A pass runs one of three ways, each in its own module: compiled static-shape steps (static.py,
where the model compiled them, for the shapes they take), else one call into the core (core.py,
float32 activations on CPU) or torch's eager layers (eager.py), which of the two chosen once, when
the decoder is made (Model.pass_for). All
three write the new keys and values at the cache's length and give the same rows' logits, so
the round never knows which ran. rollback(n) only moves the counter: entries past it are never
attended to and get overwritten by the next forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from specfast.hardware import torch_threads
from specfast.model.core import CoreGreedy
from specfast.model.kv_cache import KVCache
from specfast.model.static import StaticStep
from specfast.targets.base import argmax_rows, check_aux_layers, check_ids, to_device


class ModelDecoder:
    """A static, preallocated KV cache over `model`, plus the length of what it holds."""

    def __init__(self, model, max_length: int):
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if max_length > model.max_context:
            raise ValueError(
                f"max_length {max_length} exceeds the model's context of {model.max_context}"
            )
        c = model.config
        self.model = model
        self.max_length = max_length
        self.static = StaticStep(model, max_length) if model.compiled_step is not None else None
        self.step = model.compiled_step
        if self.static is not None:
            self.cache = self.static.cache
        else:
            self.cache = KVCache(
                c.n_layers, c.n_kv_heads, max_length, c.head_dim, model.device, model.kv_dtype
            )
            model.rope(max_length)
        self._pass = model.pass_for(self.cache)  # chosen once: see Model.pass_for
        self.core = CoreGreedy()

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def cold_passes(self) -> int:
        """Passes that compiled a graph or recorded a CUDA graph (compiled steps' first)."""
        return 0 if self.static is None else self.static.cold_passes

    @property
    def torch_threads(self) -> int | None:
        """Threads torch's own ops of a generation round should use, or None for torch's. A
        model whose passes run in the core keeps the core's helper thread spinning on the
        second core all through a generation, and a torch op that waits for a second thread
        of its own then waits for that core."""
        return 1 if self.model.in_core else None

    def forward(
        self,
        ids: torch.Tensor,
        last_only: bool = False,
        features: Sequence[int] | bool | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Any:
        """ids (T,) LongTensor on the model's device -> float32 logits (T, V), or (1, V) for the
        last position only, or over `head`'s tokens only; appends T tokens.

        `features` (target layer ids, or True for `default_aux_layers`) -> (logits, features):
        features (T, n*D) in the model dtype, the residual stream entering those layers for
        every row, from the same pass (see Model.forward)."""
        m = self.model
        check_ids(ids, m.device, m.vocab_size, self.cache.length, self.max_length)
        aux = check_aux_layers(features, m.config.n_layers)
        # The compiled step returns no hidden states: a pass that wants them runs eager.
        if aux is None and self.static is not None and self.static.takes(ids, last_only, head):
            return self.static.run(ids)[0].float()
        T, pos = ids.shape[0], self.cache.length
        with torch.inference_mode():
            out = self._pass(ids.long(), self.cache, pos, last_only, head, aux)
        self.cache.length = pos + T
        if aux is None:
            return out.float()
        return out[0].float(), out[1]

    def forward_greedy(
        self, ids: torch.Tensor, features: Sequence[int] | bool | None = None
    ) -> Any:
        """ids (T,) -> (T,) the argmax token of each row, left on the device (computed inside
        the compiled step when there is one); appends T tokens. With `features`: (argmax ids,
        features (T, n*D)), as forward."""
        m = self.model
        if features is None or features is False:
            arrays = self.core.arrays(self)
            if arrays is not None:
                return self.core.greedy(self, ids, *arrays)
            check_ids(ids, m.device, m.vocab_size, self.cache.length, self.max_length)
            if self.static is not None and self.static.takes(ids, False, None):
                return self.static.run(ids)[1]
            with torch_threads(self.torch_threads or torch.get_num_threads()):
                return argmax_rows(self.forward(ids))
        logits, feats = self.forward(ids, features=features)
        return argmax_rows(logits), feats

    def greedy_ids(self, tokens: list[int]) -> list[int]:
        """forward_greedy over a list of ids -> the argmax id of every row, as ints."""
        # Uploaded without a blocking copy: the ids coming back are the round's one host sync.
        return self.forward_greedy(to_device(tokens, self.model.device)).tolist()

    def rollback(self, length: int) -> None:
        """Forget everything after the first `length` tokens. O(1)."""
        self.cache.rollback(length)

    def reset(self) -> None:
        self.cache.rollback(0)

    def copy(self) -> ModelDecoder:
        """A new decoder of the same model holding this one's first `length` positions."""
        new = self.model.decoder(self.max_length)
        new.cache.copy_from(self.cache)
        return new
