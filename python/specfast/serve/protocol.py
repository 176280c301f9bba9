"""OpenAI's wire format: checking a request body, and the shape of an error (replies.py has
the replies').

Only what the server implements is accepted. A field it does not know, or one it knows but
cannot honour (n > 1, penalties), is a 400 that names the field, as OpenAI's own API
answers "Unrecognized request argument supplied"; silently ignoring it would return text the
client did not ask for. The check runs on the event loop, before a request is queued, so bad
input never reaches the worker thread or a Session.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specfast.logprobs import MAX_TOP_LOGPROBS
from specfast.serve.logprobs import MAX_LEGACY_LOGPROBS
from specfast.serve.tools import Tools, check_message, with_tools
from specfast.settings import MAX_SPECULATIVE_TOKENS

DRAFTERS = ("ngram", "none")
MAX_STOPS = 4  # OpenAI's limit
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
    "n", "user", "drafter", "k",
    # Accepted at their "off" values only (see IGNORED_AT_DEFAULT).
    "frequency_penalty", "presence_penalty", "logprobs", "logit_bias",
}  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format",
    "tools", "tool_choice", "parallel_tool_calls",  # serve/tools.py
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}
# Fields clients send by default; their "off" value changes nothing, anything else would.
IGNORED_AT_DEFAULT = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None,),
    "echo": (False, None),
    "best_of": (1, None),
}
ROLES = ("system", "user", "assistant", "tool")


class BadRequest(Exception):
    """A 400 (or `status`) with OpenAI's error body: the message names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


@dataclass
class Request:
    """One checked request. `prompt` is chat messages (chat) or a str or token ids."""

    kind: str  # "chat" | "completion"
    model: str
    prompt: Any
    max_tokens: int | None  # None: up to the end of the context
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    drafter: str = "ngram"
    k: int | str = "auto"
    response_format: dict | None = None  # json_object or json_schema; None: free text
    tools: Tools | None = None  # serve/tools.py: the tools, tool_choice, parallel_tool_calls
    logprobs: int | None = None  # alternatives per token (serve/logprobs.py); None: off
    id: str = ""
    created: int = 0


# ----------------------------------------------------------------------------
# checking a body


def parse_request(body: Any, kind: str, model_id: str, defaults: dict[str, Any]) -> Request:
    """The checked Request for a /v1/chat/completions ("chat") or /v1/completions body.
    `defaults` holds the server's drafter and k."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_json_type(body)}")
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(
            f"unrecognized request argument {unknown[0]!r}; this endpoint takes "
            f"{', '.join(sorted(allowed))}",
            unknown[0],
        )
    for name, off in IGNORED_AT_DEFAULT.items():
        if name in body and body[name] not in off:
            raise BadRequest(f"{name} is not supported; leave it out or send {off[0]!r}", name)
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest(f"model must be a string: this server serves {model_id!r}", "model")
    if model != model_id:
        raise BadRequest(f"unknown model {model!r}; this server serves {model_id!r}", "model")
    prompt = _messages(body) if kind == "chat" else _prompt(body)
    max_tokens = _max_tokens(body, kind)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}", "stream")
    n = body.get("n", 1)
    if isinstance(n, bool) or (n is not None and n != 1):
        raise BadRequest(f"n must be 1 (one choice per request), got {n!r}", "n")
    req = Request(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, math.inf, "a number >= 0 (0 = greedy)"),
        top_p=_top_p(body),
        seed=_seed(body),
        stop=_stop(body),
        stream=bool(stream),
        include_usage=_include_usage(body),
        drafter=_drafter(body, defaults["drafter"]),
        k=_k(body, defaults["k"]),
        response_format=_response_format(body),
        logprobs=_logprobs(body, kind),
        id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
        created=int(time.time()),
    )
    return with_tools(req, body) if kind == "chat" else req


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives each token gets, or None for no logprobs; a 400 naming the field
    says what is allowed."""
    v = body.get("logprobs")
    if kind == "completion":
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LEGACY_LOGPROBS:
            raise BadRequest(
                f"logprobs must be an integer in [0, {MAX_LEGACY_LOGPROBS}] (how many "
                f"alternatives per token) or null, got {v!r}",
                "logprobs",
            )
        return v
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"logprobs must be true or false, got {v!r}", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise BadRequest(
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
            "top_logprobs",
        )
    if top and not v:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if v else None


