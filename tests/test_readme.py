"""The README's first example runs as written, on the default model, and stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_LINES = 8


def first_python_block() -> str:
    match = re.search(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_first_example_is_short():
    lines = [line for line in first_python_block().splitlines() if line.strip()]
    assert len(lines) <= MAX_LINES, f"the first example has {len(lines)} lines: keep it short"


@pytest.mark.smollm
def test_first_example_runs(capsys):
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(first_python_block(), str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    out = namespace["out"]
    assert out.text.strip(), "the example generated no text"
    assert out.stats.new_tokens > 0
    assert out.text.strip() in printed, "the example prints its text"
