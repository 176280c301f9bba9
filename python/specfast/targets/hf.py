"""The transformers adapter: any causal LM behind the same decoder protocol as specfast's runtime.

transformers is imported lazily, only when an HF model is actually used.
"""

from __future__ import annotations

import inspect

import torch

from specfast.targets.base import argmax_rows, check_ids, check_rollback, to_device
from specfast.targets.torch.model import Model


def is_hf_model(obj) -> bool:
    """True for a transformers model, checked without importing transformers."""
    return any(c.__module__.startswith("transformers.") for c in type(obj).__mro__) and hasattr(
        obj, "config"
    )


def hf_vocab_and_context(hf_model) -> tuple[int, int]:
    """The vocabulary as the logits see it (config.vocab_size may differ) and the context."""
    vocab = hf_model.get_output_embeddings().weight.shape[0]
    return vocab, getattr(hf_model.config, "max_position_embeddings", None) or 2**31


class HFDecoder:
    """One sequence over a transformers causal LM. Rollback crops its DynamicCache.

    forward(ids (T,)) -> float32 logits (T, V), appending T tokens, exactly as `Decoder`.
    """

    def __init__(self, hf_model, max_length: int | None = None):
        from transformers import DynamicCache

        if not is_hf_model(hf_model):
            raise TypeError(f"expected a transformers model, got {type(hf_model).__name__}")
        self.model = hf_model
        cfg = hf_model.config
        self.vocab_size, self.max_context = hf_vocab_and_context(hf_model)
        max_length = self.max_context if max_length is None else max_length
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if max_length > self.max_context:
            raise ValueError(
                f"max_length {max_length} exceeds the model's context of {self.max_context}"
            )
        self.max_length = max_length
        self.cache = DynamicCache(config=cfg)
        self._length = 0
        # transformers >= 5.24 names the cache argument `cache`; earlier ones `past_key_values`
        params = inspect.signature(hf_model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def length(self) -> int:
        return self._length

    def forward(self, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        check_ids(ids, self.device, self.vocab_size, self._length, self.max_length)
        T, pos = ids.shape[0], self._length
        positions = torch.arange(pos, pos + T, device=ids.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.long()[None],
                use_cache=True,
                **{self._cache_kw: self.cache},
                cache_position=positions,
                position_ids=positions[None],
            )
        self._length = pos + T
        logits = out.logits[0]  # (T, V)
        return (logits[-1:] if last_only else logits).float()

    def forward_greedy(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T,) argmax ids, on the device; appends T tokens."""
        return argmax_rows(self.forward(ids))

    def greedy_ids(self, tokens: list[int]) -> list[int]:
        """forward_greedy over a list of ids -> the argmax id of every row, as ints."""
        return self.forward_greedy(to_device(tokens, self.device)).tolist()  # the one sync

    def rollback(self, length: int) -> None:
        check_rollback(length, self._length)
        if length < self._length:
            # a negative count removes that many tokens in every transformers version
            self.cache.crop(length - self._length)
        self._length = length

    def reset(self) -> None:
        self.rollback(0)


def make_decoder(model, max_length: int | None = None):
    """A decoder for a specfast Model or any transformers causal LM."""
    if isinstance(model, Model):
        return model.decoder(max_length)
    if is_hf_model(model):
        return HFDecoder(model, max_length)
    raise TypeError(
        f"expected a specfast Model (from load_model) or a transformers causal LM, "
        f"got {type(model).__name__}"
    )
