"""A GGUF's tensors at their own ggml types (`GgufMatrix`, weights="file"): the core's values are
gguf's dequantization bit for bit, its products within int8 activation rounding of them with
rows that never depend on each other, bad blocks refused, and files of mixed types loaded in
their own blocks, whose speculative output equals their own plain output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import CPU_KERNELS, make_hf_model, write_tiny_gguf

import specfast
from specfast import Model, ModelConfig
from specfast._core import GgufMatrix, Int8Matrix, Q4Matrix, gguf_block_types
from specfast.formats.gguf import auto_candidates
from specfast.model.quantize import dequantize
from specfast.targets import as_target

TYPES = gguf_block_types()  # what GgufMatrix holds
# Where each type's f16 scales (d, and dmin or m) sit in its block. The other bytes (values,
# high bits, 6-bit or int8 sub-block scales) are valid whatever they hold.
HALVES = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def ggml(kind: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[kind]


def set_halves(raw: np.ndarray, kind: str, rng, scale: float = 1.0) -> None:
    """Sets the f16 scales of every `kind` block in `raw` to ±(1e-3 .. 1e-2) · scale."""
    from gguf import GGML_QUANT_SIZES

    blocks = raw.reshape(-1, GGML_QUANT_SIZES[ggml(kind)][1])
    for at in HALVES[kind]:
        d = rng.uniform(1e-3, 1e-2, len(blocks)) * rng.choice([-1.0, 1.0], len(blocks)) * scale
        blocks[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(kind: str, rows: int, cols: int, rng, std: float | None = None) -> np.ndarray:
    """(rows, bytes a row) uint8: random valid `kind` blocks (random bytes, then finite f16
    scales); with `std`, the scales set so that the weights have about that deviation."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[ggml(kind)]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    state = rng.bit_generator.state
    set_halves(raw, kind, rng)
    if std is not None:  # the same scales again, times what brings the deviation to std
        rng.bit_generator.state = state
        set_halves(raw, kind, rng, std / values(kind, raw, cols).std())
    return raw


def values(kind: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """gguf's dequantization of `kind` blocks (rows, bytes a row) -> float32 (rows, cols)."""
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(raw, ggml(kind)).reshape(len(raw), cols).astype(np.float32)


def q8_0_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """w as gguf's Q8_0 blocks hold it: what "file" makes of a type the core does not hold."""
    from gguf.quants import quantize as gguf_quantize

    blocks = gguf_quantize(w.float().numpy(), ggml("Q8_0"))
    return torch.from_numpy(values("Q8_0", blocks, w.shape[1]))


def first_difference(a: np.ndarray, b: np.ndarray) -> str:
    i = np.argwhere(a.view(np.uint32) != b.view(np.uint32))[0]
    return f"first at {tuple(int(n) for n in i)}: {a[tuple(i)]!r} != {b[tuple(i)]!r}"


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32, (a.shape, b.shape)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), first_difference(a, b)


