"""What generate() needs to know of a model, whichever kind it is: a specfast Model, a
transformers causal LM or a llama_cpp.Llama. One place dispatches on the type, so the loop
never does."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from specfast.targets import hf
from specfast.targets.hf import HFDecoder, hf_vocab_and_context, is_hf_model
from specfast.targets.llama_cpp import (
    LlamaDecoder,
    LlamaTokenizer,
    is_llama,
    llama_eos_ids,
    llama_facts,
)
from specfast.targets.torch.model import Decoder

if TYPE_CHECKING:
    # Only for annotations: at run time `torch` here names this package's torch/ (specfast's
    # runtime), which importing it binds as an attribute of specfast.targets.
    import torch

__all__ = [
    "context_hint",
    "is_model",
    "is_target",
    "make_decoder",
    "model_eos_ids",
    "model_facts",
    "model_tokenizer",
    "tokenizer_vocab",
]


# What a target has, as specfast's own Model does: anything with these is a target as it
# stands (tests/test_custom_target.py is one, in a single file). Its decoder(max_length) gives
# length, forward, forward_greedy, greedy_ids and rollback (docs/architecture.md §3).
TARGET_SURFACE = ("vocab_size", "max_context", "device", "decoder")


def is_target(obj) -> bool:
    """True for an object with the target surface (TARGET_SURFACE), such as a specfast Model."""
    return not isinstance(obj, type) and all(hasattr(obj, a) for a in TARGET_SURFACE)


def is_model(obj) -> bool:
    return is_hf_model(obj) or is_llama(obj) or is_target(obj)


def model_facts(model) -> tuple[int, int, torch.device]:
    """(vocab size as the logits see it, context length in positions, device)."""
    if not is_hf_model(model) and is_target(model):
        return model.vocab_size, model.max_context, model.device
    if is_hf_model(model):
        return (*hf_vocab_and_context(model), model.device)
    if is_llama(model):
        return llama_facts(model)
    raise TypeError(
        "expected a specfast model (load_model), a transformers causal LM or a llama_cpp.Llama, "
        f"got {type(model).__name__}"
    )


def make_decoder(model, max_length: int | None = None):
    """A decoder (forward / rollback / length) over one sequence of `model`."""
    if is_llama(model):
        return LlamaDecoder(model, max_length)
    if not is_hf_model(model) and is_target(model):
        return model.decoder(max_length)
    return hf.make_decoder(model, max_length)


def model_tokenizer(model):
    """The model's tokenizer (encode / decode(skip_special_tokens=)), or None."""
    if is_llama(model):
        return LlamaTokenizer(model)  # Llama.tokenizer is a method, not a tokenizer
    return getattr(model, "tokenizer", None)


def model_eos_ids(model) -> list[int] | None:
    """The model's own end-of-generation ids, where it knows them."""
    if is_llama(model):
        return llama_eos_ids(model)
    return getattr(model, "eos_token_ids", None)


def context_hint(model) -> str:
    """Which setting sets the context, for error messages."""
    return "; build the Llama with a larger n_ctx" if is_llama(model) else ""


def tokenizer_vocab(model) -> dict[str, int] | None:
    tokenizer = model_tokenizer(model)
    return tokenizer.get_vocab() if tokenizer is not None else None


def copy_decoder(model, decoder):
    """A new decoder of `model` holding `decoder`'s first `decoder.length` positions (fork)."""
    if isinstance(decoder, Decoder):
        new = model.decoder(decoder.max_length)
        new.cache.copy_from(decoder.cache)
        return new
    if isinstance(decoder, HFDecoder):
        new = copy.copy(decoder)
        new.cache = copy.deepcopy(decoder.cache)
        return new
    raise TypeError(f"fork() cannot copy a {type(decoder).__name__} cache")
