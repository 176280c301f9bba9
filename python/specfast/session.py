"""A conversation that keeps the target's KV cache and the drafter's index across turns.

    s = specfast.Session(model, system="You are terse.", max_new_tokens=256)
    out = s.send("Write a function that ...")      # chat template applied
    out = s.send("Now rename its argument.")       # prefills only this turn's tokens
    s.rewind(1); s2 = s.fork()

How a turn works. The session holds the conversation's token ids. A str message re-renders the
whole conversation (system, then each user message and the text of each reply) with the model's
chat template and tokenizes it; the tokens the cache already holds are kept (their common
prefix with the new rendering) and only the rest is prefilled. If re-tokenizing an earlier reply
gives other tokens than the ones generated, the cache rolls back to where they part (one integer)
and `stats.reused_tokens` shows it. A list of ids is appended as-is. Then the turn runs the same
speculative rounds as generate() (`generate.run_turn`), so greedy output equals generate() on
the full history.

The cache is one Decoder of `max_length` positions (default: the model's context, capped at
8192; pass max_length= to change it). A turn that would not fit raises ValueError: there is no
silent truncation. `rewind` and `reset` free positions.

Rollback. The cache is rolled back by moving its length. The n-gram drafter cannot forget
tokens, so it is reset and re-extended with the kept tokens (O(kept), microseconds per thousand
tokens; a loaded corpus stays). A draft model forgets its committed tail and re-reads from there.

Interrupts. An exception during a turn (from the streamer, or KeyboardInterrupt) leaves the turn
wholly absent: history, cache and drafter are as they were before send(), and the exception
propagates.

Corpus. With `corpus=PATH` the n-gram drafter starts from the corpus saved there (if the file
exists; it must carry this tokenizer's fingerprint, `corpus_fingerprint`), adds each finished
turn (its prompt and reply tokens) as a document, and saves the file after each turn; the save
writes a temporary file and renames it, so a crash never damages the previous one. Rewound turns
stay in the corpus; an interrupted turn never enters it.

`fork()` copies the cache tensors up to the current length (O(length x layers) memory and time)
and the drafter's state: the n-gram index is rebuilt from the tokens (O(length)), a draft
model's or EAGLE head's KV cache is copied as the target's is. It supports the n-gram drafter,
a draft model, a CombinedDrafter, an EAGLE head and plain decoding; parent and fork share no
mutable state. A fork drafts from the corpus the parent holds but does not write the file: two
writers would overwrite each other's turns.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from typing import Any

from specfast._core import NgramDrafter
from specfast.chat import render_chat
from specfast.corpus import tokenizer_fingerprint
from specfast.drafters import make_drafter
from specfast.drafters.base import DraftSetup
from specfast.drafters.model import common_tokens
from specfast.generate import run_turn
from specfast.settings import check_k, check_settings, encode_text, prompt_to_ids
from specfast.stats import GenerateOutput
from specfast.targets import as_target, make_decoder
from specfast.targets.base import Decoder, Target, common_prefix

DEFAULT_MAX_LENGTH = 8192
# Options fixed when the session starts: they shape the drafter.
SESSION_OPTIONS = ("num_speculative_tokens", "draft_vocabulary")
# Options a turn may change: check_settings' keywords, the one list of them (generate() takes
# the same, with the same defaults: tests/test_generate.py holds the two together).
PER_TURN_OPTIONS = tuple(
    name
    for name, p in inspect.signature(check_settings).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


@dataclass
class Turn:
    """One send(): what was sent, the tokens it added before the reply, and the reply."""

    message: str | list[int]
    start: int  # where this turn's tokens begin in the conversation's token ids
    prompt_ids: list[int]  # template and message tokens (for a str), or the ids as sent
    reply_ids: list[int]
    reply_text: str | None


class Session:
    """A conversation over one model: `send` continues it, keeping the KV cache and drafter.

    `drafter`: "ngram" (default), None (plain decoding), an NgramDrafter, a draft model or a
    CombinedDrafter. `system`: a system message for str turns. `max_length`: the cache's
    positions (default: the model's context capped at 8192). Other keywords are generate()'s
    options and become per-turn defaults that send(**kwargs) may override, except
    num_speculative_tokens and draft_vocabulary, which are fixed for the session.
    """

    def __init__(
        self,
        model,
        drafter: Any = "ngram",
        system: str | None = None,
        corpus: Any = None,
        *,
        max_length: int | None = None,
        tokenizer: Any = None,
        **defaults: Any,
    ):
        target = as_target(model)
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, got {type(system).__name__}")
        unknown = sorted(set(defaults) - set(PER_TURN_OPTIONS) - set(SESSION_OPTIONS))
        if unknown:
            raise TypeError(
                f"unknown Session option(s) {unknown}; allowed: {sorted(PER_TURN_OPTIONS)} "
                f"and {list(SESSION_OPTIONS)}"
            )
        self.model = model
        self.target: Target = target
        self.system = system
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.vocab_size, context, self.device = target.vocab_size, target.max_context, target.device
        if max_length is None:
            max_length = min(context, DEFAULT_MAX_LENGTH)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        if max_length > context:
            raise ValueError(f"max_length {max_length} exceeds the model's context of {context}")
        self.max_length = max_length
        self.fixed_k = check_k(defaults.pop("num_speculative_tokens", "auto"))
        self.draft_vocabulary = defaults.pop("draft_vocabulary", "auto")
        common_tokens(self.draft_vocabulary, self.vocab_size)
        self.defaults = defaults
        self.corpus_path = None if corpus is None else os.fspath(corpus)
        self.fingerprint: str | None = None
        if corpus is not None:
            drafter = self._open_corpus(drafter)
        first = check_settings(target, self.tokenizer, **defaults)  # checks the defaults now
        self._drafter = self._make_drafter(drafter, first)
        self._decoder: Decoder | None = None  # allocated on the first send
        self._ids: list[int] = []  # the conversation's tokens; the drafter holds them all
        self._turns: list[Turn] = []

    # ------------------------------------------------------------------ state

    @property
    def history(self) -> list[Turn]:
        """The turns so far, oldest first (a copy)."""
        return list(self._turns)

    @property
    def token_ids(self) -> list[int]:
        """Every token of the conversation, replies included."""
        return list(self._ids)

    @property
    def cached_tokens(self) -> int:
        """Tokens the target's cache holds (all but the last committed one, after a turn)."""
        return 0 if self._decoder is None else self._decoder.length

    def messages(self) -> list[dict]:
        """The conversation as chat messages (str turns only), system first."""
        msgs: list[dict] = []
        if self.system is not None:
            msgs.append({"role": "system", "content": self.system})
        for t in self._turns:
            msgs.append({"role": "user", "content": t.message})
            msgs.append({"role": "assistant", "content": t.reply_text or ""})
        return msgs

    # ------------------------------------------------------------------ turns

    def send(self, message: str | list[int], **kwargs: Any) -> GenerateOutput:
        """Continues the conversation by one reply; kwargs override the session's defaults.

        A str gets the chat template; a list of ids (or a 1-D tensor) is appended as-is."""
        settings = self._settings(kwargs)
        return self._turn(message, self._context_for(message), settings, self._turns, None)

    def send_context(self, ids: list[int], **kwargs: Any) -> GenerateOutput:
        """Continues from `ids`, the whole context as the caller rendered it (a server's request):
        the session keeps what `ids` shares with its tokens and prefills the rest, as send()
        does. Turns that end past the shared part are dropped, and the new turn (a token-id
        turn) starts where the last kept one ends, so rewind(1) goes back to that point."""
        settings = self._settings(kwargs)
        ids = prompt_to_ids(ids, None, self.vocab_size, self.device)
        keep = common_prefix(ids, self._ids)
        turns = [t for t in self._turns if _end(t) <= keep]
        start = _end(turns[-1]) if turns else 0
        return self._turn(ids[start:], ids, settings, turns, start)

    def _settings(self, kwargs: dict[str, Any]):
        fixed = sorted(set(kwargs) & set(SESSION_OPTIONS))
        if fixed:
            raise TypeError(f"{fixed} are fixed when the Session starts; pass them to Session()")
        unknown = sorted(set(kwargs) - set(PER_TURN_OPTIONS))
        if unknown:
            raise TypeError(f"unknown send() option(s) {unknown}; allowed: {PER_TURN_OPTIONS}")
        return check_settings(self.target, self.tokenizer, **{**self.defaults, **kwargs})

    def _turn(self, message, ids, settings, turns, start: int | None) -> GenerateOutput:
        """Runs one turn continuing `ids`; on success the history is `turns` plus this one,
        which starts at `start` (None: where the cache's reuse ends, as send() records it)."""
        if len(ids) + settings.max_new_tokens > self.max_length:
            raise ValueError(
                f"the conversation ({len(ids)} tokens with this message) + max_new_tokens "
                f"({settings.max_new_tokens}) exceeds the session's max_length of "
                f"{self.max_length} tokens; rewind() or reset() the session, lower "
                f"max_new_tokens, or start a Session with a larger max_length"
            )
        keep = common_prefix(ids, self._ids)
        if self._decoder is None:
            self._decoder = make_decoder(self.target, self.max_length)
        before_ids, before_cache = self._ids, self._decoder.length
        cache_keep = self._reusable(ids, keep)
        self._decoder.rollback(cache_keep)
        if keep < len(self._ids):
            self._drafter.rollback(ids[:keep])  # an earlier reply re-tokenized differently
        try:
            out = run_turn(self._decoder, self._drafter, ids, keep, settings, self.fixed_k)
        except BaseException:
            self._restore(before_ids, min(cache_keep, before_cache))
            raise
        self._ids = ids + out.token_ids
        start = keep if start is None else start
        self._turns = [
            *turns,
            Turn(_message_copy(message), start, ids[start:], list(out.token_ids), out.text),
        ]
        if self.corpus_path is not None:
            self._drafter.inner.add_document(ids[keep:] + out.token_ids)
            self._drafter.inner.save(self.corpus_path, fingerprint=self.fingerprint)
        return out

    def _open_corpus(self, drafter):
        """The NgramDrafter to draft with: loaded from the corpus file if it exists."""
        if not (drafter == "ngram" or isinstance(drafter, NgramDrafter)):
            raise ValueError(f'corpus= needs drafter="ngram" (or an NgramDrafter), got {drafter!r}')
        self.fingerprint = corpus_fingerprint(self.target, self.tokenizer)
        if os.path.exists(self.corpus_path):
            return NgramDrafter.load(self.corpus_path, fingerprint=self.fingerprint)
        return NgramDrafter() if isinstance(drafter, str) else drafter

    def _restore(self, ids: list[int], cached: int) -> None:
        """Undoes an interrupted turn: the cache keeps at most `cached` tokens (what the old
        and the new context share), the drafter holds `ids` again."""
        if self._decoder is not None:
            self._decoder.rollback(min(self._decoder.length, cached))
        self._drafter.rollback(ids)

    def _reusable(self, ids: list[int], keep: int) -> int:
        """How much of the cache the next turn keeps: the tokens it holds that `ids` shares,
        leaving at least one token to prefill (its logits give the first new token)."""
        length = 0 if self._decoder is None else self._decoder.length
        return min(length, keep, len(ids) - 1)

    def _context_for(self, message) -> list[int]:
        """The conversation's tokens with this message appended (template applied to a str)."""
        if isinstance(message, str):
            if self.tokenizer is None:
                raise ValueError("a str message needs a tokenizer: pass tokenizer= or token ids")
            if not message:
                raise ValueError("the message is empty")
            if any(not isinstance(t.message, str) for t in self._turns):
                raise ValueError(
                    "this session was sent token ids; a str message would re-render only the str "
                    "turns. Keep to one kind per session (or reset() it)"
                )
            msgs = [*self.messages(), {"role": "user", "content": message}]
            text = render_chat(msgs, self.target.chat_template)
            return encode_text(self.tokenizer, text)
        if self.system is not None and not self._turns:
            raise ValueError(
                "system= applies to str messages; with token ids, put the system prompt in the ids"
            )
        return self._ids + prompt_to_ids(message, None, self.vocab_size, self.device)

    def rewind(self, n_turns: int = 1) -> None:
        """Forgets the last n turns: the cache rolls back (one integer), the drafter is reset and
        re-extended with the kept tokens."""
        if isinstance(n_turns, bool) or not isinstance(n_turns, int):
            raise TypeError(f"n_turns must be an int, got {n_turns!r}")
        if not 0 <= n_turns <= len(self._turns):
            raise ValueError(f"n_turns must be in [0, {len(self._turns)}], got {n_turns}")
        if n_turns == 0:
            return
        start = self._turns[-n_turns].start
        self._turns = self._turns[:-n_turns]
        self._ids = self._ids[:start]
        if self._decoder is not None:
            self._decoder.rollback(min(self._decoder.length, max(start - 1, 0)))
        self._drafter.rollback(self._ids)

    def reset(self) -> None:
        """Forgets every turn (the system message stays)."""
        self.rewind(len(self._turns))

    def fork(self) -> Session:
        """An independent copy of this conversation that shares no mutable state with it.

        The target's cache tensors are copied up to the current length. The drafter is copied
        too: an n-gram index is rebuilt from the tokens (its corpus documents cloned); a draft
        model (or CombinedDrafter) gets a copy of the draft model's KV cache, committed tokens,
        draft vocabulary and sampling generator; an EAGLE head (alone or with the n-gram) a
        copy of the head's cache and pending target features. Each gets its own copy of the
        auto-k state (the target's measured pass costs stay shared, as across generate()
        calls). Supported: the n-gram drafter, a draft model, a CombinedDrafter, an EAGLE head,
        and drafter=None; other drafter objects raise TypeError."""
        new = copy.copy(self)
        new._drafter = self._drafter.fork(self._ids)
        new.defaults = dict(self.defaults)
        new._turns = list(self._turns)
        new._ids = list(self._ids)
        new._decoder = None if self._decoder is None else self._decoder.copy()
        # One writer per corpus file; the fork drafts from the documents the parent holds,
        # which are what the file holds (saved after every turn).
        new.corpus_path = None
        return new

    def _make_drafter(self, drafter, settings):
        setup = DraftSetup(
            self.target,
            self.fixed_k,
            self.max_length,
            settings.seed,
            settings.params,
            self.draft_vocabulary,
            tuple(sorted(settings.eos_ids)),
        )
        return make_drafter(drafter, setup)


# ----------------------------------------------------------------------------
# helpers


def corpus_fingerprint(model, tokenizer=None) -> str:
    """What a saved corpus must match to be loaded: the tokenizer's vocabulary size and hash
    (corpus.tokenizer_fingerprint), or the model's vocabulary size when it has no tokenizer."""
    target = as_target(model)
    tokenizer = tokenizer if tokenizer is not None else target.tokenizer
    if tokenizer is not None and callable(getattr(tokenizer, "get_vocab", None)):
        return tokenizer_fingerprint(tokenizer)
    return f"vocab={target.vocab_size};no-tokenizer"


def _end(turn: Turn) -> int:
    """Where a turn's tokens end in the conversation's token ids."""
    return turn.start + len(turn.prompt_ids) + len(turn.reply_ids)


def _message_copy(message):
    if isinstance(message, str):
        return message
    return message.tolist() if hasattr(message, "tolist") else [int(t) for t in message]
