"""Chain drafters: a model that drafts one token per step from its own logits (a draft model,
drafters/model.py; an EAGLE-3 head, drafters/eagle/draft.py).

`ChainDraft` holds what both share: the k policy (a fixed k, or AutoK's `choose_draft` with its
`keep_drafting` stop on the draft's own probabilities), the turn's sampling state, the step
loop, and the scatter of q from the draft's rows back to the target's vocabulary. A subclass
says how its first step catches up on the committed tokens (`_first`), how each later step
runs (`_next`), and which target token each logit row is (`_row_ids`).

When sampling, each draft is drawn from q = logits_to_probs(draft logits, the target's
temperature/top-k/top-p/min-p), and that very tensor, scattered, is the proposal's q, so the
q in the acceptance ratio is the q the draft came from by construction. Whether step i + 1
runs depends only on the draft's own probabilities, never on the target's verdict, so stopping
early keeps sampling exact.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from specfast.autok import AutoK
from specfast.drafters.base import Base, Proposal, Verified, copy_auto, observe_model
from specfast.sampling import copy_generator, logits_to_probs
from specfast.targets.base import argmax_rows


class ChainDraft(Base):
    """The shared half of a chain drafter; see the module docstring."""

    def __init__(self, fixed_k: int | None, device: torch.device, vocab_size: int):
        self.fixed_k: int = fixed_k or 0  # used only without auto k (fixed_k given)
        self.auto = AutoK() if fixed_k is None else None
        self.device = device
        self.vocab_size = vocab_size  # the target's: q is scattered onto it
        self.generator = torch.Generator(device=device)
        self.greedy, self.sampling = True, dict[str, Any]()
        self.draft_probs: torch.Tensor | None = None  # (k, V) q of the last proposal, sampling
        self.confidences: list[float] = []  # the draft's probability of each draft token

    # -- what a subclass provides

    def extend(self, tokens: list[int]) -> None:
        raise NotImplementedError

    def rollback(self, kept: list[int]) -> None:
        raise NotImplementedError

    def ready(self) -> bool:
        """Whether there is anything to draft from."""
        return True

    def _first(self) -> torch.Tensor:
        """Catches up on what the draft has not read; -> logits (1, S) of the first draft."""
        raise NotImplementedError

    def _next(self, token: torch.Tensor) -> torch.Tensor:
        """Reads the draft token (1,) just chosen; -> logits (1, S) of the next one."""
        raise NotImplementedError

    def _row_ids(self) -> torch.Tensor | None:
        """(S,) the target token of each logit row, or None where row i is token i."""
        return None

    def _after(self, tokens: list[int]) -> None:
        """Called with the drafted tokens once the chain has stopped."""

    def _take(self, verified: Verified) -> None:
        """Reads what the verify pass hands over (an EAGLE head: the kept rows' features)."""

    # -- the protocol

    def start_turn(self, seed: int, params: dict | None) -> None:
        self.greedy = params is None or params.get("temperature", 0) == 0
        self.sampling = dict(params or {})
        self.generator.manual_seed(seed)

    def propose(self, budget: int) -> Proposal:
        k = self.fixed_k if self.auto is None else self.auto.choose_draft()
        return self.draft(min(k, budget))

    def observe(self, proposal, n_accepted, verify_seconds, verified: Verified) -> None:
        self._take(verified)
        if self.auto is not None:
            observe_model(self.auto, proposal, n_accepted, verify_seconds)

    def fork(self, ids) -> ChainDraft:
        """A copy with its own auto k (sharing only the target's pass costs), sampling state and
        generator; a subclass copies its cache and sequence on top."""
        new = copy.copy(self)
        new.auto = copy_auto(self.auto)
        new.sampling, new.confidences, new.draft_probs = dict(self.sampling), [], None
        new.generator = copy_generator(self.generator)
        return new

    # -- the chain

    def draft(self, k: int) -> Proposal:
        """Up to k drafts, one step each; with auto k the chain stops itself (keep_drafting)."""
        if k <= 0 or not self.ready():
            return Proposal([])
        ids = self._row_ids()
        logits = self._first()
        drafts, qs, confidences = [], [], []
        for i in range(k):
            row, q = self._choose(logits)  # (1,), and q (1, S) when sampling
            token = row if ids is None else ids[row]  # (1,) on the device: no sync per step
            drafts.append(token)
            if q is not None:
                qs.append(q)
            if self.auto is not None:
                # A host sync per step, small next to the step itself.
                confidences.append(draft_probability(logits, q, row))
                if not self.auto.keep_drafting(confidences):
                    break
            if i + 1 < k:
                logits = self._next(token)
        tokens = torch.cat(drafts).tolist()  # without auto k, the proposal's one host sync
        self.confidences = confidences
        self.draft_probs = self._scatter(torch.cat(qs), ids) if qs else None
        self._after(tokens)
        return Proposal(tokens, self.draft_probs, None, list(confidences))

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The row (1,) drawn from logits (1, S), and the q (1, S) it was drawn from."""
        if self.greedy:
            return argmax_rows(logits), None
        q = logits_to_probs(logits, **self.sampling)  # (1, S)
        return torch.multinomial(q, 1, generator=self.generator)[0], q

    def _scatter(self, q: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """(k, S) over the draft's rows -> (k, V) over the target's vocabulary, 0 elsewhere."""
        if ids is None:
            return q
        full = q.new_zeros(q.shape[0], self.vocab_size)
        return full.index_copy_(1, ids, q)


def draft_probability(logits: torch.Tensor, q: torch.Tensor | None, row: torch.Tensor) -> float:
    """The probability a draft gave its row: from q when sampling, else softmax(logits) (1, S)
    in float32."""
    if q is not None:
        return float(q[0, row])
    x = logits[0].float()
    return float(torch.exp(x[row] - torch.logsumexp(x, dim=0)))
