"""Fused 4-D attention against the 3-D path it replaced, whole passes of a real model, one process.

Until the change, q, k and v reached scaled_dot_product_attention as 3-D (Hkv, g*T, hd) tensors,
the g query heads of a kv head folded into its rows and the mask repeated g times;
`model.model.attention` hands them over as 4-D grouped-query heads, as CUDA's fused
kernels need (recent torch's CPU flash kernel takes both), causal for a prefill from position 0.
Here both run the same passes of the same model, interleaved (old, new,
old, new, ...) so the machine's load weighs on both alike; the median and the minimum of each
are reported:

- prefill: 512 and 2048 tokens into an empty cache (new: causal, old: an explicit mask);
- verify: 9 tokens after 500 of context (both: a (T, L) mask);
- decode: 1 token after 500 (no mask).

    python benches/bench_attention.py                       # SmolLM2-135M, float32 weights
    python benches/bench_attention.py --repeats 5 --json attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import specfast
from specfast.hardware import cpu_flags_label
from specfast.model import model as model_module

FUSED = model_module.attention


def attention_3d(q, k, v, mask=None, causal=False):
    """The path before: q (H, T, hd) regrouped per kv head as (Hkv, g*T, hd) (a copy), the
    (T, L) mask repeated g times (a prefill's too), 3-D SDPA. -> (H, T, hd)."""
    H, T, hd = q.shape
    Hkv, L = k.shape[:2]
    g = H // Hkv
    if causal:
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril_(L - T)
    if mask is not None:
        mask = _repeated(mask, g)
    y = F.scaled_dot_product_attention(q.reshape(Hkv, g * T, hd), k, v, attn_mask=mask)
    return y.view(H, T, hd)


_last: list = [None, None]


def _repeated(mask: torch.Tensor, g: int) -> torch.Tensor:
    """mask.repeat(g, 1), made once per pass as the old code did, not once per layer."""
    if _last[0] is not mask:
        _last[:] = [mask, mask.repeat(g, 1)]
    return _last[1]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def passes(decoder, ids) -> dict:
    """name -> a function running that pass once on `decoder` (set up by the function)."""

    def prefill(n):
        def run():
            decoder.reset()
            decoder.forward(ids[:n], last_only=True)

        return run

    def after_context(n):
        def run():
            decoder.rollback(500)
            decoder.forward(ids[500 : 500 + n])

        return run

    return {
        "prefill 512": prefill(512),
        "prefill 2048": prefill(2048),
        "verify 9 after 500": after_context(9),
        "decode 1 after 500": after_context(1),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="passes per path and case")
    p.add_argument("--passes", nargs="+", help="only these cases (default: all)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = specfast.load_model(dtype="float32", weights="float", compile="off")
    decoder = model.decoder(2048 + 16)
    ids = torch.randint(
        0, model.vocab_size, (2048 + 16,), generator=torch.Generator().manual_seed(0)
    )
    cases = passes(decoder, ids)
    results = {
        "cpu": cpu_flags_label(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(f"{results['cpu']}, {results['threads']} threads, torch {torch.__version__}")
    for name, run in cases.items():
        if args.passes and name not in args.passes:
            continue
        if name.startswith(("verify", "decode")):
            model_module.attention = FUSED
            decoder.reset()
            decoder.forward(ids[:500], last_only=True)  # the context, once (either path's keys)
        times: dict[str, list[float]] = {"3-D": [], "4-D": []}
        for i in range(args.repeats + 1):
            for label, fn in (("3-D", attention_3d), ("4-D", FUSED)):
                model_module.attention = fn
                t = timed(run)
                if i:  # the first round warms both up
                    times[label].append(t)
        model_module.attention = FUSED
        # The minimum too: on a shared machine noise only ever adds time.
        row = {}
        for stat in (statistics.median, min):
            old, new = stat(times["3-D"]), stat(times["4-D"])
            row[stat.__name__] = {"3-D ms": old * 1e3, "4-D ms": new * 1e3, "speedup": old / new}
            print(
                f"{name}, {stat.__name__}: 3-D {old * 1e3:.1f} ms, 4-D {new * 1e3:.1f} ms,"
                f" x{old / new:.2f}",
                flush=True,
            )
        results[name] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
