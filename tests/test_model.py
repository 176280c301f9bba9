"""The runtime against itself: cached decoding == a full no-cache forward; rollback; bad input."""

import ctypes
import dataclasses
import mmap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_upper_left

from specfast import Model, ModelConfig
from specfast._core import Int8Matrix, advise_huge_pages
from specfast.model import attention as attention_module
from specfast.model.kv_cache import KVCache
from specfast.targets.base import argmax_rows


def full_logits(model, ids):
    """Reference: one forward over the whole sequence into a fresh cache."""
    cache = KVCache(
        model.config.n_layers,
        model.config.n_kv_heads,
        len(ids),
        model.config.head_dim,
        model.device,
        model.dtype,
    )
    with torch.inference_mode():
        return model(ids, cache, 0).float()


def naive_logits(model, ids):
    """Reference with no cache and no SDPA: plain causal attention written out by hand."""
    c = model.config
    T = len(ids)
    cos, sin = model.rope(T)
    x = model.embed(ids)
    for layer in model.layers:
        h = torch.nn.functional.rms_norm(x, (c.dim,), layer.attn_norm, c.norm_eps)
        q, k, v = layer.wqkv(h).split(
            [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], -1
        )
        q = q.view(T, c.n_heads, c.head_dim).transpose(0, 1)  # (H, T, hd)
        k = k.view(T, c.n_kv_heads, c.head_dim).transpose(0, 1)
        v = v.view(T, c.n_kv_heads, c.head_dim).transpose(0, 1)

        def rot(t):
            a, b = t.chunk(2, -1)
            return t * cos[:T] + torch.cat([-b, a], -1) * sin[:T]

        q, k = rot(q), rot(k)
        g = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        att = (q @ k.transpose(1, 2)) / c.head_dim**0.5
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(0, 1).reshape(T, -1)
        x = x + layer.wo(y)
        h = torch.nn.functional.rms_norm(x, (c.dim,), layer.ffn_norm, c.norm_eps)
        gate, up = layer.w_gate_up(h).chunk(2, -1)
        x = x + layer.w_down(torch.nn.functional.silu(gate) * up)
    x = torch.nn.functional.rms_norm(x, (c.dim,), model.norm, c.norm_eps)
    w = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return x @ w.T


@pytest.fixture
def ids():
    return torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))


def test_full_forward_matches_naive_attention(tiny_model, ids):
    with torch.inference_mode():
        ref = naive_logits(tiny_model, ids)
    torch.testing.assert_close(full_logits(tiny_model, ids), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks", [[1] * 40, [7, 1, 16, 3, 13], [40]])
def test_chunked_decoding_equals_full_forward(tiny_model, ids, chunks):
    ref = full_logits(tiny_model, ids)
    dec = tiny_model.decoder(64)
    out, at = [], 0
    for n in chunks:
        out.append(dec.forward(ids[at : at + n]))
        at += n
        assert dec.length == at
    torch.testing.assert_close(torch.cat(out), ref, atol=1e-5, rtol=1e-5)


def test_rollback_then_reforward_is_identical(tiny_model, ids):
    ref = full_logits(tiny_model, ids)
    dec = tiny_model.decoder(64)
    dec.forward(ids[:20])
    junk = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(5))
    for _ in range(3):  # speculate wrong tokens, reject them, continue with the right ones
        a = dec.forward(junk)
        dec.rollback(20)
        b = dec.forward(junk)
        assert torch.equal(a, b)
        dec.rollback(20)
    rest = dec.forward(ids[20:])
    torch.testing.assert_close(rest, ref[20:], atol=1e-5, rtol=1e-5)
    dec.rollback(5)
    assert dec.length == 5
    torch.testing.assert_close(dec.forward(ids[5:12]), ref[5:12], atol=1e-5, rtol=1e-5)


def test_rollback_is_needed(tiny_model, ids):
    """Negative control: without the rollback, stale tokens stay in context and logits differ."""
    ref = full_logits(tiny_model, ids)
    dec = tiny_model.decoder(64)
    dec.forward(ids[:20])
    dec.forward(ids[:5])  # not rolled back
    assert not torch.allclose(dec.forward(ids[20:22]), ref[20:22], atol=1e-3)


