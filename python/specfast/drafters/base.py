"""One protocol for every drafter, so the speculative round has no branch per drafter kind.

A drafter owns its k policy: the round asks for a proposal within a budget and reports back
what the target accepted. The round (generate.py's `speculate`) is:

    proposal = drafter.propose(budget)         # tokens, q (k, V) or None, evidence
    verify [last, *proposal.tokens] in one target pass, accept
    drafter.observe(proposal, n_accepted, verify_seconds, verified)
    drafter.extend(committed)                  # committed tokens only

The protocol (`Drafter`):

- `extend(tokens)`: committed tokens only; a drafter never sees a rejected one.
- `prefill(features)`: called once per turn after the turn's prompt and first token are in; a
  drafter with a cache reads them now, so its first proposal costs one ordinary step.
  `features` is None unless the drafter wants them (below).
- `start_turn(seed, params)`: the turn's sampling (`params` None when greedy). A draft model
  samples with it so its q is the very distribution the acceptance rule divides by.
- `propose(budget) -> Proposal`: at most `budget` tokens; the drafter picks k (fixed or auto).
- `observe(proposal, n_accepted, verify_seconds, verified)`: feedback for its k policy.
- `rollback(kept)`: the committed sequence is now `kept`, a prefix of what it was (a Session's
  rewind, or an interrupted turn). An n-gram index resets and re-extends; a draft model cuts its
  committed list and its cache follows on the next proposal.
- `fork(ids)`: a copy sharing no mutable state with this one (`Session.fork`; `ids` are the
  committed tokens), with its own auto-k state; only the target's pass costs stay shared.
  TypeError where a drafter cannot be copied.

`verified` is the verify pass (`Verified`): its logits and how many rows were kept. A drafter
that reads the target's hidden states (an EAGLE head, eagle.py) sets `wants_features` and
`feature_layers`; the target's passes then also return those layers' inputs (one pass, no
second forward), and the round hands over the kept rows' features in `Verified.features` and
the prefilled rows' in `prefill(features)`. Only specfast's own runtime returns them.

Adding a drafter is one class (here, or in its own file) plus a line in `make_drafter`.
"""

from __future__ import annotations

import copy
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specfast._core import NgramDrafter
from specfast.autok import AutoK, shared_match_rates, shared_pass_costs


@dataclass
class Proposal:
    tokens: list[int]  # the draft, at most the budget
    q: torch.Tensor | None = None  # (k, V) draft distribution when sampling; None: one-hot
    evidence: int | None = None  # n-gram match length it drafted on; None for a draft model
    confidences: list[float] = field(default_factory=list)  # a draft model's own probabilities
    seconds: float = 0.0  # time spent proposing, set by the round


@dataclass
class Verified:
    """The verify pass of one round: logits (1 + k, V) and the rows kept (n_accepted + 1).
    Greedy rounds take only the argmax ids from the device, so there `logits` is None."""

    logits: torch.Tensor | None
    n_kept: int
    features: torch.Tensor | None = None  # (n_kept, D) hidden states, for drafters that want them


class Drafter(Protocol):
    wants_features: bool
    feature_layers: tuple[int, ...]  # the target layers whose inputs it reads, when it wants any

    def extend(self, tokens: list[int]) -> None: ...
    def prefill(self, features: torch.Tensor | None = None) -> None: ...
    def start_turn(self, seed: int, params: dict | None) -> None: ...
    def propose(self, budget: int) -> Proposal: ...
    def observe(
        self, proposal: Proposal, n_accepted: int, verify_seconds: float, verified: Verified
    ) -> None: ...
    def rollback(self, kept: list[int]) -> None: ...
    def fork(self, ids: list[int]) -> Drafter: ...


FORKABLE = "the n-gram drafter, a draft model, a CombinedDrafter, an EAGLE head and drafter=None"


