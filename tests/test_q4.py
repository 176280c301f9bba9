"""4-bit (Q4_1 and Q4_0) weights: the kernel against an int64 reference, rows that never depend
on each other, a GGUF's Q4_1 and Q4_0 tensors loaded exactly, and a q4 model whose speculative
output equals its own plain output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CPU_KERNELS, make_hf_model, write_tiny_gguf

import specfast
from specfast import Model, ModelConfig
from specfast._core import Q4Matrix
from specfast.model.quantize import core_linear, dequantize

GROUP = 32  # input features per weight scale and per activation scale


def expected(m: Q4Matrix, x: np.ndarray) -> np.ndarray:
    """The product as the kernel defines it: each row of x quantized symmetric to int8 with one
    scale sx per group of 32; integer sums in int64; then in float32, group by group,
    acc += (Σ q·xq) * (d * sx), then acc += m * (sx * Σ xq); for Q4_0 (no m),
    acc += (Σ q·xq - 8 Σ xq) * (d * sx)."""
    q, d, mins = m.parts()
    x = x.astype(np.float32)
    acc = np.zeros((x.shape[0], m.rows), np.float32)
    for g, lo in enumerate(range(0, m.cols, GROUP)):
        xg = x[:, lo : lo + GROUP]
        sx = np.abs(xg).max(axis=1, keepdims=True).astype(np.float32) / np.float32(127)
        with np.errstate(invalid="ignore", divide="ignore"):
            qx = np.where(sx > 0, np.clip(np.round(xg / sx), -127, 127), 0).astype(np.int64)
        dots = qx @ q[:, lo : lo + GROUP].astype(np.int64).T  # (n, N)
        sums = qx.sum(axis=1, keepdims=True)  # (n, 1)
        if mins is None:
            acc = acc + (dots - 8 * sums).astype(np.float32) * (d[None, :, g] * sx)
        else:
            acc = acc + dots.astype(np.float32) * (d[None, :, g] * sx)
            acc = acc + mins[None, :, g] * (sx * sums.astype(np.float32))
    return acc


def q4_0_matrix(w: np.ndarray) -> Q4Matrix:
    """w quantized by gguf as a Q4_0 tensor, read from its blocks as the GGUF loader reads them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    kind = GGMLQuantizationType.Q4_0
    return Q4Matrix.from_parts(*gguf_parts(gguf_quantize(w, kind), kind, w.shape))


def gguf_parts(blocks: np.ndarray, kind, shape: tuple[int, int]):
    """four_bit_parts of a GGUF tensor of `kind` holding `blocks`, `shape` (rows, cols)."""
    from types import SimpleNamespace

    from specfast.formats.gguf import four_bit_parts

    return four_bit_parts(SimpleNamespace(shape=shape[::-1], data=blocks, tensor_type=kind))


