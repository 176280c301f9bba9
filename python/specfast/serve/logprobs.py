"""Logprobs on the wire: checking the request's fields, and OpenAI's two reply formats.

Chat: `logprobs: true` with `top_logprobs` 0-20 -> `choices[0].logprobs.content`, one
{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]} per token. Completions: the
legacy `logprobs` 0-5 -> {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset},
whose top_logprobs also holds the chosen token, as OpenAI's does. The numbers are generate()'s
(specfast/logprobs.py says which distribution).

A token is listed when its text starts inside the reply's text: a stop string's tokens and the
EOS that ended the reply are not. Offsets count the tokens' own bytes (llguidance decodes each
token's exact bytes; a token that ends inside a UTF-8 character starts the next one's count).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any

from specfast.constraints import ll_tokenizer

MAX_LEGACY_LOGPROBS = 5  # /v1/completions, as OpenAI's


def token_pieces(target) -> Callable[[int], tuple[bytes, bool]]:
    """token id -> (its bytes, whether it is a special token, which adds no text)."""
    try:
        ll = ll_tokenizer(target.tokenizer, target.vocab_size, set(target.eos_token_ids))
    except ValueError:  # no tokenizers.Tokenizer to read: the token's decoded text
        tokenizer = target.tokenizer
        return lambda t: (
            tokenizer.decode([t], skip_special_tokens=False).encode(),
            not tokenizer.decode([t]),
        )
    return lambda t: (ll.decode_bytes([t]), ll.is_special_token(t))


class Logprobs:
    """One request's logprobs, formatted as their tokens arrive and handed out as the text that
    holds them is sent (`take`). Off (`top_n` None): take() gives None."""

    def __init__(self, kind: str, top_n: int | None, target):
        self.kind, self.top_n = kind, top_n
        self.pieces = token_pieces(target) if top_n is not None else None
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0  # characters of text the tokens so far make
        self.entries: list[tuple[int, Any]] = []  # (text offset, entry), not yet taken

    def add(self, ids: list[int], logprobs: list[float], top: list | None) -> None:
        if self.pieces is None:
            return
        for i, (t, lp) in enumerate(zip(ids, logprobs, strict=True)):
            data, special = self.pieces(t)
            alternatives = [] if top is None else top[i]
            self.entries.append((self.chars, self._entry(t, data, lp, alternatives)))
            if not special:
                self.chars += len(self.decoder.decode(data))

    def take(self, sent: int) -> dict | None:
        """The logprobs of the tokens whose text starts before character `sent` of the reply,
        not taken before, in the reply's format."""
        if self.pieces is None:
            return None
        n = next((i for i, (offset, _) in enumerate(self.entries) if offset >= sent), None)
        n = len(self.entries) if n is None else n
        taken, self.entries = self.entries[:n], self.entries[n:]
        if self.kind == "chat":
            return {"content": [entry for _, entry in taken], "refusal": None}
        return {
            "tokens": [e["token"] for _, e in taken],
            "token_logprobs": [e["logprob"] for _, e in taken],
            "top_logprobs": [e["top"] for _, e in taken],
            "text_offset": [offset for offset, _ in taken],
        }

    def _entry(self, token: int, data: bytes, logprob: float, alternatives) -> dict:
        if self.kind == "chat":
            top = [self._token(t, v) for t, v in alternatives]
            return {**self._token(token, logprob, data), "top_logprobs": top}
        by_text = {self._text(self._bytes(t)): v for t, v in alternatives}
        by_text.setdefault(self._text(data), logprob)  # the chosen token is always listed
        return {"token": self._text(data), "logprob": logprob, "top": by_text}

    def _token(self, token: int, logprob: float, data: bytes | None = None) -> dict:
        data = self._bytes(token) if data is None else data
        return {"token": self._text(data), "logprob": logprob, "bytes": list(data)}

    def _bytes(self, token: int) -> bytes:
        return self.pieces(token)[0]  # type: ignore[misc]

    @staticmethod
    def _text(data: bytes) -> str:
        return data.decode("utf-8", errors="replace")


def options(top_n: int | None) -> dict[str, Any]:
    """generate()'s keywords for a request's logprobs."""
    return {"logprobs": top_n is not None, "top_logprobs": top_n or 0}


def whole(req, target, out, text: str) -> dict | None:
    """The logprobs of a reply that did not stream, whose text is `text`."""
    logprobs = Logprobs(req.kind, req.logprobs, target)
    if out.logprobs is not None:
        logprobs.add(out.token_ids, out.logprobs, out.top_logprobs)
    return logprobs.take(len(text))


class Relay:
    """The worker's streamer when a request wants logprobs: each block's logprobs go to the
    request's coroutine as a "logprobs" event, before the block's text (Emitter's order)."""

    def __init__(self, text: Callable[[str], None], job):
        self.text, self.job = text, job

    def __call__(self, text: str) -> None:
        self.text(text)

    def put_logprobs(self, ids: list[int], logprobs: list[float], top: list | None) -> None:
        self.job.put("logprobs", (ids, logprobs, top))