def file_bytes(kind: str, rows: int, cols: int) -> int:
    """The bytes of `rows` rows of `kind` blocks in a GGUF file."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[ggml(kind)]
    return rows * cols // block * size


# every type in one matrix, its parts but the last whole 16-row tiles, the last one not
STACK = [*((kind, 16 * (i % 3 + 1)) for i, kind in enumerate(TYPES)), ("Q8_0", 37)]


def stacked(parts, cols: int = 512, seed: int = 0) -> tuple[list, np.ndarray]:
    """(from_tensors' parts of random blocks, gguf's values of them stacked)."""
    rng = np.random.default_rng(seed)
    raws = [(kind, random_blocks(kind, rows, cols, rng)) for kind, rows in parts]
    return raws, np.concatenate([values(kind, raw, cols) for kind, raw in raws])


# -----------------------------------------------------------------------------
# the matrix


def test_the_core_holds_these_types_and_the_random_blocks_are_valid():
    assert {"Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0"} <= set(TYPES) <= set(HALVES)
    rng = np.random.default_rng(0)
    for kind in [*TYPES, "Q3_K"]:
        w = values(kind, random_blocks(kind, 8, 512, rng), 512)
        assert np.isfinite(w).all() and 0 < np.abs(w).max() < 100, kind
        w = values(kind, random_blocks(kind, 8, 512, rng, std=0.05), 512)
        assert 0.04 < w.std() < 0.06, kind


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_dequantizes_as_gguf_does(kind):
    """Bit for bit, in about the file's bytes (whole 16-row blocks, a 64-byte line of scales
    a block of 256 values)."""
    (part,), want = stacked([(kind, 24)], seed=TYPES.index(kind))
    m = GgufMatrix.from_tensors([part], 512)
    assert (m.rows, m.cols, m.types()) == (24, 512, [(kind, 24)])
    assert file_bytes(kind, 32, 512) <= m.nbytes <= 1.03 * file_bytes(kind, 32, 512)
    assert_same_bits(m.dequantize(), want)


def test_a_stack_of_mixed_types_dequantizes_as_gguf_does():
    parts, want = stacked([("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 20)])
    m = GgufMatrix.from_tensors(parts, 512)
    assert m.types() == [("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 20)] and m.rows == 68
    assert_same_bits(m.dequantize(), want)
    # the controls: a flipped byte changes what gguf reads from the new bytes, in its block
    # only: a Q8_0 value (row 50, value 3 of block 2), that weight alone; the exponent of d,
    # the first two bytes of a Q4_K block and the last two of a Q6_K one, most of its block
    for part, row, at, block in [(2, 2, 2 * 34 + 2 + 3, None), (0, 5, 144 + 1, 1), (1, 3, 209, 0)]:
        flipped = [(kind, raw.copy()) for kind, raw in parts]
        flipped[part][1][row, at] ^= 0x80 if block is None else 0x04
        changed = GgufMatrix.from_tensors(flipped, 512).dequantize()
        assert_same_bits(changed, np.concatenate([values(k, raw, 512) for k, raw in flipped]))
        row += sum(len(raw) for _, raw in parts[:part])
        moved = [tuple(int(n) for n in i) for i in np.argwhere(changed != want)]
        if block is None:
            assert moved == [(row, 2 * 32 + 3)]
        else:
            assert {r for r, _ in moved} == {row} and len(moved) > 200
            assert all(256 * block <= c < 256 * (block + 1) for _, c in moved)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("n", [1, 3, 9, 17])
def test_the_product_is_the_matrix_times_x_up_to_activation_rounding(kernel, n):
    """Against float64 over gguf's values: each activation row rounded to int8 (a relative
    2^-8 of its largest value) moves an output by well under 1 % of |x|·|w|."""
    parts, w = stacked(STACK, seed=n)
    m = GgufMatrix.from_tensors(parts, 512)
    x = np.random.default_rng(n).standard_normal((n, 512), dtype=np.float32)
    out = np.full((n, m.rows), np.nan, np.float32)
    m.matmul(x, out, kernel)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    bound = 1e-2 * np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(w, axis=1))
    assert (np.abs(out - ref) <= bound).all(), np.abs(out - ref).max() / bound.max()
    # the control: a product that read one part's rows one off is caught
    wrong = out.copy()
    wrong[:, 16:48] = np.roll(out[:, 16:48], 1, axis=1)
    assert not (np.abs(wrong - ref) <= bound).all()


def test_rows_do_not_depend_on_each_other_and_every_kernel_gives_the_same_bits():
    parts, _ = stacked(STACK, seed=7)
    m = GgufMatrix.from_tensors(parts, 512)
    x = np.random.default_rng(7).standard_normal((9, 512), dtype=np.float32)
    x[4] *= 50  # one loud row: a scale shared between rows would move every other row
    outs = {}
    for kernel in CPU_KERNELS:
        out = outs[kernel] = np.empty((9, m.rows), np.float32)
        m.matmul(x, out, kernel)
        for r in range(9):
            one = np.empty((1, m.rows), np.float32)
            m.matmul(x[r : r + 1], one, kernel)
            assert_same_bits(one[0], out[r])
    for out in outs.values():
        assert_same_bits(out, outs["scalar"])
    default = np.empty((9, m.rows), np.float32)
    m.matmul(x, default)
    assert_same_bits(default, outs["scalar"])


def test_a_nan_row_gives_nan_in_its_own_row_only():
    parts, _ = stacked(STACK, seed=8)
    m = GgufMatrix.from_tensors(parts, 512)
    x = np.random.default_rng(8).standard_normal((5, 512), dtype=np.float32)
    clean = np.empty((5, m.rows), np.float32)
    m.matmul(x, clean)
    x[3, 100] = np.nan
    out = np.empty((5, m.rows), np.float32)
    m.matmul(x, out)
    assert np.isnan(out[3]).all()
    assert_same_bits(np.delete(out, 3, axis=0), np.delete(clean, 3, axis=0))


def test_bad_blocks_are_refused_with_the_reason():
    rng = np.random.default_rng(9)
    q8 = random_blocks("Q8_0", 20, 512, rng)
    q4k = random_blocks("Q4_K", 16, 512, rng)
    inf = q8.copy()
    inf[7, 34 * 3 : 34 * 3 + 2] = np.array([np.inf], np.float16).view(np.uint8)
    short, one_q4k, one_q8 = (
        np.ascontiguousarray(a) for a in (q8[:, :-1], q4k[:, :144], q8[:, :34])
    )
    cases = [
        ([("Q8_0", short)], 512, "bytes"),  # rows a byte short
        ([("Q7_K", q8)], 512, "Q7_K"),  # no such type
        ([("Q4_K", one_q4k)], 320, "256"),  # K types: rows of whole 256-value blocks
        ([("Q8_0", one_q8)], 48, "columns"),  # the others: of whole 32-value blocks
        ([("Q8_0", q8), ("Q4_K", q4k)], 512, "16"),  # a type change inside a 16-row tile
        ([("Q8_0", inf)], 512, "finite"),  # a scale of inf
        ([("Q8_0", q8[:, ::2])], 256, "contiguous"),
    ]
    for parts, cols, reason in cases:
        with pytest.raises(ValueError, match=reason):
            GgufMatrix.from_tensors(parts, cols)
    # not bytes: a TypeError, as Python's own checks of a type raise
    for wrong in (q8.view(np.int8), q8.astype(np.int32)):
        with pytest.raises(TypeError, match="uint8"):
            GgufMatrix.from_tensors([("Q8_0", wrong)], 512)
    # the control: the same parts, right
    GgufMatrix.from_tensors([("Q8_0", q8[:16]), ("Q4_K", q4k)], 512)


def test_q8_0_takes_rows_of_whole_32_value_blocks():
    """ggml's Q8_0 tensors are rows of 32-value blocks: 96 values is 3 of them."""
    (part,), want = stacked([("Q8_0", 16)], cols=96)
    assert_same_bits(GgufMatrix.from_tensors([part], 96).dequantize(), want)


