"""Conversations: a Session (cache and drafter kept) against generate() on the full history.

    python benches/bench_session.py [--dtype auto] [--tokens 160] [--out results.json]

Workloads, built at run time from real text nobody here wrote (code editing):
- `edit`: a 4-turn code-editing conversation on a CPython stdlib function (inspect.getsource);
  each turn asks for a change to the previous answer and for the whole function back.
- `agent`: an agent-style loop that resends tool output: each turn "reads the file" again (the
  function's source, as a tool result) and asks for the next step.

Per turn, interleaved in one process on the same model and dtype, all greedy (the outputs are
checked identical):
- session:  Session.send (prefills only the turn's new tokens; n-gram drafter kept);
- generate: generate() on the full history (re-prefills everything; a fresh n-gram drafter that
  indexes the history as its prompt);
- turn-only: generate() on the full history with a fresh n-gram drafter that sees only this
  turn's message and reply (what a drafter without the conversation would know);
- transformers: transformers' own `model.generate` (greedy) on the full history, with the same
  GGUF weights in the same dtype (bench.engines.load_hf_model, hf_engine), asked for as many
  tokens as the session produced; and transformers' prompt lookup (prompt_lookup_num_tokens=10).
  `--no-transformers` leaves both out. Their tokens are compared with the session's and
  reported (identical, common_prefix); they are not asserted, as transformers' kernels may
  order sums differently.
TTFT is the wall time of a call with max_new_tokens=1 (the session's includes rendering and
tokenizing the conversation), the median of `--repeats` interleaved runs. tokens/pass = tokens
per target pass over the decode (vLLM's mean acceptance length). For transformers, whose
generate() reports no prefill time, tok/s = (new tokens - 1) / (wall time of the full call -
its median TTFT), and tokens/pass = new tokens / forward calls (prefill included).

Corpus: conversation A (the edit workload) is saved to a corpus file; then a new conversation B
on the same function with its edits in another order starts with and without that corpus, and
so does one on a different function. The first turn's drafted/accepted tokens and tokens/pass
are compared.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import statistics
import tempfile
import textwrap
import time

import torch

import specfast
from specfast.bench.engines import HF_PROMPT_LOOKUP_TOKENS, hf_engine, load_hf_model
from specfast.hardware import cpu_flags_label
from specfast.session import Session

EDITS = [
    "Rename the parameter `{param}` to `{param}_value` everywhere in it.",
    "Now add a one-line docstring at the top of the function.",
    "Now add type hints to the signature.",
    "Now rename the function to `{name}_v2`.",
]
AGENT_STEPS = [
    "Explain in two sentences what this function does.",
    "The test for this function failed. Show the function with a comment above each return.",
    "Show the function again with its first parameter renamed to `{param}_value`.",
    "Show the final version of the whole function.",
]


def stdlib_source(qualname: str) -> tuple[str, str, str]:
    module, _, attr = qualname.rpartition(".")
    src = textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), attr)))
    fn = src.split("(")[0].split()[-1]
    params = src.split("(", 1)[1].split(")")[0].split(",")
    param = params[0].split("=")[0].split(":")[0].strip() or "x"
    return src.strip(), fn, param


def edit_turns(qualname: str, order=(0, 1, 2, 3)) -> list[str]:
    src, name, param = stdlib_source(qualname)
    turns = [EDITS[i].format(param=param, name=name) for i in order]
    turns = [t + " Reply with the whole function." for t in turns]
    turns[0] = f"Here is a Python function:\n```python\n{src}\n```\n{turns[0]}"
    return turns


def agent_turns(qualname: str) -> list[str]:
    src, name, param = stdlib_source(qualname)
    tool = f"Tool `read_file` returned:\n```python\n{src}\n```\n"
    return [tool + step.format(param=param, name=name) for step in AGENT_STEPS]


class TurnOnly:
    """An NgramDrafter that ignores the first `skip` tokens it is given: it knows only the turn."""

    def __init__(self, skip: int):
        self.inner, self.skip = specfast.NgramDrafter(), skip

    def extend(self, tokens):
        tokens = list(tokens)
        drop, self.skip = min(self.skip, len(tokens)), self.skip - min(self.skip, len(tokens))
        self.inner.extend(tokens[drop:])

    def propose(self, k):
        return self.inner.propose(k)

    @property
    def match_length(self):
        return self.inner.match_length


def row(out) -> dict:
    s = out.stats
    decode_s = s.seconds - s.prefill_seconds
    return {
        "ttft_s": s.prefill_seconds,
        "tok_s": (s.new_tokens - 1) / decode_s if decode_s > 0 else 0.0,
        "tokens_per_pass": s.mean_acceptance_length,
        "prefill_tokens": s.prefill_tokens,
        "reused_tokens": s.reused_tokens,
        "new_tokens": s.new_tokens,
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
    }


HF_MODES = {"transformers": "plain", "transformers_lookup": "prompt-lookup"}


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def hf_rows(hf, history: list[int], n: int, ttft: dict[str, list[float]], session_ids) -> dict:
    """transformers' rows for one turn: `n` greedy tokens on the full history, per mode."""
    rows = {}
    for name, mode in HF_MODES.items():
        out, seconds = timed(hf_engine(hf, mode, max_new_tokens=n), history)
        t_first = statistics.median(ttft[name])
        decode_s = seconds - t_first
        pairs = zip(out.token_ids, session_ids, strict=False)
        common = next((i for i, (a, b) in enumerate(pairs) if a != b), min(n, len(session_ids)))
        rows[name] = {
            "ttft_s": t_first,
            "tok_s": (n - 1) / decode_s if decode_s > 0 else 0.0,
            "tokens_per_pass": out.mean_acceptance_length,
            "prefill_tokens": len(history),
            "reused_tokens": 0,
            "new_tokens": len(out.token_ids),
            "draft_tokens": None,
            "accepted_tokens": None,
            "identical": out.token_ids == list(session_ids),
            "common_prefix": common,
        }
    return rows


