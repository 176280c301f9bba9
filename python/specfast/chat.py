"""Chat messages: telling them from other prompts, and rendering them with the model's template."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence


def is_messages(prompt) -> bool:
    """True for a list of chat messages; a malformed one is a TypeError naming the form."""
    if not isinstance(prompt, (list, tuple)) or not prompt or not isinstance(prompt[0], dict):
        return False
    for m in prompt:
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise TypeError(
                f'chat messages must be dicts like {{"role": "user", "content": "..."}}, got {m!r}'
            )
    return True


def render_chat(
    messages: Sequence[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> str:
    """Render chat messages with the model's Jinja template, or a built-in ChatML fallback.

    The template comes from the model file, so it is rendered in jinja2's immutable sandbox:
    a template can format text but cannot call into Python. Without a template (or without
    jinja2) we fall back to plain ChatML, which is what SmolLM2 and Qwen2.5 use; the only
    difference for SmolLM2 is its default system line. `tools` (OpenAI's function list) is
    passed to the template as `tools`, as transformers' apply_chat_template does; the ChatML
    fallback ignores it.
    """
    template = _compiled_template(chat_template) if chat_template else None
    if template is not None:
        extra = {} if tools is None else {"tools": tools}
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token="",
            **extra,
        )
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@functools.lru_cache(maxsize=8)
def _compiled_template(chat_template: str):
    """The template compiled once per process (a Session renders it every turn; compiling a
    real template costs milliseconds), or None without jinja2."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # transformers' `tojson` and `raise_exception`: templates are written against them (jinja2's
    # own tojson sorts keys and escapes <, > and &, so a tool call would render other text than
    # the model was trained on and wrote).
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(chat_template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str):
    raise ValueError(f"the chat template refuses these messages: {message}")
