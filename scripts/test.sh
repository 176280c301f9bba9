#!/usr/bin/env bash
# The whole test suite: install, Rust tests and lints, Python lints and stub check, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The llama.cpp tests skip where llama_cpp cannot be imported; here they must run.
python3 -c "import llama_cpp"
cargo fmt --check
cargo clippy --all-targets -- -D warnings  # the default members: specfast-core, specfast-kernels
cargo clippy -p specfast-bindings --all-targets -- -D warnings  # the PyO3 crate (specfast._core)
cargo test --release
ruff check python tests benches
ruff format --check python tests benches
python3 -m mypy.stubtest specfast._core
python3 -m mypy  # python/specfast, [tool.mypy] in pyproject.toml
python3 -m pytest -q "$@"
