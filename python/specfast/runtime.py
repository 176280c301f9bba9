"""What generate() needs to know of a model, whichever kind it is: a specfast Model or a
transformers causal LM. One place dispatches on the type, so the loop never does."""

from __future__ import annotations

import torch

from specfast.hf import hf_vocab_and_context, is_hf_model, make_decoder
from specfast.model import Model

__all__ = ["is_model", "make_decoder", "model_facts", "tokenizer_vocab"]


def is_model(obj) -> bool:
    return isinstance(obj, Model) or is_hf_model(obj)


def model_facts(model) -> tuple[int, int, torch.device]:
    """(vocab size as the logits see it, context length in positions, device)."""
    if isinstance(model, Model):
        return model.vocab_size, model.max_context, model.device
    if is_hf_model(model):
        return (*hf_vocab_and_context(model), model.device)
    raise TypeError(
        "expected a specfast model (load_model) or a transformers causal LM, "
        f"got {type(model).__name__}"
    )


def tokenizer_vocab(model) -> dict[str, int] | None:
    tokenizer = getattr(model, "tokenizer", None)
    return tokenizer.get_vocab() if tokenizer is not None else None