def check_product(m: Q4Matrix, x: np.ndarray, out: np.ndarray) -> None:
    np.testing.assert_array_equal(out, expected(m, x))
    ref = x.astype(np.float64) @ dequantize(m).double().numpy().T
    assert np.abs(out - ref).max() < 0.05 * (np.abs(ref).max() + 1e-12)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("layout", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize(
    ("rows", "cols", "n"), [(1, 1, 1), (17, 5, 3), (16, 64, 8), (33, 130, 9), (700, 577, 17)]
)
def test_kernel_equals_the_reference(kernel, layout, rows, cols, n):
    if layout == "Q4_0":
        cols = -(-cols // 32) * 32  # a Q4_0 tensor's rows are whole blocks
    rng = np.random.default_rng(rows * 1000 + cols)
    w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
    x = rng.standard_normal((n, cols), dtype=np.float32)
    m = Q4Matrix(w) if layout == "Q4_1" else q4_0_matrix(w)
    assert (m.parts()[2] is None) == (layout == "Q4_0")
    out = np.empty((n, rows), np.float32)
    m.matmul(x, out, kernel)
    check_product(m, x, out)


def test_a_kernel_that_drops_the_last_row_is_caught():
    rng = np.random.default_rng(0)
    m = Q4Matrix(rng.standard_normal((40, 96), dtype=np.float32))
    x = rng.standard_normal((5, 96), dtype=np.float32)
    out = np.zeros((5, 40), np.float32)
    m.matmul(x[:-1], out[:-1])  # the last row never computed
    with pytest.raises(AssertionError):
        check_product(m, x, out)


def test_rows_do_not_depend_on_each_other():
    rng = np.random.default_rng(1)
    m = Q4Matrix(rng.standard_normal((300, 200), dtype=np.float32))
    x = rng.standard_normal((9, 200), dtype=np.float32)
    x[4] *= 50  # one loud row: a shared activation scale would change every other row
    out = np.empty((9, 300), np.float32)
    m.matmul(x, out)
    for r in range(9):
        one = np.empty((1, 300), np.float32)
        m.matmul(x[r : r + 1], one)
        np.testing.assert_array_equal(one[0], out[r])


def test_a_gguf_q4_1_tensor_loads_exactly():
    """gguf's own Q4_1 quantizer, dequantized, then quantized again here: the same weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    rng = np.random.default_rng(2)
    w = rng.standard_normal((48, 96), dtype=np.float32)
    kind = GGMLQuantizationType.Q4_1
    file_w = gguf_dequantize(gguf_quantize(w, kind), kind).astype(np.float32)
    assert not np.array_equal(file_w, w)
    np.testing.assert_array_equal(dequantize(Q4Matrix(file_w)).numpy(), file_w)
    q, d, mins = Q4Matrix(file_w).parts()
    again = Q4Matrix.from_parts(q, d, mins)
    np.testing.assert_array_equal(dequantize(again).numpy(), file_w)


def test_a_gguf_q4_0_tensor_is_its_blocks():
    """Q4_0 blocks read as they are: the values gguf dequantizes, at 4.5 bits a weight."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 96), dtype=np.float32)
    kind = GGMLQuantizationType.Q4_0
    file_w = gguf_dequantize(gguf_quantize(w, kind), kind).astype(np.float32)
    m = q4_0_matrix(w)
    np.testing.assert_array_equal(dequantize(m).numpy(), file_w)
    assert m.nbytes == 48 * 96 // 2 + 2 * 48 * 3 < Q4Matrix(file_w).nbytes
    # the control: Q4_1 requantizes these values with a grid of its own (a group's extremes
    # are -8d and 7d only where they occur), so it does not hold them all exactly
    assert not np.array_equal(dequantize(Q4Matrix(file_w)).numpy(), file_w)


def test_a_gguf_q4_k_tensor_keeps_its_values():
    """Q4_K's values and its groups' d·sc and -dmin·min, rounded to f16: within 2^-11 of each
    group's scale and minimum of gguf's own dequantization. Random blocks: llama.cpp's
    quantizer is not in gguf-py."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(4)
    rows, cols = 24, 512
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    # d and dmin: small positive f16, as a real tensor's (random bytes could be inf or NaN)
    halves = rng.uniform(1e-4, 2e-3, (len(blocks), 2)).astype(np.float16).view(np.uint8)
    blocks[:, :4] = halves.reshape(len(blocks), 4)
    kind = GGMLQuantizationType.Q4_K
    file_w = gguf_dequantize(blocks, kind).reshape(rows, cols).astype(np.float32)
    q, d, mins = gguf_parts(blocks.reshape(rows, -1), kind, (rows, cols))
    m = Q4Matrix.from_parts(q, d, mins)
    err = np.abs(dequantize(m).numpy() - file_w).reshape(rows, -1, 32).max(axis=-1)
    assert (err <= 2.0**-11 * (15 * np.abs(d) + np.abs(mins)) + 1e-9).all()
    # the control: requantized, a group whose values miss 0 or 15 gets a grid of its own
    requantized = np.abs(dequantize(Q4Matrix(file_w)).numpy() - file_w).max()
    assert requantized > 20 * err.max()


@pytest.mark.parametrize("matrices", ["Q4_0", "Q4_1"])
def test_a_q4_gguf_loads_its_matrices_exactly(tmp_path, matrices):
    """weights="q4" on a file of Q4_0 or Q4_1 matrices keeps their values and scales (Q/K rows
    unpermuted as the float load's), Q4_0 as Q4_0: each layer's matrices stand for the file's
    weights exactly. The down projection (48 inputs: no whole blocks) is F32 in the file and
    quantized as Q4_1."""
    import transformers
    from gguf import GGMLQuantizationType

    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    path = write_tiny_gguf(hf, tmp_path / "m.gguf", GGMLQuantizationType[matrices])
    plain = specfast.load_model(path, weights="float")
    q4 = specfast.load_model(path, weights="q4")
    for layer, packed in zip(plain.layers, q4.packed_weights()[:-1], strict=True):
        floats = [layer.wqkv.weight, layer.wo.weight, layer.w_gate_up.weight]
        for w, m in zip(floats, packed[:3], strict=True):
            assert (m.parts()[2] is None) == (matrices == "Q4_0")
            assert torch.equal(dequantize(m), w)
        assert packed[3].parts()[2] is not None
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 1, 2, 3]
    want = specfast.generate(q4, prompt, max_new_tokens=40, drafter=None).token_ids
    assert specfast.generate(q4, prompt, max_new_tokens=40).token_ids == want


@pytest.mark.parametrize("table", ["Q4_0", "Q8_0", "F16"])
def test_a_quantized_load_keeps_the_embedding_in_its_blocks(tmp_path, table):
    """With int8 or q4 weights, a GGUF's quantized embedding stays in the file's blocks, its
    looked-up rows the float load's (so are its tied head and state_dict), in the model's dtype
    and device after .to(); an F32 one stays a float table."""
    from gguf import GGMLQuantizationType

    from specfast.model.embedding import FileEmbedding

    hf = make_hf_model("llama-tied-gqa")
    path = write_tiny_gguf(hf, tmp_path / "m.gguf", GGMLQuantizationType[table])
    plain = specfast.load_model(path, weights="float", dtype="float32")
    int8 = specfast.load_model(path, weights="int8", dtype="float32")
    assert isinstance(int8.embed, FileEmbedding) and not isinstance(plain.embed, FileEmbedding)
    assert int8.embed.nbytes <= plain.embed.weight.nbytes // (2 if table == "F16" else 3)
    ids = torch.tensor([[0, 7, 319], [5, 5, 1]])
    assert torch.equal(int8.embed(ids), plain.embed(ids))
    assert torch.equal(int8.state_dict()["embed.weight"], plain.embed.weight)
    # the tied head, and the whole pass, as the float model quantized after loading
    after = specfast.load_model(path, weights="float", dtype="float32").quantize_int8("int8")
    prompt = torch.arange(30) * 11 % 320
    assert torch.equal(int8.decoder(40).forward(prompt), after.decoder(40).forward(prompt))
    assert int8.to(torch.bfloat16).embed(ids).dtype == torch.bfloat16
    f32 = write_tiny_gguf(hf, tmp_path / "f32.gguf")
    assert not isinstance(specfast.load_model(f32, weights="int8").embed, FileEmbedding)


def test_bad_input_is_a_clear_error():
    m = Q4Matrix(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match=r"x must be \(n, 8\)"):
        m.matmul(np.ones((2, 7), np.float32), np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="finite"):
        Q4Matrix(np.array([[1.0, np.nan]], np.float32))
    q, d, mins = m.parts()
    with pytest.raises(ValueError, match=r"0\.\.=15"):
        Q4Matrix.from_parts(q + 16, d, mins)
    with pytest.raises(ValueError, match=r"d and m must be \(4, 1\)"):
        Q4Matrix.from_parts(q, d[:, :0], mins)
    with pytest.raises(ValueError, match=r"d and m must be \(4, 1\)"):
        Q4Matrix.from_parts(q, d[:, :0])
    x = np.ones((2, 8), np.float32)
    x[1, 3] = np.inf
    out = np.empty((2, 4), np.float32)
    m.matmul(x, out)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
    assert torch.equal(core_linear(torch.ones(3, 8), m)[0], torch.from_numpy(out[0]))


# -----------------------------------------------------------------------------
# models


def tiny_model() -> Model:
    cfg = ModelConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96
    )
    return Model.from_config(cfg, seed=3)


def test_q4_layers_and_an_int8_head():
    """(A verify pass equals one-token passes: test_int8.py, for every core weight kind.)"""
    model = tiny_model().quantize_int8("q4")
    assert model.weights == "q4" and "q4" in repr(model)
    packed = model.packed_weights()
    assert all(type(p).__name__ == "Q4Matrix" for layer in packed[:-1] for p in layer)
    assert type(packed[-1]).__name__ == "Int8Matrix"
    with pytest.raises(ValueError, match="weights must be one of"):
        tiny_model().quantize_int8("int4")


def test_q4_tiny_speculation_equals_its_own_plain_greedy():
    model = tiny_model().quantize_int8("q4")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 1, 2, 3]
    want = specfast.generate(model, prompt, max_new_tokens=60, drafter=None).token_ids
    for k in (1, 4, 16, "auto"):
        out = specfast.generate(model, prompt, max_new_tokens=60, num_speculative_tokens=k)
        assert out.token_ids == want, k


@pytest.mark.smollm
def test_q4_smollm_speculation_equals_its_own_plain_greedy(smollm_gguf):
    model = specfast.load_model(smollm_gguf, weights="q4")
    assert model.weights == "q4" and model.dtype == torch.float32
    prompts = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ",
        "Rename the variable x to count:\ndef f(x):\n    y = x + 1\n    return x * y\n",
    ]
    for prompt in prompts:
        want = specfast.generate(model, prompt, max_new_tokens=48, drafter=None).token_ids
        for k in (1, 4, 16, "auto"):
            out = specfast.generate(model, prompt, max_new_tokens=48, num_speculative_tokens=k)
            assert out.token_ids == want, (prompt[:20], k)


def test_auto_times_the_kinds_it_is_given(tmp_path, monkeypatch):
    import specfast.model.quantize as int8_module

    monkeypatch.setenv("SPECFAST_CACHE", str(tmp_path))
    monkeypatch.setattr(int8_module, "AUTO_MIN_WEIGHTS", 0)
    loaded = []

    def load(kind):
        loaded.append(kind)
        return tiny_model().quantize_int8(kind)

    _, entry = int8_module.auto_weights(tiny_model(), load)
    assert loaded == ["int8"] and "q4_ms" not in entry
    model, entry = int8_module.auto_weights(tiny_model(), load, ("int8", "q4"))
    assert loaded == ["int8", "int8", "q4"] and {"float_ms", "int8_ms", "q4_ms"} <= set(entry)
    assert model.weights == entry["weights"]
    again, hit = int8_module.auto_weights(tiny_model(), load, ("int8", "q4"))  # from the cache
    assert hit == entry and again.weights == entry["weights"]


def test_dtype_auto_on_amx_keeps_the_faster_of_bf16_and_float32(tmp_path, monkeypatch):
    from conftest import tiny_llama_gguf

    import specfast.model.quantize as int8_module
    from specfast import hardware

    monkeypatch.setattr(int8_module, "AUTO_MIN_WEIGHTS", 0)
    step_ms = {torch.bfloat16: 2.0, torch.float32: 1.0}
    monkeypatch.setattr(int8_module, "_step_seconds", lambda model: step_ms[model.dtype])
    loaded = []

    def load(dtype):
        loaded.append(dtype)
        return tiny_model().to(dtype=dtype)

    source = tmp_path / "model.gguf"
    source.write_bytes(b"stands for a model file")
    for faster, cache in [("float32", "a"), ("bfloat16", "b")]:
        monkeypatch.setenv("SPECFAST_CACHE", str(tmp_path / cache))
        step_ms[torch.float32] = 1.0 if faster == "float32" else 3.0
        loaded.clear()
        model, entry = int8_module.auto_float_dtype(source, load)
        assert entry["dtype"] == faster and str(model.dtype) == f"torch.{faster}"
        assert {"bfloat16_ms", "float32_ms"} <= set(entry)
        assert loaded == [torch.bfloat16, torch.float32]
        loaded.clear()
        again, hit = int8_module.auto_float_dtype(source, load)  # from the cache: one load
        assert hit == entry and again.dtype == model.dtype and loaded == [model.dtype]
    monkeypatch.setattr(int8_module, "available_memory", lambda: 1000)
    monkeypatch.setenv("SPECFAST_CACHE", str(tmp_path / "c"))
    model, entry = int8_module.auto_float_dtype(source, load)
    assert model.dtype == torch.bfloat16 and entry["reason"] == "no room for a float32 copy"
    # load_model times it where the CPU has AMX-BF16 (the probe stands in here), not elsewhere
    monkeypatch.setattr(int8_module, "available_memory", lambda: 1 << 40)
    monkeypatch.setenv("SPECFAST_CACHE", str(tmp_path / "d"))
    path = tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(hardware, "cpu_has_amx_bf16", lambda: True)
    step_ms[torch.float32] = 1.0
    assert specfast.load_model(path, weights="float").dtype == torch.float32
    assert specfast.load_model(path, weights="float", dtype="bfloat16").dtype == torch.bfloat16
    step_ms[torch.float32] = 3.0
    monkeypatch.setenv("SPECFAST_CACHE", str(tmp_path / "e"))
    assert specfast.load_model(path, weights="float").dtype == torch.bfloat16
    with pytest.raises(FileNotFoundError, match="no model at"):
        specfast.load_model(tmp_path / "missing.gguf")
    monkeypatch.setattr(hardware, "cpu_has_amx_bf16", lambda: False)
    assert specfast.load_model(path, weights="float").dtype == torch.float32


@pytest.mark.smollm
def test_the_smollm_gguf_is_4bit_and_a_float_model_has_no_file_types(smollm_gguf):
    assert specfast.load_model(smollm_gguf, weights="float").file_types == {"Q4_1"}
    assert not tiny_model().file_types