def conversation(model, turns: list[str], max_new_tokens: int, repeats: int, hf=None) -> list[dict]:
    session = Session(model, max_new_tokens=max_new_tokens)
    rows = []
    for i, msg in enumerate(turns):
        # TTFT: wall time of a one-token call, session and re-prefill interleaved, median.
        ttft_s, ttft_g = [], []
        ttft_hf: dict[str, list[float]] = {name: [] for name in HF_MODES}
        for _ in range(repeats):
            one, seconds = timed(session.send, msg, max_new_tokens=1)
            ttft_s.append(seconds)
            history = session.token_ids[:-1]
            session.rewind(1)
            ttft_g.append(timed(specfast.generate, model, history, max_new_tokens=1)[1])
            if hf is not None:
                for name, mode in HF_MODES.items():
                    ttft_hf[name].append(timed(hf_engine(hf, mode, max_new_tokens=1), history)[1])
        start = len(session.token_ids)
        out = session.send(msg)
        assert out.stats.prefill_tokens == one.stats.prefill_tokens
        full = specfast.generate(model, history, max_new_tokens=max_new_tokens)
        own = specfast.generate(
            model, history, max_new_tokens=max_new_tokens, drafter=TurnOnly(start)
        )
        identical = out.token_ids == full.token_ids == own.token_ids
        # Exact in float32; in bf16 other pass shapes may flip a near-tie (docs/exactness.md §4).
        assert identical or model.dtype != torch.float32, "greedy outputs differ in float32"
        r = {
            "turn": i + 1,
            "history_tokens": len(history),
            "ttft_session_s": statistics.median(ttft_s),
            "ttft_generate_s": statistics.median(ttft_g),
            "session": row(out),
            "generate": row(full),
            "turn_only": row(own),
            "identical": identical,
        }
        if hf is not None:
            r.update(hf_rows(hf, history, len(out.token_ids), ttft_hf, out.token_ids))
            r["ttft_transformers_s"] = r["transformers"]["ttft_s"]
        rows.append(r)
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict) -> str:
    s, g, t = r["session"], r["generate"], r["turn_only"]
    ts, tg = r["ttft_session_s"], r["ttft_generate_s"]
    line = (
        f"| {r['turn']} | {r['history_tokens']} | {s['prefill_tokens']} | "
        f"{tg * 1e3:.0f} | {ts * 1e3:.0f} | {ts / tg:.2f}x | "
        f"{g['tok_s']:.1f} | {s['tok_s']:.1f} | {t['tokens_per_pass']:.2f} | "
        f"{g['tokens_per_pass']:.2f} | {s['tokens_per_pass']:.2f} | "
        f"{'yes' if r['identical'] else 'no'} |"
    )
    if "transformers" in r:
        h, lk = r["transformers"], r["transformers_lookup"]
        line += (
            f" {h['ttft_s'] * 1e3:.0f} | {h['tok_s']:.1f} | {lk['tok_s']:.1f} | "
            f"{lk['tokens_per_pass']:.2f} | {_same(h, s)} | {_same(lk, s)} |"
        )
    return line


