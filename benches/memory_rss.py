"""Resident memory of the default model: after load_model, after one generate(), and the peak.

    python benches/memory_rss.py --dtype bfloat16 [--keep-plain]

--keep-plain keeps the plain weights next to their oneDNN-packed copies (what specfast did
before packing replaced them), for the before/after comparison in the README. Linux only
(/proc/self/statm, ru_maxrss in KiB).
"""

from __future__ import annotations

import argparse
import gc
import resource

import specfast
from specfast.model import Model


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--keep-plain", action="store_true")
    args = p.parse_args()
    if args.keep_plain:
        # Packing then leaves every plain matrix in place, as before.
        real = Model.packed_weights

        def keep_plain(self):
            compiled, self.compiled_step = self.compiled_step, self.compiled_step or object()
            try:
                return real(self)
            finally:
                self.compiled_step = compiled

        Model.packed_weights = keep_plain
    model = specfast.load_model(dtype=args.dtype)
    gc.collect()
    after_load = rss_mb()
    specfast.generate(model, "def f(x):\n    return", max_new_tokens=8)
    gc.collect()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"dtype={model.dtype} keep_plain={args.keep_plain}: after load {after_load:.0f} MB, "
        f"after one generate {rss_mb():.0f} MB, peak {peak:.0f} MB"
    )


if __name__ == "__main__":
    main()
