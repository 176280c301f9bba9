"""`specfast train-eagle`: its arguments and command (the work is in specfast.train.fit)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from specfast.cli.common import DTYPE_CHOICES, positive_float, positive_int
from specfast.train.fit import TrainConfig
from specfast.train.job import train_eagle


def add_train_eagle(sub) -> None:
    t = sub.add_parser(
        "train-eagle",
        help="train an EAGLE-3 head for a model on text the model writes itself",
        description="The target answers training prompts (offline corpora, none of the "
        "benchmark text), one forward per document captures its features, then an EAGLE-3 "
        "head trains (training-time test, soft cross-entropy, AdamW). Writes config.json + "
        "model.safetensors (SpecForge layout) to --out; --resume continues a run.",
    )
    t.add_argument("--target", metavar="PATH", help="GGUF file or HF folder (default: SmolLM2)")
    t.add_argument("--out", required=True, metavar="DIR")
    t.add_argument("--data", metavar="DIR", help="captured data (default: OUT/data; reused)")
    t.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="the target's dtype")
    t.add_argument("--steps", type=positive_int, default=1000, metavar="N")
    t.add_argument("--docs-per-step", type=positive_int, default=4, metavar="N")
    t.add_argument("--ttt-steps", type=positive_int, default=4, metavar="N")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--draft-vocab", type=positive_int, default=4096, metavar="N")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-len", type=positive_int, default=512, metavar="N")
    t.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N")
    t.add_argument("--max-prompts", type=positive_int, default=None, metavar="N")
    t.add_argument(
        "--prompt-scale",
        type=positive_float,
        default=1.0,
        metavar="X",
        help="X times the default number of code, completion and quoting prompts",
    )
    t.add_argument("--corpus-tokens", type=int, default=200_000, metavar="N")
    t.add_argument("--batch-size", type=positive_int, default=16, metavar="N")
    t.add_argument("--eval-every", type=positive_int, default=100, metavar="N")
    t.add_argument("--threads", type=positive_int, default=None, metavar="N")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="every stage there")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    t.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        metavar="M",
        help="stop training after M minutes (checkpoint and head saved; --resume goes on)",
    )


def cmd_train_eagle(args: argparse.Namespace, resolve_model) -> int:
    target = resolve_model(args.target)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        steps=args.steps,
        docs_per_step=args.docs_per_step,
        ttt_steps=args.ttt_steps,
        lr=args.lr,
        draft_vocab_size=args.draft_vocab,
        seed=args.seed,
        eval_every=args.eval_every,
    )
    train_eagle(
        target,
        Path(args.out),
        cfg,
        data_dir=Path(args.data) if args.data else None,
        dtype=args.dtype,
        resume=args.resume,
        max_minutes=args.max_minutes,
        device=args.device,
        max_len=args.max_len,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        max_prompts=args.max_prompts,
        prompt_scale=args.prompt_scale,
        corpus_tokens=args.corpus_tokens,
    )
    print(f"head written to {args.out}", file=sys.stderr)
    return 0
