"""A GGUF file -> Model: the tensors dequantized, the config and the tokenizer (byte-level BPE,
or SentencePiece: spm.py) from its metadata; also single tensors of it (a Llama's token
embedding for an EAGLE head)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specfast._core import GgufMatrix, Q4Matrix, gguf_block_types
from specfast.formats.common import (
    SUPPORTED_ARCHS,
    LayerQuantizer,
    build_model,
    gemma3_fields,
    int_list,
)
from specfast.formats.gguf_tokenizer import gguf_field, tokenizer_from_gguf
from specfast.model import Model, ModelConfig
from specfast.model.embedding import FileEmbedding
from specfast.model.quantize import CoreMatrix, q8_0_blocks, quantize

# ggml's float types: a GGUF whose layer matrices are all of these is not quantized.
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# The layer matrices' tensors, each layer's: Model.file_types holds their types.
LAYER_TENSORS = (
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"
)  # fmt: skip


def _gguf_reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError... on bad bytes
        raise ValueError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`), which reorders each
    head's rows from rotate-half pairs (i, i + hd/2) to interleaved pairs (2i, 2i + 1)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def four_bit_parts(t) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
    """A 4-bit tensor's values q (rows, cols) uint8 in 0..=15, scales d and minimums m (rows,
    cols / 32) float32, as Q4Matrix.from_parts takes them: Q4_0 as its blocks hold them (m None:
    w = d·(q - 8)), Q4_1 too (w = d·q + m), Q4_K with each 32-value group's d·sc and
    -dmin·min, which from_parts rounds to f16 (a relative 2^-11 of a step). None for other
    types."""
    kind = t.tensor_type.name
    if kind not in ("Q4_0", "Q4_1", "Q4_K"):
        return None
    cols = int(t.shape[0])
    rows = int(np.prod([int(n) for n in t.shape[1:]]))
    raw = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1)

    def halves(b):  # f16 fields of every block
        return b.copy().view(np.float16).astype(np.float32)

    if kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128
        d, dmin = halves(blocks[:, :2]), halves(blocks[:, 2:4])
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])  # (blocks, 8): per group of 32
        # 4 runs of 32 bytes, each two groups: the first in the low nibbles, then the high
        nibbles = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        q = (nibbles & 15).reshape(rows, cols)
        scale = (d * sc.astype(np.float32)).reshape(rows, -1)
        return q, scale, (-dmin * mins.astype(np.float32)).reshape(rows, -1)
    head = 2 if kind == "Q4_0" else 4  # d (and m) in f16, then 16 bytes of two values each
    row_blocks = raw.reshape(rows, cols // 32, head + 16)
    nibbles = row_blocks[..., head:]  # byte j: value j in its low nibble, value j + 16 in its high
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols)
    d = halves(row_blocks[..., :2])[..., 0]
    return q, d, None if kind == "Q4_0" else halves(row_blocks[..., 2:4])[..., 0]


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


def _model_config(reader, path: Path) -> tuple[ModelConfig, dict, str]:
    """(the model's config, its tensors by name, its architecture) from a GGUF's metadata."""
    from gguf.quants import dequantize

    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported by specfast's runtime (it "
            f"runs {', '.join(SUPPORTED_ARCHS)}); run it with llama.cpp as the target, with "
            "specfast's drafters: specfast.load_model(path, backend='llama.cpp')"
        )
    tensors = {t.name: t for t in reader.tensors}
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")

    def meta(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

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
    return config, tensors, arch


def load_gguf(path: Path, dtype: torch.dtype, weights: str = "float", reader=None) -> Model:
    """The model in a GGUF file, its tensors dequantized to `dtype`; with weights "int8" or
    "q4" each layer's matrices are quantized as they are read (LayerQuantizer; for q4 a 4-bit
    tensor keeps its own values and scales), and a quantized embedding stays in its blocks.

    weights="file" keeps every layer matrix in the file's own blocks (a GgufMatrix, each tensor
    at its type), and the output matrix too (the embedding, where tied) where the core holds
    its type, else in int8. A tensor of a type the core does not hold is requantized to Q8_0:
    at least the bits of a 2-6 bit type; a 16- or 32-bit float loses what the 8-bit
    activations would anyway, so a file of float layer tensors loads too, all in Q8_0. `reader`:
    the file's GGUFReader, where the caller has opened it already."""
    reader = _gguf_reader(path) if reader is None else reader
    config, tensors, arch = _model_config(reader, path)
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    n_heads, n_kv = config.n_heads, config.n_kv_heads

    # llama.cpp permutes Q/K rows for llama-arch (interleaved RoPE); qwen2/3 use NEOX RoPE as-is.
    permuted = arch in ("llama", "mistral")

    def unpermuted(name, w):
        if permuted and ".attn_q." in name:
            return _unpermute(w, n_heads)
        if permuted and ".attn_k." in name:
            return _unpermute(w, n_kv)
        return w

    def get(name):
        w = unpermuted(name, _dequantized(tensors, name, path))
        # Cast tensor by tensor: a whole float32 copy of the model never exists at once.
        return torch.from_numpy(w).to(dtype)

    quantizer = LayerQuantizer(weights) if weights != "float" else None
    held = set(gguf_block_types())

    def q4_matrix(names: list[str]) -> Q4Matrix:
        """The tensors `names` stacked by rows as a Q4Matrix: 4-bit tensors keep their values
        and scales (four_bit_parts), the others are quantized; all of Q4_0 stays Q4_0 (4.5 bits
        a weight), any other is Q4_1."""
        parts: list = []  # per tensor (q, d, m or None), its rows as ours
        for n in names:
            p = four_bit_parts(tensors[n])
            if p is None:
                parts.append(Q4Matrix(get(n).float().numpy()).parts())
            else:
                parts.append([a if a is None else unpermuted(n, a) for a in p])
        q = np.concatenate([p[0] for p in parts])
        d = np.concatenate([p[1] for p in parts])
        m = None  # all Q4_0; else Q4_1, Q4_0's tensors with m = -8d (exact in f16)
        if any(p[2] is not None for p in parts):
            m = np.concatenate([-8 * p[1] if p[2] is None else p[2] for p in parts])
        return Q4Matrix.from_parts(q, d, m)

    def file_matrix(names: list[str]) -> CoreMatrix:
        """The GGUF tensors `names` stacked by rows in their own blocks, those of a type the
        core does not hold requantized to Q8_0 (neighbours of one type: one part). A matrix all
        of Q4_0 and Q4_1 is a Q4Matrix: the same values, on the kernels tuned for that layout.
        Where the core cannot hold blocks (rows that are not whole blocks of 32, or a type that
        changes within a 16-row tile), the float values as quantize(kind="file") takes them."""

        def values() -> torch.Tensor:  # float32, as a float32 load reads them
            return torch.cat(
                [torch.from_numpy(unpermuted(n, _dequantized(tensors, n, path))) for n in names]
            )

        cols = int(tensors[names[0]].shape[0])
        if cols % 32:
            return quantize(values(), "file")
        if all(tensors[n].tensor_type.name in ("Q4_0", "Q4_1") for n in names):
            return q4_matrix(names)
        parts: list[tuple[str, np.ndarray]] = []
        for n in names:
            t = tensors[n]
            kind = t.tensor_type.name
            if kind in held:  # rows are independent in ggml: unpermuted as a float matrix's
                raw = np.asarray(t.data, dtype=np.uint8).reshape(int(np.prod(t.shape[1:])), -1)
            else:
                raw, kind = q8_0_blocks(_dequantized(tensors, n, path)), "Q8_0"
            raw = np.ascontiguousarray(unpermuted(n, raw))
            if parts and parts[-1][0] == kind:
                parts[-1] = (kind, np.concatenate([parts[-1][1], raw]))
            else:
                parts.append((kind, raw))
        if any(len(raw) % 16 for _, raw in parts[:-1]):
            return quantize(values(), "file")
        return GgufMatrix.from_tensors(parts, cols)

    def matrix(layer: dict, ready: dict, ours: str, names: list[str]) -> None:
        """Our matrix `ours`, the GGUF tensors `names` stacked by rows: for q4 weights
        q4_matrix, for file weights file_matrix, else float tensors."""
        if weights in ("q4", "file"):
            ready[ours] = m = q4_matrix(names) if weights == "q4" else file_matrix(names)
            layer[ours] = torch.empty((m.rows, m.cols), dtype=dtype, device="meta")
            return
        layer[ours] = torch.cat([get(n) for n in names])

    # Quantized weights keep a quantized embedding in its blocks (FileEmbedding): the lookup
    # reads a few rows, and a float32 table would be a 7B's largest tensor after its layers.
    embd = tensors.get("token_embd.weight")
    if quantizer is None or embd is None or embd.tensor_type.name == "F32":
        embd = None  # a float table
    ours = {"norm": get("output_norm.weight")}
    if embd is not None:
        shape = (int(embd.shape[-1]), int(embd.shape[0]))  # (V, D): build_model checks it
        ours["embed.weight"] = torch.empty(shape, dtype=dtype, device="meta")
    else:
        ours["embed.weight"] = get("token_embd.weight")
    # file weights keep the output matrix in its blocks where the core holds them (Qwen2.5's
    # Q6_K head is a fifth of the file's bytes)
    head = "token_embd.weight" if config.tie_embeddings else "output.weight"
    head_type = tensors[head].tensor_type.name if head in tensors else None
    if quantizer and weights == "file" and head_type in held:
        blocks = file_matrix([head])
        if not config.tie_embeddings:
            shape = (blocks.rows, blocks.cols)
            ours["lm_head.weight"] = torch.empty(shape, dtype=dtype, device="meta")
        quantizer.output(ours, blocks)
    elif not config.tie_embeddings:
        ours["lm_head.weight"] = get("output.weight")
        if quantizer:
            quantizer.output(ours)
    for i in range(config.n_layers):
        b = f"blk.{i}."
        layer = {f"layers.{i}.attn_norm": get(b + "attn_norm.weight")}
        layer[f"layers.{i}.ffn_norm"] = get(b + "ffn_norm.weight")
        ready: dict = {}
        matrix(layer, ready, f"layers.{i}.wqkv.weight", [b + f"attn_{n}.weight" for n in "qkv"])
        if config.attn_bias:
            layer[f"layers.{i}.wqkv.bias"] = torch.cat([get(b + f"attn_{n}.bias") for n in "qkv"])
        if config.qk_norm:
            layer[f"layers.{i}.q_norm"] = get(b + "attn_q_norm.weight")
            layer[f"layers.{i}.k_norm"] = get(b + "attn_k_norm.weight")
        if config.post_norms:  # (llama.cpp's converter stores Gemma's norms as 1 + w)
            layer[f"layers.{i}.post_attn_norm"] = get(b + "post_attention_norm.weight")
            layer[f"layers.{i}.post_ffn_norm"] = get(b + "post_ffw_norm.weight")
        matrix(layer, ready, f"layers.{i}.wo.weight", [b + "attn_output.weight"])
        matrix(
            layer,
            ready,
            f"layers.{i}.w_gate_up.weight",
            [b + "ffn_gate.weight", b + "ffn_up.weight"],
        )
        matrix(layer, ready, f"layers.{i}.w_down.weight", [b + "ffn_down.weight"])
        ours.update(quantizer.layer(i, layer, ready) if quantizer else layer)
    model = build_model(config, ours, path)
    if embd is not None:
        table = np.array(embd.data).reshape(int(embd.shape[-1]), -1)  # (V, a row's bytes)
        model.embed = FileEmbedding(table, embd.tensor_type, config.dim, dtype)
    if quantizer:
        quantizer.attach(model)
    model.file_types = _layer_types(tensors, config.n_layers)

    model.tokenizer = tokenizer_from_gguf(reader, path) if tokens else None
    model.chat_template = gguf_field(reader, "tokenizer.chat_template")
    eos = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    model.eos_token_ids = list(dict.fromkeys(int_list([e for e in eos if e is not None])))
    return model


