"""int8 weights: the kernel against a float64 reference, rows that never depend on each other,
and an int8 model whose speculative output equals its own plain output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CPU_KERNELS

import specfast
from specfast import Model, ModelConfig
from specfast._core import FloatMatrix, Int8Matrix, Q4Matrix, row_attention
from specfast.model.core import core_stack
from specfast.model.quantize import core_linear, dequantize
from specfast.targets.base import argmax_rows

GROUP = 32  # input features per activation scale


def expected(m: Int8Matrix, x: np.ndarray, per_tensor: bool = False) -> np.ndarray:
    """The product as the kernel defines it, with integer sums in int64: each row of x
    quantized symmetric to int8 with one scale per group of 32 features (or, for the negative
    control, one scale per group shared by all rows); then, in float32, group by group,
    acc += (group sum) * sx, and out = acc * sw."""
    q, sw = m.weights()
    x = x.astype(np.float32)
    n = x.shape[0]
    acc = np.zeros((n, m.rows), np.float32)
    for lo in range(0, m.cols, GROUP):
        xg = x[:, lo : lo + GROUP]
        amax = np.abs(xg).max(axis=None if per_tensor else 1, keepdims=True)
        sx = np.broadcast_to(amax.astype(np.float32) / np.float32(127), (n, 1))
        with np.errstate(invalid="ignore", divide="ignore"):
            qx = np.where(sx > 0, np.clip(np.round(xg / sx), -127, 127), 0).astype(np.int64)
        sums = qx @ q[:, lo : lo + GROUP].astype(np.int64).T  # (n, N), exact
        acc = acc + sums.astype(np.int32).astype(np.float32) * sx
    return acc * sw[None, :]


def check_product(m: Int8Matrix, x: np.ndarray, out: np.ndarray) -> None:
    np.testing.assert_array_equal(out, expected(m, x))
    # and close to the float64 product with the dequantized weights
    ref = x.astype(np.float64) @ dequantize(m).double().numpy().T
    scale = np.abs(ref).max() + 1e-12
    assert np.abs(out - ref).max() < 0.05 * scale


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize(
    ("rows", "cols", "n"), [(1, 1, 1), (17, 5, 3), (16, 64, 8), (33, 130, 9), (700, 577, 17)]
)
def test_kernel_equals_the_reference(kernel, rows, cols, n):
    rng = np.random.default_rng(rows * 1000 + cols)
    w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
    x = rng.standard_normal((n, cols), dtype=np.float32)
    m = Int8Matrix(w)
    out = np.empty((n, rows), np.float32)
    m.matmul(x, out, kernel)
    check_product(m, x, out)


def test_a_kernel_that_drops_the_last_row_is_caught():
    rng = np.random.default_rng(0)
    m = Int8Matrix(rng.standard_normal((40, 96), dtype=np.float32))
    x = rng.standard_normal((5, 96), dtype=np.float32)
    out = np.zeros((5, 40), np.float32)
    m.matmul(x[:-1], out[:-1])  # the last row never computed
    with pytest.raises(AssertionError):
        check_product(m, x, out)


def test_rows_do_not_depend_on_each_other():
    rng = np.random.default_rng(1)
    m = Int8Matrix(rng.standard_normal((300, 200), dtype=np.float32))
    x = rng.standard_normal((9, 200), dtype=np.float32)
    x[4] *= 50  # one loud row: a shared activation scale would change every other row
    out = np.empty((9, 300), np.float32)
    m.matmul(x, out)
    for r in range(9):
        one = np.empty((1, 300), np.float32)
        m.matmul(x[r : r + 1], one)
        np.testing.assert_array_equal(one[0], out[r])
    # negative control: per-tensor scales (fbgemm's dynamic linear) do not have this property
    assert not np.array_equal(expected(m, x, per_tensor=True), out)


CORE_MATRICES = [Int8Matrix, Q4Matrix, FloatMatrix]


@pytest.mark.parametrize("matrix", CORE_MATRICES)
def test_strided_and_batched_inputs_through_the_torch_glue(matrix):
    w = torch.randn(48, 40)
    m = matrix(w.numpy())
    x = torch.randn(40, 6).t()  # (6, 40), not contiguous
    y = core_linear(x, m)
    want = core_linear(x.contiguous(), m)
    assert torch.equal(y, want)
    x3 = torch.randn(2, 3, 40)
    assert torch.equal(core_linear(x3, m).view(6, 48), core_linear(x3.view(6, 40), m))
    assert core_linear(x.bfloat16(), m).dtype == torch.bfloat16


@pytest.mark.parametrize("matrix", CORE_MATRICES)
def test_bad_input_is_a_clear_error(matrix):
    m = matrix(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match=r"x must be \(n, 8\)"):
        m.matmul(np.ones((2, 7), np.float32), np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        m.matmul(np.ones((8, 2), np.float32).T, np.empty((2, 4), np.float32))
    with pytest.raises(TypeError):
        m.matmul(np.ones((2, 8), np.float64), np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="kernel must be"):
        m.matmul(np.ones((2, 8), np.float32), np.empty((2, 4), np.float32), "fast")
    with pytest.raises(ValueError, match="at least one row"):
        matrix(np.ones((0, 8), np.float32))


def test_an_int8_matrix_refuses_non_finite_weights_and_gives_nan_rows():
    m = Int8Matrix(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match="finite"):
        Int8Matrix(np.array([[1.0, np.nan]], np.float32))
    x = np.ones((2, 8), np.float32)
    x[1, 3] = np.inf
    out = np.empty((2, 4), np.float32)
    m.matmul(x, out)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()  # the sampler then refuses it


def test_row_attention_matches_torch_attention():
    H, Hkv, T, hd, S, pos = 6, 2, 5, 32, 40, 20
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(H, T, hd, generator=gen)  # (H, T, hd): head h reads kv head h // 3
    k, v = torch.randn(2, Hkv, S, hd, generator=gen)
    out = torch.empty_like(q)
    row_attention(q.numpy(), k.numpy(), v.numpy(), out.numpy(), pos)
    g = H // Hkv
    seen = torch.ones(T, pos + T, dtype=torch.bool).tril_(pos).repeat(g, 1)
    want = F.scaled_dot_product_attention(
        q.view(Hkv, g * T, hd), k[:, : pos + T], v[:, : pos + T], attn_mask=seen
    )
    torch.testing.assert_close(out, want.view(H, T, hd), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        row_attention(q.numpy(), k.numpy(), v.numpy(), out.numpy(), S - T + 1)
    with pytest.raises(ValueError, match="same hd"):
        row_attention(q.numpy(), k[..., :16].contiguous().numpy(), v.numpy(), out.numpy(), pos)


# -----------------------------------------------------------------------------
# models


def tiny_model() -> Model:
    cfg = ModelConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96
    )
    return Model.from_config(cfg, seed=3)


def core_model(kind: str) -> Model:
    """The tiny model with its passes in the core: float32, int8 or q4 weights."""
    return tiny_model() if kind == "float" else tiny_model().quantize_int8(kind)


@pytest.mark.parametrize("kind", ["float", "int8", "q4"])
def test_a_verify_pass_equals_one_token_passes_bit_for_bit(kind):
    model = core_model(kind)
    assert model.in_core and model.weights == kind
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(0))
    # across a key bucket's edge (64) and inside one
    for pos, T in ((50, 17), (60, 9), (100, 2), (100, 1)):
        d = model.decoder(256)
        d.forward(ids[:pos])
        whole = d.forward(ids[pos : pos + T])
        d.rollback(pos)
        rows = torch.cat([d.forward(ids[pos + i : pos + i + 1]) for i in range(T)])
        assert torch.equal(whole, rows), (pos, T)


@pytest.mark.parametrize("kind", ["float", "int8", "q4"])
def test_greedy_passes_equal_the_argmax_of_full_passes(kind):
    """A core model's forward_greedy calls the core with NumPy arrays and no torch op
    (CoreGreedy.greedy): pass after pass, of several sizes, its ids and the cache it
    leaves are forward()'s."""
    model = core_model(kind)
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(6))
    greedy, full = model.decoder(96), model.decoder(96)
    pos = 0
    for T in (20, 1, 9, 1, 3, 16):
        got = greedy.forward_greedy(ids[pos : pos + T])
        want = argmax_rows(full.forward(ids[pos : pos + T]))
        pos += T
        assert torch.equal(got, want) and greedy.length == full.length == pos
    for a, b in ((greedy.cache.k, full.cache.k), (greedy.cache.v, full.cache.v)):
        assert torch.equal(a[:, :, :pos], b[:, :, :pos])
    assert greedy.core._arrays is not None  # the path under test ran
    for bad, error in (
        (torch.tensor([300]), ValueError),  # beyond the vocabulary
        (torch.tensor([-1]), ValueError),
        (torch.tensor([1.0]), TypeError),
        (torch.zeros(2, 1, dtype=torch.long), ValueError),
        (torch.zeros(96 - pos + 1, dtype=torch.long), ValueError),  # past max_length
    ):
        with pytest.raises(error):
            greedy.forward_greedy(bad)
        assert greedy.length == pos


