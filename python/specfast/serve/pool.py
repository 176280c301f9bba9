"""The server's live Sessions, matched to requests by longest common prefix, and its corpus.

A request arrives as a whole rendered prompt (token ids). The pool serves it on the Session
whose tokens share the longest prefix with it: that Session keeps the shared part of its KV
cache and n-gram index and prefills only the rest (Session.send_context), as llama-server's
prompt cache does. Which Session, exactly:
- the longest shared prefix wins, among Sessions of the request's drafter and k (they shape the
  drafter, so they are fixed per Session); ties go to the most recently used;
- if the request keeps every prompt token of that Session's last turn, it continues that
  conversation (the next turn, or the last reply regenerated or cut where a stop string or
  max_tokens ended it) and is served on it;
- otherwise it parts from that conversation inside a prompt: an edited message, or another
  conversation that shares only a beginning (a system prompt). It gets a Session of its own,
  forked from the best one so the shared part is not prefilled again, and the other
  conversation keeps its cache.
At most `size` Sessions live; a new one evicts the least recently used (`size` 0: none is
kept, and every request is prefilled whole, the baseline the reuse is measured against). All of
this runs on the server's one worker thread, so nothing here is locked.

The corpus. With the n-gram drafter, every finished reply (with the prompt tokens its request
added) becomes a document of one NgramDrafter, the server's corpus; each new Session drafts
from a copy of it, so a new conversation drafts from what earlier ones said. `save()` writes it
in NgramDrafter's checksummed format, atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from specfast._core import NgramDrafter
from specfast.drafters.base import clone_ngram
from specfast.session import Session, corpus_fingerprint
from specfast.targets.base import common_prefix


class CorpusError(Exception):
    """A corpus file that cannot be loaded (damaged, or another tokenizer's)."""


def load_corpus(path: str | None, model, reset: bool) -> NgramDrafter:
    """The corpus to start from: the file at `path` if it exists, else an empty one. A file
    that cannot be loaded raises CorpusError and is left as it is, unless `reset` says to
    start empty (the file is then replaced at the first save)."""
    if path is None or not os.path.exists(path):
        return NgramDrafter()
    try:
        return NgramDrafter.load(path, fingerprint=corpus_fingerprint(model))
    except (ValueError, OSError) as e:
        if reset:
            return NgramDrafter()
        raise CorpusError(
            f"cannot load the corpus {path}: {e}\n  the file was left as it is; move it away, "
            "or pass --corpus-reset to start with an empty corpus (it then replaces the file)"
        ) from None


def reply_start(session: Session) -> int:
    """Where the last turn's reply begins in the Session's tokens (0 before any turn)."""
    turns = session.history
    return turns[-1].start + len(turns[-1].prompt_ids) if turns else 0


@dataclass
class Entry:
    session: Session
    options: tuple[str, Any]  # (drafter, k)
    last_used: int = 0


@dataclass
class Pool:
    model: Any
    size: int
    max_length: int
    corpus: NgramDrafter | None = None  # None: no n-gram corpus kept (no --corpus)
    corpus_path: str | None = None
    entries: list[Entry] = field(default_factory=list)
    clock: int = 0
    unsaved: int = 0  # finished replies not yet in the corpus file

    def session_for(self, ids: list[int], drafter: str, k) -> Session:
        """The Session to serve a request whose rendered prompt is `ids` (see the module doc)."""
        options = (drafter, k)
        self.clock += 1
        if self.size == 0:  # --sessions 0: no cache kept, every request prefills it all
            return self._new(drafter, k)
        same = [e for e in self.entries if e.options == options]
        best, shared = None, 0
        for e in same:
            n = common_prefix(ids, e.session.token_ids)
            if n > shared or (n == shared and best is not None and e.last_used > best.last_used):
                best, shared = e, n
        if best is not None and shared >= reply_start(best.session):
            best.last_used = self.clock
            return best.session
        if len(self.entries) >= self.size:
            lru = min(self.entries, key=lambda e: e.last_used)
            if lru is best:  # the pool holds one Session: cut it back rather than drop it
                best.last_used = self.clock
                return best.session
            self.entries.remove(lru)
        session = self._new(drafter, k) if best is None else self._fork(best.session, drafter, k)
        self.entries.append(Entry(session, options, self.clock))
        return session

    def _new(self, drafter: str, k) -> Session:
        draft: Any = None
        if drafter == "ngram":
            draft = clone_ngram(self.corpus, []) if self.corpus is not None else "ngram"
        return Session(
            self.model, drafter=draft, max_length=self.max_length, num_speculative_tokens=k
        )

    def _fork(self, session: Session, drafter: str, k) -> Session:
        try:
            return session.fork()
        except TypeError:  # a runtime whose cache cannot be copied (llama.cpp)
            return self._new(drafter, k)

    def finished(self, new_tokens: list[int], every: int) -> None:
        """A reply finished: `new_tokens` (the request's prompt tokens past what the Session
        held, then the reply) go into the corpus; the file is written every `every` replies."""
        if self.corpus is None:
            return
        self.corpus.add_document(new_tokens)
        self.unsaved += 1
        if self.corpus_path is not None and self.unsaved >= every:
            self.save()

    def save(self) -> None:
        if self.corpus is None or self.corpus_path is None or not self.unsaved:
            return
        self.corpus.save(self.corpus_path, fingerprint=corpus_fingerprint(self.model))
        self.unsaved = 0

    def __len__(self) -> int:
        return len(self.entries)