class _Base:
    """Defaults: no cache to prefill, no sampling state, no features, no fork."""

    wants_features = False
    feature_layers: tuple[int, ...] = ()

    def prefill(self, features=None) -> None:
        pass

    def start_turn(self, seed: int, params: dict | None) -> None:
        pass

    def fork(self, ids: list[int]) -> Drafter:
        name = type(getattr(self, "inner", self)).__name__
        raise TypeError(f"fork() supports {FORKABLE}, not {name}")


# ----------------------------------------------------------------------------
# the drafters


class NoDraft(_Base):
    """Plain decoding through the same loop: every round is one target step."""

    def extend(self, tokens) -> None:
        pass

    def propose(self, budget: int) -> Proposal:
        return Proposal([])

    def observe(self, proposal, n_accepted, verify_seconds, verified) -> None:
        pass

    def rollback(self, kept) -> None:
        pass

    def fork(self, ids) -> NoDraft:
        return NoDraft()


class IndexDraft(_Base):
    """An NgramDrafter, or any object with `extend(tokens)` and `propose(k)` (tests' oracles).

    k: fixed, or auto (AutoK by the `match_length` the object reports; None if it reports none).
    rollback: `reset()` then `extend(kept)` (O(len(kept)); an NgramDrafter keeps its corpus).
    """

    def __init__(self, inner, fixed_k: int | None):
        self.inner = inner
        self.fixed_k = fixed_k
        self.auto = AutoK() if fixed_k is None else None

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
        if not hasattr(self.inner, "reset"):
            raise TypeError(
                f"this drafter ({type(self.inner).__name__}) has no reset(), so it cannot be "
                "rolled back; give it one or use drafter='ngram'"
            )
        self.inner.reset()
        self.inner.extend(kept)

    def fork(self, ids) -> IndexDraft:
        if not isinstance(self.inner, NgramDrafter):
            return super().fork(ids)  # TypeError: another object's index cannot be copied
        new = copy.copy(self)
        new.inner, new.auto = clone_ngram(self.inner, ids), copy_auto(self.auto)
        return new


class ModelDraft(_Base):
    """A draft model (draft.DraftModelDrafter). Auto k: up to AutoK's `max_draft_k` steps, cut
    by the calibrated `keep_drafting`, or none when drafting does not pay."""

    def __init__(self, inner, fixed_k: int | None):
        self.inner = inner
        self.fixed_k = fixed_k
        self.auto = AutoK() if fixed_k is None else None
        if self.auto is not None:
            inner.keep_going = self.auto.keep_drafting

    def extend(self, tokens) -> None:
        self.inner.extend(tokens)

    def prefill(self, features=None) -> None:
        self.inner.prefill()

    def start_turn(self, seed: int, params: dict | None) -> None:
        self.inner.set_sampling(seed, params)

    def propose(self, budget: int) -> Proposal:
        k = self.fixed_k if self.auto is None else self.auto.choose_draft()
        k = min(k, budget)
        if k <= 0:
            return Proposal([])
        tokens = list(self.inner.propose(k))[:k]
        return Proposal(tokens, self.inner.draft_probs, None, list(self.inner.confidences))

    def observe(self, proposal, n_accepted, verify_seconds, verified) -> None:
        if self.auto is not None:
            _observe_model(self.auto, proposal, n_accepted, verify_seconds)

    def rollback(self, kept) -> None:
        self.inner.truncate(len(kept))

    def fork(self, ids) -> ModelDraft:
        new = copy.copy(self)
        new.auto = copy_auto(self.auto)
        new.inner = self.inner.fork(new.auto)
        return new


