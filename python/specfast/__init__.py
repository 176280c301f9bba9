"""specfast: exact speculative decoding for local LLMs. Same text, sooner."""

from specfast._core import NgramDrafter as NgramDrafter

__version__ = "0.1.0"

from specfast.sampling import (
    accept_greedy,
    accept_sampled,
    accept_sampled_torch,
    logits_to_probs,
)

__all__ = [
    "accept_greedy",
    "accept_sampled",
    "accept_sampled_torch",
    "logits_to_probs",
]
