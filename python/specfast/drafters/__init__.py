"""Drafters: one protocol for every drafter (base.py), so the speculative round has no branch
per drafter kind; one module per kind (ngram, model, combined, eagle); and `make_drafter`,
which turns generate()'s `drafter=` argument into one of them."""

from __future__ import annotations

from typing import Any

from specfast._core import NgramDrafter
from specfast.autok import shared_match_rates, shared_pass_costs
from specfast.drafters.base import Drafter, NoDraft
from specfast.drafters.chain import ChainDraft
from specfast.drafters.combined import CombinedDrafter, NgramOrChain
from specfast.drafters.eagle import EagleDraft, load_head
from specfast.drafters.model import DraftModelDrafter
from specfast.drafters.ngram import IndexDraft
from specfast.eagle.head import EagleHead
from specfast.targets import try_target
from specfast.targets.base import Target


def make_drafter(
    drafter: Any,
    *,
    target: Target,
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
    costs earlier calls measured on this target and the rates the last call ended with: the
    n-gram's, and the draft model's if it was the same one (autok.shared_pass_costs,
    autok.shared_match_rates)."""
    made = _make(drafter, target, fixed_k, max_length, seed, params, vocabulary, eos_ids)
    auto = getattr(made, "auto", None)
    if auto is not None:
        auto.use_pass_costs(shared_pass_costs(target.source))
        auto.use_match_rates(shared_match_rates(target.source), draft=_draft_model(drafter))
    return made


def _draft_model(drafter):
    """The draft model behind generate()'s `drafter` argument (an object, or the string naming
    an EAGLE head), or None for the n-gram and for no drafter."""
    if isinstance(drafter, CombinedDrafter):
        return drafter.model
    if isinstance(drafter, str):
        return drafter if _is_eagle(drafter) else None
    return drafter if isinstance(drafter, EagleHead) or try_target(drafter) is not None else None


def _make(drafter, target, fixed_k, max_length, seed, params, vocabulary, eos_ids) -> Drafter:
    if drafter is None:
        return NoDraft()
    if isinstance(drafter, str) and drafter == "ngram":
        return IndexDraft(NgramDrafter(), fixed_k)
    combined = drafter if isinstance(drafter, CombinedDrafter) else None
    draft = combined.model if combined is not None else drafter
    if isinstance(draft, EagleHead) or (isinstance(draft, str) and _is_eagle(draft)):
        chain: ChainDraft = EagleDraft(load_head(draft, target), target, fixed_k, max_length)
    elif isinstance(draft, str):
        raise ValueError(
            f'drafter must be "ngram", "eagle", "eagle:PATH", None, an NgramDrafter, an '
            f"EAGLE head or a model: {drafter!r}"
        )
    elif (draft_target := try_target(draft)) is not None:
        chain = DraftModelDrafter(
            draft_target,
            target=target,
            fixed_k=fixed_k,
            max_length=max_length,
            seed=seed,
            vocabulary=vocabulary,
            eos_ids=eos_ids,
            **params,
        )
    elif combined is not None:
        raise TypeError(
            f"CombinedDrafter's draft must be a model or an EAGLE head, got {type(draft).__name__}"
        )
    elif all(hasattr(drafter, a) for a in ("propose", "observe", "start_turn", "rollback")):
        return drafter  # the drafter protocol itself (base.py): tests/test_custom_drafter.py
    elif hasattr(drafter, "propose") and hasattr(drafter, "extend"):
        return IndexDraft(drafter, fixed_k)
    else:
        raise TypeError(
            'drafter must be "ngram", "eagle", None, an NgramDrafter, an EAGLE head or a draft '
            f"model, got {type(drafter).__name__}"
        )
    if combined is None:
        return chain
    return NgramOrChain(combined.ngram, chain, combined.min_match)


def _is_eagle(name: str) -> bool:
    return name.partition(":")[0] == "eagle"
