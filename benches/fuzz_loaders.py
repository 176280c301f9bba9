"""Thousands of hostile model files through load_model(): the long run of
tests/test_hostile_files.py, with fresh random cases each run.

    python benches/fuzz_loaders.py --cases 2000      # per kind; prints outcome counts

Exits non-zero on the first outcome that is not a model or ValueError / TypeError /
FileNotFoundError with a message (the failing case is printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hostile_files import (
    apply,
    byte_mutations,
    dump_json,
    gguf_header_length,
    json_mutations,
    load_outcome,
    mutated_folder,
    safetensors_header_length,
    write_seeds,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def fuzz_kind(kind, case, counts, cases) -> None:
    @settings(
        max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(data=st.data())
    def run(data):
        counts[load_outcome(case(kind, data))] += 1

    run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="cases per file kind")
    ap.add_argument("--kinds", default="gguf,safetensors,config,tokenizer")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="specfast-fuzz-"))
    seeds = write_seeds(tmp)
    work = tmp / "work"
    work.mkdir()
    config = json.loads((seeds["ckpt"] / "config.json").read_text())
    tok = json.loads((seeds["ckpt"] / "tokenizer.json").read_text())
    raw_gguf = seeds["gguf"].read_bytes()
    st_seed = seeds["ckpt"] / "model.safetensors"

    def json_case(data, obj):
        if data.draw(st.booleans()):
            return dump_json(data.draw(json_mutations(obj)))
        raw = dump_json(obj)
        return apply(raw, data.draw(byte_mutations(len(raw), len(raw))))

    def case(kind, data):
        if kind == "gguf":
            edits = data.draw(byte_mutations(len(raw_gguf), gguf_header_length(seeds["gguf"])))
            path = work / "m.gguf"
            path.write_bytes(apply(raw_gguf, edits))
            return path
        if kind == "safetensors":
            edits = data.draw(
                byte_mutations(st_seed.stat().st_size, safetensors_header_length(st_seed))
            )
            return mutated_folder(
                seeds["ckpt"], work / "st", "model.safetensors", lambda b: apply(b, edits)
            )
        if kind == "config":
            text = json_case(data, config)
            return mutated_folder(seeds["ckpt"], work / "cfg", "config.json", lambda _: text)
        text = json_case(data, tok)
        return mutated_folder(seeds["ckpt"], work / "tok", "tokenizer.json", lambda _: text)

    for kind in args.kinds.split(","):
        counts: Counter[str] = Counter()
        start = time.perf_counter()
        fuzz_kind(kind, case, counts, args.cases)
        secs = time.perf_counter() - start
        print(f"{kind}: {sum(counts.values())} cases in {secs:.0f} s: {dict(counts)}", flush=True)


if __name__ == "__main__":
    main()
