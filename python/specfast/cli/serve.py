"""`specfast serve`: its arguments and the command (the server itself is serve/)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from specfast.cli.common import (
    CLIError,
    add_runtime_options,
    check_device,
    load_args_model,
    positive_int,
    resolve_model,
    speculative_k,
)
from specfast.formats import load_model
from specfast.session import Session


def add_serve(sub) -> None:
    v = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server that keeps each conversation's cache",
        description="Serve the model over OpenAI's HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health), one request at a time in arrival order. "
        "Requests are served on the live session whose tokens share the longest prefix with "
        "the prompt, so a conversation's next turn prefills only its new tokens. Point a "
        "client at it: OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='none'). "
        "Needs the specfast[serve] extra.",
    )
    v.add_argument("--model", metavar="PATH", help="GGUF file or HF folder (default: SmolLM2-135M)")
    v.add_argument(
        "--backend",
        choices=("specfast", "llama.cpp"),
        default="specfast",
        help="llama.cpp: a llama_cpp.Llama as the target (specfast[llama]; one session)",
    )
    v.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (this machine only)")
    v.add_argument("--port", type=int, default=8000, help="default: 8000")
    v.add_argument(
        "--drafter",
        choices=("ngram", "none"),
        default="ngram",
        help="the default drafter; a request may pick its own (its drafter field)",
    )
    v.add_argument(
        "-k", type=speculative_k, default="auto", metavar="N|auto", help="tokens per draft"
    )
    v.add_argument(
        "--sessions",
        type=int,
        default=4,
        metavar="N",
        help="live sessions (KV caches) kept, least recently used evicted; 0: none, "
        "every request prefilled whole (default: 4)",
    )
    v.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        metavar="N",
        help="cache positions per session (default: the model's context, at most 8192)",
    )
    v.add_argument(
        "--queue",
        type=int,
        default=16,
        metavar="N",
        help="requests that may wait behind the running one; more get 429 (default: 16)",
    )
    v.add_argument(
        "--corpus",
        metavar="FILE",
        help="the n-gram corpus every reply goes into: loaded at start, written "
        "atomically every --save-every replies and on shutdown",
    )
    v.add_argument(
        "--corpus-reset",
        action="store_true",
        help="start with an empty corpus if the --corpus file cannot be loaded",
    )
    v.add_argument(
        "--save-every",
        type=positive_int,
        default=8,
        metavar="N",
        help="write the corpus every N replies (default: 8)",
    )
    v.add_argument(
        "--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug")
    )
    v.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_runtime_options(v)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from specfast.serve.app import Server, run_server
        from specfast.serve.pool import CorpusError, Pool, load_corpus
    except ImportError as e:
        raise CLIError(f"{e}; `specfast serve` needs: pip install 'specfast[serve]'") from None
    if args.sessions < 0 or args.queue < 0:
        raise CLIError("--sessions and --queue must be >= 0")
    if args.corpus_reset and not args.corpus:
        raise CLIError("--corpus-reset needs --corpus FILE")
    if args.corpus and args.drafter != "ngram":
        raise CLIError("--corpus needs the n-gram drafter (--drafter ngram)")
    model_path = resolve_model(args.model)
    check_device(args.device)
    if args.backend == "llama.cpp":
        if args.sessions > 1:
            raise CLIError("--backend llama.cpp keeps one sequence: pass --sessions 1 (or 0)")
        n_ctx = args.max_length or 4096
        model: Any = load_model(str(model_path), backend="llama.cpp", n_ctx=n_ctx, verbose=False)
    else:
        model = load_args_model(args, model_path)
    try:
        corpus = load_corpus(args.corpus, model, args.corpus_reset)
    except CorpusError as e:
        raise CLIError(str(e)) from None
    probe = Session(model, drafter=None, max_length=args.max_length)
    pool = Pool(model, args.sessions, probe.max_length, corpus, args.corpus)
    server = Server(model, model_path.name.removesuffix(".gguf"), pool, args.queue, args.save_every)
    server.defaults = {"drafter": args.drafter, "k": args.k}
    print(
        f"specfast serve: {server.model_id} on http://{args.host}:{args.port}/v1 "
        f"({args.sessions} sessions of {pool.max_length} tokens, queue {args.queue}"
        f"{f', corpus {args.corpus}' if args.corpus else ''})",
        file=sys.stderr,
        flush=True,
    )
    run_server(server, args.host, args.port, args.log_level)
    return 0
