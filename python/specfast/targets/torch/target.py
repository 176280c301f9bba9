"""A specfast Model as the loop sees it: the Target protocol's facts and capabilities, read
from the model when asked (a loader or the caller may set its tokenizer or end ids later).

The model (specfast.model) holds weights, packing and passes; what the loop asks of a target
(features for an EAGLE head, a restricted output head for a draft model, what a benchmark
prints) is answered here, so the model carries no protocol of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from specfast.model import Model, ModelDecoder
from specfast.model.packing import OutputRows
from specfast.targets.base import LayerFacts


class ModelTarget:
    """`model` behind the Target protocol. Its decoders are the model's own (ModelDecoder)."""

    features = True  # its decoders return the inputs of chosen layers
    supports_head = True  # its decoders' forward takes head= (output_rows / first_rows)
    context_hint = ""

    def __init__(self, model: Model):
        self.source = self.model = model

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_context(self) -> int:
        return self.model.max_context

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return self.model.eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self.model.chat_template

    @property
    def weights(self) -> str:
        return self.model.weights

    def decoder(self, max_length: int | None = None) -> ModelDecoder:
        return self.model.decoder(max_length)

    def output_rows(self, ids: torch.Tensor) -> OutputRows:
        return self.model.output_rows(ids)

    def first_rows(self, n: int) -> OutputRows:
        return self.model.first_rows(n)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def layer_facts(self) -> LayerFacts:
        m, c = self.model, self.model.config
        return LayerFacts(
            c.vocab_size, c.dim, c.n_layers, m.dtype, m.device, lambda dtype: m.embed.weight
        )

    def describe(self) -> dict[str, str]:
        """dtype, weights, the KV cache's dtype and how a pass runs (eager or compiled)."""
        m = self.model
        return {
            "runtime": "specfast",
            "dtype": str(m.dtype).removeprefix("torch."),
            "weights": m.weights,
            "kv_dtype": str(m.kv_dtype).removeprefix("torch."),
            "step": "compiled" if m.compiled_step is not None else "eager",
        }
