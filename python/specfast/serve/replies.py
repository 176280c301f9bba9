"""OpenAI's reply shapes: a whole completion, a streamed chunk, the usage chunk, and
specfast's own statistics beside them."""

from __future__ import annotations

from typing import Any

from specfast.serve.protocol import Request

FINISH = {"eos": "stop", "stop_string": "stop", "length": "length"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def specfast_stats(stats) -> dict[str, Any]:
    """The `specfast` object of a response: what speculation did for this request."""
    return {
        "target_passes": stats.target_passes,
        "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "forced_tokens": stats.forced_tokens,
        "reused_prompt_tokens": stats.reused_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "prefill_seconds": round(stats.prefill_seconds, 6),
        "seconds": round(stats.seconds, 6),
    }


def _head(req: Request, chunk: bool) -> dict[str, Any]:
    if req.kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model}


def completion(
    req: Request, text: str, finish: str, n_prompt: int, n_new: int, stats, logprobs=None
) -> dict:
    """The whole response of a request that did not stream."""
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": FINISH[finish],
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": FINISH[finish]}
    return {
        **_head(req, False),
        "choices": [choice],
        "usage": usage(n_prompt, n_new),
        "specfast": specfast_stats(stats),
    }


def chunk(
    req: Request, text: str | None = None, finish: str | None = None, first=False, logprobs=None
) -> dict:
    """One streamed chunk: a text delta (with its tokens' logprobs), or the last one."""
    reason = FINISH[finish] if finish else None
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
    return {**_head(req, True), "choices": [choice]}


def usage_chunk(req: Request, n_prompt: int, n_new: int, stats) -> dict:
    """The chunk after the last one when stream_options.include_usage asks for it."""
    return {
        **_head(req, True),
        "choices": [],
        "usage": usage(n_prompt, n_new),
        "specfast": specfast_stats(stats),
    }