def test_an_int8_model_in_float16_runs_its_passes_through_torch():
    """The core takes float32 activations: an int8 model in float16 (whose float16 cache is
    also a core cache dtype) runs its passes through torch instead of failing in the core."""
    model = tiny_model().to(torch.float16).quantize_int8()
    model.prepack = False  # oneDNN's switch: int8 products stay the core's
    assert isinstance(model.packed_weights()[0][0], Int8Matrix)
    d = model.decoder(32)
    logits = d.forward(torch.arange(5))
    assert logits.shape == (5, 300) and torch.isfinite(logits).all()
    d.rollback(0)
    assert torch.equal(d.forward_greedy(torch.arange(5)), argmax_rows(logits))


def test_int8_tiny_speculation_equals_its_own_plain_greedy():
    model = tiny_model().quantize_int8()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 1, 2, 3]
    want = specfast.generate(model, prompt, max_new_tokens=60, drafter=None).token_ids
    for k in (1, 4, 16, "auto"):
        out = specfast.generate(model, prompt, max_new_tokens=60, num_speculative_tokens=k)
        assert out.token_ids == want, k


@pytest.mark.smollm
def test_int8_smollm_speculation_equals_its_own_plain_greedy(smollm_gguf, monkeypatch):
    model = specfast.load_model(smollm_gguf, weights="int8")
    assert model.weights == "int8" and model.dtype == torch.float32
    prompts = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ",
        "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
        "Rough winds do shake the darling buds of May,",
        "Rename the variable x to count:\ndef f(x):\n    y = x + 1\n    return x * y\n",
    ]
    for prompt in prompts:
        want = specfast.generate(model, prompt, max_new_tokens=48, drafter=None).token_ids
        for k in (1, 4, 16, "auto"):
            out = specfast.generate(model, prompt, max_new_tokens=48, num_speculative_tokens=k)
            assert out.token_ids == want, (prompt[:20], k)


