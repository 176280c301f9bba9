#!/usr/bin/env bash
# Builds specfast's abi3 wheel (one file for every CPython >= 3.10) into the ignored .whl/ folder,
# so a machine with no Rust, maturin or network (a lent GPU) installs it with
#   python3 -m pip install --no-index --no-deps --target DIR .whl/specfast-*.whl
# Run from anywhere; prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .whl/specfast-*.whl
# maturin is a pip package here (pyproject's build backend); the binary or the module will do.
if command -v maturin >/dev/null; then
    maturin build --release --quiet --out .whl "$@" >&2
else
    python3 -m maturin build --release --quiet --out .whl "$@" >&2
fi
ls .whl/specfast-*.whl
