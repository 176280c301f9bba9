"""Draft-model drafting: a smaller model of the same vocabulary proposes k tokens.

The drafter keeps its own decoder (static KV cache for specfast models, a cropped cache for
transformers ones). It is told only the committed tokens; on each propose() it rolls its cache
back to the longest prefix that is still committed, catches up on the rest (the corrected or
bonus token, at least), and then runs k autoregressive steps.

A draft model with a large vocabulary proposes only from a subset of it (`DraftVocabulary`):
its output projection is a fifth of a 0.5B model's weights, and most of it is rare tokens.

Sampling, the step loop and the auto-k stop are the chain drafter's (drafters/chain.py).
"""

from __future__ import annotations

import copy
import os
import sys
import types
import warnings
from collections.abc import Sequence
from typing import cast

import torch

from specfast.drafters.base import DraftSetup
from specfast.drafters.chain import ChainDraft
from specfast.targets import make_decoder, tokenizer_vocab
from specfast.targets.base import Target, common_prefix, to_device

# A draft model whose vocabulary is larger than twice this proposes from its this-many lowest
# token ids plus every token of the sequence (see DraftVocabulary); "auto" in generate().
COMMON_TOKENS = 32768


class DraftModelDrafter(ChainDraft):
    """A draft model of the target's vocabulary (generate(..., drafter=model)). Auto k: up to
    AutoK's `max_draft_k` steps, cut by the calibrated `keep_drafting`, or none when drafting
    does not pay."""

    @classmethod
    def bind(cls, source: Target, setup: DraftSetup) -> DraftModelDrafter:
        """A draft model (as a Target) for setup's target, sampling as the generation does."""
        return cls(
            source,
            target=setup.target,
            fixed_k=setup.fixed_k,
            max_length=setup.max_length,
            seed=setup.seed,
            vocabulary=setup.vocabulary,
            eos_ids=setup.eos_ids,
            **setup.params,
        )

    def __init__(
        self,
        model: Target,
        *,
        target: Target,
        fixed_k: int | None,
        max_length: int,
        seed: int = 0,
        vocabulary: int | str | None = "auto",
        eos_ids: Sequence[int] = (),
        **sampling,
    ):
        check_same_vocabulary(target, model)
        warn_if_draft_larger(target, model)
        super().__init__(fixed_k, model.device, model.vocab_size)
        self.model = model
        self.decoder = make_decoder(model, max_length)
        common = common_tokens(vocabulary, model.vocab_size)
        # The draft's output rows: all of them, or the common tokens plus those seen.
        self.vocab = None
        if common is not None and model.supports_head:
            self.vocab = DraftVocabulary(model, common, always=eos_ids)
        self.start_turn(seed, sampling)
        self.committed: list[int] = []
        # The draft cache holds committed[:known] + drafts[:-1] of the last proposal.
        self._known = 0
        self._cached_drafts: list[int] = []

    def extend(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        self.committed.extend(tokens)
        if self.vocab is not None:
            self.vocab.add(tokens)

    def prefill(self, features=None) -> None:
        """Runs the draft over all committed tokens but the last, so the first proposal (and its
        measured cost) is one ordinary step rather than a whole prompt."""
        keep = self._rollback_point()
        if keep < len(self.committed) - 1:
            feed = torch.tensor(self.committed[keep:-1], dtype=torch.long, device=self.device)
            self.decoder.forward(feed, last_only=True)
        self._known, self._cached_drafts = len(self.committed) - 1, []

    def rollback(self, kept) -> None:
        """Forgets all but the first len(kept) committed tokens; the cache follows on the next
        proposal."""
        n = len(kept)
        del self.committed[n:]
        self._known = min(self._known, n)
        self._cached_drafts = []

    def fork(self, ids) -> DraftModelDrafter:
        """A copy with its own KV cache (copied up to its length), committed tokens, last drafts,
        draft vocabulary, generator and auto k."""
        new = cast(DraftModelDrafter, super().fork(ids))
        new.decoder = self.decoder.copy()
        new.committed, new._cached_drafts = list(self.committed), list(self._cached_drafts)
        new.vocab = None if self.vocab is None else self.vocab.copy()
        return new

    def __len__(self) -> int:
        return len(self.committed)

    # -- the chain's steps

    def ready(self) -> bool:
        return bool(self.committed)

    def _rollback_point(self) -> int:
        """Rolls the cache back to the longest cached prefix that was committed and returns its
        length; drafts that were accepted stay. The last committed token is never kept."""
        known = self._known  # committed for sure; of the cached drafts, keep those accepted
        keep = known + common_prefix(self._cached_drafts, self.committed[known:])
        keep = min(keep, len(self.committed) - 1)
        self.decoder.rollback(keep)
        return keep

    def _forward(self, feed: torch.Tensor) -> torch.Tensor:
        # `head=` only where the draft has a vocabulary, and so `supports_head`.
        head = {} if self.vocab is None else {"head": self.vocab.head}
        return self.decoder.forward(feed, last_only=True, **head)

    def _first(self) -> torch.Tensor:
        keep = self._rollback_point()
        return self._forward(to_device(self.committed[keep:], self.device))  # no blocking upload

    def _next(self, token: torch.Tensor) -> torch.Tensor:
        return self._forward(token)

    def _row_ids(self) -> torch.Tensor | None:
        return None if self.vocab is None else self.vocab.ids

    def _after(self, tokens: list[int]) -> None:
        self._known = len(self.committed)
        self._cached_drafts = tokens[:-1]


class DraftVocabulary:
    """The tokens a draft model may propose: the `common` lowest ids, every token the sequence
    has held (prompt and output), and `always` (the EOS ids). Its forward then projects onto
    those rows only.

    Byte-level BPE numbers tokens in merge order, most frequent first, so the lowest ids cover
    most of what a model writes, and the sequence's own tokens most of the rest of what gets
    copied (docs/benchmarks.md §5 has Qwen2.5's figures).

    Exactness does not depend on the choice: the other tokens get probability 0 in the q the
    drafts are drawn from, and the chain's scatter hands that q, zeros included, to the
    acceptance rule.
    """

    def __init__(self, model, common: int, always=()):
        self.model = model
        self.common = common
        self._common_rows = model.first_rows(common)
        self._extra: list[int] = []  # tokens >= common, in order of arrival
        self._extra_set: set[int] = set()
        self._extra_rows = None
        self.ids = self._common_rows.ids  # (S,) the token of each logit row
        self.add(always)

    def copy(self) -> DraftVocabulary:
        """A copy whose later `add`s do not reach this one (the row tensors are never written)."""
        new = copy.copy(self)
        new._extra, new._extra_set = list(self._extra), set(self._extra_set)
        return new

    def add(self, tokens) -> None:
        """Lets the draft propose these tokens from now on."""
        new = [t for t in dict.fromkeys(tokens) if t >= self.common and t not in self._extra_set]
        if not new:
            return
        self._extra.extend(new)
        self._extra_set.update(new)
        rows = self._extra_rows = self.model.output_rows(torch.tensor(self._extra))
        self.ids = torch.cat([self._common_rows.ids, rows.ids])

    def __len__(self) -> int:
        return self.ids.shape[0]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """hidden (T, D) -> logits (T, S) over these tokens."""
        y = self._common_rows(x)
        return y if self._extra_rows is None else torch.cat([y, self._extra_rows(x)], dim=-1)


def common_tokens(vocabulary, vocab_size: int) -> int | None:
    """How many lowest ids a draft always may propose, or None for the whole vocabulary."""
    if vocabulary == "auto":
        return COMMON_TOKENS if vocab_size > 2 * COMMON_TOKENS else None
    if vocabulary is None:
        return None
    if isinstance(vocabulary, bool) or not isinstance(vocabulary, int) or vocabulary < 1:
        raise ValueError(
            f'draft_vocabulary must be "auto", None (all tokens) or an int >= 1, got {vocabulary!r}'
        )
    return vocabulary if vocabulary < vocab_size else None


def check_same_vocabulary(target: Target, draft: Target) -> None:
    """Raises ValueError unless target and draft share a vocabulary (size and token strings)."""
    t_size, t_device = target.vocab_size, target.device
    d_size, d_device = draft.vocab_size, draft.device
    if t_size != d_size:
        raise ValueError(
            f"the draft model's vocabulary ({d_size} tokens) differs from the target's "
            f"({t_size}); a draft model must share the target's vocabulary"
        )
    if t_device != d_device:
        raise ValueError(f"the draft model is on {d_device} but the target is on {t_device}")
    t_vocab, d_vocab = tokenizer_vocab(target), tokenizer_vocab(draft)
    if t_vocab is not None and d_vocab is not None and t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))[:3]
        raise ValueError(
            f"the draft model's tokenizer maps tokens differently from the target's "
            f"(e.g. {differ}); a draft model must share the target's vocabulary"
        )


def warn_if_draft_larger(target: Target, draft: Target) -> None:
    """Warns when the draft has more parameters than the target. Allowed, because the output is
    still exactly the target's (acceptance never depends on which model drafted), but each draft
    step then costs more than the target pass it is meant to save, so it is almost surely a
    mistake (the pair swapped). The target as its own draft (equal size) does not warn."""
    n_target, n_draft = target.parameter_count(), draft.parameter_count()
    if n_draft > n_target:
        warnings.warn(
            f"the draft model ({n_draft:,} parameters) is larger than the target "
            f"({n_target:,}): output stays exact, but drafting will cost more than it saves; "
            "did you swap them?",
            stacklevel=_caller_stacklevel(),
        )


def _caller_stacklevel() -> int:
    """The warnings stacklevel of the first frame outside specfast, so a warning points at the
    user's line however deep inside the package it was raised."""
    package = os.path.dirname(os.path.dirname(__file__))  # specfast/, not specfast/drafters/
    frame: types.FrameType | None = sys._getframe(1)  # the function that warns
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level
