"""Draft-model drafting: a smaller model of the same vocabulary proposes k tokens.

The drafter keeps its own decoder (static KV cache for specfast models, a cropped cache for
transformers ones). It is told only the committed tokens; on each propose() it rolls its cache
back to the longest prefix that is still committed, catches up on the rest (the corrected or
bonus token, at least), and then runs k autoregressive steps.

When sampling, each draft token is drawn from q = logits_to_probs(draft logits, same
temperature/top-k/top-p/min-p as the target), and that very tensor is what `draft_probs` hands
to the acceptance rule, so the q in the ratio is the q sampled from by construction.

A draft model with a large vocabulary proposes only from a subset of it (`DraftVocabulary`):
its output projection is a fifth of a 0.5B model's weights, and most of it is rare tokens.

With `keep_going` set (generate()'s "auto" k does this), the drafter records the probability it
gave each draft token and stops early when `keep_going(confidences)` says another step will not
pay. Stopping on the draft's own probabilities keeps sampling exact: whether position i + 1 gets
a draft depends only on the draft side, never on the target's verdict.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from collections.abc import Callable, Sequence

import torch

from specfast.autok import AutoK
from specfast.drafters.base import Base, Proposal, copy_auto, draft_probability, observe_model
from specfast.sampling import copy_generator, logits_to_probs
from specfast.targets import make_decoder, tokenizer_vocab
from specfast.targets.base import Target, common_prefix, to_device

# A draft model whose vocabulary is larger than twice this proposes from its this-many lowest
# token ids plus every token of the sequence (see DraftVocabulary); "auto" in generate().
COMMON_TOKENS = 32768


class DraftModelDrafter:
    def __init__(
        self,
        model: Target,
        *,
        target: Target,
        max_length: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int = 0,
        vocabulary: int | str | None = "auto",
        eos_ids: Sequence[int] = (),
    ):
        check_same_vocabulary(target, model)
        warn_if_draft_larger(target, model)
        vocab_size, self.device = model.vocab_size, model.device
        self.model = model
        self.decoder = make_decoder(model, max_length)
        common = common_tokens(vocabulary, vocab_size)
        # The draft's output rows: all of them, or the common tokens plus those seen.
        self.vocab = None
        if common is not None and model.supports_head:
            self.vocab = DraftVocabulary(model, common, always=eos_ids)
        self.generator = torch.Generator(device=self.device)
        self.set_sampling(
            seed, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        )
        self.committed: list[int] = []
        # The draft cache holds committed[:known] + drafts[:-1] of the last proposal.
        self._known = 0
        self._cached_drafts: list[int] = []
        self.draft_probs: torch.Tensor | None = None  # (k, V) q of the last proposal, sampling only
        self.keep_going: Callable[[list[float]], bool] | None = None
        self.confidences: list[float] = []  # the draft's probability of each draft token

    def extend(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        self.committed.extend(tokens)
        if self.vocab is not None:
            self.vocab.add(tokens)

    def set_sampling(self, seed: int, params: dict | None) -> None:
        """Samples drafts with `params` (logits_to_probs keywords; None or temperature 0: greedy)
        from a generator seeded with `seed`: a Session calls it at the start of each turn."""
        self.greedy = params is None or params.get("temperature", 0) == 0
        self.sampling = dict(params or {})
        self.generator.manual_seed(seed)

    def truncate(self, n: int) -> None:
        """Forgets all but the first n committed tokens; the cache follows on the next proposal."""
        del self.committed[n:]
        self._known = min(self._known, n)
        self._cached_drafts = []

    def reset(self) -> None:
        self.committed.clear()
        self._cached_drafts.clear()
        self._known = 0
        self.decoder.rollback(0)

    def fork(self, auto=None) -> DraftModelDrafter:
        """A copy with its own KV cache (copied up to its length), committed tokens, last
        drafts, draft vocabulary and generator; its `keep_going` asks `auto` (an AutoK)."""
        new = copy.copy(self)
        new.decoder = self.decoder.copy()
        new.committed, new._cached_drafts = list(self.committed), list(self._cached_drafts)
        new.sampling, new.confidences, new.draft_probs = dict(self.sampling), [], None
        new.generator = copy_generator(self.generator)
        new.vocab = None if self.vocab is None else self.vocab.copy()
        if auto is not None:
            new.keep_going = auto.keep_drafting  # ours is bound to the parent's AutoK
        return new

    def __len__(self) -> int:
        return len(self.committed)

    def prefill(self) -> None:
        """Runs the draft over all committed tokens but the last, so the first proposal (and its
        measured cost) is one ordinary step rather than a whole prompt."""
        keep = self._rollback_point()
        if keep < len(self.committed) - 1:
            feed = torch.tensor(self.committed[keep:-1], dtype=torch.long, device=self.device)
            self.decoder.forward(feed, last_only=True)
        self._known, self._cached_drafts = len(self.committed) - 1, []

    def _rollback_point(self) -> int:
        """Rolls the cache back to the longest cached prefix that was committed and returns its
        length; drafts that were accepted stay. The last committed token is never kept."""
        known = self._known  # committed for sure; of the cached drafts, keep those accepted
        keep = known + common_prefix(self._cached_drafts, self.committed[known:])
        keep = min(keep, len(self.committed) - 1)
        self.decoder.rollback(keep)
        return keep

    def propose(self, k: int) -> list[int]:
        if not self.committed or k <= 0:
            return []
        keep = self._rollback_point()
        feed = to_device(self.committed[keep:], self.device)  # no blocking upload
        drafts, qs, confidences = [], [], []
        vocab = self.vocab
        head = {"head": vocab.head} if vocab is not None else {}  # transformers drafts: none
        for _ in range(k):
            logits = self.decoder.forward(feed, last_only=True, **head)  # (1, S)
            row, q = self._step(logits)  # a row of the logits, and q (1, S) when sampling
            nxt = vocab.ids[row] if vocab is not None else row  # (1,) token id
            drafts.append(nxt)
            if q is not None:
                qs.append(q)
            feed = nxt
            if self.keep_going is not None:
                # A host sync per step, small next to the step's forward.
                confidences.append(draft_probability(logits, q, row))
                if not self.keep_going(confidences):
                    break
        tokens = torch.cat(drafts).tolist()  # without keep_going, the proposal's one host sync
        self._known = len(self.committed)
        self._cached_drafts = tokens[:-1]
        self.draft_probs = None
        if qs:
            q = torch.cat(qs)  # (k, S): the distributions the drafts were drawn from
            self.draft_probs = vocab.expand(q) if vocab is not None else q  # (k, V)
        self.confidences = confidences
        return tokens

    def _step(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The row (1,) drawn from logits (1, S), and the q (1, S) it was drawn from."""
        if self.greedy:
            return logits.argmax(dim=-1), None  # stays on the device: no sync per step
        q = logits_to_probs(logits, **self.sampling)  # (1, S)
        return torch.multinomial(q, 1, generator=self.generator)[0], q