# -----------------------------------------------------------------------------
# files of mixed types

# Each layer tensor's type: the types GgufMatrix holds, the output matrix's among them (Qwen2.5's
# head is Q6_K), and one it does not hold (Q3_K: kept as Q8_0). The llama file's matrices all
# have under 8 bits a weight; the qwen2 one has a Q8_0 one.
FILES = {
    "qwen2": dict(
        attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_0", ffn_gate="Q5_K",
        ffn_up="Q5_K", ffn_down="Q8_0", output="Q6_K", token_embd="Q4_K",
    ),
    "llama": dict(
        attn_q="Q4_0", attn_k="Q4_K", attn_v="Q3_K", attn_output="Q4_1", ffn_gate="Q4_K",
        ffn_up="Q5_K", ffn_down="Q6_K", token_embd="Q8_0",  # tied: the head is the embedding
    ),
}  # fmt: skip
FUSED = {
    "wqkv": ["attn_q", "attn_k", "attn_v"],
    "wo": ["attn_output"],
    "w_gate_up": ["ffn_gate", "ffn_up"],
    "w_down": ["ffn_down"],
}
TINY = {"qwen2": ("qwen2-bias", False), "llama": ("llama-tied-gqa", True)}  # (kind, tied)


def file_layout(kinds: list[str], rows: list[int]) -> list[tuple[str, int]]:
    """The types() of what weights="file" makes of tensors of `kinds`, `rows` each, stacked:
    Q8_0 for a type GgufMatrix does not hold, neighbours of one type one part."""
    parts: list[tuple[str, int]] = []
    for kind, n in zip(kinds, rows, strict=True):
        kind = kind if kind in TYPES else "Q8_0"
        if parts and parts[-1][0] == kind:
            parts[-1] = (kind, parts[-1][1] + n)
        else:
            parts.append((kind, n))
    return parts


