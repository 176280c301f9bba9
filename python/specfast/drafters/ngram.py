"""The n-gram drafter (or any object with `extend` and `propose`) behind the drafter protocol."""

from __future__ import annotations

import copy

from specfast._core import NgramDrafter
from specfast.autok import AutoK
from specfast.drafters.base import Base, Drafter, DraftSetup, Proposal, clone_ngram, copy_auto


class IndexDraft(Base):
    """An NgramDrafter, or any object with `extend(tokens)` and `propose(k)` (tests' oracles).

    k: fixed, or auto (AutoK by the `match_length` the object reports; None if it reports none).
    rollback: `reset()` then `extend(kept)` (O(len(kept)); an NgramDrafter keeps its corpus).
    """

    def __init__(self, inner, fixed_k: int | None):
        self.inner = inner
        self.fixed_k: int = fixed_k or 0  # used only without auto k (fixed_k given)
        self.auto = AutoK() if fixed_k is None else None

    @classmethod
    def bind(cls, source, setup: DraftSetup) -> IndexDraft:
        """drafter="ngram" (a new NgramDrafter), or an object with extend and propose."""
        return cls(NgramDrafter() if source == "ngram" else source, setup.fixed_k)

    def extend(self, tokens) -> None:
        self.inner.extend(tokens)

    def prefill(self, features=None) -> None:
        if hasattr(self.inner, "prefill"):
            self.inner.prefill()

    def propose(self, budget: int) -> Proposal:
        match = getattr(self.inner, "match_length", None)
        k = self.fixed_k if self.auto is None else self.auto.choose(match)
        k = min(k, budget)
        if k <= 0:
            return Proposal([], evidence=match)
        tokens = list(self.inner.propose(k))[:k]
        return Proposal(tokens, getattr(self.inner, "draft_probs", None), match)

    def observe(self, proposal, n_accepted, verify_seconds, verified) -> None:
        if self.auto is not None:
            n = len(proposal.tokens)
            self.auto.observe(n, n_accepted, verify_seconds, proposal.seconds, proposal.evidence)

    def rollback(self, kept) -> None:
        try:
            reset = self.inner.reset
        except AttributeError:
            raise TypeError(
                f"this drafter ({type(self.inner).__name__}) has no reset(), so it cannot be "
                "rolled back; give it one or use drafter='ngram'"
            ) from None
        reset()
        self.inner.extend(kept)

    def fork(self, ids) -> Drafter:
        if not isinstance(self.inner, NgramDrafter):
            return super().fork(ids)  # TypeError: another object's index cannot be copied
        new = copy.copy(self)
        new.inner, new.auto = clone_ngram(self.inner, ids), copy_auto(self.auto)
        return new
