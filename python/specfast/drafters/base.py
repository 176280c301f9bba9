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
  `verify_seconds` is None when the pass's time is no measure of its cost: it compiled a
  graph or recorded a CUDA graph (a compiled target's first passes of a shape).
- `rollback(kept)`: the committed sequence is now `kept`, a prefix of what it was (a Session's
  rewind, or an interrupted turn). An n-gram index resets and re-extends; a draft model cuts its
  committed list and its cache follows on the next proposal.
- `fork(ids)`: a copy sharing no mutable state with this one (`Session.fork`; `ids` are the
  committed tokens), with its own auto-k state; only the target's pass costs stay shared.
  TypeError where a drafter cannot be copied.

`verified` is the verify pass (`Verified`): its logits and how many rows were kept. A drafter
that reads the target's hidden states (an EAGLE head, drafters/eagle/) sets `wants_features` and
`feature_layers`; the target's passes then also return those layers' inputs (one pass, no
second forward), and the round hands over the kept rows' features in `Verified.features` and
the prefilled rows' in `prefill(features)`. Only specfast's own runtime returns them.

Adding a drafter is one class in a module of its own under drafters/, with a classmethod
`bind(source, setup: DraftSetup) -> Drafter` that builds it for a target and a generation's
settings, plus one line in drafters/__init__.py's `NAMED` for the name users pass as `drafter=`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specfast._core import NgramDrafter
from specfast.autok import AutoK
from specfast.targets.base import Target


@dataclass(frozen=True)
class DraftSetup:
    """What a drafter binds itself to (`bind(source, setup)`): the target and one generation's
    settings. `fixed_k` None is auto k; `seed` and `params` the sampling a draft model matches;
    `vocabulary` a draft model's draft_vocabulary; `eos_ids` the ids that end a reply."""

    target: Target
    fixed_k: int | None
    max_length: int
    seed: int = 0
    params: dict = field(default_factory=dict)
    vocabulary: int | str | None = "auto"
    eos_ids: tuple[int, ...] = ()


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
        self,
        proposal: Proposal,
        n_accepted: int,
        verify_seconds: float | None,
        verified: Verified,
    ) -> None: ...
    def rollback(self, kept: list[int]) -> None: ...
    def fork(self, ids: list[int]) -> Drafter: ...


FORKABLE = "the n-gram drafter, a draft model, a CombinedDrafter, an EAGLE head and drafter=None"


class Base:
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


class NoDraft(Base):
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


def observe_model(auto: AutoK, proposal: Proposal, n_accepted: int, verify_seconds: float | None):
    n = len(proposal.tokens)
    auto.observe(n, n_accepted, verify_seconds, proposal.seconds, proposal.evidence)
    if n and proposal.confidences:
        auto.observe_confidences(proposal.confidences, n_accepted)


def clone_ngram(old: NgramDrafter, ids: list[int]) -> NgramDrafter:
    """A new NgramDrafter with `old`'s options and corpus documents, its live sequence `ids`."""
    new = copy.copy(old)  # Rust's Clone: options, corpus and live index
    new.reset()
    new.extend(ids)
    return new


def copy_auto(auto: AutoK | None) -> AutoK | None:
    """A copy of an AutoK that shares only the target's pass costs (autok.shared_pass_costs)."""
    if auto is None:
        return None
    return copy.deepcopy(auto, memo={id(auto._sums): auto._sums})


def feature_layers(drafter: Drafter) -> tuple[int, ...] | None:
    """The target layers whose features the round must return for this drafter, or None."""
    return tuple(drafter.feature_layers) if getattr(drafter, "wants_features", False) else None
