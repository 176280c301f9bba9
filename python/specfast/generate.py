"""The speculative decoding loop: propose, verify in one target pass, accept, roll back.

A round is: drafter.extend(committed) -> drafter.propose(k) -> target forward over
[last, d1..dk] -> acceptance -> KV rollback. The target's cache always holds every committed
token but the last; that one is fed at the start of the next round, as in gpt-fast. With no
proposal a round is exactly one step of plain decoding, so `drafter=None` is the fair baseline:
the same loop, the same runtime, no speculation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from specfast._core import accept_greedy
from specfast.chat import is_messages, render_chat
from specfast.constraints import Constraint
from specfast.drafters import make_drafter
from specfast.drafters.base import DraftSetup, Verified, feature_layers
from specfast.drafters.model import common_tokens
from specfast.hardware import torch_threads
from specfast.logprobs import committed_logprobs
from specfast.sampling import choose_tokens
from specfast.settings import (
    MAX_SPECULATIVE_TOKENS,
    Settings,
    check_k,
    check_settings,
    prompt_to_ids,
)
from specfast.stats import GenerateOutput, GenerationStats
from specfast.streaming import Emitter, decode
from specfast.targets import as_target, make_decoder
from specfast.targets.base import Decoder, to_device


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
    response_format: Any = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> GenerateOutput:
    """Generates up to `max_new_tokens` tokens; greedy output is what the model alone gives.

    `model` is a specfast model (load_model) or a transformers causal LM. `drafter` is "ngram",
    None (plain decoding in the same loop), an NgramDrafter, or a draft model sharing the
    target's vocabulary. `streamer` is a transformers-style streamer (`put`/`end`) or a callable
    that receives text as tokens are committed. `ignore_eos` keeps going past EOS (benchmarks).
    `draft_vocabulary` (a specfast draft model only): the draft proposes from its N lowest token
    ids plus the sequence's own tokens; "auto" = 32768 for vocabularies over 65536, None = all.
    `response_format` constrains the reply to a grammar (constraints.py): {"type": "json_object"},
    OpenAI's {"type": "json_schema", "json_schema": {"schema": {...}}}, {"type": "regex",
    "regex": ...} or {"type": "grammar", "grammar": <lark>}; greedy output is then the masked
    argmax at every position, with or without speculation.
    `logprobs=True` returns each new token's log-probability under the target in `out.logprobs`,
    and `top_logprobs=N` (0-20) its position's N most likely tokens in `out.top_logprobs`: the
    log-softmax of the target's logits (masked by response_format, if any) before temperature
    and the filters, read from the verify pass, so the numbers are plain decoding's (logprobs.py).
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
        response_format=response_format,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    if is_messages(prompt):  # chat messages: the model's own chat template, as pipelines do
        prompt = render_chat(prompt, target.chat_template)
    prompt_ids = prompt_to_ids(prompt, tokenizer, vocab_size, target.device)
    if len(prompt_ids) + max_new_tokens > max_context:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {max_context} tokens{target.context_hint}"
        )
    setup = DraftSetup(
        target,
        fixed_k,
        len(prompt_ids) + max_new_tokens,
        settings.seed,
        settings.params,
        draft_vocabulary,
        tuple(sorted(settings.eos_ids)),
    )
    the_drafter = make_drafter(drafter, setup)
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
    s = settings
    constraint = Constraint(s.grammar) if s.grammar is not None else None
    # Forced tokens lengthen a constrained round's draft past k: count runs up to the cap.
    longest = fixed_k if fixed_k is not None and constraint is None else MAX_SPECULATIVE_TOKENS
    stats = GenerationStats(acceptance_histogram=[0] * (longest + 1))
    emit = Emitter(s.streamer, s.tokenizer, ids, s.eos_ids, s.stops, s.max_new_tokens, s.logprobs)
    drafter.start_turn(s.seed, s.params if s.sampling is not None else None)
    # A decoder may ask for torch on fewer threads (an int8 model's, whose core keeps a helper
    # thread spinning on the second core through a generation).
    threads = decoder.torch_threads or torch.get_num_threads()
    with torch.inference_mode(), torch_threads(threads):
        reused = decoder.length
        new = torch.tensor(ids[reused:], dtype=torch.long, device=s.device)
        logits, features = _forward(decoder, new, feature_layers(drafter), last_only=True)
        if constraint is not None:  # the first token is the grammar's too
            logits = constraint.plan([], None, 0).mask(logits)
        first = choose_tokens(logits, [], None, 0, s.sampling)
        stats.target_passes = 1
        stats.prefill_tokens, stats.reused_tokens = len(ids) - reused, reused
        stats.prefill_seconds = time.perf_counter() - start
        emit.commit(*first, rows=committed_logprobs(logits, first, s.logprobs))
        if constraint is not None:
            constraint.commit(emit.token_ids)
        drafter.extend(ids[indexed:])
        drafter.extend(emit.token_ids)
        drafter.prefill(features)  # a draft model reads the prompt now, not in round one
        while not emit.done:
            speculate(decoder, drafter, emit, s, stats, constraint)
    stats.seconds = time.perf_counter() - start
    stats.new_tokens = len(emit.token_ids)
    emit.end()
    if longest != fixed_k:
        # Trim the histogram to the longest run seen so "auto" output stays readable.
        last = max((i for i, n in enumerate(stats.acceptance_histogram) if n), default=0)
        stats.acceptance_histogram = stats.acceptance_histogram[: last + 1]
    text = decode(s.tokenizer, emit.token_ids) if s.tokenizer is not None else None
    return GenerateOutput(
        emit.token_ids, text, stats, emit.finish_reason, emit.logprobs, emit.top_logprobs
    )


