"""The transformers adapter: any causal LM behind the same decoder protocol as specfast's runtime.

transformers is imported lazily, only when an HF model is actually used.
"""

from __future__ import annotations

import copy
import inspect

import torch

from specfast.targets.base import (
    Decoder,
    LayerFacts,
    argmax_rows,
    check_ids,
    check_rollback,
    to_device,
)


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

    torch_threads = None
    cold_passes = 0

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
        # A sliding-window layer's cache (Gemma 3's) keeps only its window, so a rollback
        # could not bring back what a rejected draft pushed out: such models get full layers,
        # and their attention masks still apply the window.
        sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or ())
        self.cache = DynamicCache() if sliding else DynamicCache(config=cfg)
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

    def forward(self, ids: torch.Tensor, last_only: bool = False, features=None) -> torch.Tensor:
        check_no_features(features)
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

    def forward_greedy(self, ids: torch.Tensor, features=None) -> torch.Tensor:
        """ids (T,) -> (T,) argmax ids, on the device; appends T tokens."""
        return argmax_rows(self.forward(ids, features=features))

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

    def copy(self) -> Decoder:
        """An independent decoder holding the same positions (its own copy of the cache)."""
        new = copy.copy(self)
        new.cache = copy.deepcopy(self.cache)
        return new


class HFTarget:
    """A transformers causal LM behind the Target protocol. Its decoders return no features,
    so EAGLE heads refuse it; its end ids come from the generation config."""

    chat_template: str | None = None
    weights = "float"
    features = False
    supports_head = False
    context_hint = ""

    def __init__(self, hf_model):
        self.source = hf_model
        self.vocab_size, self.max_context = hf_vocab_and_context(hf_model)
        self.tokenizer = getattr(hf_model, "tokenizer", None)
        self.chat_template = getattr(hf_model, "chat_template", None)
        own = getattr(hf_model, "eos_token_ids", None)
        self.eos_token_ids = list(own) if own else hf_eos_ids(hf_model)

    @property
    def device(self) -> torch.device:
        return self.source.device

    def decoder(self, max_length: int | None = None) -> Decoder:
        return HFDecoder(self.source, max_length)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.source.parameters())

    def layer_facts(self) -> LayerFacts:
        raise ValueError(
            "EAGLE drafting runs on specfast's runtime, which returns the target's hidden states "
            "from the verify pass; the transformers adapter does not. Load the checkpoint folder "
            "with specfast.load_model(path)"
        )

    def describe(self) -> dict[str, str]:
        dtype = str(next(self.source.parameters()).dtype).removeprefix("torch.")
        return {"runtime": "transformers", "dtype": dtype, "weights": "float", "step": "eager"}


def check_no_features(features) -> None:
    """transformers passes return no layer inputs: a pass that asks for them is refused."""
    if features is not None and features is not False:
        raise ValueError(
            "the transformers adapter returns no hidden-state features; load the checkpoint "
            "folder with specfast.load_model(path) for drafters that read them (EAGLE)"
        )


def hf_eos_ids(hf_model) -> list[int]:
    """The end ids of a transformers model's generation config (or config), else none."""
    config = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    if config is None:
        config = getattr(getattr(hf_model, "config", None), "eos_token_id", None)
    if config is None:
        return []
    return [config] if isinstance(config, int) else list(config)
