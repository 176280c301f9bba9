"""The n-gram where the context repeats, a chain drafter (a draft model or an EAGLE head)
elsewhere: `CombinedDrafter` is what the caller passes, `NgramOrChain` is what runs."""

from __future__ import annotations

from specfast._core import NgramDrafter
from specfast.drafters.base import Base, Proposal, clone_ngram
from specfast.drafters.chain import ChainDraft


class CombinedDrafter:
    """The n-gram proposal where the context repeats, the draft model's (or EAGLE head's)
    everywhere else. Pass it as generate(..., drafter=CombinedDrafter(draft)). With "auto" k,
    each round takes whichever source the measured acceptance and costs say pays more (or
    neither); with a fixed k, the n-gram drafts when its match is at least `min_match` tokens.

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


class NgramOrChain(Base):
    """Runs a CombinedDrafter: each round either the n-gram index or `chain` drafts. Both see
    every committed token; one AutoK (the chain's) picks the source (AutoK.choose_source) and
    stops the chain. A chain that did not draft catches up on its next proposal (a draft
    model's cache, an EAGLE head's pending features)."""

    def __init__(self, ngram: NgramDrafter, chain: ChainDraft, min_match: int):
        self.ngram, self.chain, self.min_match = ngram, chain, min_match
        self.wants_features, self.feature_layers = chain.wants_features, chain.feature_layers

    @property
    def auto(self):
        return self.chain.auto

    def extend(self, tokens) -> None:
        self.ngram.extend(tokens)
        self.chain.extend(tokens)

    def prefill(self, features=None) -> None:
        self.chain.prefill(features)

    def start_turn(self, seed: int, params: dict | None) -> None:
        self.chain.start_turn(seed, params)

    def propose(self, budget: int) -> Proposal:
        match, auto = self.ngram.match_length, self.chain.auto
        if auto is None:
            use_ngram, k = match >= self.min_match, self.chain.fixed_k
        else:
            use_ngram, k = auto.choose_source(match)
            if k and not use_ngram:
                k = auto.max_draft_k  # the chain stops itself (keep_drafting)
        k = min(k, budget)
        if k > 0 and use_ngram:
            tokens = list(self.ngram.propose(k))[:k]
            if tokens:
                return Proposal(tokens, None, match)
        if k <= 0 or not self.chain.ready():
            return Proposal([], evidence=match if use_ngram else None)
        return self.chain.draft(k)

    def observe(self, proposal, n_accepted, verify_seconds, verified) -> None:
        self.chain.observe(proposal, n_accepted, verify_seconds, verified)

    def rollback(self, kept) -> None:
        self.chain.rollback(kept)
        self.ngram.reset()
        self.ngram.extend(kept)

    def fork(self, ids) -> NgramOrChain:
        return NgramOrChain(clone_ngram(self.ngram, ids), self.chain.fork(ids), self.min_match)