class CombinedDraft(ModelDraft):
    """draft.CombinedDrafter: the n-gram where the context repeats, the draft model elsewhere.
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


def _observe_model(auto: AutoK, proposal: Proposal, n_accepted: int, verify_seconds: float):
    n = len(proposal.tokens)
    auto.observe(n, n_accepted, verify_seconds, proposal.seconds, proposal.evidence)
    if n and proposal.confidences:
        auto.observe_confidences(proposal.confidences, n_accepted)


def clone_ngram(old: NgramDrafter, ids: list[int]) -> NgramDrafter:
    """A new NgramDrafter with `old`'s options and corpus documents, extended with `ids`."""
    if old.corpus_tokens:  # save/load is the one exact way to copy the documents
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "fork.corpus")
            old.save(path)
            new = NgramDrafter.load(path)
    else:
        new = NgramDrafter(
            min_match=old.min_match,
            policy=old.policy,
            k_factor=old.k_factor,
            k_offset=old.k_offset,
            max_corpus_tokens=old.max_corpus_tokens,
        )
    new.extend(ids)
    return new


def copy_auto(auto: AutoK | None) -> AutoK | None:
    """A copy of an AutoK that shares only the target's pass costs (autok.shared_pass_costs)."""
    if auto is None:
        return None
    return copy.deepcopy(auto, memo={id(auto._sums): auto._sums})


# ----------------------------------------------------------------------------
# construction


def make_drafter(
    drafter: Any,
    *,
    target,
    fixed_k: int | None,
    max_length: int,
    seed: int,
    params: dict,
    vocabulary: int | str | None,
    eos_ids: list[int],
) -> Drafter:
    """The protocol object for generate()'s `drafter` argument: "ngram", None, an NgramDrafter
    (or any object with extend/propose), a draft model, a CombinedDrafter, or an EAGLE head
    ("eagle", "eagle:PATH", an EagleHead from load_eagle). Its auto k starts from the pass
    costs earlier calls measured on this target and the n-gram rates the last call ended with
    (autok.shared_pass_costs, autok.shared_match_rates)."""
    made = _make(drafter, target, fixed_k, max_length, seed, params, vocabulary, eos_ids)
    auto = getattr(made, "auto", None)
    if auto is not None:
        auto.use_pass_costs(shared_pass_costs(target))
        auto.use_match_rates(shared_match_rates(target))
    return made


def _make(drafter, target, fixed_k, max_length, seed, params, vocabulary, eos_ids) -> Drafter:
    from specfast.draft import CombinedDrafter, DraftModelDrafter
    from specfast.eagle import EagleHead
    from specfast.eagle_draft import eagle_drafter
    from specfast.targets import is_model

    if drafter is None:
        return NoDraft()
    if (
        isinstance(drafter, EagleHead)
        or (isinstance(drafter, str) and drafter.partition(":")[0] == "eagle")
        or (isinstance(drafter, CombinedDrafter) and isinstance(drafter.model, EagleHead))
    ):
        return eagle_drafter(drafter, target, fixed_k, max_length)
    if isinstance(drafter, str):
        if drafter != "ngram":
            raise ValueError(
                f'drafter must be "ngram", "eagle", "eagle:PATH", None, an NgramDrafter, an '
                f"EAGLE head or a model: {drafter!r}"
            )
        return IndexDraft(NgramDrafter(), fixed_k)
    if is_model(drafter) or isinstance(drafter, CombinedDrafter):
        model_drafter = DraftModelDrafter(
            drafter.model if isinstance(drafter, CombinedDrafter) else drafter,
            target=target,
            max_length=max_length,
            seed=seed,
            vocabulary=vocabulary,
            eos_ids=eos_ids,
            **params,
        )
        if isinstance(drafter, CombinedDrafter):
            drafter.bind(model_drafter)
            return CombinedDraft(drafter, fixed_k)
        return ModelDraft(model_drafter, fixed_k)
    if hasattr(drafter, "propose") and hasattr(drafter, "extend"):
        return IndexDraft(drafter, fixed_k)
    raise TypeError(
        'drafter must be "ngram", "eagle", None, an NgramDrafter, an EAGLE head or a draft '
        f"model, got {type(drafter).__name__}"
    )


def feature_layers(drafter: Drafter) -> tuple[int, ...] | None:
    """The target layers whose features the round must return for this drafter, or None."""
    return tuple(drafter.feature_layers) if getattr(drafter, "wants_features", False) else None
