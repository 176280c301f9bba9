"""The `specfast` command's arguments: the parser of every subcommand and the argument types
that check values as they are parsed."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from specfast.bench import (
    DEFAULT_ENGINES,
    DEFAULT_LLAMA_ENGINES,
    ENGINES,
)
from specfast.bench.workloads import KINDS
from specfast.cli.common import (
    add_runtime_options,
    positive_int,
    speculative_k,
)
from specfast.cli.serve import add_serve
from specfast.cli.train_eagle import add_train_eagle
from specfast.model.quantize import WEIGHTS_CHOICES

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
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the reply to the JSON schema in FILE (response_format json_schema)",
    )
    fmt.add_argument("--regex", metavar="RE", help="constrain the reply to a regular expression")
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
