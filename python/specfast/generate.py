"""The speculative decoding loop: propose, verify in one target pass, accept, roll back.

A round is: drafter.extend(committed) -> drafter.propose(k) -> target forward over
[last, d1..dk] -> acceptance -> KV rollback. The target's cache always holds every committed
token but the last; that one is fed at the start of the next round, as in gpt-fast. With no
proposal a round is exactly one step of plain decoding, so `drafter=None` is the fair baseline:
the same loop, the same runtime, no speculation.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specfast._core import accept_greedy, accept_sampled
from specfast.drafters import make_drafter
from specfast.drafters.base import Verified, feature_layers
from specfast.drafters.model import common_tokens
from specfast.sampling import (
    accept_sampled_torch,
    check_sampling_params,
    logits_to_probs,
    position_uniforms,
    sample_rows,
)
from specfast.targets import as_target, make_decoder
from specfast.targets.base import Decoder, Target, to_device
from specfast.targets.torch.int8 import torch_threads

MAX_SPECULATIVE_TOKENS = 64


@dataclass
class GenerationStats:
    """What a generate() call did. `mean_acceptance_length` is vLLM's: 1 + accepted / steps."""

    target_passes: int = 0  # every target forward, prefill included
    draft_tokens: int = 0  # tokens proposed and verified
    accepted_tokens: int = 0  # proposed tokens that were committed
    acceptance_histogram: list[int] = field(default_factory=list)  # [n] = rounds accepting n
    new_tokens: int = 0
    seconds: float = 0.0  # wall time, prefill included
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0  # tokens run through the target before the first new token
    reused_tokens: int = 0  # tokens already in the cache (a Session's earlier turns)

    @property
    def decode_steps(self) -> int:
        return max(self.target_passes - 1, 0)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.decode_steps if self.decode_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "target_passes": self.target_passes,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_histogram": list(self.acceptance_histogram),
            "new_tokens": self.new_tokens,
            "tokens_per_second": self.tokens_per_second,
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "prefill_tokens": self.prefill_tokens,
            "reused_tokens": self.reused_tokens,
        }


@dataclass
class GenerateOutput:
    token_ids: list[int]  # new tokens only
    text: str | None
    stats: GenerationStats
    finish_reason: str  # "length" | "eos" | "stop_string"


# ----------------------------------------------------------------------------
# argument checking


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


def _is_messages(prompt) -> bool:
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


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------
# the loop


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
    )


