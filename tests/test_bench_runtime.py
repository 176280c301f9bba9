"""benches/bench_runtime.py's bookkeeping: with --interleave each bucket's row gets its own
pass times, whatever order the passes ran in, and rounds run with the threads far apart are
reported apart from the others."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import bench_runtime


def test_interleaved_rows_get_their_own_bucket_times(monkeypatch):
    # A pass over n tokens "takes" n ms: a row given another bucket's times would show it.
    monkeypatch.setattr(bench_runtime, "pass_time", lambda dec, feed: 1e-3 * feed.shape[0])
    rows = bench_runtime.main(
        ["--shapes", "tiny", "--ns", "1", "2", "4", "--repeats", "3", "--interleave"]
    )["rows"]
    assert [r["n"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert "error" not in r
        assert r["seconds"] == 1e-3 * r["n"] and r["vs_n1"] == r["n"]


def test_rounds_with_the_threads_far_apart_are_reported_apart(monkeypatch):
    # Every other round "has" its threads 4 x farther apart, and its passes take 1.5 x as long:
    # a median over all rounds would be neither figure.
    state = {"round": -1}

    def round_trip(device):
        state["round"] += 1
        return 0.2e-6 if state["round"] % 2 == 1 else 0.05e-6

    def pass_time(dec, feed):
        slow = 1.5 if state["round"] % 2 == 1 else 1.0
        return 1e-3 * feed.shape[0] * slow

    monkeypatch.setattr(bench_runtime, "round_trip", round_trip)
    monkeypatch.setattr(bench_runtime, "pass_time", pass_time)
    rows = bench_runtime.main(
        ["--shapes", "tiny", "--ns", "1", "4", "--repeats", "6", "--interleave"]
    )["rows"]
    for r in rows:
        assert (r["rounds"], r["far_rounds"]) == (6, 3)
        assert r["seconds"] == 1e-3 * r["n"] and r["vs_n1"] == r["n"]
        assert r["round_trip_seconds"] == 0.05e-6
        assert r["far"]["seconds"] == 1.5e-3 * r["n"] and r["far"]["vs_n1"] == r["n"]
        assert r["far"]["round_trip_seconds"] == 0.2e-6
