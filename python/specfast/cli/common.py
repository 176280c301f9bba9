"""What the `specfast` subcommands share: the dtype and compile choices, argument types, and
the stats block printed after a generation (generate, and chat's /stats)."""

from __future__ import annotations

import argparse
from typing import Any

from specfast.targets.torch.model import DTYPE_CHOICES
from specfast.targets.torch.steps import COMPILE_CHOICES

__all__ = ["COMPILE_CHOICES", "DTYPE_CHOICES", "format_stats", "positive_float", "positive_int"]


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


def format_stats(stats: Any) -> str:
    hist = list(getattr(stats, "acceptance_histogram", None) or [])
    lines = [
        f"{stats.tokens_per_second:.1f} tokens/s  ({stats.seconds:.2f} s)",
        f"target passes: {stats.target_passes}   "
        f"mean acceptance length: {stats.mean_acceptance_length:.2f} tokens/pass   "
        f"drafted {stats.draft_tokens}, accepted {stats.accepted_tokens}",
    ]
    if hist:
        total = sum(hist) or 1
        lines.append("accepted per round:")
        for i, c in enumerate(hist):
            if c:
                lines.append(f"  {i:>3} | {'#' * max(1, round(40 * c / total)):<40} {c}")
    return "\n".join(lines)
