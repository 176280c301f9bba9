"""A quantized model's passes over a float16 KV cache against a float32 one, in one process.

Both decoders hold the same context; their passes alternate (f16, f32, f16, ...) so that the
machine's drift falls on both alike. One row per (context, tokens per pass): the median time
of each and their ratio. int8 and q4 models decode over float16 by default (`Model.kv_dtype`).

    python benches/bench_kv_cache.py                        # SmolLM2 q4, 500 and 2000 tokens
    python benches/bench_kv_cache.py --weights int8 --contexts 500 --ns 1 9 --repeats 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specfast
from specfast.hardware import cpu_flags_label


def decoder(model, kv_dtype: torch.dtype, ids: torch.Tensor):
    """A decoder over a cache of `kv_dtype` that holds `ids`."""
    model.kv_dtype = kv_dtype
    dec = model.decoder(len(ids) + 32)
    model.kv_dtype = None
    dec.forward(ids, last_only=True)
    return dec


def pair_times(decs: dict, feed: torch.Tensor, length: int, repeats: int) -> dict:
    """{name: median seconds} of one pass over `feed` after `length` tokens, passes alternating
    between the decoders."""
    times: dict = {name: [] for name in decs}
    for _ in range(repeats):
        for name, dec in decs.items():
            dec.rollback(length)
            t = time.perf_counter()
            dec.forward_greedy(feed)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2-135M)")
    p.add_argument("--weights", choices=("q4", "int8"), default="q4")
    p.add_argument("--contexts", type=int, nargs="+", default=[500, 2000])
    p.add_argument("--ns", type=int, nargs="+", default=[1, 9], help="tokens per pass")
    p.add_argument("--repeats", type=int, default=150)
    a = p.parse_args(argv)
    model = specfast.load_model(a.model, weights=a.weights)
    print(f"cpu ({cpu_flags_label()}), {model.weights} weights, {torch.get_num_threads()} threads")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in a.contexts:
        ids = torch.randint(0, model.vocab_size, (length + max(a.ns),), generator=gen)
        decs = {n: decoder(model, d, ids[:length]) for n, d in
                (("float16", torch.float16), ("float32", torch.float32))}  # fmt: skip
        for n in a.ns:
            t = pair_times(decs, ids[length : length + n], length, a.repeats)
            row = {"context": length, "n": n, **t, "ratio": t["float16"] / t["float32"]}
            rows.append(row)
            print(
                f"after {length:5d} tokens, {n:2d} per pass: float16 {t['float16'] * 1e3:.2f} ms,"
                f" float32 {t['float32'] * 1e3:.2f} ms, x{row['ratio']:.2f}"
            )
    return rows


if __name__ == "__main__":
    main()