def _response_format(body: dict) -> dict | None:
    """OpenAI's response_format: text (no constraint), json_object or json_schema (with its
    name, schema and strict). The schema itself is checked against the model's tokenizer by the
    server (constraints.check_response_format) before the request is queued."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(rf, dict) or rf.get("type") not in kinds:
        raise BadRequest(
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, got '
            f"{rf!r}"[:300],
            "response_format",
        )
    return None if rf["type"] == "text" else rf


def _json_type(v: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if v is None:
        return "null"
    return names.get(type(v), "a number" if isinstance(v, (int, float)) else type(v).__name__)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            f"messages must be a non-empty array of {{role, content}} objects, got "
            f"{_json_type(messages) if messages != [] else 'an empty array'}",
            "messages",
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object, got {_json_type(m)}", where)
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role"
            )
        content = m.get("content")  # an assistant's tool calls may come without text
        if content is not None or role != "assistant" or not m.get("tool_calls"):
            content = _content(content, f"{where}.content")
        out.append(check_message(m, role, content, where))
    return out


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or an array of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise BadRequest(f"{where}: only text parts are supported, got {part!r}", where)
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}: a text part's text must be a string", where)
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(
        f"{where} must be a string or an array of text parts, got {_json_type(content)}", where
    )


def _prompt(body: dict) -> str | list[int]:
    """A completion prompt: a string, a one-string array, or an array of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty; give at least one character", "prompt")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    raise BadRequest(
        "prompt must be a non-empty string, or a non-empty array of token ids (one prompt per "
        f"request), got {_json_type(prompt)}",
        "prompt",
    )


def _int(body: dict, name: str, low: int, what: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise BadRequest(f"{name} must be {what}, got {v!r}", name)
    return v


def _max_tokens(body: dict, kind: str) -> int | None:
    a = _int(body, "max_tokens", 1, "an integer >= 1")
    b = _int(body, "max_completion_tokens", 1, "an integer >= 1") if kind == "chat" else None
    if a is not None and b is not None and a != b:
        raise BadRequest("give max_tokens or max_completion_tokens, not two values", "max_tokens")
    n = a if a is not None else b
    return COMPLETIONS_DEFAULT_MAX_TOKENS if n is None and kind == "completion" else n


def _number(body: dict, name: str, default: float, low: float, high: float, what: str) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise BadRequest(f"{name} must be {what}, got {v!r}", name)
    if not math.isfinite(v):
        raise BadRequest(f"{name} must be {what}, got {v!r}", name)
    return float(v)


def _top_p(body: dict) -> float | None:
    v = body.get("top_p")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise BadRequest(f"top_p must be a number in (0, 1], got {v!r}", "top_p")
    return float(v)


def _seed(body: dict) -> int | None:
    v = body.get("seed")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
        raise BadRequest(f"seed must be an integer in [0, 2**63), got {v!r}", "seed")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise BadRequest(
            f"stop must be a non-empty string or an array of up to {MAX_STOPS} of them, got {v!r}",
            "stop",
        )
    return stops


def _include_usage(body: dict) -> bool:
    v = body.get("stream_options")
    if v is None:
        return False
    if not isinstance(v, dict) or not isinstance(v.get("include_usage", False), bool):
        raise BadRequest(
            'stream_options must be an object like {"include_usage": true}', "stream_options"
        )
    if not body.get("stream"):
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    return bool(v.get("include_usage", False))


def _drafter(body: dict, default: str) -> str:
    v = body.get("drafter", default)
    if v not in DRAFTERS:
        raise BadRequest(f"drafter must be one of {', '.join(DRAFTERS)}, got {v!r}", "drafter")
    return v


def _k(body: dict, default: int | str) -> int | str:
    v = body.get("k", default)
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SPECULATIVE_TOKENS:
        raise BadRequest(
            f'k must be "auto" or an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {v!r}', "k"
        )
    return v


# ----------------------------------------------------------------------------
# responses