def mixed_gguf(folder, arch: str):
    """A 2-layer model (width 256, 4 heads of 64, 2 kv heads, FFN 512, vocabulary 320) written
    with FILES[arch]'s random blocks (weights about N(0, 0.05)) for its matrices."""
    kind, tied = TINY[arch]
    hf = make_hf_model(kind, hidden_size=256, intermediate_size=512, tie_word_embeddings=tied)
    rng = np.random.default_rng(0)
    shapes = dict(
        attn_q=(256, 256), attn_k=(128, 256), attn_v=(128, 256), attn_output=(256, 256),
        ffn_gate=(512, 256), ffn_up=(512, 256), ffn_down=(256, 512),
    )  # fmt: skip
    blocks = {}
    for name, kind_ in FILES[arch].items():
        if name in shapes:
            for i in range(2):
                raw = random_blocks(kind_, *shapes[name], rng, std=0.05)
                blocks[f"blk.{i}.{name}.weight"] = (raw, ggml(kind_))
        else:
            blocks[f"{name}.weight"] = (random_blocks(kind_, 320, 256, rng, std=0.05), ggml(kind_))
    return write_tiny_gguf(hf, folder / f"{arch}.gguf", blocks=blocks), blocks


@pytest.fixture(scope="module", params=sorted(FILES))
def mixed(request, tmp_path_factory):
    """(arch, path, blocks written, the float load, the file load) of each mixed file."""
    arch = request.param
    path, blocks = mixed_gguf(tmp_path_factory.mktemp(arch), arch)
    plain = specfast.load_model(path, weights="float", dtype="float32")
    return arch, path, blocks, plain, specfast.load_model(path, weights="file")


def test_a_mixed_file_loads_in_its_own_blocks(mixed):
    """Each matrix a GgufMatrix of the file's types (file_layout), standing for the float
    load's values exactly (Q/K rows unpermuted on the blocks), but the Q3_K tensor: Q8_0 of its
    values; the head too, in its Q6_K or Q8_0 blocks."""
    arch, _, blocks, plain, model = mixed
    plain.unpack()  # its plain matrices, whatever ran on it before
    assert model.weights == "file" and as_target(model).describe()["weights"] == "file"
    assert model.file_types == {v for k, v in FILES[arch].items() if k.startswith(("attn", "ffn"))}
    packed = model.packed_weights()
    for layer, matrices in zip(plain.layers, packed[:-1], strict=True):
        for (ours, names), m in zip(FUSED.items(), matrices, strict=True):
            kinds = [FILES[arch][n] for n in names]
            rows = getattr(layer, ours).weight.split(
                [len(blocks[f"blk.0.{n}.weight"][0]) for n in names]
            )
            if set(kinds) <= {"Q4_0", "Q4_1"}:  # the same values, on Q4Matrix's kernels
                assert isinstance(m, Q4Matrix), ours
            else:
                assert isinstance(m, GgufMatrix), ours
                assert m.types() == file_layout(kinds, [len(w) for w in rows]), ours
            want = [
                w if kind in TYPES else q8_0_roundtrip(w)
                for w, kind in zip(rows, kinds, strict=True)
            ]
            assert torch.equal(dequantize(m), torch.cat(want)), ours
    head = FILES[arch].get("output", FILES[arch]["token_embd"])
    assert isinstance(packed[-1], GgufMatrix) and packed[-1].types() == [(head, 320)]
    assert torch.equal(dequantize(packed[-1]), plain.output_weight)
    assert torch.equal(model.output_weight, plain.output_weight)  # what a reader gets back
    # the control: the file's own Q rows (llama's permuted) are not the float load's
    raw, _ = blocks["blk.0.attn_q.weight"]
    q = torch.from_numpy(values(FILES[arch]["attn_q"], raw, 256))
    assert torch.equal(q, plain.layers[0].wqkv.weight[:256]) == (arch == "qwen2")


