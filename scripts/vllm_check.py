"""End to end on vLLM: specfast's drafter leaves greedy output unchanged and gets drafts accepted.

Run by scripts/vllm_check.sh in a venv with vLLM (its CPU build here). Builds a tiny random
Llama with transformers (head_dim 64), then generates greedily from token-id prompts, short and
long, three ways, each in its own process (a vLLM engine per process): without speculation, with
specfast's proposer (V1: method "custom_class"; V2: method "specfast") and with vLLM's own
"ngram". Fails unless specfast's outputs equal the plain ones token for token and vLLM's metrics
show drafts accepted. Prints a table (and writes JSON with --out).
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


def spec_metrics(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters so far: drafts, draft tokens, accepted tokens."""
    return {
        m.name.removeprefix("vllm:spec_decode_"): getattr(m, "value", 0)
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num_")
    }


def run(model: str, method: str, out: str) -> None:
    """One engine: generate every prompt set greedily, record tokens, time and metrics."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_LEN,
        enforce_eager=True, disable_log_stats=False, seed=0, max_num_seqs=8,
        speculative_config=speculative_config(method, vllm.__version__),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    result: dict = {"vllm": vllm.__version__, "sets": {}}
    for name, ids in prompts().items():
        llm.generate([TokensPrompt(prompt_token_ids=ids[0])], params)  # warm up
        before = spec_metrics(llm)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params)
        seconds = time.perf_counter() - start
        after = spec_metrics(llm)
        result["sets"][name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "seconds": seconds,
            "metrics": {key: after[key] - before.get(key, 0) for key in after},
        }
    if "model" in (speculative_config(method, vllm.__version__) or {}):  # the V1 proposer
        result["proposer"] = llm.collective_rpc(proposer_state)[0]
    Path(out).write_text(json.dumps(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument(
        "--run", nargs=3, metavar=("MODEL", "METHOD", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.run:
        run(*args.run)
        return 0
    # (Insecure serialization lets `collective_rpc` send `proposer_state` to the worker: our
    # own function, in our own engine.)
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-llama"
        make_model(model)
        results = {}
        for method in ("plain", "specfast", "ngram"):
            out = Path(tmp) / f"{method}.json"
            cmd = [sys.executable, __file__, "--run", str(model), method, str(out)]
            subprocess.run(cmd, check=True, env=env)
            results[method] = json.loads(out.read_text())
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
