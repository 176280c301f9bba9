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

import datetime as _dt
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import specfast
from specfast.autok import measured_pass_costs
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
from specfast.bench.workloads import build_workloads, read_prompts
from specfast.hardware import cpu_flags_label
from specfast.targets.llama_cpp import LlamaTokenizer, llama_eos_ids
from specfast.targets.torch.model import resolve_dtype

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
# ---------------------------------------------------------------------------- results


@dataclass
class Run:
    engine: str
    kind: str
    prompt: str
    repeat: int
    seconds: float
    new_tokens: int
    target_passes: int | None
    mean_acceptance_length: float | None
    acceptance_histogram: list[int] | None
    token_ids: list[int] = field(repr=False)
    prefill_seconds: float | None = None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first, per second after the first: the rate once the prompt is in."""
        if self.prefill_seconds is None or self.seconds <= self.prefill_seconds:
            return None
        return (self.new_tokens - 1) / (self.seconds - self.prefill_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def reference_engine(engine: str, engines: Sequence[str]) -> str | None:
    """The engine whose output `engine` must reproduce token for token."""
    if engine in LLAMA_ALL and engine != "llama.cpp-plain":
        return "llama.cpp-plain" if "llama.cpp-plain" in engines else None
    if engine == "specfast-plain":
        return "hf-plain" if "hf-plain" in engines else None
    if engine.startswith("specfast-"):
        return "specfast-plain" if "specfast-plain" in engines else None
    if engine.startswith("hf-") and engine != "hf-plain":
        return "hf-plain" if "hf-plain" in engines else None
    return None


def sweep_k(engine: str) -> int | None:
    """k of a sweep engine name such as 'specfast-ngram@k=8'."""
    _, sep, k = engine.partition("@k=")
    return int(k) if sep else None


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


# ---------------------------------------------------------------------------- summaries


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: Sequence[Run]) -> dict[str, dict[str, dict[str, Any]]]:
    """{kind: {engine: figures}}: medians over repeats per prompt, then over prompts."""
    engines = list(dict.fromkeys(r.engine for r in runs))
    kinds = list(dict.fromkeys(r.kind for r in runs))
    # Per (kind, prompt, engine): median time over repeats; the first repeat's tokens.
    per: dict[tuple[str, str, str], dict[str, Any]] = {}
    for key in dict.fromkeys((r.kind, r.prompt, r.engine) for r in runs):
        rs = [r for r in runs if (r.kind, r.prompt, r.engine) == key]
        secs = statistics.median(r.seconds for r in rs)
        per[key] = {
            "tps": rs[0].new_tokens / secs if secs > 0 else float("nan"),
            "dtps": _median([r.decode_tokens_per_second for r in rs]),
            "mal": _median([r.mean_acceptance_length for r in rs]),
            "passes": _median([r.target_passes for r in rs]),
            "tokens": rs[0].token_ids,
            "new_tokens": rs[0].new_tokens,
            "repeats_agree": all(r.token_ids == rs[0].token_ids for r in rs),
        }

    out: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in kinds:
        prompts = list(dict.fromkeys(p for (k, p, _e) in per if k == kind))
        out[kind] = {}
        for eng in engines:
            mine = {p: per[(kind, p, eng)] for p in prompts if (kind, p, eng) in per}
            if not mine:
                continue

            def ratio(
                base: str, mine: dict = mine, kind: str = kind, rate: str = "tps"
            ) -> float | None:
                rs = [
                    m[rate] / per[(kind, p, base)][rate]
                    for p, m in mine.items()
                    if (kind, p, base) in per
                    and m[rate] is not None
                    and (per[(kind, p, base)][rate] or 0) > 0
                ]
                return statistics.median(rs) if rs else None

            ref = reference_engine(eng, engines)
            same = None
            if ref is not None:
                pairs = [(m, per.get((kind, p, ref))) for p, m in mine.items()]
                same = [m["tokens"] == r["tokens"] for m, r in pairs if r is not None]
            out[kind][eng] = {
                "prompts": len(mine),
                "tokens_per_second": _median([m["tps"] for m in mine.values()]),
                "speedup_vs_hf_plain": ratio("hf-plain"),
                "speedup_vs_specfast_plain": ratio("specfast-plain"),
                "speedup_vs_llama_plain": ratio("llama.cpp-plain"),
                # tokens after the first over the time after the first: the rate past prefill
                "decode_tokens_per_second": _median([m["dtps"] for m in mine.values()]),
                "decode_speedup_vs_llama_plain": ratio("llama.cpp-plain", rate="dtps"),
                "mean_acceptance_length": _median([m["mal"] for m in mine.values()]),
                "target_passes": _median([m["passes"] for m in mine.values()]),
                "new_tokens": _median([m["new_tokens"] for m in mine.values()]),
                "reference": ref,
                "identical": sum(same) if same is not None else None,
                "compared": len(same) if same is not None else None,
                "repeats_agree": all(m["repeats_agree"] for m in mine.values()),
            }
    return out


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def format_tables(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One plain-text table per workload kind."""
    head = (
        "engine",
        "tok/s",
        "× hf-plain",
        "× sf-plain",
        "mean acc len",
        "target passes",
        "identical",
    )
    llama = _has_llama(summary)
    if llama:
        head = (*head[:4], "× llama.cpp", "decode tok/s", "decode × llama.cpp", *head[4:])
    blocks = []
    for kind, engines in summary.items():
        rows = [head]
        for eng, f in engines.items():
            same = "–"
            if f["compared"]:
                same = f"{f['identical']}/{f['compared']} vs {f['reference']}"
            extra = ()
            if llama:
                extra = (
                    _fmt(f.get("speedup_vs_llama_plain"), ".2f", "×"),
                    _fmt(f.get("decode_tokens_per_second"), ".1f"),
                    _fmt(f.get("decode_speedup_vs_llama_plain"), ".2f", "×"),
                )
            rows.append(
                (
                    eng,
                    _fmt(f["tokens_per_second"], ".1f"),
                    _fmt(f["speedup_vs_hf_plain"], ".2f", "×"),
                    _fmt(f["speedup_vs_specfast_plain"], ".2f", "×"),
                    *extra,
                    _fmt(f["mean_acceptance_length"], ".2f"),
                    _fmt(f["target_passes"], ".0f"),
                    same,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        n = max(f["prompts"] for f in engines.values())
        lines = [f"{kind} ({n} prompt{'s' if n != 1 else ''})"]
        for j, r in enumerate(rows):
            cells = [r[0].ljust(widths[0])] + [
                c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
            ]
            lines.append("  ".join(cells).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _has_llama(summary: dict[str, dict[str, dict[str, Any]]]) -> bool:
    return any("llama.cpp-plain" in engines for engines in summary.values())


def format_markdown(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The same figures as one Markdown table (workload kind as a column), for the README."""
    if _has_llama(summary):
        return format_markdown_llama(summary)
    lines = [
        "| workload | engine | tok/s | × hf-plain | × specfast-plain | mean acc. len | identical |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for kind, engines in summary.items():
        for eng, f in engines.items():
            same = f"{f['identical']}/{f['compared']}" if f["compared"] else "ref"
            lines.append(
                f"| {kind} | {eng} | {_fmt(f['tokens_per_second'], '.1f')} "
                f"| {_fmt(f['speedup_vs_hf_plain'], '.2f', '×')} "
                f"| {_fmt(f['speedup_vs_specfast_plain'], '.2f', '×')} "
                f"| {_fmt(f['mean_acceptance_length'], '.2f')} | {same} |"
            )
    return "\n".join(lines)


def format_markdown_llama(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The llama.cpp comparison: end-to-end and decode rates against llama.cpp's own loop."""
    lines = [
        "| workload | engine | tok/s | × llama.cpp | decode tok/s | decode × llama.cpp "
        "| mean acc. len | identical |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for kind, engines in summary.items():
        for eng, f in engines.items():
            same = f"{f['identical']}/{f['compared']}" if f["compared"] else "ref"
            lines.append(
                f"| {kind} | {eng} | {_fmt(f['tokens_per_second'], '.1f')} "
                f"| {_fmt(f.get('speedup_vs_llama_plain'), '.2f', '×')} "
                f"| {_fmt(f.get('decode_tokens_per_second'), '.1f')} "
                f"| {_fmt(f.get('decode_speedup_vs_llama_plain'), '.2f', '×')} "
                f"| {_fmt(f['mean_acceptance_length'], '.2f')} | {same} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- machine + JSON


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_info(device: str = "cpu") -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
    }
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["cpu_flags"] = cpu_flags_label()
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    info["specfast"] = specfast.__version__
    return info


def peak_memory(device: str = "cpu") -> dict[str, float]:
    """The process's peak resident memory (and peak CUDA allocation) so far, in MB."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB
    if device.startswith("cuda"):
        out["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def pass_cost_report(targets: dict[str, Any]) -> dict[str, dict[int, float]]:
    """{runtime: {n: seconds}}: what one pass over n tokens cost each target, as auto k measured
    it during the runs (autok.measured_pass_costs); targets that ran no auto-k round are left
    out. Speculation pays where verifying n tokens costs far less than n single steps."""
    out = {}
    for name, target in targets.items():
        costs = measured_pass_costs(target) if target is not None else {}
        if 1 in costs:
            out[name] = costs
    return out


def format_pass_costs(name: str, costs: dict[int, float]) -> str:
    """t(1) in ms, t(n)/t(1) for every other pass length measured, and the ceiling those
    lengths allow: n t(1) / t(n), the speedup of rounds whose n - 1 drafts are all accepted."""
    t1 = costs[1]
    ratios = " ".join(f"{n}:{t / t1:.2f}" for n, t in costs.items() if n != 1)
    line = f"pass cost on {name}, as auto k measured it: t(1) = {t1 * 1e3:.1f} ms; "
    if not ratios:
        return line + "no longer pass measured"
    best = max((n for n in costs if n != 1), key=lambda n: n * t1 / costs[n])
    return line + (
        f"t(n)/t(1) for n tokens: {ratios}; with every draft accepted, at most "
        f"{best * t1 / costs[best]:.2f}x plain (n = {best})"
    )


def machine_label(meta: dict[str, Any]) -> str:
    if meta.get("gpu"):
        return str(meta["gpu"])
    flags = f" [{meta['cpu_flags']}]" if meta.get("cpu_flags") else ""
    return f"{meta.get('cpu', 'CPU')}{flags}, {meta.get('cpu_count', '?')} cores"


def plot_title(model_path: str | Path, dtype: str, max_new_tokens: int, meta: dict) -> str:
    name = Path(model_path).name.removesuffix(".gguf")
    return f"{name}, {dtype}, greedy, {max_new_tokens} new tokens, on {machine_label(meta)}"


def _first(tokens: Sequence[int], ids: Sequence[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in ids), None)


def write_json(
    path: Path,
    meta: dict[str, Any],
    runs: Sequence[Run],
    summary: dict,
    eos_token_ids: Sequence[int] = (),
) -> Path:
    """results.json: meta (machine, versions, command), the summary, and every timed run.

    EOS is disabled while benchmarking; `first_eos` says where the model would have stopped.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    eos = set(eos_token_ids)
    doc = {
        "meta": meta | {"eos_token_ids": sorted(eos)},
        "summary": summary,
        "runs": [
            asdict(r)
            | {
                "tokens_per_second": r.tokens_per_second,
                "decode_tokens_per_second": r.decode_tokens_per_second,
                "first_eos": _first(r.token_ids, eos),
            }
            for r in runs
        ],
    }
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


# ---------------------------------------------------------------------------- plots

_COLORS = {
    "specfast-plain": "#9ecae1",
    "specfast-ngram": "#08519c",
    "specfast-draft": "#3182bd",
    "specfast-draft-int8": "#6baed6",
    "specfast-combined": "#31a354",
    "specfast-eagle": "#e6550d",
    "specfast-eagle+ngram": "#a63603",
    "hf-plain": "#bdbdbd",
    "hf-prompt-lookup": "#e6550d",
    "hf-assisted": "#fd8d3c",
}
_HATCH = {"hf-plain": "//", "hf-prompt-lookup": "//", "hf-assisted": "//"}


def plot_speedup(summary: dict, path: Path, title: str) -> Path:
    """Grouped bars: speedup over transformers plain (else specfast plain) per workload, engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(summary)
    engines = [e for e in dict.fromkeys(e for k in kinds for e in summary[k]) if sweep_k(e) is None]
    has_hf = any("hf-plain" in summary[k] for k in kinds)
    key, base = (
        ("speedup_vs_hf_plain", "transformers plain")
        if has_hf
        else ("speedup_vs_specfast_plain", "specfast plain")
    )
    fig, ax = plt.subplots(figsize=(max(8.0, 2.5 + 0.45 * len(kinds) * len(engines)), 5.0))
    width = 0.8 / max(1, len(engines))
    top = 1.0
    for i, eng in enumerate(engines):
        xs, ys = [], []
        for j, kind in enumerate(kinds):
            v = summary[kind].get(eng, {}).get(key)
            if v is not None:
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(v)
        bars = ax.bar(
            xs,
            ys,
            width,
            label=eng,
            color=_COLORS.get(eng),
            hatch=_HATCH.get(eng),
            edgecolor="black",
            linewidth=0.5,
        )
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=2)
        top = max([top, *ys])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(kinds)))
    ax.set_xticklabels(kinds)
    ax.set_xlabel("workload kind")
    ax.set_ylabel(f"speedup over {base} (× tokens/s, median)")
    ax.set_ylim(0, top * 1.18)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="engine")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_sweep(summary: dict, path: Path, title: str) -> Path:
    """tokens/s and mean acceptance length against k, one line per workload kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_a) = plt.subplots(1, 2, figsize=(11, 4.4))
    cmap = plt.get_cmap("tab10")
    for c, (kind, engines) in enumerate(summary.items()):
        pts = sorted((sweep_k(e), f) for e, f in engines.items() if sweep_k(e) is not None)
        if not pts:
            continue
        ks = [k for k, _ in pts]
        color = cmap(c % 10)
        ax_t.plot(ks, [f["tokens_per_second"] for _, f in pts], "o-", color=color, label=kind)
        ax_a.plot(ks, [f["mean_acceptance_length"] for _, f in pts], "o-", color=color, label=kind)
        plain = engines.get("specfast-plain", {}).get("tokens_per_second")
        if plain:
            ax_t.axhline(plain, color=color, linestyle=":", linewidth=1)
    all_ks = sorted({k for v in summary.values() for e in v if (k := sweep_k(e)) is not None})
    for ax in (ax_t, ax_a):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_ks, [str(k) for k in all_ks])
        ax.minorticks_off()
        ax.set_xlabel("k (speculative tokens per round)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_ylabel("tokens/s (median; dotted: specfast plain)")
    ax_a.set_ylabel("mean acceptance length (tokens per target pass)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


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
        sf_model = specfast.load_model(str(model_path), **load)
        if any(e.startswith("specfast-eagle") for e in engines_wanted):
            sf_eagle = specfast.load_eagle(opts.get("eagle"), sf_model)
        if args.draft:
            sf_draft = specfast.load_model(str(args.draft), **load)
        if args.draft and "specfast-draft-int8" in engines_wanted:
            sf_draft_int8 = specfast.load_model(
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

    runtime = sf_model.describe() if sf_model is not None else {}
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
