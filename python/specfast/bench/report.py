"""The bench's results: runs, per-kind summaries (medians of per-prompt ratios), the tables
and markdown it prints, and the JSON with the machine it ran on."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import statistics
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specfast import __version__
from specfast.autok import measured_pass_costs
from specfast.bench.llama import LLAMA_ALL
from specfast.hardware import cpu_flags_label

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
    head: tuple[str, ...] = (
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
            extra: tuple[str, ...] = ()
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
    info["specfast"] = __version__
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


def _first(tokens: Sequence[int], ids: Collection[int]) -> int | None:
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
