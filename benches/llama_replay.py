"""Auto k over llama.cpp without timing noise: replay drafters against the target's greedy output,
priced by the target's measured pass costs.

    python benches/llama_replay.py --model PATH [--kind code-edit] [--prompts 6] [--cache F.json]
        [--costs-of llama.cpp|specfast] [--max-pass 17] [--autok-rev REV]

Once per model (cached in `--cache`): the pass cost t(n) of one llama_decode over n = 1..17 new
tokens after `--context` tokens (median of 9), and llama.cpp's own greedy output for each prompt.
`--costs-of specfast` prices the same text with specfast's torch runtime's passes instead (the
GGUF loaded at dtype auto), and `--max-pass N` times passes up to N tokens (each such table is
cached beside the first). `--autok-rev REV` replays auto k as of another revision's autok.py.
Then each policy is replayed over those outputs: a round proposes, accepts the longest prefix equal
to the true continuation, commits it plus one token and is charged t(k + 1). The figure is
N t(1) / sum of the rounds' costs, the speedup over plain decoding if the loop itself were free.
Auto k runs the real AutoK (drafters.make_drafter), fed the table's costs as its measured
seconds, with its rates and pass costs carried from prompt to prompt as in one process (the
prompts are replayed twice; the second pass is reported). The lookup row replays
llama-cpp-python's LlamaPromptLookupDecoding search (2- then 1-gram, earliest, 10 tokens).
"n-gram hindsight" is the ceiling of every k policy for the n-gram's proposals: each round it
takes the k that maximises (tokens it yields) / t(k + 1), knowing how much of a 16-token
proposal is right. "oracle" drafts the true continuation.

A policy that wins here can still lose on the clock (the replay ignores per-round overhead and
the scatter of real pass times); confirm it with benches/autok_ab.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from autok_ab import load_autok, use  # benches/, next to this script
from llama_ceiling import pass_costs

import specfast
from specfast.bench.llama import llama_cpp_engine, load_llamas
from specfast.bench.workloads import build_workloads
from specfast.drafters import make_drafter
from specfast.drafters.base import DraftSetup
from specfast.hardware import cpu_flags_label

MAX_PASS = 17


def measure(model: str, kind: str, prompts: int, tokens: int, context: int) -> dict:
    """The pass-cost table and llama.cpp plain's greedy output for each prompt."""
    llama = load_llamas(Path(model), ["llama.cpp-plain"], None, n_threads=2)["target"]
    costs = pass_costs(llama, context, sizes=range(1, MAX_PASS + 1), repeats=9)
    template = llama.metadata.get("tokenizer.chat_template")
    plain = llama_cpp_engine(llama, max_new_tokens=tokens)
    runs = []
    for w in build_workloads([kind], prompts):
        text = w.render(template) if w.chat else w.render()
        ids = list(llama.tokenize(text.encode(), add_bos=True, special=True))
        runs.append({"name": w.name, "prompt": ids, "output": plain(ids).token_ids})
    return {"model": model, "cpu_flags": cpu_flags_label(), "costs": costs, "runs": runs}


