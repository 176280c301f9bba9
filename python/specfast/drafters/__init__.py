"""Drafters: one protocol for every drafter (base.py), so the speculative round has no branch
per drafter kind; one module per kind (ngram, model, combined, eagle); and `make_drafter`,
which turns generate()'s `drafter=` argument into one of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specfast.autok import shared_match_rates, shared_pass_costs
from specfast.drafters.base import Drafter, DraftSetup, NoDraft
from specfast.drafters.chain import ChainDraft
from specfast.drafters.combined import CombinedDrafter, NgramOrChain
from specfast.drafters.eagle import EagleDraft
from specfast.drafters.eagle.head import EagleHead
from specfast.drafters.model import DraftModelDrafter
from specfast.drafters.ngram import IndexDraft
from specfast.targets import try_target

# The names generate()'s `drafter=` takes, "name" or "name:argument": the class that binds
# itself to the target and settings (`bind(the string, setup)`). A new drafter is a module
# with its class, plus a line here.
NAMED: dict[str, Callable[[Any, DraftSetup], Drafter]] = {
    "ngram": IndexDraft.bind,
    "eagle": EagleDraft.bind,  # "eagle", "eagle:PATH"
}


def make_drafter(drafter: Any, setup: DraftSetup) -> Drafter:
    """The protocol object for generate()'s `drafter` argument: a name of `NAMED` ("ngram",
    "eagle", "eagle:PATH"), None, an NgramDrafter (or any object with extend/propose), a draft
    model, a CombinedDrafter, an EagleHead from load_eagle, or a Drafter itself. Its auto k
    starts from the pass costs earlier calls measured on this target and the rates the last
    call ended with: the n-gram's, and the draft model's if it was the same one
    (autok.shared_pass_costs, autok.shared_match_rates)."""
    made = _make(drafter, setup)
    auto = getattr(made, "auto", None)
    if auto is not None:
        target = setup.target
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


def _make(drafter, setup: DraftSetup) -> Drafter:
    if drafter is None:
        return NoDraft()
    if isinstance(drafter, str):
        return _named(drafter)(drafter, setup)
    if isinstance(drafter, CombinedDrafter):
        chain = _chain(drafter.model, setup)
        return NgramOrChain(drafter.ngram, chain, drafter.min_match)
    if isinstance(drafter, EagleHead) or try_target(drafter) is not None:
        return _chain(drafter, setup)
    if all(hasattr(drafter, a) for a in ("propose", "observe", "start_turn", "rollback")):
        return drafter  # the drafter protocol itself (base.py): tests/test_custom_drafter.py
    if hasattr(drafter, "propose") and hasattr(drafter, "extend"):
        return IndexDraft.bind(drafter, setup)
    raise TypeError(
        f"drafter must be {_names()}, None, an NgramDrafter, an EAGLE head or a draft model, "
        f"got {type(drafter).__name__}"
    )


def _chain(draft, setup: DraftSetup) -> ChainDraft:
    """A drafter that drafts a chain with a model: an EAGLE head (or its name), or a draft
    model (CombinedDrafter's second part)."""
    if isinstance(draft, EagleHead) or (isinstance(draft, str) and _is_eagle(draft)):
        return EagleDraft.bind(draft, setup)
    if (draft_target := try_target(draft)) is not None:
        return DraftModelDrafter.bind(draft_target, setup)
    raise TypeError(
        f"CombinedDrafter's draft must be a model or an EAGLE head, got {type(draft).__name__}"
    )


def _named(name: str) -> Callable[[Any, DraftSetup], Drafter]:
    bind = NAMED.get(name.partition(":")[0])
    if bind is None:
        raise ValueError(
            f"drafter must be {_names()}, None, an NgramDrafter, an EAGLE head or a model: {name!r}"
        )
    return bind


def _names() -> str:
    return ", ".join(f'"{n}"' for n in NAMED) + ', "eagle:PATH"'


def _is_eagle(name: str) -> bool:
    return name.partition(":")[0] == "eagle"
