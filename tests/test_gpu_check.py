"""scripts/gpu_check.sh rehearsed on this CPU (DEVICE=cpu), on the smallest shape: the wheel is
installed into a fresh --target folder and everything runs from there, with a Python that sees
neither maturin nor the editable install; each bench row lands in runtime.jsonl as measured."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
]


def wheel_is_current() -> bool:
    """A wheel in .whl/ newer than every Rust source (its Python is overlaid if older)."""
    wheels = list((ROOT / ".whl").glob("specfast-*.whl"))
    if not wheels:
        return False
    rust = [ROOT / "Cargo.toml", ROOT / "Cargo.lock", *(ROOT / "rust").rglob("*.rs")]
    return min(w.stat().st_mtime for w in wheels) > max(p.stat().st_mtime for p in rust)


def rehearse(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DEVICE": "cpu",
        "SHAPES": "tiny",
        "OUT": str(tmp_path / "out"),
        "BUILD_WHEEL": "0" if wheel_is_current() else "1",
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )


def test_rehearsal_runs_from_the_installed_wheel_and_records_every_row(tmp_path):
    p = rehearse(tmp_path, NS="1 2", REPEATS="2", CPU_TESTS="0")  # CI runs those itself
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    # specfast came from the --target folder, not from the checkout's editable install
    assert "specfast /tmp/specfast-check." in p.stdout
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "runtime.jsonl").read_text().splitlines()]
    assert [(r["step"], r["n"]) for r in rows] == [
        ("eager", 1),
        ("eager", 2),
        ("compiled", 1),
        ("compiled", 2),
    ]
    assert not [r for r in rows if "error" in r]
    assert all(r["cudagraph_skips"] == 0 and r["fraction_of_bound"] > 0 for r in rows)
    summary = (out / "summary.txt").read_text().splitlines()
    assert len(summary) == len(rows) + 1 and summary[-1].startswith("4 rows, 0 failed")
    assert "skipped" in (out / "tests.log").read_text()  # the cuda-marked tests, collected


def avoided_modules() -> list[str]:
    """The script's AVOID list: what the isolated Python must not see."""
    text = SCRIPT.read_text()
    block = text[text.index('AVOID="') + len('AVOID="') :]
    return block[: block.index('"')].split()


def test_control_a_python_that_sees_site_packages_whole_is_refused(tmp_path):
    """Without -S the site-packages of this Python are visible whole, and the rehearsal stops
    there, naming what it saw: each AVOID module this Python can import (in a venv or on the
    system Python alike; the test packages are always among them)."""
    visible = [
        m for m in avoided_modules() if m != "specfast" and importlib.util.find_spec(m) is not None
    ]
    assert visible, "the test environment imports none of AVOID: the control proves nothing"
    p = rehearse(tmp_path, PY_FLAGS="", INSTALL_ONLY="1")
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "visible to the check" in out
    assert all(f"'{m}'" in out for m in visible), (visible, out[-2000:])


def test_a_row_that_fails_is_a_row(tmp_path):
    """A shape the bench does not know: the process fails, the check records it and goes on."""
    p = rehearse(tmp_path, SHAPES="no-such-shape", NS="1", STEPS="eager")
    assert p.returncode != 0
    rows = [json.loads(line) for line in (tmp_path / "out/runtime.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["model"] == "no-such-shape" and "error" in rows[0]