def test_a_mixed_file_gives_the_float_loads_logits_up_to_activation_rounding(mixed, monkeypatch):
    """The float load dequantizes the same blocks, so the logits differ by the rounding of
    the activations (and of the float16 cache) only: less than int8 weights' (which round the
    weights too) differ. The control: a file load that kept llama's Q/K rows permuted."""
    import specfast.formats.gguf as gguf_module

    arch, path, _, plain, model = mixed
    ids = torch.tensor([5, 77, 300, 12, 9, 260, 260, 31, 4, 150, 7, 7, 7, 88, 199, 3] * 2)
    want = plain.decoder(64).forward(ids)

    def error(m) -> float:  # relative to the float load's logits
        return float((m.decoder(64).forward(ids) - want).norm() / want.norm())

    ours = error(model)  # (0.014 for llama, 0.017 for qwen2; int8 0.021 and 0.026)
    assert ours < 0.03 and ours < error(specfast.load_model(path, weights="int8")), ours
    if arch == "llama":
        real = gguf_module._unpermute

        def on_floats_only(w, n_head):
            return w if w.dtype == np.uint8 else real(w, n_head)

        monkeypatch.setattr(gguf_module, "_unpermute", on_floats_only)
        assert error(specfast.load_model(path, weights="file")) > 0.1  # (0.37)


def test_a_mixed_files_speculative_output_is_its_plain_output(mixed):
    model = mixed[-1]
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 1, 2, 3, 5, 6, 7]
    want = specfast.generate(model, prompt, max_new_tokens=40, drafter=None).token_ids
    for k in (1, 4, "auto"):
        out = specfast.generate(model, prompt, max_new_tokens=40, num_speculative_tokens=k)
        assert out.token_ids == want, k


def test_auto_picks_among_float_file_and_int8_and_never_q4(mixed, tmp_path, monkeypatch):
    """weights="auto" on a quantized file times its own blocks, and int8 only where every
    layer matrix has under 8 bits a weight (the llama file's, not the qwen2 one with Q8_0);
    q4 never, as these files hold other types than Q4_0 and Q4_1."""
    import specfast.model.quantize as int8_module

    arch, path, *_ = mixed
    monkeypatch.setenv("SPECFAST_CACHE", str(tmp_path))
    monkeypatch.setattr(int8_module, "AUTO_MIN_WEIGHTS", 0)
    step_ms = {"file": 1.0, "int8": 2.0, "q4": 0.5, "float": 3.0}
    monkeypatch.setattr(int8_module, "_step_seconds", lambda model: step_ms[model.weights])
    model = specfast.load_model(path)
    cache = json.loads((tmp_path / "weights.json").read_text())
    (entry,) = [e for e in cache.values() if "float_ms" in e]  # (not dtype auto's, on AMX)
    kinds = {"float", "file", "int8"} if arch == "llama" else {"float", "file"}
    assert set(entry) == {"choice"} | {f"{k}_ms" for k in kinds}
    assert entry["choice"] == model.weights == "file"
    assert isinstance(model.packed_weights()[0][0], GgufMatrix)


def test_auto_loads_only_its_cached_choice(mixed, tmp_path, monkeypatch):
    """Once auto has timed a file, the next load builds only the kind it chose: not the float
    model first (a 1.5B's float32 copy takes most of a minute). The control: a cache entry for
    other candidates (another CPU or kernel version) is not taken."""
    import specfast.formats as formats
    import specfast.model.quantize as int8_module

    _, path, *_ = mixed
    monkeypatch.setenv("SPECFAST_CACHE", str(tmp_path))
    monkeypatch.setattr(int8_module, "AUTO_MIN_WEIGHTS", 0)
    step_ms = {"file": 1.0, "int8": 2.0, "q4": 0.5, "float": 3.0}
    monkeypatch.setattr(int8_module, "_step_seconds", lambda model: step_ms[model.weights])
    loaded: list[str] = []
    real_load = formats._load

    def load(path, device, dtype, weights, reader=None):
        loaded.append(weights)
        return real_load(path, device, dtype, weights, reader)

    monkeypatch.setattr(formats, "_load", load)
    assert specfast.load_model(path).weights == "file"
    assert loaded[0] == "float" and "file" in loaded  # timed: every candidate built
    loaded.clear()
    assert specfast.load_model(path).weights == "file"
    assert loaded == ["file"]
    monkeypatch.setattr(int8_module, "KERNEL_VERSION", int8_module.KERNEL_VERSION + 1)
    loaded.clear()
    specfast.load_model(path)
    assert loaded[0] == "float"  # a stale entry does not count


