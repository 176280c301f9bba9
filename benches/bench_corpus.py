"""Saving and loading a persistent n-gram corpus of 1M tokens: time, and file bytes per token.

The corpus is real text: the CPython standard library's .py files (sorted by path), one document
per file, split on whitespace, each distinct word mapped to an id, cut at CORPUS_TOKENS. Three
operations are timed in turns, in one process, on the same corpus:
- build: `add_document` for every file into a fresh drafter (the indexing a load must redo);
- save:  `d.save(path)`: write a temporary file, fsync, rename;
- load:  `NgramDrafter.load(path)`: read, check, re-index.

    pytest benches/bench_corpus.py --benchmark-enable    # pytest-benchmark figures
    python benches/bench_corpus.py [DIR]                  # the README figures, interleaved
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytest

from specfast import NgramDrafter

CORPUS_TOKENS = 1_000_000


def stdlib_documents(n: int) -> list[list[int]]:
    """Whitespace-split words of the stdlib's .py files, one document per file, n ids in all."""
    root = Path(os.__file__).parent
    vocab: dict[str, int] = {}
    docs: list[list[int]] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        words = path.read_text(encoding="utf-8", errors="replace").split()
        doc = [vocab.setdefault(w, len(vocab)) for w in words[: n - total]]
        if doc:
            docs.append(doc)
            total += len(doc)
        if total >= n:
            return docs
    raise RuntimeError(f"only {total} stdlib tokens found, need {n}")


DOCS = stdlib_documents(CORPUS_TOKENS)


def build(policy: str) -> NgramDrafter:
    d = NgramDrafter(policy=policy)
    for doc in DOCS:
        d.add_document(doc)
    return d


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stdlib.sfc"
    build("earliest").save(path)
    return path


def test_build(benchmark) -> None:
    benchmark.pedantic(build, args=("earliest",), rounds=3)


def test_save(benchmark, tmp_path: Path) -> None:
    d = build("earliest")
    benchmark.pedantic(d.save, args=(tmp_path / "c.sfc",), rounds=3)


def test_load(benchmark, saved: Path) -> None:
    d = benchmark.pedantic(NgramDrafter.load, args=(saved,), rounds=3)
    assert d.corpus_tokens == CORPUS_TOKENS


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    path = folder / "stdlib.sfc"
    reps = 5
    print(f"corpus: {CORPUS_TOKENS} tokens in {len(DOCS)} documents (stdlib .py files)")
    print(f"file in {folder}; median of {reps} interleaved runs\n")
    print("| policy | build (add_document) | save | load | load / build | file bytes/token |")
    print("|---|---|---|---|---|---|")
    for policy in ["earliest", "recent", "frequent"]:
        times: dict[str, list[float]] = {"build": [], "save": [], "load": []}
        for _ in range(reps):
            t0 = time.perf_counter()
            d = build(policy)
            t1 = time.perf_counter()
            d.save(path)
            t2 = time.perf_counter()
            e = NgramDrafter.load(path)
            t3 = time.perf_counter()
            assert e.corpus_tokens == d.corpus_tokens == CORPUS_TOKENS
            times["build"].append(t1 - t0)
            times["save"].append(t2 - t1)
            times["load"].append(t3 - t2)
            del d, e
        m = {k: statistics.median(v) for k, v in times.items()}
        per_token = path.stat().st_size / CORPUS_TOKENS
        print(
            f"| {policy} | {m['build'] * 1e3:.0f} ms | {m['save'] * 1e3:.1f} ms "
            f"| {m['load'] * 1e3:.0f} ms | {m['load'] / m['build']:.2f} | {per_token:.3f} |"
        )
    path.unlink()


if __name__ == "__main__":
    main()
