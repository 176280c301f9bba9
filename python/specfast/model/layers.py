"""The layers' math, shared by every way a pass runs (eager.py, static.py; core.py for the
final projection): a layer's weights (`Layer`), a matrix product through whatever the matrix is
packed as (`linear`), the stack of layers (`run_layers`) and the final norm and projection
(`final_logits`). Activations are (T, D): one sequence, no batch dimension."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from specfast.model.config import ModelConfig
from specfast.model.quantize import CORE_MATRICES, core_linear

HAS_MKLDNN_LINEAR = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


def linear(x, weight, packed=None, bias=None):
    """F.linear, through a oneDNN-prepacked weight or a core matrix if given."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, CORE_MATRICES):
        y = core_linear(x, packed)
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Layer(nn.Module):
    """One layer's weights: norms, fused q/k/v, the output projection, fused gate/up, down."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.attn_norm = nn.Parameter(torch.ones(c.dim))
        self.wqkv = nn.Linear(c.dim, qkv_out, bias=c.attn_bias)  # fused q, k, v
        if c.qk_norm:  # (hd,) gains shared by every query head, and by every key head
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(c.dim))
        self.w_gate_up = nn.Linear(c.dim, 2 * c.intermediate_size, bias=False)  # fused
        self.w_down = nn.Linear(c.intermediate_size, c.dim, bias=False)
        if c.post_norms:  # gemma3: on the attention's and the MLP's outputs, before the sum
            self.post_attn_norm = nn.Parameter(torch.ones(c.dim))
            self.post_ffn_norm = nn.Parameter(torch.ones(c.dim))


def run_layers(model, x, cos, sin, attend, packed, aux=None, local=None) -> torch.Tensor:
    """x (T, D) through every layer; `attend(i, q, k, v)` stores k, v and attends. `aux`
    (layer id -> None) gets the residual stream entering each of its layers. `local`: the
    (cos, sin) of the sliding layers, where their RoPE differs."""
    c = model.config
    T, H, Hkv, hd = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
    act = F.silu if c.act == "silu" else partial(F.gelu, approximate="tanh")
    q_gain = None if c.attn_scale is None else c.attn_scale * math.sqrt(hd)
    global_rope = (cos, sin)
    for i, layer in enumerate(model.layers):
        cos, sin = local if local is not None and i in c.sliding_layers else global_rope
        if aux is not None and i in aux:
            aux[i] = x  # (T, D): the input of layer i = the output of layer i - 1
        pw = packed[i] if packed else (None,) * 4
        h = F.rms_norm(x, (c.dim,), layer.attn_norm, c.norm_eps)
        qkv = linear(h, layer.wqkv.weight, pw[0], layer.wqkv.bias)  # (T, (H + 2Hkv) * hd)
        qk = qkv[:, : (H + Hkv) * hd].view(T, H + Hkv, hd)
        v = qkv[:, (H + Hkv) * hd :].view(T, Hkv, hd)
        if c.qk_norm:  # each head normed on its own, queries and keys by their own gains
            gains = torch.cat([layer.q_norm.expand(H, hd), layer.k_norm.expand(Hkv, hd)])
            qk = F.rms_norm(qk, (hd,), eps=c.norm_eps) * gains  # (T, H + Hkv, hd)
        x1, x2 = qk.chunk(2, dim=-1)
        qk = qk * cos + torch.cat([-x2, x1], dim=-1) * sin  # RoPE on q and k at once
        q, k = qk.split([H, Hkv], dim=1)  # (T, H, hd), (T, Hkv, hd)
        if q_gain is not None:  # attention scales scores by 1/sqrt(hd): make it attn_scale
            q = q * q_gain
        y = attend(i, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # (H, T, hd)
        y = linear(y.transpose(0, 1).reshape(T, H * hd), layer.wo.weight, pw[1])
        if c.post_norms:
            y = F.rms_norm(y, (c.dim,), layer.post_attn_norm, c.norm_eps)
        x = x + y
        h = F.rms_norm(x, (c.dim,), layer.ffn_norm, c.norm_eps)
        gate, up = linear(h, layer.w_gate_up.weight, pw[2]).chunk(2, dim=-1)  # (T, F) each
        y = linear(act(gate) * up, layer.w_down.weight, pw[3])
        if c.post_norms:
            y = F.rms_norm(y, (c.dim,), layer.post_ffn_norm, c.norm_eps)
        x = x + y
    return x


def final_logits(model, x, head, packed) -> torch.Tensor:
    """x (T, D) through the final norm and the vocabulary projection (or `head`, e.g.
    OutputRows) -> logits (T, V) (or (T, S))."""
    x = F.rms_norm(x, (model.config.dim,), model.norm, model.config.norm_eps)
    if head is not None:
        return head(x)  # (T, S)
    if packed:  # (output_weight would rebuild a dense copy of a packed head: not read)
        return linear(x, None, packed[-1])  # (T, V)
    return F.linear(x, model.output_weight)  # (T, V)
