"""EAGLE-3 heads: a one-layer drafter that reads the target's own hidden states.

The head's layout is SpecForge's export (`LlamaForCausalLMEagle3`), which SGLang and vLLM load:
config.json + model.safetensors with the tensors named below (an optional `model.` prefix is
accepted). `EagleHead.state_dict()` keys are exactly those names.

One step over T positions (`EagleHead.layer`):

    x = cat(input_layernorm(embed(tokens)), hidden_norm(hidden))      # (T, 2H)
    x = hidden + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))    # causal, RoPE
    x = x + down_proj(silu(gate_proj(n)) * up_proj(n)), n = post_attention_layernorm(x)
    out_hidden = x; logits over the draft vocabulary = lm_head(norm(x))

At position t the head reads hidden = fc(features of target position t) with token t + 1 and
predicts token t + 2. The features are the residual stream entering three target layers
(`aux_layers`), concatenated. Drafting step j > 0 reads the head's own out_hidden of the step
before with the token it just drafted, one position further. Draft id i is target id
i + d2t[i]; the draft's q over the target vocabulary is zero outside the draft vocabulary.

The drafter is `drafters/eagle/draft.py`'s EagleDraft; generate.py hands it the target's features of
every row the target keeps (drafters/base.py, `wants_features`).
"""

from __future__ import annotations

import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from specfast.drafters.eagle.config import EagleConfig
from specfast.model.config import rope_inv_freq
from specfast.model.layers import HAS_MKLDNN_LINEAR, linear
from specfast.model.quantize import core_linear, quantize

# ----------------------------------------------------------------------------
# the head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # training under bf16 autocast (x in bf16, float32 master weights): in float32, as a
        # norm is cheap and precision-sensitive
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)


# head -> (key, FastLinears): drafting's copy of its matrices, outside the module so that
# copying or pickling a head does not copy oneDNN's packed tensors.
_FAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Attention(nn.Module):
    """The head's attention projections (SpecForge's `self_attn`): q, k, v read 2H inputs."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        H, hd = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(2 * H, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, H, bias=False)


class MLP(nn.Module):
    """The head's gated MLP (SpecForge's `mlp`)."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        H, F = c.hidden_size, c.intermediate_size
        self.gate_proj = nn.Linear(H, F, bias=False)
        self.up_proj = nn.Linear(H, F, bias=False)
        self.down_proj = nn.Linear(F, H, bias=False)


