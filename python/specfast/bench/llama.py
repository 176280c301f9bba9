"""Bench engines over llama.cpp (`specfast bench --backend llama.cpp`).

- `llama.cpp-plain`: llama-cpp-python's own loop, `Llama.generate` with temp=0 (its greedy
  sampler), one llama_decode per token.
- `llama.cpp-lookup`: the same loop with its `LlamaPromptLookupDecoding` draft model (its
  defaults, max_ngram_size=2, num_pred_tokens=10), on a second Llama: a draft model forces
  logits_all.
- `specfast-llama-plain`, `-ngram`, `-draft`, `-eagle`: specfast.generate over the same Llama
  object (drafter None, "ngram", a draft Llama, an EAGLE-3 head reading llama.cpp's layer inputs).

EOS never stops an engine: Llama.generate does not stop on EOS itself and specfast runs with
eos_token_id=[]. Each engine records the time to its first token (prefill_seconds), so the
decode rate (tokens after the first over the time after the first) is comparable across them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from specfast.bench.engines import EngineOutput, specfast_engine
from specfast.drafters.eagle.files import load_eagle
from specfast.targets import LayerInputs, check_llama_build, llama_threads, tile_restorer

LLAMA_ENGINES = (
    "llama.cpp-plain",
    "llama.cpp-lookup",
    "specfast-llama-plain",
    "specfast-llama-ngram",
)
LLAMA_DRAFT_ENGINES = ("specfast-llama-draft",)  # added by --draft
# opt-in (--engines): an EAGLE-3 head (--eagle PATH, default the shipped one) over the Llama
LLAMA_EAGLE_ENGINES = ("specfast-llama-eagle",)
LLAMA_ALL = (*LLAMA_ENGINES, *LLAMA_DRAFT_ENGINES, *LLAMA_EAGLE_ENGINES)
LOOKUP_TOKENS = 10  # LlamaPromptLookupDecoding's default num_pred_tokens
# Big enough for the longest workload prompt plus its new tokens. The lookup engine's Llama
# keeps an (n_ctx, V) float32 score array (400 MB for SmolLM2 at 2048), so not more than needed.
BENCH_N_CTX = 2048


def load_llamas(
    model_path: Path,
    wanted: list[str],
    draft_path: Path | None,
    n_ctx: int = BENCH_N_CTX,
    n_threads: int | None = None,
) -> dict[str, Any]:
    """The Llama objects the wanted engines need: 'target', 'lookup', 'draft'. n_threads=None
    keeps Llama's defaults (half the cores for single tokens, all of them for batches)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    check_llama_build()  # before any Llama: loading one runs the build's kernels

    def load(path: Path, **kw):
        if n_threads is not None:
            kw |= {"n_threads": n_threads, "n_threads_batch": n_threads}
        return Llama(model_path=str(path), n_ctx=n_ctx, verbose=False, **kw)

    out: dict[str, Any] = {}
    if any(e != "llama.cpp-lookup" for e in wanted if e in LLAMA_ALL):
        out["target"] = load(model_path)
    if "llama.cpp-lookup" in wanted:
        lookup = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
        # logits_all=True by hand: with a draft model Llama turns it on for eval but sizes its
        # score array by the argument (n_batch rows), and prompts past n_batch then overflow it.
        out["lookup"] = load(model_path, draft_model=lookup, logits_all=True)
    if "specfast-llama-draft" in wanted:
        if draft_path is None:
            raise ValueError("specfast-llama-draft needs a draft model (--draft PATH)")
        out["draft"] = load(draft_path)
    return out


def llama_cpp_engine(llama: Any, *, max_new_tokens: int):
    """Llama.generate, greedy, as an engine; counts its target passes (llama.eval calls)."""
    passes = [0]
    real_eval = llama.eval
    restore_tiles, threads = tile_restorer(), llama_threads(llama)

    def counting_eval(tokens):
        passes[0] += 1
        if restore_tiles is not None:  # as specfast's loop does: the torch engines ran between
            restore_tiles(threads)
        return real_eval(tokens)

    llama.eval = counting_eval  # Llama.generate calls self.eval once per pass

    def run(ids: list[int]) -> EngineOutput:
        llama.reset()  # no prompt reuse from the previous run: every engine prefills
        passes[0] = 0
        t0 = time.perf_counter()
        first = None
        out: list[int] = []
        for token in llama.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter() - t0
            out.append(int(token))
            if len(out) >= max_new_tokens:
                break
        n = passes[0]
        return EngineOutput(
            token_ids=out,
            target_passes=n,
            mean_acceptance_length=len(out) / n if n else None,
            prefill_seconds=first,
        )

    return run


def build_llama_engines(
    wanted: list[str],
    llamas: dict[str, Any],
    *,
    k: int | str,
    max_new_tokens: int,
    eagle: str | None = None,
) -> dict[str, Any]:
    """The wanted llama.cpp engines over `llamas` (load_llamas); `eagle`: the head folder of
    specfast-llama-eagle (None: the shipped one)."""
    n = max_new_tokens
    engines: dict[str, Any] = {}
    for e in wanted:
        if e == "llama.cpp-plain":
            engines[e] = llama_cpp_engine(llamas["target"], max_new_tokens=n)
        elif e == "llama.cpp-lookup":
            engines[e] = llama_cpp_engine(llamas["lookup"], max_new_tokens=n)
        elif e == "specfast-llama-plain":
            engines[e] = specfast_engine(llamas["target"], drafter=None, k=k, max_new_tokens=n)
        elif e == "specfast-llama-ngram":
            engines[e] = specfast_engine(llamas["target"], drafter="ngram", k=k, max_new_tokens=n)
        elif e == "specfast-llama-eagle":
            head = load_eagle(eagle, llamas["target"])
            run = specfast_engine(llamas["target"], drafter=head, k=k, max_new_tokens=n)
            engines[e] = _then_plain_graph(run, llamas["target"])
        elif e == "specfast-llama-draft":
            engines[e] = specfast_engine(
                llamas["target"], drafter=llamas["draft"], k=k, max_new_tokens=n
            )
    return engines


def _then_plain_graph(run, llama):
    """`run`, after which the Llama's layer inputs are off again: the engines that share the
    Llama (llama.cpp-plain's own loop among them) run llama.cpp's plain graph."""

    def wrapped(ids):
        try:
            return run(ids)
        finally:
            LayerInputs(llama, ())

    return wrapped


def llama_meta(llamas: dict[str, Any]) -> dict[str, Any]:
    """What the JSON should say about the llama.cpp side: version, threads, context."""
    import llama_cpp

    target = llamas.get("target") or llamas.get("lookup")
    meta: dict[str, Any] = {"llama_cpp_python": llama_cpp.__version__}
    if target is not None:
        meta |= {
            "llama_n_threads": target.n_threads,
            "llama_n_threads_batch": target.n_threads_batch,
            "llama_n_ctx": target.n_ctx(),
            "llama_n_batch": target.n_batch,
            "llama_system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        }
    return meta