class DraftVocabulary:
    """The tokens a draft model may propose: the `common` lowest ids, every token the sequence
    has held (prompt and output), and `always` (the EOS ids). Its forward then projects onto
    those rows only.

    Byte-level BPE numbers tokens in merge order, most frequent first: Qwen2's lowest 32k of
    152k ids cover 94% of the tokens of stdlib code, and the sequence's own tokens cover most of
    the rest of what gets copied. On the 0.5B Qwen a step reads 59 MB of output rows instead of
    272 MB and costs 17% less.

    Exactness does not depend on the choice: the other tokens get probability 0 in the q the
    drafts are drawn from, and `expand` hands that q, zeros included, to the acceptance rule.
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
        self._extra_rows = self.model.output_rows(torch.tensor(self._extra))
        self.ids = torch.cat([self._common_rows.ids, self._extra_rows.ids])

    def __len__(self) -> int:
        return self.ids.shape[0]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """hidden (T, D) -> logits (T, S) over these tokens."""
        y = self._common_rows(x)
        return y if self._extra_rows is None else torch.cat([y, self._extra_rows(x)], dim=-1)

    def expand(self, q: torch.Tensor) -> torch.Tensor:
        """(k, S) probabilities over these tokens -> (k, V) over the vocabulary, 0 elsewhere."""
        full = q.new_zeros(q.shape[0], self.model.vocab_size)
        return full.index_copy_(1, self.ids, q)


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
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class ModelDraft(Base):
    """A draft model (DraftModelDrafter). Auto k: up to AutoK's `max_draft_k` steps, cut
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
            observe_model(self.auto, proposal, n_accepted, verify_seconds)

    def rollback(self, kept) -> None:
        self.inner.truncate(len(kept))

    def fork(self, ids) -> ModelDraft:
        new = copy.copy(self)
        new.auto = copy_auto(self.auto)
        new.inner = self.inner.fork(new.auto)
        return new
