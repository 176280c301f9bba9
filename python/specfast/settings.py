"""One call's generation options, checked in one place for generate() and Session.send: the
prompt's token ids, sampling, EOS ids, stop strings, the streamer, the response format and
logprobs. Bad values raise ValueError or TypeError saying what is allowed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specfast.constraints import Grammar, check_response_format
from specfast.logprobs import check_logprobs
from specfast.sampling import check_sampling_params
from specfast.targets.base import Target

MAX_SPECULATIVE_TOKENS = 64


def check_k(num_speculative_tokens) -> int | None:
    """Returns the fixed k, or None for "auto"."""
    if num_speculative_tokens == "auto":
        return None
    k = num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f'num_speculative_tokens must be "auto" or an int, got {k!r}')
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] or 'auto', got {k}"
        )
    return k


def prompt_to_ids(prompt, tokenizer, vocab_size: int, device: torch.device) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a str prompt needs a tokenizer: pass tokenizer= or token ids")
        ids = encode_text(tokenizer, prompt)
    elif isinstance(prompt, torch.Tensor):
        if prompt.dtype in (torch.bool,) or prompt.dtype.is_floating_point or prompt.is_complex():
            raise TypeError(f"a tensor prompt must hold integer token ids, got {prompt.dtype}")
        if prompt.device.type != device.type:
            raise ValueError(
                f"prompt is on {prompt.device} but the model is on {device}; move it first"
            )
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise ValueError(f"a tensor prompt must be 1-D (or (1, T)), got {tuple(prompt.shape)}")
        ids = prompt.tolist()
    elif isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(
                f"a numpy prompt must be 1-D integers, got {prompt.dtype} {prompt.shape}"
            )
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"prompt ids must be ints, got {type(t).__name__}: {t!r}")
        ids = [int(t) for t in ids]
    else:
        raise TypeError(
            f"prompt must be a str, a list of ints or a 1-D integer tensor, got {type(prompt)}"
        )
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt ids must be in [0, {vocab_size}); got {bad[:5]}")
    return ids


def encode_text(tokenizer, text: str) -> list[int]:
    enc = tokenizer.encode(text)
    return list(enc.ids) if hasattr(enc, "ids") else list(enc)


@dataclass
class Settings:
    """One call's checked generation options (generate(), or one Session.send)."""

    max_new_tokens: int
    sampling: tuple[int, dict] | None  # None for greedy, else (seed, logits_to_probs keywords)
    seed: int
    params: dict
    eos_ids: set[int]
    stops: list[str]
    streamer: Any
    tokenizer: Any
    vocab_size: int
    device: torch.device
    grammar: Grammar | None = None  # response_format's, checked and compiled
    logprobs: int | None = None  # None: off; else how many alternatives each token gets


def check_settings(
    target: Target,
    tokenizer,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: str | Sequence[str] | None = None,
    streamer: Any = None,
    ignore_eos: bool = False,
    response_format: Any = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> Settings:
    """Checks generate()'s per-call options; ValueError/TypeError say what is allowed."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    params: dict[str, Any] = dict(
        temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0, min_p=min_p or 0.0
    )
    if top_p == 0:
        params["top_p"] = 0.0  # `or` would turn it into "off"; let the check refuse it
    check_sampling_params(**params)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
    if seed is not None and not 0 <= seed < 2**64:
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed}")
    eos_ids = _eos_ids(eos_token_id, target, ignore_eos)
    stops = _stop_strings(stop_strings, tokenizer)
    grammar = check_response_format(response_format, tokenizer, target.vocab_size, eos_ids)
    top = check_logprobs(logprobs, top_logprobs)
    seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    sampling = None if temperature == 0 else (seed, params)
    return Settings(
        max_new_tokens,
        sampling,
        seed,
        params,
        eos_ids,
        stops,
        streamer,
        tokenizer,
        target.vocab_size,
        target.device,
        grammar,
        top,
    )


def _eos_ids(eos_token_id, target: Target, ignore_eos: bool) -> set[int]:
    if ignore_eos:
        return set()
    if eos_token_id is None:
        return set(target.eos_token_ids)
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"eos_token_id must be an int or a list of ints, got {t!r}")
    return set(ids)


def _stop_strings(stop_strings, tokenizer) -> list[str]:
    if stop_strings is None:
        return []
    stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
    if stops and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer: pass tokenizer= or use eos_token_id")
    return stops