def test_per_tensor_activation_scales_break_speculative_exactness(monkeypatch):
    """Negative control for the test above, on a tiny model so it needs no file: with one
    activation scale shared by the rows of a pass, a verify pass no longer equals one-token
    passes, and the speculative output drifts from plain greedy. In float32 the whole pass runs
    in the core; in bfloat16 torch runs it, each product through `core_linear`, which the fault
    replaces."""
    import specfast.model.layers as layers_module

    def verify_equals_rows(model) -> bool:
        d = model.decoder(128)
        d.forward(ids[:40])
        whole = d.forward(ids[40:49])
        d.rollback(40)
        rows = torch.cat([d.forward(ids[40 + i : 41 + i]) for i in range(9)])
        return torch.equal(whole, rows)

    def per_tensor(x, m):
        q, sw = m.weights()
        x2 = x.reshape(-1, m.cols).float()
        s = x2.abs().max().clamp_min(1e-30) / 127
        qx = torch.round(x2 / s).clamp(-127, 127)
        y = (qx.double() @ torch.from_numpy(q).double().T).float() * (s * torch.from_numpy(sw))
        return y.view(*x.shape[:-1], m.rows).to(x.dtype)

    model = tiny_model().to(torch.bfloat16).quantize_int8()
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(1))
    assert verify_equals_rows(model)
    monkeypatch.setattr(layers_module, "core_linear", per_tensor)
    assert not verify_equals_rows(model)


