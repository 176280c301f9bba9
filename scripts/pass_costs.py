"""Pass costs on a real GGUF file: specfast's weight kinds against llama.cpp on the same file.

    python scripts/pass_costs.py [FILE] [--weights file,int8,q4] [--context 300] [--rounds 7]

FILE defaults to the Qwen2.5-Coder 1.5B Q4_K_M that scripts/qwen_pair.py assembles. After
`--context` tokens of real text (textwrap's source), each engine times a one-token pass t(1) and
a 9-token verify pass t(9) from the same context, in alternating rounds so that a slow minute of
a shared machine slows every engine alike. llama.cpp runs through llama_decode
(`Llama.eval`). Also printed: the bytes a specfast pass reads, the read bound (those bytes over
the measured read rate of filled memory) and resident memory.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import textwrap
from pathlib import Path

from shape_7b import median_pass, read_bandwidth, resident_gb

DEFAULT = Path.home() / ".cache/specfast/qwen2.5-coder/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", nargs="?", default=str(DEFAULT))
    p.add_argument("--weights", default="file,int8")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()

    import torch

    import specfast
    from specfast.model.quantize import torch_threads

    path = Path(a.file)
    size = path.stat().st_size / 1e9
    bandwidth = read_bandwidth()
    print(f"{path.name}: {size:.3f} GB; read rate {bandwidth:.1f} GB/s", flush=True)
    torch.set_num_threads(2)
    runs: dict[str, object] = {}
    base = resident_gb()[0]
    ids: list[int] = []
    for kind in a.weights.split(","):
        model = specfast.load_model(str(path), dtype="float32", weights=kind)
        if not ids:
            ids = model.tokenizer.encode(inspect.getsource(textwrap)).ids[: a.context + 9]
        packed = model.packed_weights()
        read = sum(m.nbytes for layer in packed[:-1] for m in layer) + packed[-1].nbytes
        anon = resident_gb()[0] - base
        base += anon
        t = torch.tensor(ids)
        d = model.decoder(a.context + 16)
        with torch.inference_mode():
            d.forward(t[: a.context])

        def run(n, d=d, t=t):
            def step():
                d.cache.length = a.context
                with torch.inference_mode(), torch_threads(2):
                    d.forward(t[a.context : a.context + n])

            return step

        runs[kind] = run
        print(
            f"specfast {kind}: a pass reads {read / 1e9:.3f} GB (read bound "
            f"{read / 1e9 / bandwidth * 1e3:.1f} ms); model resident {anon:.2f} GB",
            flush=True,
        )

    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=a.context + 16, n_threads=2, n_batch=512, verbose=False)
    llm.eval(ids[: a.context])

    def llama(n):
        def step():
            llm.n_tokens = a.context  # rewind: the same context each time
            llm.eval(ids[a.context : a.context + n])

        return step

    runs["llama.cpp"] = llama
    rounds: dict[str, list[float]] = {f"{k}/{n}": [] for k in runs for n in (1, 9)}
    fastest = {key: float("inf") for key in rounds}
    for _ in range(a.rounds):
        for k, make in runs.items():
            for n in (1, 9):
                step, times = make(n), []
                rounds[f"{k}/{n}"].append(median_pass(step, 5, times))
                fastest[f"{k}/{n}"] = min(fastest[f"{k}/{n}"], *times)

    def per_round(x, y):  # the median over rounds of x / y
        return statistics.median(p / q for p, q in zip(rounds[x], rounds[y], strict=True))

    print(f"median of {a.rounds} rounds, each the median of 5 passes:")
    for k in runs:
        t1, t9 = (statistics.median(rounds[f"{k}/{n}"]) * 1e3 for n in (1, 9))
        ratio = per_round(f"{k}/9", f"{k}/1")
        line = f"  {k:10s} t(1) {t1:6.1f} ms  t(9) {t9:6.1f} ms  t(9)/t(1) {ratio:.2f}"
        if k != "llama.cpp":
            line += f"  t(1) {per_round('llama.cpp/1', f'{k}/1'):.2f}x llama.cpp's speed"
        print(line, flush=True)
    # Other load on the machine slows some passes; the fastest pass of each kind
    # is the engine's own cost.
    print(f"fastest pass of {a.rounds} x 5:")
    for k in runs:
        t1, t9 = (fastest[f"{k}/{n}"] * 1e3 for n in (1, 9))
        line = f"  {k:10s} t(1) {t1:6.1f} ms  t(9) {t9:6.1f} ms  t(9)/t(1) {t9 / t1:.2f}"
        if k != "llama.cpp":
            line += f"  t(1) {fastest['llama.cpp/1'] * 1e3 / t1:.2f}x llama.cpp's speed"
        print(line, flush=True)


if __name__ == "__main__":
    main()
