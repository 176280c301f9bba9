"""One n-gram drafter per vLLM request, kept in step with the request's token history.

vLLM hands a proposer each batch row's whole history (prompt and output, no drafts). Keeping an
index per request and extending it by only the new tokens makes a round O(new tokens), where
vLLM's own n-gram rescans the whole history (O(context) per round). Nothing here imports vLLM, so
the bookkeeping is tested on replays of the runner's calls without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from specfast._core import NgramDrafter

# Draft only from a match of at least this many tokens: a one-token match rarely continues.
MIN_MATCH = 2
# Where verification costs, at most k_factor draft tokens per matched token (vLLM's suffix method
# caps a draft by its match length the same way).
K_FACTOR = 1.0
# Tokens one verify pass holds at about one token's cost (see draft_cap). Set it for the hardware
# with SPECFAST_VLLM_FREE_TOKENS.
FREE_TOKENS = 8
FREE_TOKENS_ENV = "SPECFAST_VLLM_FREE_TOKENS"


def draft_cap(k: int, match: int, batch: int, free_tokens: int = FREE_TOKENS) -> int:
    """Draft tokens for a request whose longest earlier match is `match` tokens, in a step that
    decodes `batch` requests, where a pass over up to `free_tokens` tokens costs about one token's.

    The step's pass holds batch x (1 + draft) tokens. Up to free_tokens of them cost next to
    nothing, so each row may draft free_tokens // batch - 1 tokens on the evidence of any match
    (at batch 1 with free_tokens >= k + 1: all k). Past that every draft token costs compute, and
    the draft holds at most K_FACTOR tokens per matched token. Below MIN_MATCH, no draft.
    """
    if k <= 0 or match < MIN_MATCH:
        return 0
    free = free_tokens // max(batch, 1) - 1
    return min(k, max(int(K_FACTOR * match), free))


def free_tokens_setting() -> int:
    """FREE_TOKENS, or the environment's SPECFAST_VLLM_FREE_TOKENS (an integer >= 1)."""
    value = os.environ.get(FREE_TOKENS_ENV)
    if value is None:
        return FREE_TOKENS
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{FREE_TOKENS_ENV} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclass
class _Request:
    drafter: NgramDrafter
    length: int  # tokens indexed
    last: int  # the last of them: a history that no longer has it here was rewritten


class RequestDrafts:
    """Per-request drafters by request id: `sync` a row's history, `propose`, `finish`.

    A known request is extended by the tokens past what it has indexed (a request resumed after
    preemption too: its history is the same). One that is unknown, or whose history no longer
    agrees with what was indexed (shorter, or another token at the last indexed position: an id
    resubmitted with another prompt, or a row key that now holds another request), is rebuilt
    from the row. Drafts are a function of the history alone, so every tensor-parallel rank
    proposes the same; a draft only proposes, so a wrong one costs speed, never output.
    """

    def __init__(self, *, free_tokens: int | None = None):
        self.free_tokens = free_tokens_setting() if free_tokens is None else free_tokens
        self.requests: dict[str, _Request] = {}
        self.rebuilds = 0  # requests indexed from scratch (new, or history rewritten)

    def sync(self, req_id: str, history) -> None:
        """Brings the request's index to `history`, its row up to its length (prompt + output):
        a numpy array, or a torch tensor on any device (only the new tokens are copied off it)."""
        n = len(history)
        state = self.requests.get(req_id)
        if (
            state is not None
            and 0 < state.length <= n
            and int(history[state.length - 1]) == state.last
        ):
            if n > state.length:
                state.drafter.extend(_ids(history[state.length :]))
                state.length, state.last = n, int(history[n - 1])
            return
        drafter = NgramDrafter(min_match=MIN_MATCH)  # uncapped: propose applies draft_cap
        if n:
            drafter.extend(_ids(history))
        self.requests[req_id] = _Request(drafter, n, int(history[n - 1]) if n else -1)
        self.rebuilds += 1

    def propose(self, req_id: str, k: int, batch: int = 1) -> list[int]:
        """Up to k draft tokens for a synced request in a step decoding `batch` requests, as
        many as `draft_cap` allows ([] when k <= 0 or nothing matches)."""
        drafter = self.requests[req_id].drafter
        cap = draft_cap(k, drafter.match_length, batch, self.free_tokens)
        return drafter.propose(cap) if cap else []

    def finish(self, req_ids) -> None:
        """Frees finished requests' state (ids never seen are ignored)."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)

    def reset(self) -> None:
        self.requests.clear()

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.requests


def _ids(tokens) -> np.ndarray:
    if hasattr(tokens, "cpu"):  # a torch tensor, maybe on a GPU
        tokens = tokens.cpu().numpy()
    return np.ascontiguousarray(tokens, dtype=np.uint32)


def draft_budget(k: int, length: int, max_model_len: int) -> int:
    """Draft tokens a request of `length` tokens may get: k, less what would pass max_model_len.

    A round appends the drafts plus one token from the target, so drafts stop one short.
    """
    return max(0, min(k, max_model_len - length - 1))
