"""What a generate() call returns: its tokens and text, why it stopped, and what it did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """What a generate() call did. `mean_acceptance_length` is vLLM's: 1 + accepted / steps."""

    target_passes: int = 0  # every target forward, prefill included
    draft_tokens: int = 0  # tokens proposed and verified (forced ones included)
    accepted_tokens: int = 0  # proposed tokens that were committed (forced ones included)
    forced_tokens: int = 0  # tokens a response_format's grammar forced, verified as free drafts
    acceptance_histogram: list[int] = field(default_factory=list)  # [n] = rounds accepting n
    new_tokens: int = 0
    seconds: float = 0.0  # wall time, prefill included
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0  # tokens run through the target before the first new token
    reused_tokens: int = 0  # tokens already in the cache (a Session's earlier turns)

    @property
    def decode_steps(self) -> int:
        return max(self.target_passes - 1, 0)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.decode_steps if self.decode_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "target_passes": self.target_passes,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forced_tokens": self.forced_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_histogram": list(self.acceptance_histogram),
            "new_tokens": self.new_tokens,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "prefill_tokens": self.prefill_tokens,
            "reused_tokens": self.reused_tokens,
        }


@dataclass
class GenerateOutput:
    """`logprobs` (with logprobs=True): each new token's log-probability under the target,
    `top_logprobs` (with top_logprobs=N): per token its position's N most likely tokens as
    (id, logprob), most likely first; specfast/logprobs.py says which distribution."""

    token_ids: list[int]  # new tokens only
    text: str | None
    stats: GenerationStats
    finish_reason: str  # "length" | "eos" | "stop_string"
    logprobs: list[float] | None = None  # one per token_ids entry
    top_logprobs: list[list[tuple[int, float]]] | None = None