def _layer_types(tensors: dict, n_layers: int) -> frozenset[str]:
    return frozenset(
        tensors[f"blk.{i}.{name}.weight"].tensor_type.name
        for i in range(n_layers)
        for name in LAYER_TENSORS
    )


def gguf_summary(path: Path):
    """(the config, the layer matrices' ggml types, the file's reader) of a GGUF file, from its
    metadata and tensor table only: what weights="auto" needs to find its cached choice before
    loading anything. The reader goes on to load_gguf: opening one parses every metadata
    field (8 s for a 151,936-token vocabulary)."""
    reader = _gguf_reader(path)
    config, tensors, _ = _model_config(reader, path)
    try:
        return config, _layer_types(tensors, config.n_layers), reader
    except KeyError as e:
        raise ValueError(f"{path}: a layer tensor is missing from the GGUF file: {e}") from None


def auto_candidates(types: frozenset[str]) -> tuple[str, ...]:
    """weights="auto"'s quantized candidates for a model whose layer matrices are of the ggml
    `types` (Model.file_types; none for a checkpoint folder): int8, and for a quantized GGUF
    its own blocks ("file"), with int8 only where every type has under 8 bits a weight (int8's
    one scale a row holds fewer than Q8_0's scale per 32), and q4 too where every type is Q4_0
    or Q4_1: its layer matrices are then the file's values, as "file"'s, and its int8 output
    matrix the int8 candidate's (on SmolLM2's Q4_1 file it decodes 4 % faster than "file",
    whose Q8_0 head reads a little more)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if types <= FLOAT_TYPES:
        return ("int8",)

    def bits(kind: str) -> float:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        return 8 * size / block

    if types <= {"Q4_0", "Q4_1"}:
        return ("file", "int8", "q4")
    return ("file", "int8") if all(bits(t) < 8 for t in types) else ("file",)


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