class MidLayer(nn.Module):
    """The head's one layer (SpecForge's `midlayer`): its norms, attention and MLP."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        H = c.hidden_size
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)


class EagleHead(nn.Module):
    """An EAGLE-3 head. `embed_tokens` is its own only when the file has one; otherwise the
    target's embedding is used (`bind_embedding`). `aux_layers` says which target layers feed it.

    Buffers: d2t (Vd,) int64 and t2d (V,) bool, as SpecForge. `target_ids` (Vd,) = arange + d2t.
    """

    d2t: torch.Tensor  # buffers (register_buffer)
    t2d: torch.Tensor

    def __init__(self, config: EagleConfig, own_embedding: bool = False):
        super().__init__()
        c = self.config = config
        H, Vd = c.hidden_size, c.draft_vocab_size
        self.fc = nn.Linear(3 * c.target_hidden_size, H, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(c.vocab_size, H) if own_embedding else None
        self._shared_embed: torch.Tensor | None = None  # the target's (V, H), not saved
        self._rope: dict = {}

    # -- vocabulary and embedding

    @property
    def aux_layers(self) -> tuple[int, ...] | None:
        return self.config.aux_layers

    @property
    def target_ids(self) -> torch.Tensor:
        """(Vd,) the target token of each draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_ids) -> None:
        """Sets d2t and t2d from the target ids of the draft vocabulary, in draft-id order."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64, device=self.d2t.device)
        check_vocab_maps(ids - torch.arange(len(ids), device=ids.device), None, self.config)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def bind_embedding(self, weight: torch.Tensor) -> EagleHead:
        """Uses the target's embedding (V, H) when the head has none of its own."""
        c = self.config
        if tuple(weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"the target's embedding is {tuple(weight.shape)} but this head needs "
                f"({c.vocab_size}, {c.hidden_size}); a head without embed_tokens must have the "
                "target's hidden size"
            )
        self._shared_embed = weight.detach()  # a plain tensor: not a parameter of the head
        return self

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens)
        if self._shared_embed is None:
            raise ValueError("this head has no embed_tokens: bind the target's (bind_embedding)")
        return F.embedding(tokens, self._shared_embed).to(self.fc.weight.dtype)

    # -- rope

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(length, head_dim) cos and sin in the head's dtype, cached."""
        key = (self.fc.weight.device, self.fc.weight.dtype)
        cached = self._rope.get(key)
        if cached is None or cached[0].shape[0] < length:
            n = max(length, 2 * cached[0].shape[0] if cached else 256)
            c = self.config
            spec = types.SimpleNamespace(
                head_dim=c.head_dim, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, extra={}
            )
            # Normal tensors even when first asked for under inference_mode, so training can
            # use them too; float32, then cast, as the target's tables are.
            with torch.inference_mode(False):
                pos = torch.arange(n, dtype=torch.float64)
                freqs = torch.outer(pos, rope_inv_freq(spec)).float()  # type: ignore[arg-type]
                emb = torch.cat([freqs, freqs], dim=-1)  # (n, hd), rotate-half layout
                cached = (emb.cos().to(*key), emb.sin().to(*key))
            self._rope[key] = cached
        return cached

    def fast_linears(self, int8: bool = False) -> FastLinears:
        """Drafting's copy of the matrices (FastLinears), made once for these weights on CPU: a
        new generate() call or Session reuses it (quantizing or prepacking is not free)."""
        w = self.fc.weight
        if w.device.type != "cpu":  # no quantizing or prepacking there: the copy is cheap
            return FastLinears(self, int8)
        params = tuple((p.data_ptr(), p._version) for p in self.parameters())
        key = (int8, w.dtype, params)
        cached = _FAST.get(self)
        if cached is None or cached[0] != key:
            cached = _FAST[self] = (key, FastLinears(self, int8))
        return cached[1]

    def _apply(self, fn, *args, **kwargs):
        self._rope = {}
        _FAST.pop(self, None)
        out = super()._apply(fn, *args, **kwargs)
        if self._shared_embed is not None:
            self._shared_embed = fn(self._shared_embed)
        return out

    # -- forward

    def layer(self, hidden, tokens, cos, sin, attend, fast: FastLinears | None = None):
        """hidden (..., T, H), tokens (..., T), cos/sin (..., T, 1, hd) at the rows' positions;
        `attend(q, k, v)` with q (..., Hkv, g*T, hd), k and v (..., Hkv, T, hd) -> (..., Hkv,
        g*T, hd). -> out_hidden (..., T, H). `fast`: the drafter's prepacked matrices
        (inference only; training uses the modules)."""
        c, mid = self.config, self.midlayer
        attn, mlp = mid.self_attn, mid.mlp
        H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        g, T, lead = H // Hkv, hidden.shape[-2], hidden.shape[:-2]
        x = torch.cat([mid.input_layernorm(self.embed(tokens)), mid.hidden_norm(hidden)], dim=-1)
        if fast is None:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        else:
            q, k, v = fast("qkv", x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q, k = q.view(*lead, T, H, hd), k.view(*lead, T, Hkv, hd)
        v = v.view(*lead, T, Hkv, hd)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # (..., T, H, hd) -> (..., Hkv, g*T, hd): query head h uses kv head h // g
        q = q.transpose(-3, -2).reshape(*lead, Hkv, g * T, hd)
        y = attend(q, k.transpose(-3, -2), v.transpose(-3, -2))  # (..., Hkv, g*T, hd)
        y = y.reshape(*lead, H, T, hd).transpose(-3, -2).reshape(*lead, T, H * hd)
        x = hidden + (attn.o_proj(y) if fast is None else fast("o", y))
        n = mid.post_attention_layernorm(x)
        if fast is None:
            return x + mlp.down_proj(F.silu(mlp.gate_proj(n)) * mlp.up_proj(n))
        gate, up = fast("gate_up", n).chunk(2, dim=-1)
        return x + fast("down", F.silu(gate) * up)

    def logits(self, out_hidden: torch.Tensor, fast: FastLinears | None = None) -> torch.Tensor:
        """(..., T, H) -> (..., T, Vd) over the draft vocabulary."""
        x = self.norm(out_hidden)
        return self.lm_head(x) if fast is None else fast("lm_head", x)

    def forward(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k_prev: torch.Tensor | None = None,
        v_prev: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step over whole sequences, for training (and tests).

        hidden (B, T, H) or (T, H): fc(target features) for step 0, the previous step's
        out_hidden after; tokens (B, T) or (T,): the token each row reads (token t + 1 for
        position t at step 0); positions (T,) or (B, T): each row's RoPE position (t + s at
        training-time-test step s, as SpecForge and inference do).
        k_prev, v_prev (B, Hkv, P, hd) or (Hkv, P, hd): keys/values of earlier steps, already
        rotated (the `k`, `v` this returned before, concatenated along P).
        mask (T, P + T) or (B, T, P + T) bool, True = may attend, over [k_prev, the new keys];
        default: every earlier key plus the new keys causally.
        -> (out_hidden like hidden, logits (..., T, Vd), k, v (..., Hkv, T, hd) of the new rows).

        Training-time test, step s: k_prev/v_prev = the keys of steps 0..s-1, and a mask where
        row t sees step 0's keys at positions <= t and its own chain's keys (row t) of steps
        1..s.
        """
        cos_t, sin_t = self.rope(int(positions.max()) + 1)
        cos, sin = cos_t[positions].unsqueeze(-2), sin_t[positions].unsqueeze(-2)  # (.., T, 1, hd)
        out_k: list[torch.Tensor] = []
        T = hidden.shape[-2]
        g = self.config.num_attention_heads // self.config.num_key_value_heads
        if mask is None:
            P = 0 if k_prev is None else k_prev.shape[-2]
            mask = torch.ones(T, P + T, dtype=torch.bool, device=hidden.device).tril_(P)
        # grouped queries: (..., T, S) -> (..., 1, g*T, S), the same mask for every kv head
        mask_g = mask.repeat(*([1] * (mask.dim() - 2)), g, 1).unsqueeze(-3)

        def attend(q, k, v):
            out_k.extend([k, v])
            if k_prev is not None:
                k = torch.cat([k_prev, k], dim=-2)
                v = torch.cat([v_prev, v], dim=-2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_g)

        x = self.layer(hidden, tokens, cos, sin, attend)
        return x, self.logits(x), out_k[0], out_k[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout; x (..., T, heads, hd), cos/sin (..., T, 1, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class FastLinears:
    """The head's matrices for drafting: q/k/v and gate/up fused (fewer ops per step), and on
    CPU oneDNN-prepacked as the target's are (model.packed_weights says why; for a head of
    SmolLM2's size a packed and a plain step cost about the same), or with `int8` in the core's
    int8 kernel, as a target with int8 or q4 weights runs (a float32 head step would cost a
    large share of such a target's pass). A copy (EagleHead.fast_linears
    keeps one per head's weights on CPU); the head's own weights stay what training and saving
    use."""

    def __init__(self, head: EagleHead, int8: bool = False):
        mid = head.midlayer
        a, m = mid.self_attn, mid.mlp
        weights = {
            "fc": head.fc.weight,
            "qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            "o": a.o_proj.weight,
            "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            "down": m.down_proj.weight,
            "lm_head": head.lm_head.weight,
        }
        self.weights = {k: w.detach().contiguous() for k, w in weights.items()}
        self.packed: dict = dict.fromkeys(self.weights)
        on_cpu = head.fc.weight.device.type == "cpu"
        self.int8 = None
        if int8 and on_cpu and head.fc.weight.dtype == torch.float32:
            self.int8 = {k: quantize(w) for k, w in self.weights.items()}
        elif on_cpu and HAS_MKLDNN_LINEAR:
            try:
                for k, w in self.weights.items():
                    self.packed[k] = torch.ops.mkldnn._reorder_linear_weight(w, 16)
            except RuntimeError:  # a oneDNN build that cannot pack this dtype: plain F.linear
                self.packed = dict.fromkeys(self.weights)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return core_linear(x, self.int8[name])
        return linear(x, self.weights[name], self.packed[name])


def random_head(
    config: EagleConfig, seed: int = 0, own_embedding: bool = False, scale: float = 1.0
) -> EagleHead:
    """A head with random weights (tests): N(0, 0.02 * scale) matrices, N(1, 0.1) norm gains,
    and the draft vocabulary = the first draft_vocab_size target ids (d2t = 0)."""
    head = EagleHead(config, own_embedding)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * scale * torch.randn(p.shape, generator=g))
        head.set_draft_vocab(range(config.draft_vocab_size))
    return head


# ----------------------------------------------------------------------------
# files


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor | None, config: EagleConfig) -> None:
    """d2t (Vd,) integer offsets mapping draft id i to target id i + d2t[i], all distinct and in
    [0, V); t2d (V,) bool marking exactly those target ids."""
    V, Vd = config.vocab_size, config.draft_vocab_size
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or tuple(d2t.shape) != (Vd,):
        raise ValueError(
            f"d2t must be an integer tensor of shape ({Vd},) (draft_vocab_size), got "
            f"{d2t.dtype} {tuple(d2t.shape)}"
        )
    ids = torch.arange(Vd, device=d2t.device) + d2t.long()
    if Vd and (int(ids.min()) < 0 or int(ids.max()) >= V):
        bad = int(((ids < 0) | (ids >= V)).nonzero()[0, 0])
        raise ValueError(
            f"d2t maps draft id {bad} to target id {int(ids[bad])}, outside the target's "
            f"vocabulary [0, {V})"
        )
    if len(torch.unique(ids)) != Vd:
        raise ValueError("d2t maps two draft ids to the same target id; each must be distinct")
    if t2d is None:
        return
    if tuple(t2d.shape) != (V,):
        raise ValueError(
            f"t2d must have one entry per target token ({V}, vocab_size), got {tuple(t2d.shape)}"
        )
    marked = t2d.bool()
    if int(marked.sum()) != Vd or not bool(marked[ids].all()):
        raise ValueError("t2d does not mark exactly the target ids that d2t maps to")
