"""A GGUF file -> Model: the tensors dequantized, the config and the tokenizer (byte-level BPE,
or SentencePiece: spm.py) from its metadata; also single tensors of it (a Llama's token
embedding for an EAGLE head)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from specfast.formats.common import (
    SUPPORTED_ARCHS,
    LayerQuantizer,
    build_model,
    gemma3_fields,
    int_list,
)
from specfast.formats.spm import spm_tokenizer
from specfast.targets.llama_cpp.state import llama_state
from specfast.targets.torch.model import Model, ModelConfig

# ggml's 4-bit types: each group of 32 weights is 16 levels on an affine scale, which a Q4_1
# group of the q4 weights holds (exactly for Q4_0 and Q4_1).
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")


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


def load_gguf(path: Path, dtype: torch.dtype, weights: str = "float") -> Model:
    """The model in a GGUF file, its tensors dequantized to `dtype`; with weights "int8" or
    "q4" each layer's matrices are quantized as they are read (LayerQuantizer)."""
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported by specfast's runtime (it "
            f"runs {', '.join(SUPPORTED_ARCHS)}); run it with llama.cpp as the target, with "
            "specfast's drafters: specfast.load_model(path, backend='llama.cpp')"
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
        n_layers = int(meta("block_count"))
        config = ModelConfig(
            vocab_size=int(vocab or 0),  # (set above: the metadata, tokens or embedding)
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=int(meta("attention.key_length", dim // n_heads)),
            intermediate_size=int(meta("feed_forward_length")),
            norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_context=int(meta("context_length", 2048)),
            attn_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            tie_embeddings="output.weight" not in tensors,
            arch=arch,
            extra=extra,
            **(gemma3_options(meta, dim, n_heads, n_layers) if arch == "gemma3" else {}),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad or missing GGUF model metadata: {e}") from None

    # llama.cpp permutes Q/K rows for llama-arch (interleaved RoPE); qwen2/3 use NEOX RoPE as-is.
    permuted = arch in ("llama", "mistral")

    def get(name):
        w = _dequantized(tensors, name, path)
        if permuted and ".attn_q." in name:
            w = _unpermute(w, n_heads)
        elif permuted and ".attn_k." in name:
            w = _unpermute(w, n_kv)
        # Cast tensor by tensor: a whole float32 copy of the model never exists at once.
        return torch.from_numpy(w).to(dtype)

    quantizer = LayerQuantizer(weights) if weights != "float" else None
    ours = {"embed.weight": get("token_embd.weight"), "norm": get("output_norm.weight")}
    if not config.tie_embeddings:
        ours["lm_head.weight"] = get("output.weight")
        if quantizer:
            quantizer.output(ours)
    for i in range(config.n_layers):
        b = f"blk.{i}."
        layer = {f"layers.{i}.attn_norm": get(b + "attn_norm.weight")}
        layer[f"layers.{i}.ffn_norm"] = get(b + "ffn_norm.weight")
        layer[f"layers.{i}.wqkv.weight"] = torch.cat([get(b + f"attn_{n}.weight") for n in "qkv"])
        if config.attn_bias:
            layer[f"layers.{i}.wqkv.bias"] = torch.cat([get(b + f"attn_{n}.bias") for n in "qkv"])
        if config.qk_norm:
            layer[f"layers.{i}.q_norm"] = get(b + "attn_q_norm.weight")
            layer[f"layers.{i}.k_norm"] = get(b + "attn_k_norm.weight")
        if config.post_norms:  # (llama.cpp's converter stores Gemma's norms as 1 + w)
            layer[f"layers.{i}.post_attn_norm"] = get(b + "post_attention_norm.weight")
            layer[f"layers.{i}.post_ffn_norm"] = get(b + "post_ffw_norm.weight")
        layer[f"layers.{i}.wo.weight"] = get(b + "attn_output.weight")
        layer[f"layers.{i}.w_gate_up.weight"] = torch.cat(
            [get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")]
        )
        layer[f"layers.{i}.w_down.weight"] = get(b + "ffn_down.weight")
        ours.update(quantizer.layer(i, layer) if quantizer else layer)
    model = build_model(config, ours, path)
    if quantizer:
        quantizer.attach(model)
    model.file_is_4bit = all(
        tensors[f"blk.{i}.{name}.weight"].tensor_type.name in FOUR_BIT_TYPES
        for i in range(config.n_layers)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    )

    model.tokenizer = tokenizer_from_gguf(reader, path) if tokens else None
    model.chat_template = _field(reader, "tokenizer.chat_template")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    model.eos_token_ids = list(dict.fromkeys(int_list([e for e in eos if e is not None])))
    return model


def gemma3_options(meta, dim: int, n_heads: int, n_layers: int) -> dict:
    """ModelConfig's gemma3 fields from GGUF metadata, with llama.cpp's rules where the file is
    silent: every 6th layer global, the rest sliding with RoPE base 10000, and scores scaled by
    1/sqrt(key_length) (1/sqrt(dim / heads) for the 62-layer 27B)."""
    hd = int(meta("attention.key_length", dim // n_heads))
    return gemma3_fields(
        dim,
        hd,
        (dim / n_heads if n_layers == 62 else hd) ** -0.5,
        int(meta("attention.sliding_window", 4096)),
        tuple(i for i in range(n_layers) if (i + 1) % 6),
        10000.0,
    )


def llama_embedding(llama, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Llama's token embedding (V, D) dequantized from its GGUF file, in `dtype`: what an
    EAGLE head without its own embed_tokens embeds its tokens with. Cached per Llama and
    dtype for the Llama's lifetime (SmolLM2's: 113 MB in float32); dequantizing takes a float32 copy
    of the whole matrix, a few GB for a 150k-token vocabulary at 4096 wide."""
    cache = llama_state(llama).setdefault("embedding", {})
    if dtype not in cache:
        cache[dtype] = gguf_tensor(llama.model_path, "token_embd.weight").to(dtype)
    return cache[dtype]


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
    file's tokenizer model is neither byte-level BPE nor SentencePiece (formats/spm.py)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    kind = _field(reader, "tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece (Gemma, Llama 2)
        return spm_tokenizer(
            list(_field(reader, "tokenizer.ggml.tokens")),
            [float(s) for s in _field(reader, "tokenizer.ggml.scores") or []],
            [int(t) for t in _field(reader, "tokenizer.ggml.token_type") or []],
            bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
            add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
            path=path,
        )
    if kind != "gpt2":
        warnings.warn(
            f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', and "
            "SentencePiece, 'llama', are); the model loads without a tokenizer",
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
