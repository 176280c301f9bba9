"""What every loader shares: the architectures specfast runs, and a Model assembled from
tensors named as ours, with names and shapes checked against the config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specfast.model import Model, ModelConfig
from specfast.model.quantize import quantize

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path) -> Model:
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


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


class LayerQuantizer:
    """Quantizes each layer's matrices to int8 or q4 (`kind`) as a loader reads them, leaving
    shape-only placeholders: only one float matrix exists at a time, so a model whose float32
    copy would not fit in memory (a 7B is 30 GB) loads in about the size of its quantized one.
    Each matrix is quantized from the same float32 values as `Model.quantize_int8` reads, so the
    model is the same bits either way. Kind "file": a GGUF's own blocks, which its loader makes
    into core matrices itself (the `ready` ones)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.layers: list[list] = []
        self.head = None

    def layer(
        self, i: int, tensors: dict[str, torch.Tensor], ready: dict | None = None
    ) -> dict[str, torch.Tensor]:
        """Layer i's tensors (our names), its matrices quantized and replaced by placeholders;
        those in `ready` (name -> core matrix, with a placeholder in `tensors`) taken as they
        are."""
        ready = ready or {}
        row = []
        for m in MATRICES:
            name = f"layers.{i}.{m}.weight"
            row.append(ready[name] if name in ready else self._take(tensors, name, self.kind))
        self.layers.append(row)
        return tensors

    def output(self, weights: dict[str, torch.Tensor], ready=None) -> None:
        """The output matrix: `ready` (a core matrix the loader made: a GGUF's own blocks, tied
        or with a placeholder in `weights`) as it is, else the untied one in int8 (a 4-bit one
        costs the most agreement)."""
        self.head = ready if ready is not None else self._take(weights, "lm_head.weight", "int8")

    def attach(self, model: Model) -> Model:
        """The model, running on the quantized matrices (a tied head quantized from the
        embedding, which the lookup keeps)."""
        head = self.head if self.head is not None else quantize(model.embed.weight, "int8")
        model.adopt_quantized(self.kind, [*self.layers, head])
        return model

    @staticmethod
    def _take(tensors: dict[str, torch.Tensor], name: str, kind: str):
        w = tensors[name]
        tensors[name] = torch.empty(w.shape, dtype=w.dtype, device="meta")
        return quantize(w, kind)


def fuse_layer(get, i: int, prefix: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our layer i's tensors from HF-named ones: `get(name)` returns a tensor in the dtype
    the model loads in. (Gemma's post_attention_layernorm follows attention; Llama's is the
    norm before the MLP.)"""
    p = f"{prefix}layers.{i}."
    mlp_norm = "pre_feedforward_layernorm" if config.post_norms else "post_attention_layernorm"
    out = {
        f"layers.{i}.attn_norm": get(p + "input_layernorm.weight"),
        f"layers.{i}.ffn_norm": get(p + f"{mlp_norm}.weight"),
        f"layers.{i}.wqkv.weight": torch.cat(
            [get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0
        ),
        f"layers.{i}.wo.weight": get(p + "self_attn.o_proj.weight"),
        f"layers.{i}.w_gate_up.weight": torch.cat(
            [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0
        ),
        f"layers.{i}.w_down.weight": get(p + "mlp.down_proj.weight"),
    }
    if config.attn_bias:
        out[f"layers.{i}.wqkv.bias"] = torch.cat(
            [get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0
        )
    if config.qk_norm:
        out[f"layers.{i}.q_norm"] = get(p + "self_attn.q_norm.weight")
        out[f"layers.{i}.k_norm"] = get(p + "self_attn.k_norm.weight")
    if config.post_norms:
        out[f"layers.{i}.post_attn_norm"] = get(p + "post_attention_layernorm.weight")
        out[f"layers.{i}.post_ffn_norm"] = get(p + "post_feedforward_layernorm.weight")
    return out


def gemma3_fields(
    dim: int,
    head_dim: int,
    attn_scale: float,
    window: int | None,
    sliding_layers: tuple[int, ...],
    local_theta: float,
) -> dict:
    """ModelConfig's gemma3 fields, whichever file they come from; attn_scale None where it is
    attention's own 1/sqrt(head_dim)."""
    return dict(
        embed_scale=dim**0.5,
        post_norms=True,
        act="gelu_tanh",
        attn_scale=None if attn_scale == head_dim**-0.5 else attn_scale,
        sliding_window=window,
        sliding_layers=sliding_layers,
        rope_local_theta=local_theta,
    )


def int_list(x) -> list[int]:
    if x is None:
        return []
    xs = x if isinstance(x, (list, tuple)) else [x]
    return [int(v) for v in xs if isinstance(v, (int, np.integer))]
