"""The head a training run builds and writes: its config from the target (`head_config`), the
draft vocabulary from token counts, its initial weights (`init_head`), and saving it in
SpecForge's layout (`save_head`) or reading a run's back (`load_train_head`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specfast.drafters.eagle.config import EagleConfig
from specfast.drafters.eagle.files import head_from_tensors, save_eagle
from specfast.drafters.eagle.head import EagleHead

# ---------------------------------------------------------------------------- the head


def new_head(config: dict) -> EagleHead:
    """A float32 head to train, from its config.json (`head_config`): the drafter's class, so
    what is trained is what drafts."""
    return EagleHead(EagleConfig.from_dict(config))


def head_config(target, draft_vocab_size: int, aux_layers) -> dict:
    """config.json of a head for `target` (a specfast Model), SpecForge/vLLM keys."""
    c = target.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.dim,
        "target_hidden_size": c.dim,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_context,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent ids of `counts` (V,) -> (d2t (size,) int64, t2d (V,) bool),
    draft ids in increasing target id (ties broken by the lower id)."""
    if not 0 < size <= counts.numel():
        raise ValueError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
    # stable sort on -count: equal counts keep increasing id order, so the choice is unique
    order = torch.sort(-counts.to(torch.int64), stable=True).indices[:size]
    ids = order.sort().values
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


def init_head(target, config: dict, d2t: torch.Tensor, t2d: torch.Tensor, seed: int) -> EagleHead:
    """A head ready to train: N(0, 0.02) matrices, unit norms; then lm_head copied from the
    target's output rows of the draft vocabulary and norm from a tenth of its final norm (the
    output space starts where the target's is, at a soft scale). Measured on SmolLM2: with the
    full norm gain, or with fc passing the last aux feature through, the head started
    confidently wrong (loss above a uniform guess's) and took many steps to unlearn it."""
    torch.manual_seed(seed)
    head = new_head(config)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.lm_head.weight.copy_(target.output_weight[head.target_ids].float())
        # A tenth of the target's final norm gain: the copied output rows give logits at a
        # tenth of the target's scale, a soft start (full scale started confidently wrong).
        head.norm.weight.copy_(0.1 * target.norm.float())
    return head


def load_train_head(folder: Path) -> EagleHead:
    """A saved head (config.json + model.safetensors) in float32, to train or evaluate."""
    from safetensors.torch import load_file

    head = new_head(json.loads((Path(folder) / "config.json").read_text()))
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    head.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items()})
    return head.float()


# ---------------------------------------------------------------------------- saving


def to_eagle_head(head: EagleHead) -> EagleHead:
    """A frozen copy of the trained head, checked by the loader's rules (shapes, d2t in range,
    t2d marking the same ids)."""
    tensors = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    return head_from_tensors(head.config, tensors)


def save_head(head: EagleHead, folder: Path) -> None:
    """config.json + model.safetensors through save_eagle (drafters/eagle/head.py): SpecForge's
    names, matrices and norms in bf16, d2t int64, t2d bool, no embedding (shared with the
    target)."""
    save_eagle(to_eagle_head(head), folder, dtype="bfloat16")
