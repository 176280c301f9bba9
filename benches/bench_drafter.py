"""Drafter cost per round at 1k, 32k and 128k tokens of context, against transformers' search.

A round is what the generate loop does between target passes: extend with 1-8 accepted tokens,
then propose(8). The text is real: CPython standard-library sources, split on whitespace, each
distinct word mapped to an id (no tokenizer needed; about 30k distinct ids). Every context size
runs the same rounds, on the same tokens: the n tokens before them are the context. (Rounds on
different text would measure the text as much as the context size: the same code taking its
rounds 32k tokens further into the stdlib costs ~1.8x more with a 1k context.) Timing starts after
ROUNDS_PER_CALL untimed rounds: indexing a 128k-token prompt sweeps the CPU caches, and the
interpreter's first calls after it pay ~20 µs to bring its own code and data back, once per
prompt, which the first 64 rounds would otherwise share out as ~0.3-0.8 µs each.

    pytest benches/bench_drafter.py --benchmark-enable    # pytest-benchmark figures
    python benches/bench_drafter.py                       # the README table, interleaved
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from specfast import NgramDrafter

SIZES = [1_024, 32_768, 131_072]
ROUNDS_PER_CALL = 64  # rounds timed per call; accepted counts cycle through 1..8
STEPS = [1 + (i * 5) % 8 for i in range(ROUNDS_PER_CALL)]


# ---- workload


def stdlib_tokens(n: int) -> list[int]:
    """The first n whitespace-split words of the stdlib's .py files (sorted by path), as ids."""
    root = Path(os.__file__).parent
    vocab: dict[str, int] = {}
    out: list[int] = []
    for path in sorted(root.glob("*.py")):
        for word in path.read_text(encoding="utf-8", errors="replace").split():
            out.append(vocab.setdefault(word, len(vocab)))
        if len(out) >= n:
            break
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} stdlib tokens found, need {n}")
    return out[:n]


TOKENS = stdlib_tokens(max(SIZES) + 2 * sum(STEPS) + 16)
START = max(SIZES)  # where the rounds begin, whatever the context size
TIMED = START + sum(STEPS)  # where the timed rounds begin, after as many untimed ones


# ---- transformers' prompt-lookup search, re-implemented faithfully


def hf_prompt_lookup(
    input_ids: torch.Tensor, max_matching_ngram_size: int = 2, num_output_tokens: int = 10
) -> torch.Tensor:
    """PromptLookupCandidateGenerator.get_candidates from transformers, for batch 1."""
    input_length = input_ids.size(1)
    for ngram_size in range(min(max_matching_ngram_size, input_length - 1), 0, -1):
        # (1, L - n + 1, n): every n-gram of the context, compared with the last one
        windows = input_ids.unfold(dimension=1, size=ngram_size, step=1)
        ngram_tensor = input_ids[0, -ngram_size:]
        matches = (windows == ngram_tensor).all(dim=2)
        match_indices = matches.nonzero(as_tuple=True)[1]
        for idx in match_indices:  # earliest first
            start_idx = idx + ngram_size
            end_idx = min(start_idx + num_output_tokens, input_length)
            if start_idx < end_idx:
                return input_ids[0, start_idx:end_idx]
    return input_ids.new_empty(0)


# ---- one timed call: ROUNDS_PER_CALL rounds after a context of n tokens


def specfast_setup(n: int, policy: str = "earliest") -> NgramDrafter:
    """A drafter that has indexed n tokens of context, then played the untimed rounds."""
    d = NgramDrafter(policy=policy)
    d.extend(TOKENS[START - n : START])
    specfast_rounds(d, n, START)
    return d


def specfast_rounds(d: NgramDrafter, n: int, start: int = TIMED) -> int:
    pos = start
    proposed = 0
    for step in STEPS:
        d.extend(TOKENS[pos : pos + step])
        pos += step
        proposed += len(d.propose(8))
    return proposed


def hf_setup(n: int) -> torch.Tensor:
    """The same context as specfast_setup's, untimed rounds included (the search keeps no state)."""
    return torch.tensor([TOKENS[START - n : TIMED]], dtype=torch.long)