def speculate(
    decoder: Decoder,
    drafter,
    emit: Emitter,
    settings: Settings,
    stats: GenerationStats,
    constraint: Constraint | None = None,
):
    """One round: propose, verify [last, *draft] in one target pass, accept, roll back the
    rejected rows, commit, tell the drafter. The same for every drafter (drafters/). Under a
    grammar the draft is cut where the grammar refuses it, the tokens it forces are appended,
    and every row is masked (constraints.py says why that is exact)."""
    budget = emit.max_new_tokens - len(emit.token_ids) - 1  # proposals past this are wasted
    t0 = time.perf_counter()
    proposal = drafter.propose(budget)
    draft = proposal.tokens
    if draft:
        _check_draft(draft, settings.vocab_size)
    t1 = time.perf_counter()
    proposal.seconds = t1 - t0
    sampling = settings.sampling
    q = proposal.q if sampling is not None and draft else None
    plan = None
    if constraint is not None:
        plan = constraint.plan(draft, q, min(budget, MAX_SPECULATIVE_TOKENS))
        draft, q = plan.tokens, plan.q
    tokens = [emit.token_ids[-1], *draft]
    layers = feature_layers(drafter)
    cold = cold_passes(decoder)
    out, logits, features = _verify(
        decoder, tokens, draft, q, len(emit.token_ids), sampling, settings.device, layers, plan,
        want_logits=settings.logprobs is not None,
    )  # fmt: skip
    seconds: float | None = time.perf_counter() - t1
    n_accepted = len(out) - 1
    if features is not None:
        features = features[: n_accepted + 1]
    verified = Verified(logits, n_accepted + 1, features)
    if cold_passes(decoder) != cold:
        # The pass compiled a graph: seconds where a pass takes milliseconds, no measure of what
        # a pass of that length costs. The drafter gets no time (auto k keeps the acceptance).
        seconds = None
    own = n_accepted
    if plan is not None:
        # The drafter hears of its own tokens only, and a pass the grammar cut or lengthened is
        # no price for the length the drafter chose.
        own = min(n_accepted, plan.proposed)
        seconds = seconds if len(draft) == len(proposal.tokens) else None
        stats.forced_tokens += plan.forced
    drafter.observe(proposal, own, seconds, verified)
    # Keep [last, accepted drafts] in the cache; the new token goes in next round.
    decoder.rollback(decoder.length - len(draft) + n_accepted)
    committed = emit.commit(*out, rows=committed_logprobs(logits, out, settings.logprobs))
    if constraint is not None:
        constraint.commit(emit.token_ids[-committed:])
    stats.target_passes += 1
    stats.draft_tokens += len(draft)
    stats.accepted_tokens += min(n_accepted, committed)
    stats.acceptance_histogram[n_accepted] += 1
    drafter.extend(emit.token_ids[-committed:])


def cold_passes(decoder: Decoder) -> int:
    """How many of the decoder's passes so far compiled a graph or recorded a CUDA graph (a
    compiled target's first passes of a shape): the round's one place that reads it."""
    return decoder.cold_passes


def _verify(
    decoder, tokens, draft, q, pos, sampling, device, layers=None, plan=None, want_logits=False
):
    """One target pass over tokens = [last, *draft] -> (tokens it commits, its logits or None,
    the features of `layers` for every row or None).

    Greedy: the argmax of every row is taken inside the step (a compiled step's graph) and the
    k+1 ids are the round's one device-to-host copy (`greedy_ids`: lists in and out, so
    llama.cpp's decoder needs no torch call); the accepted count is their leading run of
    matches, counted on the host (O(k)). Sampling needs the logits, and so does a grammar: its
    masks (`plan`) are applied to every row before the argmax or the sampling transforms, and
    logprobs (`want_logits`) read every row; without them the logits never leave the step."""
    fast = sampling is None and plan is None and not want_logits  # greedy ids are all it needs
    if fast and layers is None:
        return accept_greedy(draft, decoder.greedy_ids(tokens)), None, None
    ids = to_device(tokens, device)  # no blocking upload: the ids coming back are the one sync
    if fast:
        top, features = decoder.forward_greedy(ids, features=layers)
        return accept_greedy(draft, top.tolist()), None, features
    logits, features = _forward(decoder, ids, layers)  # (1 + len(draft), V)
    if plan is not None:
        logits = plan.mask(logits)
    return choose_tokens(logits, draft, q, pos, sampling), logits, features


def _forward(decoder, ids, layers, last_only=False):
    """decoder.forward -> (logits, features of `layers` or None). Only decoders that can give
    features (specfast's Decoder, LlamaDecoder) are asked for them; make_drafter checks that."""
    if layers is None:
        return decoder.forward(ids, last_only=last_only), None
    return decoder.forward(ids, last_only=last_only, features=layers)


def _check_draft(draft: list[int], vocab_size: int) -> None:
    # Checked here, on the host, so the decoder need not sync to check ids on an accelerator.
    for t in draft:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"the drafter proposed {t!r}; ids must be ints in [0, {vocab_size})")
