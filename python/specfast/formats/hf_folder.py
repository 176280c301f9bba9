"""A Hugging Face checkpoint folder (config.json + *.safetensors, tokenizer files) -> Model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specfast.formats.common import (
    SUPPORTED_ARCHS,
    LayerQuantizer,
    build_model,
    fuse_layer,
    gemma3_fields,
    int_list,
)
from specfast.model import Model, ModelConfig


def _gemma3_options(cfg: dict) -> dict:
    """ModelConfig's gemma3 fields from a Gemma3ForCausalLM config.json."""
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    types = cfg.get("layer_types") or []
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return gemma3_fields(
        cfg["hidden_size"],
        hd,
        float(cfg.get("query_pre_attn_scalar", hd)) ** -0.5,
        cfg.get("sliding_window"),
        tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        # transformers 4.x: rope_local_base_freq
        float(local.get("rope_theta", cfg.get("rope_local_base_freq", 1e4))),
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


# model_type -> our arch, where they differ (Gemma3ForCausalLM, the text-only Gemma 3)
HF_ARCHS = {"gemma3_text": "gemma3"}


def config_from_hf(cfg: dict, source: Path) -> ModelConfig:
    """ModelConfig from a transformers config.json dict (4.x or 5.x spelling)."""
    model_type = str(cfg.get("model_type"))
    arch = HF_ARCHS.get(model_type, model_type)
    if arch not in SUPPORTED_ARCHS or (arch == "gemma3" and model_type != "gemma3_text"):
        supported = sorted({*SUPPORTED_ARCHS, *HF_ARCHS} - set(HF_ARCHS.values()))
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; use one of "
            f"{supported}; for others, run a GGUF of the model with llama.cpp as the target, "
            "with specfast's drafters: specfast.load_model(path, backend='llama.cpp')"
        )
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise ValueError(f"{source}: logit softcapping is not supported")
    rope_params = cfg.get("rope_parameters") or {}
    gemma: dict = {}
    if arch == "gemma3":  # transformers 5 keys its rope_parameters by layer type
        rope_params = rope_params.get("full_attention") or {}
        try:
            gemma = _gemma3_options(cfg)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: bad Gemma 3 config.json: {e!r}") from None
    # transformers 5 nests theta and scaling in rope_parameters; 4.x has rope_theta + rope_scaling
    scaling = dict(rope_params or cfg.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    default = scaling.get("rope_type", scaling.get("type", "default")) == "default"
    rope = None if default else scaling
    try:
        n_heads = cfg["num_attention_heads"]
        return ModelConfig(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or None,  # type: ignore[arg-type]  # None: dim / heads
            intermediate_size=cfg["intermediate_size"],
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_context=cfg.get("max_position_embeddings", 2048),
            attn_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("qwen3", "gemma3"),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", arch != "mistral")),
            arch=arch,
            **gemma,
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


def load_hf_folder(folder: Path, dtype: torch.dtype, weights: str = "float") -> Model:
    """The model in a Hugging Face checkpoint folder, in `dtype`; with weights "int8" or "q4"
    each layer's matrices are quantized as they are read (LayerQuantizer). ("file" is a GGUF
    file's own blocks: a ValueError here.)"""
    if weights == "file":
        raise ValueError(
            f'{folder}: weights="file" keeps the blocks of a GGUF file, and this is a checkpoint '
            'folder; pass a GGUF file, or weights="int8", "q4" or "float"'
        )
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
        if config.arch == "gemma3" and name.endswith("norm.weight"):
            # Gemma's RMSNorm multiplies by 1 + w, in float32 (as transformers computes it)
            return (raw[name].float() + 1.0).to(dtype)
        return raw[name].to(dtype)

    quantizer = LayerQuantizer(weights) if weights != "float" else None
    tensors = {
        "embed.weight": get(prefix + "embed_tokens.weight"),
        "norm": get(prefix + "norm.weight"),
    }
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = get("lm_head.weight")
        if quantizer:
            quantizer.output(tensors)
    for i in range(config.n_layers):
        layer = fuse_layer(get, i, prefix, config)
        tensors.update(quantizer.layer(i, layer) if quantizer else layer)
    model = build_model(config, tensors, folder)
    if quantizer:
        quantizer.attach(model)

    model.tokenizer = None
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            model.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{folder / 'tokenizer.json'}: cannot load tokenizer: {e}") from None
    tok_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tok_path) if tok_path.is_file() else {}
    template = tok_cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    model.chat_template = template if isinstance(template, str) else None
    eos = cfg.get("eos_token_id")
    if (folder / "generation_config.json").is_file():
        eos = _read_json(folder / "generation_config.json").get("eos_token_id", eos)
    model.eos_token_ids = int_list(eos)
    return model