def hf_rounds(ids: torch.Tensor, n: int) -> int:
    pos = TIMED
    proposed = 0
    for step in STEPS:
        new = torch.tensor([TOKENS[pos : pos + step]], dtype=torch.long)
        ids = torch.cat([ids, new], dim=1)  # as assisted generation grows input_ids
        pos += step
        proposed += len(hf_prompt_lookup(ids))
    return proposed


# ---- pytest-benchmark


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
def test_specfast_round(benchmark, n: int) -> None:
    benchmark.extra_info["rounds_per_call"] = ROUNDS_PER_CALL
    benchmark.pedantic(
        specfast_rounds, setup=lambda: ((specfast_setup(n), n), {}), rounds=30, iterations=1
    )


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
def test_hf_round(benchmark, n: int) -> None:
    benchmark.extra_info["rounds_per_call"] = ROUNDS_PER_CALL
    benchmark.pedantic(hf_rounds, setup=lambda: ((hf_setup(n), n), {}), rounds=5, iterations=1)


def indexed(n: int) -> NgramDrafter:
    """A drafter that has indexed n tokens of context, as after a prompt."""
    d = NgramDrafter()
    d.extend(TOKENS[START - n : START])
    return d


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
def test_memory_per_token(benchmark, n: int) -> None:
    d = benchmark.pedantic(indexed, args=(n,), rounds=1, iterations=1)
    benchmark.extra_info["bytes_per_token"] = d.memory_bytes() / len(d)


# ---- the README table: interleaved medians, per round


def _median_round_us(setup: Callable, run: Callable, n: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        state = setup(n)
        t0 = time.perf_counter()
        run(state, n)
        times.append((time.perf_counter() - t0) / ROUNDS_PER_CALL)
    return statistics.median(times) * 1e6


def replay(tokens: list[int], policy: str, k: int) -> float:
    """Tokens per target pass if the target's output were `tokens` (greedy replay)."""
    d = NgramDrafter(policy=policy)
    start = len(tokens) // 2
    d.extend(tokens[:start])
    pos, passes = start, 0
    while pos < len(tokens):
        draft = d.propose(k)
        accepted = 0
        while accepted < len(draft) and pos + accepted < len(tokens):
            if draft[accepted] != tokens[pos + accepted]:
                break
            accepted += 1
        step = min(accepted + 1, len(tokens) - pos)
        d.extend(tokens[pos : pos + step])
        pos += step
        passes += 1
    return (len(tokens) - start) / passes


def main() -> None:
    torch.set_num_threads(1)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, one thread")
    print()
    print("| context | specfast µs/round | HF-style µs/round | HF / specfast | bytes/token |")
    print("|---|---|---|---|---|")
    base = None
    for n in SIZES:
        sf, hf = [], []
        for _ in range(3):  # interleave the two so drift hits both alike
            sf.append(_median_round_us(specfast_setup, specfast_rounds, n, 7))
            hf.append(_median_round_us(hf_setup, hf_rounds, n, 1))
        s, h = statistics.median(sf), statistics.median(hf)
        base = base or s
        mem = indexed(n).memory_bytes() / n
        print(f"| {n // 1024}k | {s:.2f} | {h:.0f} | ×{h / s:,.0f} | {mem:.0f} |")
    print()
    print(f"specfast round at 128k / at 1k: ×{s / base:.2f}")
    print()
    print("Greedy replay of the second half of 64k stdlib words, tokens per target pass:")
    print("| policy | k=8 | k=16 |")
    print("|---|---|---|")
    text = TOKENS[: 1 << 16]
    for policy in ["earliest", "recent", "frequent"]:
        print(f"| {policy} | {replay(text, policy, 8):.3f} | {replay(text, policy, 16):.3f} |")
    for policy in ["earliest", "recent", "frequent"]:
        t0 = time.perf_counter()
        specfast_setup(max(SIZES), policy)
        ms = (time.perf_counter() - t0) * 1e3
        print(f"extend of {max(SIZES) // 1024}k tokens, {policy}: {ms:.0f} ms")


if __name__ == "__main__":
    main()
