"""The bench's engines: one call generates from a prompt's ids and says what it took
(EngineOutput); the runner (bench/__init__) does the timing. specfast.generate, transformers'
generate() and, in llama.py, llama.cpp's own loop."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specfast.drafters.combined import CombinedDrafter
from specfast.generate import generate as specfast_generate

HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' documented default for prompt lookup


@dataclass
class EngineOutput:
    """What one engine call returns; the runner does the timing."""

    token_ids: list[int]
    target_passes: int | None = None
    mean_acceptance_length: float | None = None
    acceptance_histogram: list[int] | None = None
    prefill_seconds: float | None = None  # time to the first token (specfast engines)


Engine = Callable[[list[int]], EngineOutput]


# specfast side of "no EOS": an empty set of EOS ids, so every engine emits max_new_tokens tokens.
NO_EOS: list[int] = []


class Combined:
    """A fresh CombinedDrafter per run: it holds one sequence's n-gram index and cache. Its
    draft is a draft model or an EAGLE head."""

    def __init__(self, draft_model: Any):
        self.draft_model = draft_model


def specfast_engine(
    model: Any,
    *,
    drafter: Any,
    k: int | str,
    max_new_tokens: int,
    generate: Callable[..., Any] | None = None,
) -> Engine:
    """specfast.generate, greedy, as an engine. `generate` is injectable for tests."""
    if generate is None:
        generate = specfast_generate

    def run(ids: list[int]) -> EngineOutput:
        if isinstance(drafter, Combined):
            this_drafter: Any = CombinedDrafter(drafter.draft_model)
        else:
            this_drafter = drafter
        out = generate(
            model,
            ids,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            drafter=this_drafter,
            num_speculative_tokens=k,
            eos_token_id=NO_EOS,
        )
        s = out.stats
        hist = getattr(s, "acceptance_histogram", None)
        return EngineOutput(
            token_ids=list(out.token_ids),
            target_passes=s.target_passes,
            mean_acceptance_length=s.mean_acceptance_length,
            acceptance_histogram=list(hist) if hist is not None else None,
            prefill_seconds=s.prefill_seconds,
        )

    return run


# Forward-call counters of the transformers models the bench runs, one per model (kept here, not
# written onto the model).
_PASS_COUNTERS: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _pass_counter(model: Any) -> list[int]:
    """A counter of forward calls on `model`, installed once per model."""
    counter = _PASS_COUNTERS.get(model)
    if counter is None:
        counter = [0]
        model.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
        _PASS_COUNTERS[model] = counter
    return counter


def hf_engine(
    model: Any,
    mode: str,
    *,
    max_new_tokens: int,
    assistant: Any = None,
    prompt_lookup_num_tokens: int = HF_PROMPT_LOOKUP_TOKENS,
) -> Engine:
    """transformers generate(), greedy: mode is 'plain', 'prompt-lookup' or 'assisted'."""
    counter = _pass_counter(model)
    # An EOS id the model cannot emit: transformers then generates exactly max_new_tokens.
    no_eos = int(model.config.get_text_config().vocab_size)
    extra: dict[str, Any] = {}
    if mode == "prompt-lookup":
        extra["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    elif mode == "assisted":
        if assistant is None:
            raise ValueError("hf-assisted needs a draft model (--draft PATH)")
        extra["assistant_model"] = assistant
    elif mode != "plain":
        raise ValueError(f"unknown transformers mode {mode!r}")

    def run(ids: list[int]) -> EngineOutput:
        x = torch.tensor([ids], dtype=torch.long, device=model.device)
        counter[0] = 0
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=no_eos,
                pad_token_id=no_eos - 1,
                **extra,
            )
        new = out[0, len(ids) :].tolist()
        passes = counter[0]
        return EngineOutput(new, passes, len(new) / passes if passes else None)

    return run


def load_hf_model(path: str | Path, dtype: str, device: str) -> Any:
    """The same weights through transformers: a GGUF file (dequantized) or an HF folder."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    tdtype = getattr(torch, dtype)
    if p.is_file():
        m = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=tdtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(p, dtype=tdtype)
    return m.to(device).eval()  # type: ignore[arg-type]  # (transformers types .to oddly)


def load_hf_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    p = Path(path)
    if p.is_file():
        return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    return AutoTokenizer.from_pretrained(p)