def generate(
    model,
    prompt,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: str | Sequence[str] | None = None,
    streamer: Any = None,
    drafter: Any = "ngram",
    num_speculative_tokens: int | str = "auto",
    tokenizer: Any = None,
    ignore_eos: bool = False,
    draft_vocabulary: int | str | None = "auto",
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens; greedy output is what the model alone gives.

    `model` is a specfast model (load_model) or a transformers causal LM. `drafter` is "ngram",
    None (plain decoding in the same loop), an NgramDrafter, or a draft model sharing the
    target's vocabulary. `streamer` is a transformers-style streamer (`put`/`end`) or a callable
    that receives text as tokens are committed. `ignore_eos` keeps going past EOS (benchmarks).
    `draft_vocabulary` (a specfast draft model only): the draft proposes from its N lowest token
    ids plus the sequence's own tokens; "auto" = 32768 for vocabularies over 65536, None = all.
    A call is a one-turn Session: it prefills the whole prompt into a fresh cache.
    """
    fixed_k = check_k(num_speculative_tokens)
    target = as_target(model)
    tokenizer = tokenizer if tokenizer is not None else target.tokenizer
    vocab_size, max_context = target.vocab_size, target.max_context
    common_tokens(draft_vocabulary, vocab_size)  # checked even when no draft model uses it
    settings = check_settings(
        target,
        tokenizer,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        eos_token_id=eos_token_id,
        stop_strings=stop_strings,
        streamer=streamer,
        ignore_eos=ignore_eos,
    )
    if _is_messages(prompt):  # chat messages: the model's own chat template, as pipelines do
        prompt = render_chat(prompt, target.chat_template)
    prompt_ids = prompt_to_ids(prompt, tokenizer, vocab_size, target.device)
    if len(prompt_ids) + max_new_tokens > max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {max_context} tokens{target.context_hint}"
        )
    the_drafter = make_drafter(
        drafter,
        target=target,
        fixed_k=fixed_k,
        max_length=len(prompt_ids) + max_new_tokens,
        seed=settings.seed,
        params=settings.params,
        vocabulary=draft_vocabulary,
        eos_ids=sorted(settings.eos_ids),
    )
    start = time.perf_counter()
    with torch.inference_mode():
        decoder = make_decoder(target, len(prompt_ids) + max_new_tokens)
        return run_turn(decoder, the_drafter, prompt_ids, 0, settings, fixed_k, start=start)


def run_turn(
    decoder: Decoder,
    drafter,
    ids: list[int],
    indexed: int,
    settings: Settings,
    fixed_k: int | None,
    start: float | None = None,
) -> GenerateOutput:
    """Continues `ids` (the whole context) by one reply. The decoder holds `ids[:decoder.length]`
    and the drafter `ids[:indexed]`; the rest is prefilled here, then rounds run to the end.
    Returns with the cache holding every committed token but the last, as a round leaves it."""
    start = time.perf_counter() if start is None else start
    stats = GenerationStats(acceptance_histogram=[0] * ((fixed_k or MAX_SPECULATIVE_TOKENS) + 1))
    s = settings
    emit = _Emitter(s.streamer, s.tokenizer, ids, s.eos_ids, s.stops, s.max_new_tokens)
    drafter.start_turn(s.seed, s.params if s.sampling is not None else None)
    # A decoder may ask for torch on fewer threads (an int8 model's, whose core keeps a helper
    # thread spinning on the second core through a generation).
    threads = decoder.torch_threads or torch.get_num_threads()
    with torch.inference_mode(), torch_threads(threads):
        reused = decoder.length
        new = torch.tensor(ids[reused:], dtype=torch.long, device=s.device)
        logits, features = _forward(decoder, new, feature_layers(drafter), last_only=True)
        first = _choose(logits, [], None, 0, s.sampling)
        stats.target_passes = 1
        stats.prefill_tokens, stats.reused_tokens = len(ids) - reused, reused
        stats.prefill_seconds = time.perf_counter() - start
        emit.commit(*first)
        drafter.extend(ids[indexed:])
        drafter.extend(emit.token_ids)
        drafter.prefill(features)  # a draft model reads the prompt now, not in round one
        while not emit.done:
            speculate(decoder, drafter, emit, s, stats)
    stats.seconds = time.perf_counter() - start
    stats.new_tokens = len(emit.token_ids)
    emit.end()
    if fixed_k is None:
        # Trim the histogram to the longest run seen so "auto" output stays readable.
        last = max((i for i, n in enumerate(stats.acceptance_histogram) if n), default=0)
        stats.acceptance_histogram = stats.acceptance_histogram[: last + 1]
    text = _decode(s.tokenizer, emit.token_ids) if s.tokenizer is not None else None
    return GenerateOutput(emit.token_ids, text, stats, emit.finish_reason)


def speculate(
    decoder: Decoder, drafter, emit: _Emitter, settings: Settings, stats: GenerationStats
):
    """One round: propose, verify [last, *draft] in one target pass, accept, roll back the
    rejected rows, commit, tell the drafter. The same for every drafter (drafters/)."""
    budget = emit.max_new_tokens - len(emit.token_ids) - 1  # proposals past this are wasted
    t0 = time.perf_counter()
    proposal = drafter.propose(budget)
    draft = proposal.tokens
    if draft:
        _check_draft(draft, settings.vocab_size)
    t1 = time.perf_counter()
    proposal.seconds = t1 - t0
    tokens = [emit.token_ids[-1], *draft]
    sampling = settings.sampling
    q = proposal.q if sampling is not None and draft else None
    layers = feature_layers(drafter)
    cold = cold_passes(decoder)
    out, logits, features = _verify(
        decoder, tokens, draft, q, len(emit.token_ids), sampling, settings.device, layers
    )
    seconds: float | None = time.perf_counter() - t1
    n_accepted = len(out) - 1
    if features is not None:
        features = features[: n_accepted + 1]
    verified = Verified(logits, n_accepted + 1, features)
    if cold_passes(decoder) != cold:
        # The pass compiled a graph: seconds where a pass takes milliseconds, no measure of what
        # a pass of that length costs. The drafter gets no time (auto k keeps the acceptance).
        seconds = None
    drafter.observe(proposal, n_accepted, seconds, verified)
    # Keep [last, accepted drafts] in the cache; the new token goes in next round.
    decoder.rollback(decoder.length - len(draft) + n_accepted)
    committed = emit.commit(*out)
    stats.target_passes += 1
    stats.draft_tokens += len(draft)
    stats.accepted_tokens += min(n_accepted, committed)
    stats.acceptance_histogram[n_accepted] += 1
    drafter.extend(emit.token_ids[-committed:])


def cold_passes(decoder: Decoder) -> int:
    """How many of the decoder's passes so far compiled a graph or recorded a CUDA graph (a
    compiled target's first passes of a shape): the round's one place that reads it."""
    return decoder.cold_passes


def _verify(decoder, tokens, draft, q, pos, sampling, device, layers=None):
    """One target pass over tokens = [last, *draft] -> (tokens it commits, its logits or None,
    the features of `layers` for every row or None).

    Greedy: the argmax of every row is taken inside the step (a compiled step's graph) and the
    k+1 ids are the round's one device-to-host copy (`greedy_ids`: lists in and out, so
    llama.cpp's decoder needs no torch call); the accepted count is their leading run of
    matches, counted on the host (O(k)). Sampling needs the logits."""
    if sampling is None and layers is None:
        return accept_greedy(draft, decoder.greedy_ids(tokens)), None, None
    ids = to_device(tokens, device)  # no blocking upload: the ids coming back are the one sync
    if sampling is None:
        top, features = decoder.forward_greedy(ids, features=layers)
        return accept_greedy(draft, top.tolist()), None, features
    logits, features = _forward(decoder, ids, layers)  # (1 + len(draft), V)
    return _choose(logits, draft, q, pos, sampling), logits, features


def _forward(decoder, ids, layers, last_only=False):
    """decoder.forward -> (logits, features of `layers` or None). Only decoders that can give
    features (specfast's Decoder, LlamaDecoder) are asked for them; make_drafter checks that."""
    if layers is None:
        return decoder.forward(ids, last_only=last_only), None
    return decoder.forward(ids, last_only=last_only, features=layers)


def _choose(logits, draft, q, pos, sampling) -> list[int]:
    """The tokens one target pass commits: accepted drafts plus the target's own token.

    `pos` is the absolute output position of the pass's first row; `sampling` is None for
    greedy, else (seed, logits_to_probs keyword arguments).
    """
    if sampling is None:
        return accept_greedy(draft, logits.argmax(dim=-1).tolist())  # one sync: k+1 ids
    seed, params = sampling
    probs = logits_to_probs(logits, **params)  # (k+1, V) float32, on the model's device
    if q is None:
        # One-hot drafts (n-gram, or none): draw every row's token from p with the uniform of
        # its absolute position, and keep drafts while they equal the draw. Accepting d with
        # probability p(d) and otherwise drawing from p with d removed is the residual rule
        # for a one-hot q, so this is exact; and because a position's draw never depends on k,
        # a seed gives the very text plain sampling gives, with or without speculation.
        return accept_greedy(
            draft, sample_rows(probs, position_uniforms(seed, pos, len(probs))).tolist()
        )
    # A draft model's q: the ratio test and the residual max(0, p - q), one seed per round.
    round_seed = int(position_uniforms(seed ^ 0x5EED, pos, 1)[0] * 2**53)
    if probs.device.type == "cpu":
        return accept_sampled(probs.numpy(), draft, q.float().numpy(), seed=round_seed)
    return accept_sampled_torch(probs, draft, q, seed=round_seed)


def _check_draft(draft: list[int], vocab_size: int) -> None:
    # Checked here, on the host, so the decoder need not sync to check ids on an accelerator.
    for t in draft:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"the drafter proposed {t!r}; ids must be ints in [0, {vocab_size})")


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


class _Emitter:
    """Commits tokens one at a time: EOS, stop strings and max_new_tokens cut inside a block."""

    def __init__(self, streamer, tokenizer, prompt_ids, eos_ids, stops, max_new_tokens):
        self.streamer, self.tokenizer = streamer, tokenizer
        self.eos_ids, self.stops, self.max_new_tokens = eos_ids, stops, max_new_tokens
        self.token_ids: list[int] = []
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

    def commit(self, *tokens: int) -> int:
        """Commits tokens until one ends the generation; returns how many were committed."""
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
        self._stream(self.token_ids[len(self.token_ids) - n :])
        return n

    def _stop_in_tail(self) -> bool:
        # Checked after every token, so a stop string found here has just been completed.
        tail = _decode(self.tokenizer, self.token_ids[-self._stop_window :])
        return any(s in tail for s in self.stops)

    def _stream(self, new: list[int]) -> None:
        if self.streamer is None or not new:
            return
        if hasattr(self.streamer, "put"):
            self.streamer.put(torch.tensor(new))
        else:
            self.streamer(self._pop_text())

    def _pop_text(self) -> str:
        text = _decode(self.tokenizer, self.token_ids) if self.tokenizer is not None else ""
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
            text = _decode(self.tokenizer, self.token_ids)
            if len(text) > len(self._sent):
                self.streamer(text[len(self._sent) :])


# ----------------------------------------------------------------------------
# chat templates


def render_chat(
    messages: Sequence[dict], chat_template: str | None = None, add_generation_prompt: bool = True
) -> str:
    """Render chat messages with the model's Jinja template, or a built-in ChatML fallback.

    The template comes from the model file, so it is rendered in jinja2's immutable sandbox:
    a template can format text but cannot call into Python. Without a template (or without
    jinja2) we fall back to plain ChatML, which is what SmolLM2 and Qwen2.5 use; the only
    difference for SmolLM2 is its default system line.
    """
    template = _compiled_template(chat_template) if chat_template else None
    if template is not None:
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token="",
            eos_token="",
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
    return env.from_string(chat_template)
