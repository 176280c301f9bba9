"""Drafting with an EAGLE-3 head (eagle/head.py): the drafter generate() runs for an EagleHead.

The head keeps its own static KV cache, rolled back after every verify, and reads the target's
features of the rows the target kept; q is the head's filtered distribution mapped through d2t.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

import specfast.drafters.eagle.files as eagle_files
from specfast.drafters.base import DraftSetup, Verified
from specfast.drafters.chain import ChainDraft
from specfast.drafters.eagle.files import (
    check_config_for_target,
    eagle_target,
    load_eagle,
    target_embedding,
)
from specfast.drafters.eagle.head import EagleHead
from specfast.model.kv_cache import KVCache
from specfast.targets.base import Target, to_device

# The most rows one catch-up feeds the head. Rows the head has not read pile up while it does
# not draft (the prompt, rounds the n-gram or plain decoding took); past this many, it starts
# over on the newest CATCH_UP rows alone. Its drafts then come from a shorter context of its own
# (the target's features still carry the whole one), and a probe after a long idle stretch
# costs a few target steps at most, not a pass over everything skipped.
CATCH_UP = 32

# ----------------------------------------------------------------------------
# the drafter


class EagleDraft(ChainDraft):
    """Drafts a chain with an EAGLE-3 head (generate(..., drafter=head)).

    The head's static KV cache holds positions [origin, fed) computed from the target's real
    features (its cache position 0 is the sequence's `origin`); positions past it are this
    round's drafts. After each verify the round hands over the features of the rows the target
    kept (`Verified.features`); the next proposal rolls the cache back to `fed` and re-feeds
    those positions with them, in one head pass whose last row gives the first draft. So
    accepted drafts are re-read with the target's features, never the head's own guesses.
    Features wait until the head drafts: a call it never drafts in costs it nothing. Past
    CATCH_UP waiting rows the head's context restarts on the newest of them.

    q (sampling): the head's draft-vocabulary logits filtered as the target's, scattered to
    target ids via d2t (the chain's `_row_ids`) with zeros elsewhere.
    """

    wants_features = True

    @classmethod
    def bind(cls, source, setup: DraftSetup) -> EagleDraft:
        """drafter="eagle" (the default model's shipped head), "eagle:PATH", or an EagleHead."""
        head = load_head(source, setup.target)
        return cls(head, setup.target, setup.fixed_k, setup.max_length)

    def __init__(self, head: EagleHead, target: Target, fixed_k: int | None, max_length: int):
        facts = eagle_target(target)
        check_config_for_target(head.config, facts)
        if head.embed_tokens is None and head._shared_embed is None:
            head.bind_embedding(target_embedding(facts, head.fc.weight.dtype))
        w = head.fc.weight
        c = head.config
        super().__init__(fixed_k, w.device, c.vocab_size)
        self.head = head
        self.feature_layers: tuple[int, ...] = tuple(head.aux_layers or ())
        self.cache = KVCache(1, c.num_key_value_heads, max_length, c.head_dim, w.device, w.dtype)
        head.rope(max_length)
        self.target_ids = head.target_ids.to(w.device)  # (Vd,)
        with torch.inference_mode():
            # A target that runs int8 or q4 weights on CPU: the head's products in int8 too.
            self.fast = head.fast_linears(int8=target.weights != "float")
        self.committed: list[int] = []
        # Head cache positions [0, fed - origin) hold the target's real features of sequence
        # positions [origin, fed).
        self.origin = self.fed = 0
        # Target features of positions [fed, fed + n_pending), not fed yet: a list, so rounds
        # that do not draft (auto k) append in O(1) and the next draft concatenates once.
        self.pending: list[torch.Tensor] = []
        self.n_pending = 0

    # -- the protocol

    def fork(self, ids) -> EagleDraft:
        new = cast(EagleDraft, super().fork(ids))
        new.cache = self.cache.clone()
        new.committed, new.pending = list(self.committed), list(self.pending)  # never written
        return new

    def extend(self, tokens) -> None:
        self.committed.extend(int(t) for t in tokens)

    def prefill(self, features: torch.Tensor | None = None) -> None:
        """Takes the target's features of the rows this turn prefilled (the last len(features)
        positions before the newest token); the head reads them when it next drafts."""
        if features is None:
            raise ValueError("the EAGLE drafter needs the target's features of the prompt")
        self._add_features(len(self.committed) - 1 - features.shape[0], features)

    def rollback(self, kept) -> None:
        """The committed sequence is now `kept`: features of positions past len(kept) - 2 are
        forgotten (the target re-sends them when it prefills them again)."""
        self.committed = [int(t) for t in kept]
        known = max(len(self.committed) - 1, 0)
        if self.fed >= known:
            self.fed, self.pending, self.n_pending = known, [], 0
            self.origin = min(self.origin, known)
        elif self.fed + self.n_pending > known:
            self.pending = [self._take_pending()[: known - self.fed]]
            self.n_pending = known - self.fed

    # -- the chain's steps

    def _take(self, verified: Verified) -> None:
        if verified.features is None:
            raise ValueError("the round gave the EAGLE drafter no features")
        self._add_features(len(self.committed) - 1, verified.features)

    def ready(self) -> bool:
        return self.n_pending > 0

    def _row_ids(self) -> torch.Tensor:
        return self.target_ids

    def _first(self) -> torch.Tensor:
        """Re-feeds the pending real rows; -> the first draft's logits (1, Vd)."""
        rows = self._take_pending()
        self.cache.rollback(self.fed - self.origin)  # forget last round's drafts
        self._hidden = self._feed(rows)
        self.fed, self.pending, self.n_pending = self.fed + rows.shape[0], [], 0
        return self.head.logits(self._hidden, self.fast).float()

    def _next(self, token: torch.Tensor) -> torch.Tensor:
        self._hidden = self._step(self._hidden, token)
        return self.head.logits(self._hidden, self.fast).float()

    # -- the head's passes

    def _add_features(self, start: int, features: torch.Tensor) -> None:
        """Records the target's features of positions [start, start + len(features))."""
        have = self.fed + self.n_pending
        if not 0 <= start <= have:
            raise ValueError(
                f"the EAGLE drafter got target features from position {start} but knows only "
                f"[0, {have}); rebuild it (a new generate() call or Session)"
            )
        if start < self.fed:  # the target recomputed rows the head had: take them again
            self.fed, self.pending = start, []
            self.origin = min(self.origin, start)
        elif start < have:  # rows past `start` were recomputed: keep those before it
            self.pending = [self._take_pending()[: start - self.fed]]
        self.pending.append(features)
        self.n_pending = start - self.fed + features.shape[0]
        self._keep_newest()

    def _keep_newest(self) -> None:
        """Past CATCH_UP pending rows, restarts the head's context on the newest CATCH_UP: the
        rest are dropped now (whole chunks, then a view of one), so what waits stays bounded."""
        extra = self.n_pending - CATCH_UP
        if extra <= 0:
            return
        self.origin = self.fed = self.fed + extra
        self.n_pending = CATCH_UP
        while extra >= self.pending[0].shape[0]:
            extra -= self.pending.pop(0).shape[0]
        self.pending[0] = self.pending[0][extra:]

    def _take_pending(self) -> torch.Tensor:
        """The pending features as one (n_pending, F) tensor."""
        rows = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        self.pending = [rows]
        return rows

    def _feed(self, features: torch.Tensor) -> torch.Tensor:
        """Runs the head over positions [fed, fed + n) with the target's features there and
        the committed tokens one ahead -> out_hidden of the last row (1, H)."""
        pos, n = self.fed, features.shape[0]
        tokens = to_device(self.committed[pos + 1 : pos + 1 + n], self.device)  # not blocking
        hidden = self.fast("fc", features.to(self.head.fc.weight.dtype))  # (n, H)
        return self._step(hidden, tokens)[-1:]

    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden (T, H), tokens (T,) at positions [cache.length, +T) -> out_hidden (T, H);
        appends T positions to the head's cache."""
        pos, T = self.cache.length, hidden.shape[0]
        if pos + T > self.cache.max_length:
            raise ValueError(f"the EAGLE drafter's cache holds {self.cache.max_length} positions")
        cos, sin = self.head.rope(pos + T)
        cos, sin = cos[pos : pos + T, None, :], sin[pos : pos + T, None, :]
        c = self.head.config
        g = c.num_attention_heads // c.num_key_value_heads
        mask = None
        if T > 1:
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=self.device).tril_(pos)
            mask = mask.repeat(g, 1)

        def attend(q, k, v):  # q (Hkv, g*T, hd); k, v (Hkv, T, hd)
            k_all, v_all = self.cache.write(0, pos, k, v)
            return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)

        out = self.head.layer(hidden, tokens, cos, sin, attend, self.fast)
        self.cache.length = pos + T
        return out


def load_head(drafter, target: Target) -> EagleHead:
    """The EagleHead for generate()'s `drafter`: "eagle" (the default model's shipped head),
    "eagle:PATH", or an EagleHead as it is."""
    if not isinstance(drafter, str):
        return drafter
    path = drafter.partition(":")[2] or None
    if path is None and not eagle_files.DEFAULT_HEAD.is_dir():
        raise ValueError(
            f'drafter="eagle" uses the head for SmolLM2-135M-Instruct at '
            f"{eagle_files.DEFAULT_HEAD}, which is not there (it is in specfast's source tree, "
            "not its wheel); pass a head folder as drafter='eagle:PATH', or a head from "
            "specfast.load_eagle(path, model)"
        )
    return load_eagle(path, target)
