"""The bench's plots: speedup per workload kind, and tokens/s against k for a sweep."""

from __future__ import annotations

from pathlib import Path

from specfast.bench.report import sweep_k

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
