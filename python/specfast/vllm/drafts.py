"""One n-gram drafter per vLLM request, kept in step with the request's token history.

vLLM hands a proposer each batch row's whole history (prompt and output, no drafts). Keeping an
index per request and extending it by only the new tokens makes a round O(new tokens), where
vLLM's own n-gram rescans the whole history (O(context) per round). Nothing here imports vLLM, so
the bookkeeping is tested on replays of the runner's calls without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specfast._core import NgramDrafter

# Draft only from a match of at least this many tokens, and at most k_factor tokens per matched
# token: in a batch every drafted token costs verification compute, and a one-token match rarely
# continues (vLLM's suffix method caps a draft by its match length the same way).
MIN_MATCH = 2
K_FACTOR = 1.0


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

    def __init__(self, *, min_match: int = MIN_MATCH, k_factor: float = K_FACTOR):
        self.min_match, self.k_factor = min_match, k_factor
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
        drafter = NgramDrafter(min_match=self.min_match, k_factor=self.k_factor)
        if n:
            drafter.extend(_ids(history))
        self.requests[req_id] = _Request(drafter, n, int(history[n - 1]) if n else -1)
        self.rebuilds += 1

    def propose(self, req_id: str, k: int) -> list[int]:
        """Up to k draft tokens for a synced request ([] when k <= 0 or nothing matches)."""
        if k <= 0:
            return []
        return self.requests[req_id].drafter.propose(k)

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
