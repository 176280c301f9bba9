"""Pass costs at 7B scale: specfast against llama.cpp on the same file, where no real 3-8B GGUF
can be had. Writes a GGUF with DeepSeek-R1-Distill-Qwen-7B's layer shapes (qwen2: 28 layers,
dim 3584, 28 query and 4 kv heads, FFN 18944, q/k/v bias) and random weights, in Q8_0 or Q4_0,
with SmolLM2's tokenizer (vocabulary 49,152: the layers are the 7B's, 6.5 of its 6.9B weights).
Random weights make the text meaningless, so this measures what does not depend on them: a
pass's time (t(1), t(9)/t(1)) against the memory-read bound, and resident memory. Acceptance,
and so end-to-end speed on real text, needs the real model.

    python scripts/shape_7b.py q8_0     # specfast int8 against llama.cpp Q8_0
    python scripts/shape_7b.py q4_0     # specfast q4 against llama.cpp Q4_0

The files go to ~/.cache/specfast/shape-7b/ (7.3 and 3.9 GB), never into the repo.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

LAYERS, DIM, HEADS, KV_HEADS, FFN = 28, 3584, 28, 4, 18944
KINDS = {"q8_0": ("Q8_0", "int8"), "q4_0": ("Q4_0", "q4")}
CONTEXT = 64  # tokens before the timed passes (a 7B's prefill on 2 cores takes a while)
ROUNDS = 7


def random_blocks(rows: int, cols: int, kind: str, rng) -> np.ndarray:
    """A (rows, cols) matrix of random blocks of 32 weights, about N(0, 0.02), as bytes."""
    n = rows * cols // 32
    scale = np.full((n, 1), 0.02 / 64 if kind == "Q8_0" else 0.02 / 4, np.float16).view(np.uint8)
    if kind == "Q8_0":
        qs = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    else:
        qs = rng.integers(0, 256, (n, 16), dtype=np.uint8)  # two 4-bit values a byte
    return np.concatenate([scale, qs], axis=1).reshape(rows, -1)


def write(path: Path, kind: str) -> None:
    import gguf

    from specfast import default_model_path

    src = gguf.GGUFReader(default_model_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(4096)
    w.add_embedding_length(DIM)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q8_0 if kind == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_0
    )
    for name, field in src.fields.items():  # SmolLM2's tokenizer, as it is
        if name.startswith("tokenizer."):
            value = field.contents()
            if isinstance(value, list):
                w.add_array(name, value)
            elif isinstance(value, str):
                w.add_string(name, value)
            elif isinstance(value, (bool, np.bool_)):
                w.add_bool(name, bool(value))
            else:
                w.add_uint32(name, int(value))
    rng = np.random.default_rng(0)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    hd = DIM // HEADS

    def matrix(name, rows, cols):
        w.add_tensor(name, random_blocks(rows, cols, kind, rng), raw_dtype=qtype)

    def vector(name, n, value=None):
        v = np.full(n, 1.0, np.float32) if value is None else value
        w.add_tensor(name, v)

    matrix("token_embd.weight", vocab, DIM)
    matrix("output.weight", vocab, DIM)
    vector("output_norm.weight", DIM)
    for i in range(LAYERS):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", DIM)
        vector(b + "ffn_norm.weight", DIM)
        for n, rows in (("q", HEADS * hd), ("k", KV_HEADS * hd), ("v", KV_HEADS * hd)):
            matrix(b + f"attn_{n}.weight", rows, DIM)
            vector(b + f"attn_{n}.bias", rows, rng.normal(0, 0.02, rows).astype(np.float32))
        matrix(b + "attn_output.weight", DIM, HEADS * hd)
        matrix(b + "ffn_gate.weight", FFN, DIM)
        matrix(b + "ffn_up.weight", FFN, DIM)
        matrix(b + "ffn_down.weight", DIM, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_bandwidth() -> float:
    """GB/s of a 2-thread sum over 2 GiB of filled memory (not the zero page)."""
    import torch

    x = torch.ones(1 << 29)
    x.sum()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        runs.append(time.perf_counter() - start)
    return x.numel() * 4 / min(runs) / 1e9


def rss_gb() -> float:
    """The peak resident set (GB), the GGUF's mapped pages included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def resident_gb() -> tuple[float, float]:
    """(anonymous, file-backed) resident memory now, GB: the model, and the GGUF's mapped
    pages, which the OS drops first when memory is short."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) / 1e6 for k in ("RssAnon", "RssFile"))


def median_pass(run, n: int = 7, times: list[float] | None = None) -> float:
    """The median time of n calls of run; each time is also appended to `times`."""
    times = [] if times is None else times
    for _ in range(n):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[-n:])


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "q8_0"
    kind, weights = KINDS[name]
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specfast/shape-7b"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"qwen2-7b-shape-random-{name}.gguf"
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        write(path.with_suffix(".part"), kind)
        path.with_suffix(".part").rename(path)
    size = path.stat().st_size / 1e9
    bandwidth = read_bandwidth()
    print(f"{path.name}: {size:.2f} GB; read bandwidth {bandwidth:.1f} GB/s", flush=True)
    ids = np.random.default_rng(1).integers(100, 40000, CONTEXT + 9).tolist()

    import torch

    import specfast

    torch.set_num_threads(2)
    baseline = resident_gb()[0]  # the interpreter, torch and specfast before any model
    start = time.perf_counter()
    model = specfast.load_model(str(path), dtype="float32", weights=weights)
    loaded, rss = time.perf_counter() - start, rss_gb()
    # What a pass reads: every layer matrix and the output matrix, as the core holds them.
    read = sum(m.nbytes for layer in model.packed_weights()[:-1] for m in layer)
    read = (read + model.packed_weights()[-1].nbytes) / 1e9
    t = torch.tensor(ids)
    d = model.decoder(CONTEXT + 16)
    d.forward(t[:CONTEXT])

    def specfast_pass(n):
        def run():
            d.cache.length = CONTEXT
            d.forward(t[CONTEXT : CONTEXT + n])

        return run

    kv = d.cache.k.numel() * d.cache.k.element_size() * 2 / 1e9
    anon, mapped = resident_gb()  # before llama.cpp maps its copy of the file

    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=CONTEXT + 16, n_threads=2, n_batch=128, verbose=False)
    llm.eval(ids[:CONTEXT])

    def llama_pass(n):
        def run():
            llm.n_tokens = CONTEXT  # rewind: the same context each time
            llm.eval(ids[CONTEXT : CONTEXT + n])

        return run

    # Rounds alternate the two engines, so a slow minute of this shared machine slows both.
    rounds = {key: [] for key in ("sf1", "sf9", "lc1", "lc9")}
    for _ in range(ROUNDS):
        for n in (1, 9):
            rounds[f"sf{n}"].append(median_pass(specfast_pass(n), 5))
            rounds[f"lc{n}"].append(median_pass(llama_pass(n), 5))
    med = {key: statistics.median(v) for key, v in rounds.items()}

    def per_round(a, b):  # the median of each round's a / b
        return statistics.median(x / y for x, y in zip(rounds[a], rounds[b], strict=True))

    ratio = per_round("lc1", "sf1")
    print(
        f"specfast {weights}: loaded in {loaded:.0f} s; resident {anon:.2f} GB, "
        f"{anon - baseline:.2f} GB of it the model's (+ {mapped:.2f} GB of the mapped file), "
        f"peak {rss:.2f} GB; file {size:.2f} GB, KV cache {kv:.3f} GB; "
        f"t(1) {med['sf1'] * 1e3:.0f} ms, t(9)/t(1) {per_round('sf9', 'sf1'):.2f}; a pass reads "
        f"{read:.2f} GB: the read bound is {read / bandwidth * 1e3:.0f} ms\n"
        f"llama.cpp {kind}: t(1) {med['lc1'] * 1e3:.0f} ms, "
        f"t(9)/t(1) {per_round('lc9', 'lc1'):.2f}\n"
        f"specfast plain {ratio:.2f}x llama.cpp's (the median of {ROUNDS} rounds' ratios; "
        f"t(1) ranges: specfast {min(rounds['sf1']) * 1e3:.0f}-{max(rounds['sf1']) * 1e3:.0f} "
        f"ms, llama.cpp {min(rounds['lc1']) * 1e3:.0f}-{max(rounds['lc1']) * 1e3:.0f} ms)",
        flush=True,
    )


if __name__ == "__main__":
    main()
