"""Committing tokens one at a time: EOS, stop strings and max_new_tokens end a reply inside a
round's block, and a streamer gets the text as it is committed."""

from __future__ import annotations

import torch

from specfast.logprobs import Rows


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


class Emitter:
    """Commits tokens one at a time: EOS, stop strings and max_new_tokens cut inside a block.

    With `logprobs` (the number of alternatives, or None: off) it keeps each committed token's
    logprobs too, and a streamer with a `put_logprobs(ids, logprobs, top_logprobs)` method gets
    them for each block's committed tokens, before their text."""

    def __init__(
        self, streamer, tokenizer, prompt_ids, eos_ids, stops, max_new_tokens, logprobs
    ) -> None:
        self.streamer, self.tokenizer = streamer, tokenizer
        self.eos_ids, self.stops, self.max_new_tokens = eos_ids, stops, max_new_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = None if logprobs is None else []
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if logprobs else None
        self.finish_reason = ""
        # A stop string of L characters ends within the last 4L + 4 tokens (a token is at least a
        # byte), so only that tail is decoded per token.
        self._stop_window = 4 * max(map(len, stops), default=0) + 4
        self._sent = ""  # text already handed to a callback streamer
        if streamer is not None and hasattr(streamer, "put"):
            streamer.put(torch.tensor([prompt_ids]))  # TextStreamer(skip_prompt=True) skips this

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def commit(self, *tokens: int, rows: Rows | None = None) -> int:
        """Commits tokens until one ends the generation; returns how many were committed.
        `rows`: the tokens' logprobs (specfast.logprobs.token_logprobs), when they are kept."""
        n = 0
        for t in tokens:
            if self.done:
                break
            self.token_ids.append(t)
            n += 1
            if t in self.eos_ids:
                self.finish_reason = "eos"
            elif self.stops and self._stop_in_tail():
                self.finish_reason = "stop_string"
            if not self.finish_reason and len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
        new = self.token_ids[len(self.token_ids) - n :]
        if rows is not None and self.logprobs is not None and n:
            logprobs, top = rows[0][:n], None if rows[1] is None else rows[1][:n]
            self.logprobs.extend(logprobs)
            if self.top_logprobs is not None and top is not None:
                self.top_logprobs.extend(top)
            if callable(getattr(self.streamer, "put_logprobs", None)):
                self.streamer.put_logprobs(new, logprobs, top)
        self._stream(new)
        return n

    def _stop_in_tail(self) -> bool:
        # Checked after every token, so a stop string found here has just been completed.
        tail = decode(self.tokenizer, self.token_ids[-self._stop_window :])
        return any(s in tail for s in self.stops)

    def _stream(self, new: list[int]) -> None:
        if self.streamer is None or not new:
            return
        if hasattr(self.streamer, "put"):
            self.streamer.put(torch.tensor(new))
        else:
            self.streamer(self._pop_text())

    def _pop_text(self) -> str:
        text = decode(self.tokenizer, self.token_ids) if self.tokenizer is not None else ""
        # Hold back a trailing replacement char: a multi-byte character may be half-committed.
        stable = text.rstrip("\ufffd")
        delta, self._sent = stable[len(self._sent) :], stable
        return delta

    def end(self) -> None:
        if self.streamer is None:
            return
        if hasattr(self.streamer, "end"):
            self.streamer.end()
        elif self.tokenizer is not None:
            text = decode(self.tokenizer, self.token_ids)
            if len(text) > len(self._sent):
                self.streamer(text[len(self._sent) :])
