"""An EAGLE-3 head's config.json, as SpecForge writes it and vLLM and SGLang read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from specfast.model import Model
from specfast.targets.base import default_aux_layers

ARCHITECTURE = "LlamaForCausalLMEagle3"


# ----------------------------------------------------------------------------
# config


@dataclass
class EagleConfig:
    """config.json of an EAGLE-3 head (SpecForge / vLLM names in `from_dict` / `to_dict`)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    # None: hidden_size, and hidden_size // num_attention_heads (set in __post_init__)
    target_hidden_size: int = None  # type: ignore[assignment]
    head_dim: int = None  # type: ignore[assignment]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    aux_layers: tuple[int, ...] | None = None  # None: (2, L // 2, L - 3) of the target
    extra: dict = field(default_factory=dict, repr=False)  # other config.json keys, kept

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        names = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        names += ("intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size")
        for name in (*names, "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"EAGLE config: {name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"EAGLE config: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"EAGLE config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"EAGLE config: draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size "
                f"({self.vocab_size})"
            )
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ValueError("EAGLE config: rope_theta and rms_norm_eps must be positive")
        if self.aux_layers is not None:
            ids = self.aux_layers
            if not isinstance(ids, (list, tuple)) or len(ids) != 3:
                raise ValueError(f"EAGLE config: 3 aux layer ids expected, got {ids!r}")
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError(f"EAGLE config: aux layer ids must be ints >= 0, got {ids!r}")
            self.aux_layers = tuple(ids)

    @classmethod
    def from_dict(cls, d: dict) -> EagleConfig:
        if not isinstance(d, dict):
            raise ValueError(f"EAGLE config must be a JSON object, got {type(d).__name__}")
        known = {
            "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "draft_vocab_size", "target_hidden_size", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_scaling", "max_position_embeddings",
        }  # fmt: skip
        missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"EAGLE config.json lacks {missing}")
        kw = {k: d[k] for k in known if d.get(k) is not None}
        kw.setdefault("num_key_value_heads", d["num_attention_heads"])
        kw.setdefault("intermediate_size", 4 * d["hidden_size"])
        kw.setdefault("draft_vocab_size", d["vocab_size"])
        eagle = d.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"EAGLE config: only hidden_act 'silu' is supported, got {d['hidden_act']!r}"
            )
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"EAGLE config: num_hidden_layers must be 1, got {d['num_hidden_layers']!r}"
            )
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**kw, aux_layers=aux, extra=extra)

    def to_dict(self) -> dict:
        d = dict(self.extra)
        d.update(
            architectures=[ARCHITECTURE],
            model_type="llama",
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.target_hidden_size,
            num_hidden_layers=1,
            tie_word_embeddings=False,
        )
        if self.aux_layers is not None:
            eagle = dict(d.get("eagle_config") or {})
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
            d["eagle_config"] = eagle
        return d

    @classmethod
    def for_target(cls, target: Model, draft_vocab_size: int | None = None, **kw) -> EagleConfig:
        """A head shaped like the target's layers (hidden size, heads, RoPE), as SpecForge's
        configs are; keyword arguments override."""
        c = target.config
        base = dict(
            hidden_size=c.dim,
            num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size or c.vocab_size,
            target_hidden_size=c.dim,
            rms_norm_eps=c.norm_eps,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling,
            max_position_embeddings=c.max_context,
            aux_layers=default_aux_layers(c.n_layers),
        )
        base.update(kw)
        return cls(**base)  # type: ignore[arg-type]  # (the keys are the fields)
