"""Tool calls out of a reply's text (tools.py says how they are asked for and constrained).

`Calls` reads the reply's text as it grows, into the deltas a stream sends: content
until a call opens, then each call's first delta (index, id, name) and its arguments' text as
it comes. A whole reply is the same parse of the whole text, so a stream reassembles to it.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from specfast.serve.tools import CLOSE, OPEN, parses

HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
DECODER = json.JSONDecoder()


class Calls:
    """Reads a reply's text as it grows into OpenAI's deltas: {"content": ...} until a call
    opens, then {"tool_calls": [...]}: a call's first delta (index, id, type, name, arguments
    ""), then its arguments' text as it comes. `calls` holds the calls so far."""

    def __init__(self) -> None:
        self.text, self.pos, self.state = "", 0, "content"  # pos: what is sent (or dropped)
        self.open_at = self.args_at = 0
        self.calls: list[dict] = []

    def feed(self, delta: str, end: bool = False) -> list[dict]:
        """The deltas `delta` completes; `end`: the reply is over, send what is held back."""
        self.text += delta
        out: list[dict] = []
        while self._step(out, end):
            pass
        return out

    def _step(self, out: list[dict], end: bool) -> bool:
        """One state's work; False when it waits for more text."""
        text, pos = self.text, self.pos
        if self.state == "content":
            i = text.find(OPEN, pos)
            if i < 0:
                # Held back: what may still become <tool_call>, and the whitespace before it.
                self._content(out, len(text) if end else _sendable(text, pos))
                return False
            self._content(out, pos + len(text[pos:i].rstrip()))
            self.open_at, self.state = i, "head"
            return True
        if self.state == "head":
            m = HEAD.match(text, self.open_at + len(OPEN))
            if m is None:
                if end and not self.calls:  # cut before the name was out: text, not a call
                    self._content(out, len(text))
                return False
            name, index = m.group(1), len(self.calls)
            new = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
            self.calls.append({**new, "function": {"name": name, "arguments": ""}})
            # Its own dicts: the call's arguments grow as they come, the delta's stay "".
            out.append(_delta(index, **new, function={"name": name, "arguments": ""}))
            self.pos = self.args_at = m.end()
            self.state = "arguments"
            return True
        if self.state == "arguments":
            try:
                _, stop = DECODER.raw_decode(text, self.args_at)
                done = text[stop:].lstrip().startswith("}")  # the call's own closing brace
            except ValueError:  # not complete yet: all of it is arguments
                stop, done = len(text), False
            if end and not done:  # cut by max_tokens: the arguments so far
                stop = len(text)
            if stop > pos:
                self.calls[-1]["function"]["arguments"] += text[pos:stop]
                out.append(_delta(len(self.calls) - 1, function={"arguments": text[pos:stop]}))
                self.pos = stop
            if done:
                self.pos, self.state = text.index("}", stop) + 1, "close"
            return done
        rest = text[pos:].lstrip()  # "close": after the call's }, or "between" calls
        tag = CLOSE if self.state == "close" else OPEN
        if rest.startswith(tag):
            at = text.index(tag, pos)
            if tag == CLOSE:
                self.pos, self.state = at + len(CLOSE), "between"
            else:
                self.open_at, self.state = at, "head"
            return True
        if tag.startswith(rest) and (not end or self.state == "between"):
            return False  # the tag may be on its way (at the end: a call max_tokens cut off)
        self.state = "content"  # not the format: the rest is text
        return True

    def _content(self, out: list[dict], stop: int) -> None:
        if stop > self.pos:
            out.append({"content": self.text[self.pos : stop]})
            self.pos = stop


def _delta(index: int, **fields: Any) -> dict:
    return {"tool_calls": [{"index": index, **fields}]}


def _sendable(text: str, start: int) -> int:
    """Where content may be sent up to: before a tail that may still become <tool_call>, and
    before trailing whitespace (a call that follows drops it)."""
    end = len(text)
    for k in range(min(len(OPEN) - 1, end - start), 0, -1):
        if text.endswith(OPEN[:k]):
            end -= k
            break
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def reply(req: Any, body: dict, text: str, finish: str) -> dict:
    """A whole chat response with its calls parsed out of `text` (what a stream would send)."""
    if not parses(req):
        return body
    calls = Calls()
    content = "".join(d.get("content", "") for d in calls.feed(text, end=True))
    choice = body["choices"][0]
    if calls.calls:
        choice["message"] = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": calls.calls,
        }
        choice["finish_reason"] = "length" if finish == "length" else "tool_calls"
    return body


class CallStream:
    """A streamed chat reply's chunks: its text as content, or as tool-call deltas. `chunk` is
    replies.chunk (tools.py sits below protocol.py, which imports it)."""

    def __init__(self, req: Any, chunk: Any):
        self.req, self.chunk = req, chunk
        self.calls = Calls() if req.kind == "chat" and parses(req) else None

    def chunks(self, text: str, end: bool = False) -> list[dict]:
        if self.calls is None:
            return [self.chunk(self.req, text)] if text else []
        out = []
        for delta in self.calls.feed(text, end):
            c = self.chunk(self.req)
            c["choices"][0]["delta"] = delta
            out.append(c)
        return out

    def last(self, finish: str) -> dict:
        c = self.chunk(self.req, finish=finish)
        if self.calls is not None and self.calls.calls and finish != "length":
            c["choices"][0]["finish_reason"] = "tool_calls"
        return c
