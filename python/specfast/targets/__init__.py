"""Targets: every model the loop can verify with, behind one protocol (base.py, `Target`).

`as_target` is the one place that asks what kind of model an object is. Every public entrance
(generate, Session, a draft model, an EAGLE head's target, the server) calls it once; past it
the code sees a Target and its Decoders, never a class.

- a specfast Model (specfast.model) becomes a `ModelTarget` (torch/);
- a transformers causal LM becomes an `HFTarget` (hf.py);
- a llama_cpp.Llama becomes a `LlamaTarget` (llama_cpp/);
- any other object with the target surface (TARGET_SURFACE) becomes an `ObjectTarget`, which
  gives the capabilities it lacks their plain defaults (tests/test_custom_target.py is one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from specfast.model import Model
from specfast.targets.base import Decoder, LayerFacts, Target
from specfast.targets.hf import HFDecoder, HFTarget, hf_eos_ids, is_hf_model
from specfast.targets.llama_cpp import (
    LayerInputs,
    LlamaDecoder,
    LlamaTokenizer,
    check_llama_build,
    is_llama,
    llama_eos_ids,
    llama_threads,
    load_llama,
    tile_restorer,
)
from specfast.targets.llama_cpp.target import LlamaTarget
from specfast.targets.torch import ModelTarget

# Outside targets/, code imports a kind's names from here, never from its folder
# (tests/test_layers.py): the llama.cpp names serve the GGUF loader and the llama.cpp benchmark.
__all__ = [
    "Decoder",
    "HFDecoder",
    "LayerInputs",
    "LlamaDecoder",
    "LlamaTokenizer",
    "ModelTarget",
    "Target",
    "as_target",
    "check_llama_build",
    "is_target",
    "llama_eos_ids",
    "llama_threads",
    "load_llama",
    "make_decoder",
    "tile_restorer",
    "tokenizer_vocab",
    "try_target",
]

# What an object needs to be a target as it stands: its decoder(max_length) gives length,
# forward, forward_greedy, greedy_ids and rollback (docs/architecture.md §3).
TARGET_SURFACE = ("vocab_size", "max_context", "device", "decoder")
_WRAPPED = (ModelTarget, HFTarget, LlamaTarget)


def try_target(obj: Any) -> Target | None:
    """`obj` as a Target (the same object when it is one already), or None for a non-model."""
    if isinstance(obj, (*_WRAPPED, ObjectTarget)):
        return obj
    if isinstance(obj, Model):
        return ModelTarget(obj)
    if isinstance(obj, type):
        return None
    if is_hf_model(obj):
        return HFTarget(obj)
    if is_llama(obj):
        return LlamaTarget(obj)
    if is_target(obj):
        return ObjectTarget(obj)
    return None


def as_target(obj: Any) -> Target:
    """`obj` as a Target, or TypeError naming what a model may be."""
    target = try_target(obj)
    if target is None:
        raise TypeError(
            "model must be a specfast Model (load_model), a transformers causal LM, a "
            f"llama_cpp.Llama or an object with {', '.join(TARGET_SURFACE)}; got "
            f"{type(obj).__name__}"
        )
    return target


def is_target(obj: Any) -> bool:
    """True for an object with the target surface (TARGET_SURFACE), such as a specfast Model."""
    return not isinstance(obj, type) and all(hasattr(obj, a) for a in TARGET_SURFACE)


def make_decoder(model: Any, max_length: int | None = None) -> Decoder:
    """A decoder over one sequence of `model` (anything as_target takes)."""
    return as_target(model).decoder(max_length)


def tokenizer_vocab(target: Target) -> dict[str, int] | None:
    """The tokenizer's token -> id map, where the target has a tokenizer that gives one."""
    get_vocab = getattr(target.tokenizer, "get_vocab", None)
    return get_vocab() if callable(get_vocab) else None


# ----------------------------------------------------------------------------
# an object with the target surface


class ObjectTarget:
    """An object with TARGET_SURFACE as a Target: what it has is used, the rest defaults (no
    tokenizer, no features, float weights). Its decoders get the Decoder members they lack."""

    supports_head = False
    context_hint = ""

    def __init__(self, obj: Any):
        self.source = obj
        self.vocab_size: int = obj.vocab_size
        self.max_context: int = obj.max_context
        self.device: torch.device = obj.device
        self.tokenizer = getattr(obj, "tokenizer", None)
        self.chat_template: str | None = getattr(obj, "chat_template", None)
        own = getattr(obj, "eos_token_ids", None)
        self.eos_token_ids: list[int] = list(own) if own else hf_eos_ids(obj)
        self.weights: str = getattr(obj, "weights", "float")
        self.features: bool = bool(getattr(obj, "features", False))

    def decoder(self, max_length: int | None = None) -> Decoder:
        return ObjectDecoder(self.source.decoder(max_length))

    def parameter_count(self) -> int:
        count = getattr(self.source, "parameter_count", None)
        return int(count()) if callable(count) else 0

    def layer_facts(self) -> LayerFacts:
        facts = getattr(self.source, "layer_facts", None)
        if not callable(facts):
            raise TypeError(
                "the EAGLE target must be a specfast Model or a llama_cpp.Llama (or give "
                f"layer_facts()), got {type(self.source).__name__}"
            )
        return facts()

    def describe(self) -> dict[str, str]:
        return {"runtime": type(self.source).__name__}


class ObjectDecoder:
    """A decoder of an ObjectTarget: its own members, and the protocol's defaults for those it
    lacks (no thread hint, no cold passes, reset as rollback(0), copy refused)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.max_length: int = getattr(inner, "max_length", 0) or 2**31
        self.forward = inner.forward
        self.forward_greedy = inner.forward_greedy
        self.greedy_ids = inner.greedy_ids
        self.rollback = inner.rollback

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def torch_threads(self) -> int | None:
        return getattr(self.inner, "torch_threads", None)

    @property
    def cold_passes(self) -> int:
        return getattr(self.inner, "cold_passes", 0)

    def reset(self) -> None:
        self.inner.rollback(0)

    def copy(self) -> Decoder:
        copy = getattr(self.inner, "copy", None)
        if not callable(copy):
            raise TypeError(f"fork() cannot copy a {type(self.inner).__name__} cache")
        return ObjectDecoder(copy())


if TYPE_CHECKING:  # mypy checks that each runtime meets both protocols (scripts/test.sh)
    from specfast.model import ModelDecoder

    def _targets(a: ModelTarget, b: HFTarget, c: LlamaTarget, d: ObjectTarget) -> list[Target]:
        return [a, b, c, d]

    def _decoders(
        a: ModelDecoder, b: HFDecoder, c: LlamaDecoder, d: ObjectDecoder
    ) -> list[Decoder]:
        return [a, b, c, d]
