"""How much speculation can gain over llama.cpp on this machine: pass costs and an oracle.

    python benches/llama_ceiling.py [--model PATH] [--kind code-edit] [--prompts 3] [--repeats 2]

Two measurements, on one Llama (n_threads=2 unless --threads), greedy, 128 new tokens, EOS off:

- **Pass cost**: one llama_decode over n new tokens after `--context` tokens (median of 15,
  sizes interleaved; see pass_costs), as a multiple of n = 1. Verifying k drafts is a pass
  over k + 1 tokens, so with every draft accepted a round yields k + 1 tokens for
  cost(k + 1): the "ideal" row is that ratio.
- **Oracle**: specfast.generate over the Llama with a drafter that proposes the true greedy
  continuation (llama.cpp plain's own output) with fixed k, interleaved per prompt with
  llama.cpp plain, llama-cpp-python's prompt lookup, specfast's plain loop and the n-gram
  drafter (auto k). The oracle's decode rate is the ceiling any drafter can reach with that k;
  the n-gram row shows how close a real drafter gets, and the last line sets the best oracle
  against twice the lookup (#15's goal).

Rates are decode rates (tokens after the first over the time after the first), medians over
prompts and repeats, as ratios to llama.cpp plain in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import specfast
from specfast.bench.llama import llama_cpp_engine, load_llamas
from specfast.bench.workloads import build_workloads
from specfast.hardware import cpu_flags_label
from specfast.model import Model
from specfast.targets.base import default_model_path
from specfast.targets.llama_cpp import LlamaDecoder

PASS_SIZES = (1, 2, 3, 4, 5, 7, 9, 13, 17)
ORACLE_KS = (2, 4, 8, 12, 16)


class Oracle:
    """Proposes the true continuation: `truth` is the reference output after `n_prompt`."""

    def __init__(self, truth: list[int], n_prompt: int):
        self.truth, self.n_prompt, self.seq = truth, n_prompt, []

    def extend(self, tokens) -> None:
        self.seq.extend(tokens)

    def reset(self) -> None:
        self.seq = []

    def propose(self, k: int) -> list[int]:
        i = len(self.seq) - self.n_prompt
        return self.truth[i : i + k]


def pass_costs(target, context: int, sizes=PASS_SIZES, repeats: int = 15) -> dict[int, float]:
    """n -> median seconds of one pass over n tokens after `context` tokens, on a Llama or on a
    specfast Model (its own decoder, at the model's dtype).

    The sizes are timed round-robin (one pass of each n per round, after an untimed warm-up
    round), so the machine's drift over the minutes this takes falls on every n alike; timed n by
    n, the first size measured right after the prefill read slow. t(1) is the middle one of
    three consecutive steps, as plain decoding runs them: one step timed after a rollback read
    14-16 % slower than a step in a run (Qwen2.5-Coder 1.5B Q4_K_M on a Zen 4, 2026-12-01), and
    t(1) timed first and alone made plain decoding look slower than it is, so every replayed
    speedup read high (t(1) 51 ms, now 44; the clock's plain steps 36-42)."""
    if isinstance(target, Model):
        dec, vocab = target.decoder(context + max(*sizes, 3)), target.vocab_size
    else:
        dec, vocab = LlamaDecoder(target), target.n_vocab()
    gen = torch.Generator().manual_seed(0)
    dec.forward(torch.randint(100, vocab - 100, (context,), generator=gen), True)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            steps = 3 if n == 1 else 1
            taken = []
            for _ in range(steps):
                ids = torch.randint(100, vocab - 100, (n,), generator=gen)
                t0 = time.perf_counter()
                dec.forward_greedy(ids)
                taken.append(time.perf_counter() - t0)
            dec.rollback(context)
            if r:  # round 0 warms up
                times[n].append(taken[steps // 2])
    dec.reset()
    return {n: statistics.median(t) for n, t in times.items()}


def decode_rate(n_tokens: int, seconds: float, prefill_seconds: float) -> float:
    return (n_tokens - 1) / (seconds - prefill_seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M Q4_1)")
    p.add_argument("--kind", default="code-edit")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=500)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    path = args.model or default_model_path()
    llamas = load_llamas(
        path, ["llama.cpp-plain", "llama.cpp-lookup"], None, n_threads=args.threads
    )
    llama = llamas["target"]
    costs = pass_costs(llama, args.context)
    base = costs[1]
    print(f"{path}  ({cpu_flags_label()}, n_threads={args.threads})")
    print("tokens in the pass:  " + "  ".join(f"{n:>5}" for n in costs))
    print("cost / one token:    " + "  ".join(f"{c / base:5.2f}" for c in costs.values()))
    print("ideal tokens / cost: " + "  ".join(f"{n * base / c:5.2f}" for n, c in costs.items()))

    template = llama.metadata.get("tokenizer.chat_template")
    plain = llama_cpp_engine(llama, max_new_tokens=args.tokens)
    lookup = llama_cpp_engine(llamas["lookup"], max_new_tokens=args.tokens)
    rates: dict[str, list[float]] = {}
    for w in build_workloads([args.kind], args.prompts):
        text = w.render(template) if w.chat else w.render()
        ids = list(llama.tokenize(text.encode(), add_bos=True, special=True))
        truth = plain(ids).token_ids
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ref = plain(ids)
            rates.setdefault("llama.cpp plain", []).append(
                decode_rate(len(ref.token_ids), time.perf_counter() - t0, ref.prefill_seconds)
            )
            t0 = time.perf_counter()
            looked = lookup(ids)
            rates.setdefault("llama.cpp lookup", []).append(
                decode_rate(len(looked.token_ids), time.perf_counter() - t0, looked.prefill_seconds)
            )
            runs = [("specfast plain", None, "auto"), ("specfast n-gram (auto k)", "ngram", "auto")]
            runs += [(f"oracle k={k}", Oracle(truth, len(ids)), k) for k in ORACLE_KS]
            for name, drafter, k in runs:
                t0 = time.perf_counter()
                out = specfast.generate(
                    llama,
                    ids,
                    max_new_tokens=args.tokens,
                    drafter=drafter,
                    num_speculative_tokens=k,
                    eos_token_id=[],
                )
                seconds = time.perf_counter() - t0
                rate = decode_rate(len(out.token_ids), seconds, out.stats.prefill_seconds)
                rates.setdefault(name, []).append(rate)
    ref_rate = statistics.median(rates["llama.cpp plain"])
    print(f"\n{args.kind}, {args.prompts} prompts x {args.repeats} repeats, {args.tokens} tokens")
    ratio = {name: statistics.median(values) / ref_rate for name, values in rates.items()}
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:26s} {median:7.1f} tok/s  {ratio[name]:5.2f}x llama.cpp plain")
    best = max((r, name) for name, r in ratio.items() if name.startswith("oracle"))
    print(
        f"best oracle ({best[1]}) {best[0]:.2f}x against twice the lookup "
        f"{2 * ratio['llama.cpp lookup']:.2f}x: with k up to {max(ORACLE_KS)}, no drafter "
        f"could pass {best[0]:.2f}x here"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "model": str(path),
                    "cpu_flags": cpu_flags_label(),
                    "pass_seconds": costs,
                    "decode_rates": rates,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