def test_decoders_are_independent(tiny_model, ids):
    a, b = tiny_model.decoder(64), tiny_model.decoder(64)
    la = a.forward(ids[:10])
    b.forward(ids[20:35])
    torch.testing.assert_close(a.forward(ids[10:15]), full_logits(tiny_model, ids[:15])[10:])
    assert b.length == 15 and a.length == 15
    assert torch.equal(la, full_logits(tiny_model, ids[:10]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepacked_weights_match_plain_linear(tiny_model, ids, dtype):
    model = Model.from_config(tiny_model.config, seed=0, dtype=dtype)
    packed = model.decoder(64).forward(ids)
    model.prepack = False
    model.unpack()
    assert model.packed_weights() is None
    plain = model.decoder(64).forward(ids)
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(packed, plain, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weights_stay_close_and_are_used(tiny_model, ids, dtype):
    model = Model.from_config(tiny_model.config, seed=0, dtype=dtype)
    ref = model.decoder(64).forward(ids).float()
    model.quantize_int8()
    assert isinstance(model.packed_weights()[-1], Int8Matrix)  # the int8 path, not the bf16 one
    got = model.decoder(64).forward(ids).float()
    assert not torch.equal(got, ref)
    # Per-row int8 of N(0, 0.02) weights: errors of a few 1e-3 on logits of size ~0.1.
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("mode", ["packed", "plain", "int8"])
def test_output_rows_are_those_columns_of_the_logits(tiny_model, ids, mode):
    model = Model.from_config(tiny_model.config, seed=0)
    model.prepack = mode != "plain"
    if mode == "int8":
        model.quantize_int8()
    full = model.decoder(64).forward(ids)  # (T, V)
    rows = torch.tensor([0, 1, 2, 7, 299, 42])
    head = model.output_rows(rows)
    assert (head.packed is None) == (mode == "plain")
    part = model.decoder(64).forward(ids, head=head)  # (T, 6)
    torch.testing.assert_close(part, full[:, rows], atol=1e-5, rtol=1e-5)
    assert model.first_rows(5) is model.first_rows(5)  # kept
    model.output_rows(torch.tensor([0, 7, 4]))  # not mistaken for the first 3 rows
    torch.testing.assert_close(model.first_rows(3).weight, model.output_weight[:3])


def test_int8_is_refused_off_cpu(tiny_model):
    model = Model.from_config(tiny_model.config, seed=0).to("meta")
    with pytest.raises(ValueError, match="CPU only"):
        model.quantize_int8()


def test_unpack_before_editing_weights(tiny_model, ids):
    before = tiny_model.decoder(64).forward(ids)
    tiny_model.unpack()  # the plain weights back, the packed copy dropped
    with torch.no_grad():
        tiny_model.layers[0].w_down.weight.mul_(2)
    assert not torch.allclose(tiny_model.decoder(64).forward(ids), before, atol=1e-4)
    with torch.no_grad():
        tiny_model.unpack()
        tiny_model.layers[0].w_down.weight.div_(2)
    torch.testing.assert_close(tiny_model.decoder(64).forward(ids), before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [True, False])
def test_packing_replaces_the_plain_weights(tiny_model, ids, dtype, tied):
    """Packed, the model holds one copy of each matrix, not two; unpack() gives the very
    weights back, and so do state_dict() and a cast."""
    config = dataclasses.replace(tiny_model.config, tie_embeddings=tied)
    model = Model.from_config(config, seed=0, dtype=dtype)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    first = model.decoder(64).forward(ids)
    if model.packed_weights() is None:
        pytest.skip("this torch build cannot prepack")
    matrices = [model.layers[0].wqkv.weight, model.layers[1].w_down.weight]
    assert all(w.is_meta for w in matrices)  # the plain copies are gone
    assert (model.lm_head is None) or model.lm_head.weight.is_meta
    assert not model.embed.weight.is_meta  # the lookup still needs the embedding
    head = "embed.weight" if tied else "lm_head.weight"
    assert torch.equal(model.output_weight, ref[head])
    sd = model.state_dict()  # unpacks
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    assert torch.equal(model.decoder(64).forward(ids), first)  # packed again, same logits
    as32 = model.float()
    assert torch.equal(as32.layers[0].wqkv.weight, ref["layers.0.wqkv.weight"].float())


def test_bfloat16_close_to_float32(tiny_model, ids):
    ref = full_logits(tiny_model, ids)
    bf = Model.from_config(tiny_model.config, seed=0, dtype="bfloat16")
    assert bf.dtype == torch.bfloat16
    dec = bf.decoder(64)
    out = torch.cat([dec.forward(ids[:30]), dec.forward(ids[30:31]), dec.forward(ids[31:])])
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_rope_scaling_changes_positions_only_far_out():
    base = dict(vocab_size=50, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=32)
    scaled = dict(rope_type="linear", factor=4.0)
    a = Model.from_config(ModelConfig(**base), seed=3)
    b = Model.from_config(ModelConfig(**base, rope_scaling=scaled), seed=3)
    ids = torch.arange(20) % 50
    assert not torch.allclose(a.decoder(32).forward(ids), b.decoder(32).forward(ids))
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        Model.from_config(ModelConfig(**base, rope_scaling={"rope_type": "yarn"})).decoder(8)


@pytest.mark.parametrize(
    ("bad", "exc", "msg"),
    [
        ([1, 2], TypeError, "LongTensor"),
        (torch.tensor([1.0, 2.0]), TypeError, "integer"),
        (torch.tensor([], dtype=torch.long), ValueError, "non-empty"),
        (torch.tensor([[1, 2]]), ValueError, "1-D"),
        (torch.tensor([1, 300]), ValueError, r"\[0, 300\)"),
        (torch.tensor([-1]), ValueError, r"\[0, 300\)"),
        (torch.zeros(17, dtype=torch.long), ValueError, "max_length"),
        (torch.tensor([1], device="meta"), ValueError, "model is on cpu"),
    ],
)
def test_bad_input(tiny_model, bad, exc, msg):
    dec = tiny_model.decoder(16)
    with pytest.raises(exc, match=msg):
        dec.forward(bad)
    assert dec.length == 0


def test_bad_lengths_and_config(tiny_model):
    with pytest.raises(ValueError, match="context"):
        tiny_model.decoder(257)
    with pytest.raises(ValueError, match="positive int"):
        tiny_model.decoder(0)
    dec = tiny_model.decoder(16)
    dec.forward(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        dec.rollback(4)
    with pytest.raises(ValueError):
        dec.rollback(-1)
    with pytest.raises(TypeError):
        dec.rollback(1.0)
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        Model.from_config(ModelConfig(), dtype="float64")
    with pytest.raises(ValueError, match="dtype"):
        Model.from_config(ModelConfig(), dtype=torch.int64)


@pytest.mark.parametrize("sdpa_gqa", [True, False], ids=["enable_gqa", "expand"])
@pytest.mark.parametrize("T, pos", [(1, 20), (9, 20), (24, 0)], ids=["decode", "verify", "prefill"])
def test_attention_is_fused_and_equals_written_out_attention(monkeypatch, sdpa_gqa, T, pos):
    """model.attention: 4-D grouped-query attention (SDPA's enable_gqa, or the stride-0 expand
    of torch < 2.5) that the CPU flash kernel takes (FLASH_ATTENTION alone raises otherwise),
    with a mask (verify), causal (prefill from 0) or neither (decode), as written out."""
    monkeypatch.setattr(attention_module, "SDPA_GQA", sdpa_gqa)
    H, Hkv, hd, L = 6, 2, 16, pos + T
    g = torch.Generator().manual_seed(T)
    q = torch.randn(T, H + Hkv, hd, generator=g)[:, :H].transpose(0, 1)  # (H, T, hd), a view
    k, v = torch.randn(2, Hkv, L, hd, generator=g)
    causal = pos == 0 and T > 1
    mask = torch.ones(T, L, dtype=torch.bool).tril_(pos)  # query i sees keys [0, pos + i]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        y = attention_module.attention(q, k, v, None if causal or T == 1 else mask, causal)
    scores = q @ k.repeat_interleave(H // Hkv, 0).transpose(1, 2) / hd**0.5  # (H, T, L)
    want = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(H // Hkv, 0)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, pos", [(2, 0), (9, 20), (16, 3)])
def test_verify_mask_on_cuda_is_the_same_mask_unwritten(T, pos):
    """On CUDA a verify pass's mask is SDPA's lower-right causal bias (flash takes it); it must
    be the written mask the CPU uses: row i sees keys [0, pos + i]. Control: the upper-left
    bias (SDPA's is_causal) hides keys the rows must see whenever pos > 0."""
    written = attention_module.verify_mask(T, pos, torch.device("cpu"))
    assert written.shape == (T, pos + T)
    assert written.sum().item() == T * pos + T * (T + 1) // 2
    bias = attention_module.verify_mask(T, pos, torch.device("cuda"))  # builds nothing on a device
    assert torch.equal(bias._materialize(torch.device("cpu")), written)
    upper = causal_upper_left(T, pos + T)._materialize(torch.device("cpu"))
    assert torch.equal(upper, written) == (pos == 0)
    g = torch.Generator().manual_seed(pos)
    q, k, v = torch.randn(1, 4, T, 8, generator=g), *torch.randn(2, 1, 4, pos + T, 8, generator=g)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        F.scaled_dot_product_attention(q, k, v, attn_mask=written),
    )


ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_flash_attention_forward": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_efficient_attention_forward": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
}


def attention_kernels(run) -> set[str]:
    """Which of SDPA's kernels `run()` went through, from the profiler's operator names."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {ATTENTION_OPS[e.key] for e in prof.key_averages() if e.key in ATTENTION_OPS}


@pytest.mark.cuda
def test_cuda_passes_take_fused_attention():
    """On CUDA in bf16 every eager pass (causal prefill, masked verify, decode) attends through
    flash, never SDPA's math path nor cuDNN (a graph built per key length); the static step
    through a fused kernel. Profiled, since the passes set their own allowed kernels."""
    model = Model.from_config(ModelConfig(max_context=512), seed=0, device="cuda", dtype="bf16")
    ids = torch.arange(1, 41, device="cuda")
    with torch.inference_mode():
        dec = model.decoder(64)
        assert attention_kernels(lambda: dec.forward(ids[:30])) == {"flash"}  # prefill
        assert attention_kernels(lambda: dec.forward(ids[30:39])) == {"flash"}  # verify
        assert attention_kernels(lambda: dec.forward(ids[39:])) == {"flash"}  # decode
        c = model.config
        cos, sin = (t[:256] for t in model.rope(256))
        k = torch.zeros(c.n_layers, c.n_kv_heads, 256, c.head_dim, device="cuda", dtype=model.dtype)
        got = attention_kernels(
            lambda: model.forward_static(
                ids[:8], torch.arange(8, device="cuda"), k, k.clone(), cos, sin
            )
        )
        assert got and "math" not in got
        # control: a written mask on the same verify pass cannot take flash
        q = torch.randn(1, c.n_heads, 9, c.head_dim, device="cuda", dtype=model.dtype)
        kv = torch.randn(1, c.n_kv_heads, 39, c.head_dim, device="cuda", dtype=model.dtype)
        written = attention_module.verify_mask(9, 30, torch.device("cpu")).cuda()
        with attention_module.eager_attention_backends(q.device):
            got = attention_kernels(
                lambda: F.scaled_dot_product_attention(
                    q, kv, kv, attn_mask=written, enable_gqa=True
                )
            )
        assert got and "flash" not in got


@pytest.mark.cuda
def test_cuda_matches_cpu(tiny_model, ids):
    ref = full_logits(tiny_model, ids)
    gpu = Model.from_config(tiny_model.config, seed=0, device="cuda")
    dec = gpu.decoder(64)
    out = torch.cat([dec.forward(ids[:25].cuda()), dec.forward(ids[25:].cuda())]).cpu()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="model is on"):
        dec.forward(ids[:1])


def test_argmax_rows_keeps_torchs_rules_on_ties_and_nans():
    nan = float("nan")
    rows = torch.tensor(
        [
            [1.0, 5.0, 5.0, 2.0],  # a tie: the first index
            [1.0, nan, 3.0, nan],  # a NaN counts as the largest: the first one
            [-3.0, -1.0, -2.0, -1.0],
            [-float("inf")] * 4,
        ]
    )
    assert argmax_rows(rows).tolist() == [1, 1, 1, 0]
    g = torch.Generator().manual_seed(0)
    big = torch.randn(9, 49152, generator=g).round(decimals=1)  # many ties at the top
    for logits in (big, big[:, ::2], big.bfloat16(), big[3]):
        got = argmax_rows(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))


def _thp_eligible(address: int) -> bool | None:
    """Whether Linux may back the mapping holding `address` with 2 MiB pages (smaps'
    THPeligible), or None where this cannot be read."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


def _thp_setting() -> str:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in setting:
        pytest.skip("transparent huge pages are off")
    return setting


def test_advise_huge_pages_marks_a_fresh_mapping_eligible():
    if "[madvise]" not in _thp_setting():
        pytest.skip("under `always` every mapping is eligible: nothing to tell apart")
    size = 8 << 20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(view)
    try:
        # Not advised yet: the control, which a check that always says "eligible" would fail.
        assert _thp_eligible(address + size // 2) is False
        advised = advise_huge_pages(address, size)
        assert advised >= size - (2 << 20) and advised % (2 << 20) == 0
        assert _thp_eligible(address + size // 2) is True
        assert advise_huge_pages(address, (2 << 20) - 1) == 0  # no whole aligned page inside
    finally:
        del view
        region.close()


def test_a_cpu_cache_is_zeroed_on_memory_advised_for_huge_pages():
    shape = (2, 2, 4096, 64)  # 4 MiB a buffer in float32: whole aligned pages inside
    cache = KVCache(*shape, "cpu", torch.float32)
    assert all(t.shape == shape and not t.any() for t in (cache.k, cache.v))
    _thp_setting()
    assert _thp_eligible(cache.k.data_ptr() + cache.k.nbytes // 2) is True
