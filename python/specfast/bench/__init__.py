"""Side-by-side benchmark: specfast against transformers, interleaved in one process.

Method (docs/benchmarks.md §1): one model, dtype, machine, prompt set; each prompt runs every engine
in turn (the order rotates each repeat), after one warm-up run per engine. A figure is a median:
per prompt over repeats, then per workload kind over prompts. Speedups are per-prompt ratios, then
their median, never one number across workload kinds.

Every engine generates exactly `max_new_tokens` tokens, greedy. EOS is disabled on both sides
(specfast: `eos_token_id=[]`; transformers: an EOS id outside the vocabulary), so tokens/s counts
the same work for every engine; the JSON records where the model emitted its first EOS.

Target passes for transformers are counted with a forward pre-hook on the target (the prefill
counts as one pass, as it emits the first token); its mean acceptance length is new tokens per pass.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from specfast.bench.engines import (
    Combined,
    Engine,
    EngineOutput,
    hf_engine,
    load_hf_model,
    load_hf_tokenizer,
    specfast_engine,
)
from specfast.bench.llama import (
    LLAMA_ALL,
    LLAMA_DRAFT_ENGINES,
    LLAMA_ENGINES,
    build_llama_engines,
    llama_meta,
    load_llamas,
)
from specfast.bench.plots import plot_speedup, plot_sweep
from specfast.bench.report import (
    Run,
    format_markdown,
    format_pass_costs,
    format_tables,
    machine_info,
    pass_cost_report,
    peak_memory,
    plot_title,
    summarize,
    sweep_k,
    write_json,
)
from specfast.bench.workloads import build_workloads, read_prompts
from specfast.drafters.eagle.files import load_eagle
from specfast.formats import load_model
from specfast.model.config import resolve_dtype
from specfast.targets import LlamaTokenizer, as_target, llama_eos_ids

ENGINES = (
    "specfast-plain",
    "specfast-ngram",
    "specfast-draft",
    "specfast-draft-int8",
    "specfast-combined",
    "specfast-eagle",  # opt-in: the EAGLE-3 head (--eagle PATH, default the shipped one)
    "specfast-eagle+ngram",
    "hf-plain",
    "hf-prompt-lookup",
    "hf-assisted",
    *LLAMA_ALL,  # opt-in: --backend llama.cpp or --engines
)
DRAFT_ENGINES = ("specfast-draft", "specfast-combined", "hf-assisted")  # added by --draft
# Every engine that needs --draft; specfast-draft-int8 (Model.quantize_int8) is opt-in.
NEEDS_DRAFT = (*DRAFT_ENGINES, "specfast-draft-int8", *LLAMA_DRAFT_ENGINES)
DEFAULT_ENGINES = ("specfast-plain", "specfast-ngram", "hf-plain", "hf-prompt-lookup")
DEFAULT_LLAMA_ENGINES = LLAMA_ENGINES  # --backend llama.cpp (plus LLAMA_DRAFT_ENGINES with --draft)
SWEEP_KS = (1, 2, 4, 8, 16, 32)
# ---------------------------------------------------------------------------- the runner


def run_interleaved(
    prompts: Sequence[tuple[str, str, list[int]]],
    engines: dict[str, Engine],
    repeats: int = 3,
    *,
    progress: bool = True,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_run: Callable[[Run], None] | None = None,
) -> list[Run]:
    """Run every engine on every (kind, name, ids) prompt, interleaved; return every timed run.

    One warm-up call per engine comes first (allocations, kernels, lazy imports). Within a prompt
    the engine order rotates each repeat so no engine always runs right after another. `on_run`
    sees each run as it is measured (the CLI appends it to runs.jsonl, so a bench stopped midway
    keeps what it measured).
    """
    from tqdm.auto import tqdm

    names = list(engines)
    total = len(names) * (1 + len(prompts) * repeats)
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not progress)
    runs: list[Run] = []

    def timed(fn: Engine, ids: list[int]) -> tuple[float, EngineOutput]:
        if sync:
            sync()
        t0 = clock()
        out = fn(ids)
        if sync:
            sync()
        return clock() - t0, out

    try:
        if prompts:
            for name in names:
                bar.set_postfix_str(f"warm-up {name}")
                timed(engines[name], prompts[0][2])
                bar.update()
        for kind, pname, ids in prompts:
            for r in range(repeats):
                shift = r % len(names)
                for name in names[shift:] + names[:shift]:
                    bar.set_postfix_str(f"{pname} {name}")
                    secs, out = timed(engines[name], ids)
                    ids_out = [int(t) for t in out.token_ids]
                    run = Run(
                        engine=name,
                        kind=kind,
                        prompt=pname,
                        repeat=r,
                        seconds=secs,
                        new_tokens=len(ids_out),
                        target_passes=out.target_passes,
                        mean_acceptance_length=out.mean_acceptance_length,
                        acceptance_histogram=out.acceptance_histogram,
                        token_ids=ids_out,
                        prefill_seconds=out.prefill_seconds,
                    )
                    runs.append(run)
                    if on_run is not None:
                        on_run(run)
                    bar.update()
    finally:
        bar.close()
    return runs


# ---------------------------------------------------------------------------- the bench command


def bench_main(args: Any, model_path: Path, argv: Sequence[str]) -> int:
    """`specfast bench`: build workloads and engines, run interleaved, print, write JSON + plots."""
    engines_wanted = list(args.engines)
    opts = vars(args)  # bench_main is also called with namespaces that lack some options
    own_prompts = read_prompts(args.prompts) if opts.get("prompts") else None
    sf_needed = (
        any(e.startswith("specfast-") and e not in LLAMA_ALL for e in engines_wanted)
        or args.sweep_k
    )
    llamas: dict[str, Any] = {}
    if any(e in LLAMA_ALL for e in engines_wanted):
        threads = opts.get("llama_threads")
        llamas = load_llamas(model_path, engines_wanted, args.draft, n_threads=threads)
    hf_needed = any(e.startswith("hf-") for e in engines_wanted)

    requested_dtype = args.dtype
    if args.dtype == "auto":  # one concrete dtype for every engine, transformers' included
        args.dtype = str(resolve_dtype("auto", args.device)).removeprefix("torch.")
    print(f"loading {model_path} ({args.dtype}, {args.device})", file=sys.stderr)
    sf_model = sf_draft = sf_draft_int8 = hf_model = hf_draft = sf_eagle = None
    if sf_needed:
        # specfast's engines get what a user's load_model gets: dtype and weights "auto" pick
        # by hardware (int8 weights where they time faster), transformers the concrete dtype.
        load = dict(
            device=args.device,
            dtype=requested_dtype,
            compile=args.compile,
            weights=opts.get("weights", "auto"),
        )
        sf_model = load_model(str(model_path), **load)
        if any(e.startswith("specfast-eagle") for e in engines_wanted):
            sf_eagle = load_eagle(opts.get("eagle"), sf_model)
        if args.draft:
            sf_draft = load_model(str(args.draft), **load)
        if args.draft and "specfast-draft-int8" in engines_wanted:
            sf_draft_int8 = load_model(
                str(args.draft), device=args.device, dtype=args.dtype
            ).quantize_int8()
    if hf_needed:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()  # keep stderr for our own progress bar
        hf_model = load_hf_model(model_path, args.dtype, args.device)
        if args.draft and "hf-assisted" in engines_wanted:
            hf_draft = load_hf_model(args.draft, args.dtype, args.device)

    # One tokenization for every engine, so all of them see the same ids.
    llama_any = llamas.get("target") or llamas.get("lookup")
    if sf_model is not None:
        template = sf_model.chat_template

        def encode(text: str) -> list[int]:
            return list(sf_model.tokenizer.encode(text).ids)
    elif llama_any is not None:
        template = llama_any.metadata.get("tokenizer.chat_template")
        encode = LlamaTokenizer(llama_any).encode
    else:
        tok = load_hf_tokenizer(model_path)
        template = tok.chat_template  # a transformers tokenizer's (None without one)

        def encode(text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False).input_ids)

    workloads = own_prompts or build_workloads(args.workloads, args.prompts_per_workload)
    prompts = [(w.kind, w.name, encode(w.render(template))) for w in workloads]

    n = args.max_new_tokens
    engines: dict[str, Engine] = {}
    for e in engines_wanted:
        if e == "specfast-plain":
            engines[e] = specfast_engine(sf_model, drafter=None, k=args.k, max_new_tokens=n)
        elif e == "specfast-ngram":
            engines[e] = specfast_engine(sf_model, drafter="ngram", k=args.k, max_new_tokens=n)
        elif e == "specfast-draft":
            engines[e] = specfast_engine(sf_model, drafter=sf_draft, k=args.k, max_new_tokens=n)
        elif e == "specfast-draft-int8":
            engines[e] = specfast_engine(
                sf_model, drafter=sf_draft_int8, k=args.k, max_new_tokens=n
            )
        elif e == "specfast-combined":
            engines[e] = specfast_engine(
                sf_model, drafter=Combined(sf_draft), k=args.k, max_new_tokens=n
            )
        elif e == "specfast-eagle":
            engines[e] = specfast_engine(sf_model, drafter=sf_eagle, k=args.k, max_new_tokens=n)
        elif e == "specfast-eagle+ngram":
            engines[e] = specfast_engine(
                sf_model, drafter=Combined(sf_eagle), k=args.k, max_new_tokens=n
            )
        elif e == "hf-plain":
            engines[e] = hf_engine(hf_model, "plain", max_new_tokens=n)
        elif e == "hf-prompt-lookup":
            engines[e] = hf_engine(hf_model, "prompt-lookup", max_new_tokens=n)
        elif e == "hf-assisted":
            engines[e] = hf_engine(hf_model, "assisted", max_new_tokens=n, assistant=hf_draft)
    if llamas:
        engines |= build_llama_engines(
            engines_wanted, llamas, k=args.k, max_new_tokens=n, eagle=opts.get("eagle")
        )
    if args.sweep_k:
        if "specfast-plain" not in engines:
            engines["specfast-plain"] = specfast_engine(
                sf_model, drafter=None, k=1, max_new_tokens=n
            )
        for k in SWEEP_KS:
            engines[f"specfast-ngram@k={k}"] = specfast_engine(
                sf_model, drafter="ngram", k=k, max_new_tokens=n
            )

    sync = None
    if args.device.startswith("cuda"):
        sync = torch.cuda.synchronize

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.jsonl", "w") as log:

        def on_run(run: Run) -> None:
            log.write(json.dumps(asdict(run)) + "\n")
            log.flush()

        runs = run_interleaved(prompts, engines, args.repeats, sync=sync, on_run=on_run)
    summary = summarize(runs)

    runtime = as_target(sf_model).describe() if sf_model is not None else {}
    meta = machine_info(args.device) | {
        "command": " ".join(["specfast", *argv]),
        "model": str(model_path),
        "draft": str(args.draft) if args.draft else None,
        "eagle": str(opts.get("eagle") or "shipped")
        if sf_eagle is not None or "specfast-llama-eagle" in engines
        else None,
        "dtype": args.dtype,
        "dtype_requested": requested_dtype,
        "specfast_dtype": runtime.get("dtype"),
        "weights": runtime.get("weights"),
        "kv_dtype": runtime.get("kv_dtype"),
        "compile": args.compile,
        "step": runtime.get("step", "eager"),
        **peak_memory(args.device),
        "max_new_tokens": n,
        "repeats": args.repeats,
        "k": args.k,
        "eos": "disabled: every engine generates exactly max_new_tokens tokens",
        "prompts": [
            {"kind": k, "name": name, "prompt_tokens": len(ids)} for k, name, ids in prompts
        ],
    }
    if llamas:
        meta |= llama_meta(llamas)
    only_llama = all(e in LLAMA_ALL for e in engines)
    dtype_label = "llama.cpp (the GGUF's own weights)" if only_llama else args.dtype
    title = plot_title(model_path, dtype_label, n, meta)
    main_summary = {
        k: {e: f for e, f in v.items() if sweep_k(e) is None} for k, v in summary.items()
    }

    costs = pass_cost_report({"specfast": sf_model, "llama.cpp": llamas.get("target")})
    if costs:
        meta["pass_costs_ms"] = {k: {n: t * 1e3 for n, t in c.items()} for k, c in costs.items()}

    print(format_tables(main_summary))
    for name, c in costs.items():
        print(format_pass_costs(name, c))
    eos_ids: list[int] = []
    if sf_model is not None:
        eos_ids = list(sf_model.eos_token_ids)
    elif llama_any is not None:
        eos_ids = llama_eos_ids(llama_any)
    elif hf_model is not None:
        e = hf_model.generation_config.eos_token_id
        eos_ids = [e] if isinstance(e, int) else list(e or [])
    js = write_json(out / "results.json", meta, runs, summary, eos_ids)
    (out / "results.md").write_text(format_markdown(main_summary) + "\n")
    png = plot_speedup(main_summary, out / "speedup.png", f"Speedup per workload kind\n{title}")
    print(f"\nwrote {js}, {out / 'results.md'} and {png}", file=sys.stderr)
    if args.sweep_k:
        sw = plot_sweep(summary, out / "sweep_k.png", f"specfast ngram against k\n{title}")
        print(f"wrote {sw}", file=sys.stderr)
    print("acceptance depends on the workload: read each kind on its own.", file=sys.stderr)
    return 0