def test_auto_candidates_by_the_files_types():
    assert auto_candidates(frozenset()) == ("int8",)  # a checkpoint folder
    assert auto_candidates(frozenset({"F16"})) == ("int8",)  # a float file
    assert auto_candidates(frozenset({"F32", "BF16"})) == ("int8",)
    assert auto_candidates(frozenset({"Q4_K", "Q6_K"})) == ("file", "int8")
    assert auto_candidates(frozenset({"Q4_0", "Q5_0", "Q3_K", "IQ2_XXS"})) == ("file", "int8")
    assert auto_candidates(frozenset({"Q4_K", "Q8_0"})) == ("file",)  # int8 holds fewer bits
    assert auto_candidates(frozenset({"Q4_K", "F16"})) == ("file",)
    # all Q4_0/Q4_1: q4 holds the file's values, as "file" does (SmolLM2's Q4_1 file)
    assert auto_candidates(frozenset({"Q4_1"})) == ("file", "int8", "q4")
    assert auto_candidates(frozenset({"Q4_0", "Q4_1"})) == ("file", "int8", "q4")
    assert "q4" not in auto_candidates(frozenset({"Q4_0", "Q5_0"}))


def test_a_float_file_loads_as_q8_0(tmp_path):
    """A GGUF of F32 tensors: "file" holds every layer matrix as Q8_0 (its rows' values
    rounded as gguf's Q8_0 rounds them), the head (the F32 embedding) int8; a matrix whose
    rows are not whole 32-value blocks is int8 too. Its speculative output is its plain
    output."""
    hf = make_hf_model("qwen2-bias", intermediate_size=128)
    path = write_tiny_gguf(hf, tmp_path / "f32.gguf")
    plain = specfast.load_model(path, weights="float", dtype="float32")
    model = specfast.load_model(path, weights="file")
    assert model.file_types == {"F32"}
    packed = model.packed_weights()
    for layer, matrices in zip(plain.layers, packed[:-1], strict=True):
        for ours, m in zip(FUSED, matrices, strict=True):
            w = getattr(layer, ours).weight
            assert m.types() == [("Q8_0", w.shape[0])]
            assert torch.equal(dequantize(m), q8_0_roundtrip(w))
    assert isinstance(packed[-1], Int8Matrix)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 1, 2, 3]
    want = specfast.generate(model, prompt, max_new_tokens=30, drafter=None).token_ids
    assert specfast.generate(model, prompt, max_new_tokens=30).token_ids == want
    # FFN 48 wide: the down projection's rows are no whole Q8_0 blocks
    hf = make_hf_model("llama-tied-gqa", intermediate_size=48)
    narrow = specfast.load_model(write_tiny_gguf(hf, tmp_path / "narrow.gguf"), weights="file")
    kinds = [type(m).__name__ for m in narrow.packed_weights()[0]]
    assert kinds == ["GgufMatrix", "GgufMatrix", "GgufMatrix", "Int8Matrix"]


def test_a_float_model_quantized_as_file_is_q8_0():
    """quantize_int8("file") on a model with no file: its matrices in Q8_0, the head int8."""
    config = ModelConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
        max_context=256,
    )  # fmt: skip
    plain = Model.from_config(config, seed=0)
    model = Model.from_config(config, seed=0).quantize_int8("file")
    packed = model.packed_weights()
    assert model.weights == "file" and isinstance(packed[-1], Int8Matrix)
    assert torch.equal(dequantize(packed[0][0]), q8_0_roundtrip(plain.layers[0].wqkv.weight))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 1, 2, 3]
    want = specfast.generate(model, prompt, max_new_tokens=30, drafter=None).token_ids
    assert specfast.generate(model, prompt, max_new_tokens=30).token_ids == want


def test_file_weights_need_a_gguf_file(tmp_path):
    pytest.importorskip("transformers")
    make_hf_model("llama-tied-gqa").save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="GGUF file"):
        specfast.load_model(tmp_path, weights="file")
