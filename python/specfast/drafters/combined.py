"""CombinedDrafter: the n-gram proposal where the context repeats, a draft model's elsewhere."""

from __future__ import annotations

import copy

import torch

from specfast._core import NgramDrafter
from specfast.drafters.base import Proposal, clone_ngram
from specfast.drafters.model import DraftModelDrafter, ModelDraft


class CombinedDrafter:
    """The n-gram proposal where the context repeats, the draft model's everywhere else. Pass it
    as generate(..., drafter=CombinedDrafter(draft)). With "auto" k, each round takes whichever
    source the measured acceptance and costs say pays more (or neither); with a fixed k, the
    n-gram drafts when its match is at least `min_match` tokens long.

    n-gram drafts cost microseconds and win where output copies input; a draft model costs k
    small forwards and wins on open text. The draft model's cache falls behind while the n-gram
    drafts, and catches up in one pass on its next proposal.
    """

    def __init__(self, draft_model, *, min_match: int = 3, ngram=None):
        if isinstance(min_match, bool) or not isinstance(min_match, int) or min_match < 1:
            raise ValueError(f"min_match must be an int >= 1, got {min_match!r}")
        self.model = draft_model
        self.min_match = min_match
        self.ngram = ngram if ngram is not None else NgramDrafter()
        self.draft: DraftModelDrafter | None = None  # bound by generate(), which knows the target
        self.draft_probs: torch.Tensor | None = None
        self.confidences: list[float] = []  # the draft model's, when it drafted this round
        # Set by generate()'s auto k each round: True = n-gram, False = model, None = min_match.
        self.use_ngram: bool | None = None

    def bind(self, draft: DraftModelDrafter) -> None:
        self.draft = draft

    def _ngram_turn(self) -> bool:
        if self.use_ngram is not None:
            return self.use_ngram
        return self.ngram.match_length >= self.min_match

    @property
    def match_length(self) -> int | None:
        """The n-gram evidence when the n-gram drafts this round; None when the model does."""
        return self.ngram.match_length if self._ngram_turn() else None

    def extend(self, tokens) -> None:
        self.ngram.extend(tokens)
        if self.draft is not None:
            self.draft.extend(tokens)

    def prefill(self) -> None:
        if self.draft is not None:
            self.draft.prefill()

    def propose(self, k: int) -> list[int]:
        if self.draft is None:
            raise ValueError("CombinedDrafter is bound to a target by generate(); pass it there")
        if self._ngram_turn():
            tokens = self.ngram.propose(k)
            if tokens:
                self.draft_probs, self.confidences = None, []  # one-hot drafts
                return tokens
        tokens = self.draft.propose(k)
        self.draft_probs, self.confidences = self.draft.draft_probs, self.draft.confidences
        return tokens


class CombinedDraft(ModelDraft):
    """CombinedDrafter: the n-gram where the context repeats, the draft model elsewhere.
    Auto k picks the source each round (AutoK.choose_source); a fixed k uses `min_match`."""

    def __init__(self, inner, fixed_k: int | None):
        super().__init__(inner.draft, fixed_k)
        self.combined = inner

    def extend(self, tokens) -> None:
        self.combined.extend(tokens)

    def propose(self, budget: int) -> Proposal:
        c = self.combined
        if self.auto is None:
            k = self.fixed_k
        else:
            c.use_ngram, k = self.auto.choose_source(c.ngram.match_length)
            if k and not c.use_ngram:
                k = self.auto.max_draft_k  # the draft model stops itself (keep_drafting)
        k = min(k, budget)
        match = c.match_length  # the evidence this round drafts on
        if k <= 0:
            return Proposal([], evidence=match)
        tokens = list(c.propose(k))[:k]
        return Proposal(tokens, c.draft_probs, match, list(c.confidences))

    def rollback(self, kept) -> None:
        self.combined.ngram.reset()
        self.combined.ngram.extend(kept)
        self.inner.truncate(len(kept))

    def fork(self, ids) -> CombinedDraft:
        new = super().fork(ids)
        c = new.combined = copy.copy(self.combined)
        c.ngram, c.draft = clone_ngram(c.ngram, ids), new.inner
        c.draft_probs, c.confidences = None, []
        return new
