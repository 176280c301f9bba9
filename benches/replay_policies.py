"""Which n-gram match policy drafts best on real workloads? Replays the target's own greedy output.

For each workload prompt, SmolLM2-135M (float32) generates 128 tokens greedily once. Then each
drafter configuration is replayed against that fixed output: a round proposes k tokens from the
committed context, accepts the longest prefix that equals the true continuation, and commits it
plus one token. Tokens per round is the mean acceptance length the drafter would get with a fixed
k, free of timing noise. transformers' prompt-lookup search (n-gram sizes 2 then 1, earliest
match, k=10) is replayed the same way for reference.

    python benches/replay_policies.py [--per-kind 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import statistics

import specfast
from specfast.bench.workloads import KINDS, build_workloads


def replay(propose, prompt: list[int], output: list[int]) -> float:
    """Tokens per target pass over `output` when `propose(context, k)` drafts."""
    seq, i, passes = list(prompt), 0, 0
    while i < len(output):
        draft = propose(seq)
        n = 0
        while n < len(draft) and i + n < len(output) and draft[n] == output[i + n]:
            n += 1
        step = min(n + 1, len(output) - i)
        seq.extend(output[i : i + step])
        i += step
        passes += 1
    return len(output) / passes


def hf_prompt_lookup(seq: list[int], k: int = 10, max_ngram: int = 2) -> list[int]:
    """transformers' search: the earliest earlier occurrence of the last n tokens, n = 2 then 1."""
    for n in range(max_ngram, 0, -1):
        if len(seq) <= n:
            continue
        tail = seq[-n:]
        for start in range(len(seq) - n):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


def ngram_proposer(policy: str, k: int, min_match: int = 1):
    state = {"d": None, "fed": 0}

    def propose(seq: list[int]) -> list[int]:
        if state["d"] is None:
            state["d"] = specfast.NgramDrafter(policy=policy, min_match=min_match)
        state["d"].extend(seq[state["fed"] :])
        state["fed"] = len(seq)
        return state["d"].propose(k)

    return propose


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-kind", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()

    model = specfast.load_model(specfast.default_model_path(), dtype="float32")
    cases = []
    for w in build_workloads(KINDS, args.per_kind):
        ids = model.tokenizer.encode(w.render(model.chat_template)).ids
        out = specfast.generate(model, ids, max_new_tokens=args.tokens, drafter=None)
        cases.append((w.kind, ids, out.token_ids))

    configs = {"transformers prompt lookup (n<=2, earliest), k=10": lambda: hf_prompt_lookup}
    for policy in ("earliest", "recent", "frequent"):
        for k in (4, 10, 16):
            configs[f"{policy}, k={k}"] = lambda p=policy, k=k: ngram_proposer(p, k)
    print("| drafter | " + " | ".join(KINDS) + " |")
    print("|---|" + "---|" * len(KINDS))
    for name, make in configs.items():
        cells = []
        for kind in KINDS:
            vals = [replay(make(), p, o) for kd, p, o in cases if kd == kind]
            cells.append(f"{statistics.median(vals):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