def _same(h: dict, s: dict) -> str:
    return "yes" if h["identical"] else f"no ({h['common_prefix']}/{s['new_tokens']})"


HEADER = (
    "| turn | history tokens | session prefill | TTFT generate (ms) | TTFT session (ms) | ratio | "
    "tok/s generate | tok/s session | tokens/pass turn-only | tokens/pass generate | "
    "tokens/pass session | identical |"
)
HF_HEADER = (
    " TTFT transformers (ms) | tok/s transformers | tok/s hf lookup | tokens/pass hf lookup | "
    "transformers = session | hf lookup = session |"
)


def header(with_hf: bool) -> str:
    head = HEADER + (HF_HEADER if with_hf else "")
    return head + "\n" + "|---" * (head.count("|") - 1) + "|"


def corpus_runs(model, max_new_tokens: int) -> dict:
    """First turn of a new conversation, with and without the corpus of an earlier one."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "edit.corpus")
        earlier = Session(model, corpus=path, max_new_tokens=max_new_tokens)
        for msg in edit_turns("textwrap.dedent"):
            earlier.send(msg)
        cases = {
            "same function, edits reordered": edit_turns("textwrap.dedent", (2, 0, 3, 1)),
            "another function": edit_turns("colorsys.rgb_to_hls"),
        }
        for name, turns in cases.items():
            with_corpus = Session(model, corpus=path, max_new_tokens=max_new_tokens)
            without = Session(model, max_new_tokens=max_new_tokens)
            a, b = with_corpus.send(turns[0]), without.send(turns[0])
            assert a.token_ids == b.token_ids or model.dtype != torch.float32, "outputs differ"
            results[name] = {"with_corpus": row(a), "without": row(b)}
            ra, rb = row(a), row(b)
            print(
                f"| {name} | {rb['draft_tokens']} / {rb['accepted_tokens']} | "
                f"{ra['draft_tokens']} / {ra['accepted_tokens']} | {rb['tokens_per_pass']:.2f} | "
                f"{ra['tokens_per_pass']:.2f} | {rb['tok_s']:.1f} | {ra['tok_s']:.1f} |",
                flush=True,
            )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--tokens", type=int, default=160, help="max new tokens per turn")
    p.add_argument("--function", default="textwrap.dedent")
    p.add_argument("--repeats", type=int, default=3, help="TTFT measurements per turn (median)")
    p.add_argument("--sections", default="edit,agent,corpus", help="comma-separated subset")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument(
        "--no-transformers",
        action="store_true",
        help="leave out transformers' generate() (plain and prompt lookup)",
    )
    args = p.parse_args()
    model = specfast.load_model(dtype=args.dtype)
    hf = None
    if not args.no_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        # The same GGUF weights, in the one concrete dtype "auto" resolved to for specfast.
        dtype = str(model.dtype).removeprefix("torch.")
        hf = load_hf_model(specfast.default_model_path(), dtype, "cpu")
        hf_engine(hf, "plain", max_new_tokens=2)([1, 2, 3])  # warm-up
    info = {
        "model": str(specfast.default_model_path().name),
        "dtype": str(model.dtype).removeprefix("torch."),
        "cpu_flags": cpu_flags_label(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "transformers": None if hf is None else importlib.import_module("transformers").__version__,
        "hf_prompt_lookup_num_tokens": None if hf is None else HF_PROMPT_LOOKUP_TOKENS,
    }
    print(info)
    specfast.generate(model, [1, 2, 3], max_new_tokens=4)  # warm-up
    results: dict = {"info": info}
    sections = args.sections.split(",")
    for name, turns in (
        ("edit", edit_turns(args.function)),
        ("agent", agent_turns(args.function)),
    ):
        if name not in sections:
            continue
        print(f"\n{name}: {args.function}\n{header(hf is not None)}")
        results[name] = conversation(model, turns, args.tokens, args.repeats, hf)
        if hf is not None:
            for mode in HF_MODES:
                same, n = sum(r[mode]["identical"] for r in results[name]), len(results[name])
                # float32 agrees on every turn; bf16 may flip a near-tie (docs/exactness.md §4).
                flag = "  <- differs in float32" if same < n and info["dtype"] == "float32" else ""
                print(f"{mode}: {same}/{n} turns identical to the session{flag}")
    if "corpus" in sections:
        print(
            "\ncorpus: first turn of a new conversation\n| case | drafted / accepted without | "
            "drafted / accepted with corpus | tokens/pass without | tokens/pass with | "
            "tok/s without | tok/s with |\n|---|---|---|---|---|---|---|"
        )
        results["corpus"] = corpus_runs(model, args.tokens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