def accepted(draft: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(draft) and n < len(truth) and draft[n] == truth[n]:
        n += 1
    return n


class ReplayTarget:
    """Stands for the target in AutoK's per-target tables (weakly keyed: a bare object() is
    not weakly referenceable, so every call would start fresh)."""


def replay_auto(runs: list[dict], costs: dict[int, float], key: object) -> list[float]:
    """Speedup per run of drafter="ngram" with auto k; `key` stands for the target. The runs are
    replayed twice and the second pass is reported: the first measures pass costs and leaves
    its rates, as earlier calls on one Llama do."""
    return _replay_auto(runs + runs, costs, key)[len(runs) :]


def _replay_auto(runs: list[dict], costs: dict[int, float], key: object) -> list[float]:
    out = []
    for run in runs:
        truth = run["output"]
        d = make_drafter("ngram", DraftSetup(key, None, 1 << 20, vocabulary=None))
        d.extend(run["prompt"])
        d.extend(truth[:1])
        i, seconds = 1, 0.0
        while i < len(truth):
            p = d.propose(len(truth) - i - 1)
            n = accepted(p.tokens, truth[i:])
            t = costs[len(p.tokens) + 1]
            d.observe(p, n, t, None)
            d.extend(truth[i : i + n + 1])
            i, seconds = i + n + 1, seconds + t
        out.append((len(truth) - 1) * costs[1] / seconds)
    return out


def replay_fixed(runs: list[dict], costs: dict[int, float], propose) -> list[float]:
    """Speedup per run when `propose(context, truth_ahead)` drafts (fixed policies, oracles),
    with passes up to the longest `costs` has."""
    out, max_pass = [], max(costs)
    for run in runs:
        truth, seq = run["output"], list(run["prompt"]) + run["output"][:1]
        i, seconds = 1, 0.0
        while i < len(truth):
            draft = propose(seq, truth[i:])[: min(max_pass - 1, len(truth) - i - 1)]
            n = accepted(draft, truth[i:])
            seconds += costs[len(draft) + 1]
            seq.extend(truth[i : i + n + 1])
            i += n + 1
        out.append((len(truth) - 1) * costs[1] / seconds)
    return out


def lookup(seq: list[int], k: int = 10, max_ngram: int = 2) -> list[int]:
    """LlamaPromptLookupDecoding's search: the earliest occurrence of the last 2 then 1 tokens."""
    for n in range(max_ngram, 0, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


def ngram_hindsight(costs: dict[int, float]):
    def propose(seq, truth):
        d = specfast.NgramDrafter()
        d.extend(seq)
        draft = d.propose(max(costs) - 1)
        n = accepted(draft, truth)
        best = max(range(len(draft) + 1), key=lambda k: (min(k, n) + 1) / costs[k + 1])
        return draft[:best]

    return propose


def ngram_fixed(k: int):
    def propose(seq, _truth):
        d = specfast.NgramDrafter()
        d.extend(seq)
        return d.propose(k)

    return propose


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--kind", default="code-edit")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=500)
    p.add_argument("--cache", default=None, help="JSON of the costs and outputs, reused if there")
    p.add_argument("--costs-of", choices=("llama.cpp", "specfast"), default="llama.cpp")
    p.add_argument("--max-pass", type=int, default=MAX_PASS)
    p.add_argument("--autok-rev", default=None, help="replay auto k as of this git revision")
    args = p.parse_args()
    cache = Path(args.cache) if args.cache else None
    if cache and cache.exists():
        data = json.loads(cache.read_text())
    else:
        data = measure(args.model, args.kind, args.prompts, args.tokens, args.context)
        if cache:
            cache.write_text(json.dumps(data))
    table = "costs"
    if (args.costs_of, args.max_pass) != ("llama.cpp", MAX_PASS):
        table = f"costs of {args.costs_of}, to {args.max_pass}"
        if table not in data:
            if args.costs_of == "specfast":
                target = specfast.load_model(Path(data["model"]))
            else:
                target = load_llamas(Path(data["model"]), ["llama.cpp-plain"], None, n_threads=2)
                target = target["target"]
            sizes = range(1, args.max_pass + 1)
            data[table] = pass_costs(target, args.context, sizes=sizes, repeats=9)
            if cache:
                cache.write_text(json.dumps(data))
    costs = {int(n): t for n, t in data[table].items()}
    if args.autok_rev:
        use(load_autok(args.autok_rev))
    runs = data["runs"]
    print(f"{data['model']}  (outputs on {data['cpu_flags']}; now {cpu_flags_label()})")
    print(f"{args.kind}, {len(runs)} prompts, priced by {table}")
    print("t(n)/t(1): " + " ".join(f"{n}:{costs[n] / costs[1]:.2f}" for n in costs))
    rows = {"auto k (n-gram)": replay_auto(runs, costs, ReplayTarget())}
    rows["llama.cpp lookup (k=10)"] = replay_fixed(runs, costs, lambda s, _t: lookup(s))
    for k in (4, 8, 10, 16):
        rows[f"n-gram k={k}"] = replay_fixed(runs, costs, ngram_fixed(k))
    rows["n-gram hindsight"] = replay_fixed(runs, costs, ngram_hindsight(costs))
    for k in sorted({4, 8, 16, max(costs) - 1}):
        rows[f"oracle k={k}"] = replay_fixed(runs, costs, lambda _s, t, k=k: t[:k])
    for name, values in rows.items():
        each = " ".join(f"{v:5.2f}" for v in values)
        print(
            f"  {name:24s} median {statistics.median(values):5.2f}x  mean "
            f"{statistics.mean(values):5.2f}x   [{each}]"
        )


if __name__ == "__main__":
    main()
