"""What a model is before it has weights: its config (ModelConfig), its RoPE frequencies, and
the dtype and device names load_model takes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specfast.hardware import auto_dtype

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPES.update({"bf16": torch.bfloat16, "float": torch.float32})
_DTYPES.update({"float16": torch.float16, "fp16": torch.float16, "half": torch.float16})
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(dtype, device=None) -> torch.dtype:
    """'auto' | 'float32' | 'bfloat16' | 'float16' (or the torch dtype) -> torch.dtype.

    "auto" picks by hardware (specfast.hardware.auto_dtype): bf16 on CUDA (fp16 without bf16),
    and on CPU bf16 only where the CPU has AMX-BF16, else float32.
    """
    if isinstance(dtype, torch.dtype) and dtype in set(_DTYPES.values()):
        return dtype
    if dtype == "auto":
        return auto_dtype(resolve_device(device))
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(
        f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16' (or the torch dtype), "
        f"got {dtype!r}"
    )


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"bad device {device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    return device


# -----------------------------------------------------------------------------
# config


@dataclass
class ModelConfig:
    vocab_size: int = 256
    dim: int = 64  # hidden size
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = None  # type: ignore[assignment]  # None -> dim // n_heads, in __post_init__
    intermediate_size: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_context: int = 2048
    attn_bias: bool = False  # qwen2: biases on q, k, v
    qk_norm: bool = False  # qwen3, gemma3: an RMSNorm on every query and key head before RoPE
    # gemma3: the embedding times embed_scale; norms after attention and after the MLP too;
    # a GELU(tanh)-gated MLP; scores scaled by attn_scale (None: 1/sqrt(head_dim)); and the
    # layers in sliding_layers attend only to their last sliding_window keys, with RoPE of
    # base rope_local_theta.
    embed_scale: float = 1.0
    post_norms: bool = False
    act: str = "silu"  # "silu" | "gelu_tanh"
    attn_scale: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    tie_embeddings: bool = False
    arch: str = "llama"
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // max(self.n_heads, 1)
        ints = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim")
        for name in (*ints, "intermediate_size", "max_context"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError("rope_theta and norm_eps must be positive")
        if self.act not in ("silu", "gelu_tanh"):
            raise ValueError(f"ModelConfig.act must be 'silu' or 'gelu_tanh', got {self.act!r}")
        if self.sliding_layers and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding_layers need a positive sliding_window")
        self.sliding_layers = tuple(self.sliding_layers)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """(head_dim/2,) float64 inverse frequencies, with the config's scaling applied; `local`:
    the sliding layers' (base rope_local_theta, unscaled)."""
    hd = config.head_dim
    theta = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if local:
        return inv_freq
    s = config.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(s["factor"])
    elif kind == "llama3":
        # Same rule as transformers' _compute_llama3_parameters: long wavelengths are divided by
        # `factor`, short ones kept, and the band in between interpolated smoothly.
        factor = float(s["factor"])
        lo, hi = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    freq_factors = config.extra.get("rope_freq_factors")  # GGUF llama3: rope_freqs.weight
    if freq_factors is not None:
        inv_freq = inv_freq / torch.as_tensor(freq_factors, dtype=torch.float64)
    return inv_freq
