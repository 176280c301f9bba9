"""Collect `bench_*.py` files too, so `pytest benches --benchmark-enable` finds every benchmark.

(pyproject's testpaths keep benches/ out of the normal run; --benchmark-disable is its default.)
"""

import pytest


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
