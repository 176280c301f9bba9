"""benches/bench_runtime.py's bookkeeping: with --interleave each bucket's row gets its own
pass times, whatever order the passes ran in."""

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
