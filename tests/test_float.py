"""float32 weights in the core (`FloatMatrix`): the product against a float64 reference, rows
that never depend on each other, and a float32 CPU model whose passes run in the core and whose
speculative output equals its own plain output. (Bad arguments, the torch glue, and a verify
pass against one-token passes: test_int8.py, for every core matrix.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CPU_KERNELS

import specfast
from specfast import Model, ModelConfig
from specfast._core import FloatMatrix
from specfast.model.quantize import dequantize


def check_product(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out is close to the float64 product."""
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.sqrt(w.shape[1]))


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize(
    ("rows", "cols", "n"),
    [(1, 1, 1), (17, 5, 3), (16, 64, 8), (33, 130, 9), (70, 96, 4), (300, 576, 17)],
)
def test_the_product_equals_the_reference(kernel, rows, cols, n):
    rng = np.random.default_rng(rows * 1000 + cols)
    w = rng.standard_normal((rows, cols), dtype=np.float32)
    x = rng.standard_normal((n, cols), dtype=np.float32)
    m = FloatMatrix(w)
    out, portable = np.empty((n, rows), np.float32), np.empty((n, rows), np.float32)
    m.matmul(x, out, kernel)
    check_product(w, x, out)
    # every build sums in the same order: the portable one's bits
    m.matmul(x, portable, "scalar")
    np.testing.assert_array_equal(out, portable)
    assert np.array_equal(m.weights(), w) and torch.equal(dequantize(m), torch.from_numpy(w))


def test_a_product_that_drops_the_last_row_is_caught():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 96), dtype=np.float32)
    x = rng.standard_normal((5, 96), dtype=np.float32)
    m, out = FloatMatrix(w), np.zeros((5, 40), np.float32)
    m.matmul(x[:-1], out[:-1])  # the last row never computed
    with pytest.raises(AssertionError):
        check_product(w, x, out)


def test_rows_do_not_depend_on_each_other():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 576), dtype=np.float32)
    x = rng.standard_normal((9, 576), dtype=np.float32)
    m, out = FloatMatrix(w), np.empty((9, 300), np.float32)
    m.matmul(x, out)
    for r in range(9):
        one = np.empty((1, 300), np.float32)
        m.matmul(x[r : r + 1], one)
        np.testing.assert_array_equal(one[0], out[r])
    # negative control: one sequential sum per value (another order, as a GEMM blocked for
    # another row count might take) gives other bits, which the checks above would catch
    seq = np.zeros((9, 300), np.float32)
    for i in range(576):
        seq += x[:, i : i + 1] * w[:, i]
    assert not np.array_equal(seq, out)


# -----------------------------------------------------------------------------
# models


def tiny_model() -> Model:
    cfg = ModelConfig(
        vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96
    )
    return Model.from_config(cfg, seed=4)


def test_a_float32_cpu_model_runs_in_the_core():
    """Its matrices are FloatMatrix and its passes one call into the core, over a float32
    cache; with prepack off torch runs them (F.linear), and the logits agree to float32
    rounding. (A verify pass equals one-token passes bit for bit, and greedy passes through
    the core equal forward's argmax: test_int8.py, for every core weight kind.)"""
    model = tiny_model()
    assert model.in_core and model.kv_dtype == torch.float32
    assert all(isinstance(p, FloatMatrix) for p in model.packed_weights()[0])
    assert f"weights=float ({specfast._core.int8_kernel()})" in repr(model)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0))
    core = model.decoder(64).forward(ids)
    plain = tiny_model()
    plain.prepack = False
    assert not plain.in_core and "weights=float (torch)" in repr(plain)
    torch.testing.assert_close(core, plain.decoder(64).forward(ids), atol=1e-4, rtol=1e-4)


def test_float32_tiny_speculation_equals_its_own_plain_greedy():
    model = tiny_model()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 1, 2, 3]
    want = specfast.generate(model, prompt, max_new_tokens=60, drafter=None).token_ids
    for k in (1, 4, 16, "auto"):
        out = specfast.generate(model, prompt, max_new_tokens=60, num_speculative_tokens=k)
        assert out.token_ids == want, k