def test_weights_option():
    with pytest.raises(ValueError, match="weights must be one of"):
        specfast.load_model(weights="int4")
    with pytest.raises(ValueError, match="eagerly"):
        specfast.load_model(weights="int8", compile="on")
    model = tiny_model()
    assert model.weights == "float"
    model.quantize_int8()
    assert model.weights == "int8" and "int8" in repr(model)
    with pytest.raises(ValueError, match="eagerly"):
        model.compile_steps()


def test_the_core_head_is_the_final_norm_and_the_output_product():
    """An int8 pass's logits come from the core call (final norm and output matrix there); they
    match torch's norm followed by the same int8 product, and a logits buffer of the wrong shape
    is an error before the cache changes."""
    model = tiny_model().quantize_int8()
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        d = model.decoder(64)
        logits = d.forward(ids)  # (12, V), the core's head
        d.rollback(0)
        normed = d.forward(ids, head=lambda h: h)  # torch's final norm, no projection
    packed = model.packed_weights()
    want = core_linear(normed, packed[-1])
    assert torch.allclose(logits, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits, core_linear(normed * 2, packed[-1]), atol=1e-3)

    stack = core_stack(model, packed)
    c = model.config
    x = model.embed.weight[:1].detach().float().numpy().copy()
    cos, sin = (t[:1].contiguous().numpy() for t in model.rope(1))
    k, v = (np.zeros((c.n_layers, c.n_kv_heads, 8, c.head_dim), np.float32) for _ in range(2))
    for bad in (
        np.empty((1, c.vocab_size - 1), np.float32),
        np.empty((2, c.vocab_size), np.float32),
    ):
        with pytest.raises(ValueError, match="logits"):
            stack.forward(x, cos, sin, k, v, 0, logits=bad)
    assert not k.any() and not v.any()
    good = np.zeros((1, c.vocab_size), np.float32)
    stack.forward(x, cos, sin, k, v, 0, logits=good)
    assert k.any() and np.isfinite(good).all() and good.any()


def test_a_core_decoder_caches_in_float16():
    """int8 and q4 models decode over a float16 cache (float models keep their dtype): the core
    writes each key and value rounded once (layer 0's keys, whose input is the embedding alone,
    are the float32 cache's rounded) and the pass differs from one over a float32 cache (the
    rounding is real). The two caches must share a dtype, float32 or float16. Passes over the
    float16 cache equal one-token passes bit for bit (test_a_verify_pass_equals_...)."""
    assert tiny_model().decoder(8).cache.k.dtype == torch.float32
    for kind in ("int8", "q4"):
        model = tiny_model().quantize_int8(kind)
        assert model.kv_dtype == torch.float16 and "kv_dtype=torch.float16" in repr(model)
        assert model.decoder(8).cache.k.dtype == torch.float16
        model.kv_dtype = torch.float32  # full precision, asked for
        assert model.decoder(8).cache.k.dtype == torch.float32
        model.kv_dtype = None
        assert model.decoder(8).cache.k.dtype == torch.float16
        with pytest.raises(ValueError, match="kv_dtype must be"):
            model.kv_dtype = torch.bfloat16

    model = tiny_model().quantize_int8("q4")
    stack = core_stack(model, model.packed_weights())
    c = model.config
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5))
    x0 = model.embed(ids).detach().float().numpy()
    cos, sin = (t[:40].contiguous().numpy() for t in model.rope(40))
    shape = (c.n_layers, c.n_kv_heads, 48, c.head_dim)
    out = {}
    for dtype in (np.float16, np.float32):
        x, k, v = x0.copy(), np.zeros(shape, dtype), np.zeros(shape, dtype)
        stack.forward(x, cos, sin, k, v, 0)
        out[dtype] = x, k
    np.testing.assert_array_equal(out[np.float16][1][0], out[np.float32][1][0].astype(np.float16))
    assert not np.array_equal(out[np.float16][0], out[np.float32][0])

    x = x0[:1].copy()
    for k, v in (
        (np.zeros(shape, np.float32), np.zeros(shape, np.float16)),
        (np.zeros(shape, np.float64), np.zeros(shape, np.float64)),
    ):
        with pytest.raises(TypeError, match="both be float32 or both float16"):
            stack.forward(x, cos[:1], sin[:1], k, v, 0)
