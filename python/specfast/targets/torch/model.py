"""A lean Llama-family transformer (llama, qwen2, mistral, SmolLM) for batch-1 decoding.

One sequence, no batch dimension: activations are (T, D). The KV cache lives in a `Decoder`, so one
set of weights can serve several independent sequences (the target can be its own draft).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from specfast._core import CoreLayers
from specfast.hardware import auto_dtype
from specfast.targets.base import (
    EagleFacts,
    argmax_array,
    argmax_rows,
    check_aux_layers,
    check_ids,
    to_device,
)
from specfast.targets.torch.int8 import (
    INT8_SERIAL_ROWS,
    QUANTIZED,
    FloatMatrix,
    Int8Matrix,
    Q4Matrix,
    core_linear,
    dequantize,
    int8_kernel,
    quantize,
    torch_threads,
)
from specfast.targets.torch.kv_cache import KVCache, static_cache
from specfast.targets.torch.steps import (
    BUCKETS,
    bucket,
    compile_step,
    model_capacity,
    static_capacity,
)

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
    head_dim: int | None = None  # None -> dim // n_heads
    intermediate_size: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_context: int = 2048
    attn_bias: bool = False  # qwen2: biases on q, k, v
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


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """(head_dim/2,) float64 inverse frequencies, with the config's scaling applied."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
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


# -----------------------------------------------------------------------------
# the model

HAS_MKLDNN_LINEAR = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


def linear(x, weight, packed=None, bias=None):
    """F.linear, through a oneDNN-prepacked weight or a core matrix if given."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, (Int8Matrix, Q4Matrix, FloatMatrix)):
        y = core_linear(x, packed)
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Caches an int8 or q4 model's passes run in the core over (rust/attention.rs): float16 halves
# what a pass reads at long context (after 2000 tokens SmolLM2's float32 keys and values are
# 92 MB a pass, as much as its q4 weights); each value is rounded once, when written.
CORE_CACHE_DTYPES = (torch.float16, torch.float32)

# Keys a row attends over are padded to a multiple of this (masked), so that a row sees the
# same key length in a verify pass as in a one-token pass at its position.
KEY_BUCKET = 64


def row_groups(pos: int, T: int, capacity: int, device) -> list[tuple[int, int, torch.Tensor]]:
    """For T query rows at positions pos..: (first row, end row, mask (n, 1, 1, keys)) per run of
    rows whose key length (their position + 1, padded to a KEY_BUCKET multiple) is the same."""
    groups = []
    t = 0
    while t < T:
        keys = min(capacity, -(-(pos + t + 1) // KEY_BUCKET) * KEY_BUCKET)
        end = min(T, keys - pos) if keys < capacity else T
        slots = torch.arange(keys, device=device)
        seen = slots[None, :] <= torch.arange(pos + t, pos + end, device=device)[:, None]
        groups.append((t, end, seen[:, None, None, :]))  # (n, 1, 1, keys)
        t = end
    return groups


def attend_rows(q, k_cache, v_cache, groups, g: int) -> torch.Tensor:
    """Attention of T query rows over a layer's cache, each row computed exactly as a one-row
    pass computes it: as one item of a batch, over its group's padded key length, masked past
    its position (row_groups).

    q (H, T, hd); k_cache, v_cache (Hkv, S, hd) -> (H, T, hd).
    """
    H, T, hd = q.shape
    Hkv = H // g
    rows = q.view(Hkv, g, T, hd).permute(2, 0, 1, 3)  # (T, Hkv, g, hd): one item a row
    outs = []
    for t, end, seen in groups:
        keys = seen.shape[-1]
        k = k_cache[None, :, :keys].expand(end - t, Hkv, keys, hd)
        v = v_cache[None, :, :keys].expand(end - t, Hkv, keys, hd)
        outs.append(F.scaled_dot_product_attention(rows[t:end], k, v, attn_mask=seen))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.permute(1, 2, 0, 3).reshape(H, T, hd)


# SDPA reads each kv head once for its g query heads itself from torch 2.5 on (enable_gqa, in the
# fused kernels on CUDA and on CPU); before, a stride-0 expand gives them the same keys uncopied.
SDPA_GQA = torch.__version__ >= "2.5"


def attention(q, k, v, mask=None, causal: bool = False) -> torch.Tensor:
    """q (H, T, hd) over a layer's keys and values k, v (Hkv, L, hd) -> (H, T, hd).

    4-D, as SDPA's fused kernels need (flash, memory-efficient and cuDNN on CUDA, flash on CPU):
    given 3-D tensors it takes the math path, several kernels a layer around a float32 score
    tensor of every query row against every key. `mask` (T, L) bool, True = may attend (or
    verify_mask's causal bias on CUDA);
    `causal` instead when query i sees keys [0, i] (a prefill from position 0), which lets the
    fused kernels skip the blocks above the diagonal rather than compute and mask them.
    """
    H, T, hd = q.shape
    Hkv, L = k.shape[:2]
    g = H // Hkv  # head h uses kv head h // g
    if q.device.type == "cpu" and not causal:
        # Decode and verify passes on a CPU: a kv head's g query heads as one (g*T)-row batch
        # item. The 4-D call took up to 1.28x as long for 2-9 rows on one thread here
        # (benches/bench_attention.py); a causal prefill (2.5x faster at 2048) still takes it.
        mask = None if mask is None else mask.repeat(g, 1)  # (g*T, L)
        y = F.scaled_dot_product_attention(q.reshape(Hkv, g * T, hd), k, v, attn_mask=mask)
        return y.reshape(H, T, hd)
    if SDPA_GQA:
        y = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=causal, enable_gqa=True
        )  # (1, H, T, hd)
        return y[0]
    k = k[:, None].expand(Hkv, g, L, hd)  # (Hkv, g, L, hd), stride 0 over g
    v = v[:, None].expand(Hkv, g, L, hd)
    y = F.scaled_dot_product_attention(
        q.view(Hkv, g, T, hd), k, v, attn_mask=mask, is_causal=causal
    )
    return y.reshape(H, T, hd)


# SDPA's backends for an eager pass on CUDA: all but cuDNN's, which torch prefers on Hopper. cuDNN
# builds an execution graph for each new shape, and an eager decode step's key length is new every
# step. The compiled steps keep it: their shapes are fixed, one graph a bucket.
EAGER_CUDA_SDPA = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def verify_mask(T: int, pos: int, device: torch.device) -> torch.Tensor | CausalBias:
    """Which of the keys [0, pos+T) each of T query rows at positions pos.. sees: row i sees
    [0, pos+i]. A (T, pos+T) bool tensor; on CUDA SDPA's lower-right causal bias, the same mask
    unwritten, which the flash kernel takes with grouped-query heads. A written mask there goes
    to the math path (flash takes none, cuDNN is off in eager passes): several kernels a layer,
    and a verify pass cost 2-3 plain steps on an H200."""
    if device.type == "cuda":
        return causal_lower_right(T, pos + T)
    return torch.ones(T, pos + T, dtype=torch.bool, device=device).tril_(pos)


def eager_attention_backends(device: torch.device):
    """The context an eager pass runs its layers in: on CUDA, SDPA limited to EAGER_CUDA_SDPA."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(EAGER_CUDA_SDPA))


def trim_heap() -> None:
    """Hands freed heap memory back to the OS (glibc's malloc_trim). glibc keeps large freed
    blocks for reuse, so without this the weights packing replaced (or a loader's temporaries)
    stay in the process's resident memory. A no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _to_placeholder(m: nn.Linear) -> None:
    """Drops a matrix's values, keeping its shape and dtype (a meta tensor)."""
    w = torch.empty(m.weight.shape, dtype=m.weight.dtype, device="meta")
    m.weight = nn.Parameter(w, requires_grad=False)


class Model(nn.Module):
    """Weights of a Llama-family model. `decoder(max_length)` gives one sequence's state."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList()
        for _ in range(c.n_layers):
            layer = nn.Module()
            layer.attn_norm = nn.Parameter(torch.ones(c.dim))
            layer.wqkv = nn.Linear(c.dim, qkv_out, bias=c.attn_bias)  # fused q, k, v
            layer.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
            layer.ffn_norm = nn.Parameter(torch.ones(c.dim))
            layer.w_gate_up = nn.Linear(c.dim, 2 * c.intermediate_size, bias=False)  # fused
            layer.w_down = nn.Linear(c.intermediate_size, c.dim, bias=False)
            self.layers.append(layer)
        self.norm = nn.Parameter(torch.ones(c.dim))
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)
        self.requires_grad_(False)
        # set by the loaders
        self.tokenizer = None
        self.eos_token_ids: list[int] = []
        self.chat_template: str | None = None
        self._rope_cache: dict = {}
        self._packed: list | None = None  # packed CPU weights (packed_weights), built on first use
        self._plain_released = False  # the packed copy replaced the plain weights
        self._rows_cache: dict[int, OutputRows] = {}  # first_rows(n) by n
        self._stack: tuple = (None, None)  # (packing, its CoreLayers): see _core_stack
        self.prepack = True
        self.weight_kind = "float"  # "int8" or "q4" after quantize_int8
        self._kv_dtype: torch.dtype | None = None  # kv_dtype's choice; None: by weights
        # The file's layer matrices were 4-bit (a Q4 GGUF): weights="auto" may pick q4.
        self.file_is_4bit = False
        self.compiled_step = None  # torch.compile'd forward_static (steps.compile_step)
        self.static_capacity = 0  # KV slots of the compiled step's decoders (compile_steps)
        # Runs of a (bucket, cache) that compile or record, not run: the first; on CUDA the
        # second too, which records the CUDA graph (the first runs eagerly to warm up).
        self.cold_runs = 1
        self._step_runs: dict[tuple[int, int], int] = {}  # (bucket, id of the cache) -> runs

    def extra_repr(self) -> str:
        step = "compiled" if self.compiled_step is not None else "eager"
        packing = self._packing()
        kernel = int8_kernel() if packing == "core" else packing or "torch"
        weights = f"{self.weight_kind} ({kernel})"
        return (
            f"dtype={self.dtype}, weights={weights}, kv_dtype={self.kv_dtype}, "
            f"device={self.device}, step={step}"
        )

    @property
    def weights(self) -> str:
        """'int8' or 'q4' after quantize_int8(), else 'float'."""
        return self.weight_kind

    @property
    def int8(self) -> bool:
        """True once the matrices run in the core with int8 activations (int8 or q4 weights)."""
        return self.weight_kind != "float"

    @property
    def in_core(self) -> bool:
        """True where passes run wholly in the core (rust/layer.rs), over a cache of
        CORE_CACHE_DTYPES: float32 activations on CPU, with int8 or q4 weights, or with float32
        weights (`FloatMatrix`) unless `prepack` is off or the passes run compiled steps."""
        cpu32 = self.dtype == torch.float32 and self.device.type == "cpu"
        return cpu32 and (self.int8 or (self.prepack and self.compiled_step is None))

    def _packing(self) -> str | None:
        """What packed_weights() packs the matrices for on CPU: "core" (int8 or q4 weights, or
        float32 passes in the core), "oneDNN" (other dtypes, with prepack), or None (torch reads
        the plain weights)."""
        if self.device.type != "cpu":
            return None
        if self.int8 or self.in_core:
            return "core"
        return "oneDNN" if self.prepack and HAS_MKLDNN_LINEAR else None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of a decoder's KV cache: float16 where an int8 or q4 model's passes run in
        the core, the model's dtype elsewhere. Where passes run in the core, set it to
        torch.float16 or torch.float32 (a float16 cache halves what a pass reads at long
        context, and rounds each key and value once), or to None for the default; new decoders
        take it."""
        if not self.in_core:
            return self.dtype
        if self._kv_dtype is None:
            return torch.float16 if self.int8 else self.dtype
        return self._kv_dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype: torch.dtype | None) -> None:
        if dtype not in (*CORE_CACHE_DTYPES, None):
            raise ValueError(
                f"kv_dtype must be torch.float16, torch.float32 or None, got {dtype!r}"
            )
        self._kv_dtype = dtype

    def compile_steps(
        self,
        enabled: bool = True,
        mode: str | None = None,
        backend: str = "inductor",
        max_length: int | None = None,
    ) -> Model:
        """Decoders made from now on run decode and verify passes as compiled static-shape
        steps (enabled=False: eager again). See specfast.targets.torch.steps. Their KV cache
        has one capacity, for `max_length` tokens (None: the whole context, up to 4095), so
        generations up to that long share one compile per bucket; a longer decoder gets a
        larger capacity and compiles again. steps.warmup compiles ahead. Returns self."""
        if enabled and self.int8:
            raise ValueError("int8 weights run eagerly on CPU; compile a float model instead")
        if max_length is not None and not 0 < max_length <= self.max_context:
            raise ValueError(f"max_length must be in [1, {self.max_context}], got {max_length}")
        self.unpack()  # a compiled step reads the plain weights (packed_weights keeps them then)
        self.compiled_step = compile_step(self, mode, backend) if enabled else None
        self.static_capacity = model_capacity(self.max_context, max_length)
        self.cold_runs = 2 if self.device.type == "cuda" else 1
        self._step_runs = {}
        return self

    @classmethod
    def from_config(cls, config: ModelConfig, seed: int = 0, device=None, dtype="float32"):
        """A model with random weights (for tests): N(0, 0.02) matrices, N(1, 0.1) norm gains."""
        model = cls(config)
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        return model.to(device=resolve_device(device), dtype=resolve_dtype(dtype))

    def state_dict(self, *args, **kwargs):
        self.unpack()  # the real weights, not the placeholders packing leaves
        return super().state_dict(*args, **kwargs)

    # -- properties the generate() loop reads

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_context

    def decoder(self, max_length: int | None = None) -> Decoder:
        return Decoder(self, self.max_context if max_length is None else max_length)

    # -- the rest of the Target protocol (targets/base.py): a Model is its own target

    features = True  # its decoders return the inputs of chosen layers
    supports_head = True  # its decoders' forward takes head= (OutputRows)
    context_hint = ""

    @property
    def source(self) -> Model:
        return self

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def eagle_facts(self) -> EagleFacts:
        c = self.config
        return EagleFacts(
            c.vocab_size, c.dim, c.n_layers, self.dtype, self.device,
            lambda dtype: self.embed.weight,
        )  # fmt: skip

    def describe(self) -> dict[str, str]:
        """dtype, weights, the KV cache's dtype and how a pass runs (eager or compiled)."""
        return {
            "runtime": "specfast",
            "dtype": str(self.dtype).removeprefix("torch."),
            "weights": self.weights,
            "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
            "step": "compiled" if self.compiled_step is not None else "eager",
        }

    # -- rope

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(length, head_dim) cos and sin tables in the model dtype, cached per device/dtype."""
        key = (self.device, self.dtype)
        cached = self._rope_cache.get(key)
        if cached is None or cached[0].shape[0] < length:
            n = max(length, cached[0].shape[0] if cached else 0)
            pos = torch.arange(n, dtype=torch.float64)
            freqs = torch.outer(pos, rope_inv_freq(self.config)).float()  # (n, hd/2)
            emb = torch.cat([freqs, freqs], dim=-1)  # (n, hd), rotate-half layout
            # Computed in float32, then cast, as transformers does, so bf16 results agree.
            with torch.inference_mode():  # like the cache: one kind of tensor for the step
                cached = (
                    emb.cos().to(self.device, self.dtype),
                    emb.sin().to(self.device, self.dtype),
                )
            self._rope_cache[key] = cached
        return cached

    def _apply(self, fn, *args, **kwargs):
        self._rope_cache = {}  # moved or cast: rebuild the tables lazily
        self.unpack()  # the plain weights back first: they are what gets moved or cast
        self._rows_cache = {}
        return super()._apply(fn, *args, **kwargs)

    # -- CPU weight prepacking

    def packed_weights(self) -> list | None:
        """Per layer (wqkv, wo, w_gate_up, w_down) and then lm_head, as the core's matrices where
        passes run in the core (float32 on CPU: FloatMatrix, or int8 and q4 after
        `quantize_int8()`), else as oneDNN-blocked weights (`_packing`).

        On CPU, a plain F.linear makes oneDNN re-lay out a bf16 weight on every call, and MKL's
        fp32 GEMM gets slow for 2-16 rows. Prepacked weights make a forward over 1-16 tokens cost
        about the same, which is what verification needs. None off CPU or with
        `prepack = False`.

        The packed copy replaces the plain weights of those matrices (they become shape-only
        placeholders on the meta device), so packing does not double the model's memory.
        `unpack()` restores them exactly (oneDNN's reorder is lossless; int8 ones come back
        dequantized); call it before reading or editing a matrix in place, and before
        `state_dict()`. A model with compiled steps keeps the plain weights, which they read.
        """
        if self._packed is not None:
            return self._packed or None
        packed: list = []
        # Each plain matrix goes as soon as its packed copy exists, so the peak is one copy.
        release = self.compiled_step is None
        released: list[tuple[nn.Linear, torch.Tensor]] = []

        def pack(m: nn.Linear, head: bool = False):
            p = self._pack(m.weight, head)
            if release:
                released.append((m, p))
                _to_placeholder(m)
            return p

        if self._packing() is not None:
            try:
                for layer in self.layers:
                    packed.append(
                        [pack(m) for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
                    )
                # A tied head is the embedding, which the lookup still needs: kept.
                packed.append(
                    pack(self.lm_head, head=True)
                    if self.lm_head is not None
                    else self._pack(self.embed.weight, head=True)
                )
            except RuntimeError:  # a oneDNN build that cannot pack this dtype: plain F.linear
                for m, p in released:
                    m.weight = nn.Parameter(p.to_dense(), requires_grad=False)
                packed, released = [], []
        self._packed = packed
        self._plain_released = bool(released)
        if released:
            trim_heap()
        return packed or None

    def _packed_modules(self) -> list[tuple[nn.Linear, int, int | None]]:
        """(module, layer index or -1 for the head, matrix index) for every packed matrix."""
        out = [
            (m, i, j)
            for i, layer in enumerate(self.layers)
            for j, m in enumerate((layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
        ]
        return out + ([(self.lm_head, -1, None)] if self.lm_head is not None else [])

    def _restore_plain(self) -> None:
        if not self._plain_released:
            return
        for m, i, j in self._packed_modules():
            w = self._unpacked(self._packed[i][j] if j is not None else self._packed[-1])
            m.weight = nn.Parameter(w, requires_grad=False)
        self._plain_released = False

    def _pack(self, w: torch.Tensor, head: bool = False):
        """One matrix as packed_weights() holds it: int8 or q4 (the head int8), FloatMatrix, or
        oneDNN-blocked for 16 rows (as fast as unpacked for 1 row, 1.5-2x faster for 4-16)."""
        if self.int8:
            return quantize(w, "int8" if head else self.weight_kind)
        if self.in_core:
            return FloatMatrix(w.detach().contiguous().numpy())
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)

    def _unpacked(self, p) -> torch.Tensor:
        """The plain matrix a packed one stands for."""
        if isinstance(p, (Int8Matrix, Q4Matrix, FloatMatrix)):
            return dequantize(p).to(self.dtype)
        return p.to_dense()

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, D): the vocabulary projection (the embedding when they are tied)."""
        if self.lm_head is None:
            return self.embed.weight
        if self._plain_released:  # a dense copy for the caller, without keeping it
            return self._unpacked(self._packed[-1])
        return self.lm_head.weight

    def output_rows(self, ids: torch.Tensor) -> OutputRows:
        """The vocabulary projection for the tokens `ids` only, packed as the model's own is."""
        return OutputRows(self, ids)

    def first_rows(self, n: int) -> OutputRows:
        """output_rows(arange(n)), built once per model (a draft model's common tokens)."""
        if n not in self._rows_cache:
            self._rows_cache[n] = OutputRows(self, torch.arange(n))
        return self._rows_cache[n]

    def unpack(self) -> None:
        """Drops the packed copy and restores the plain weights it replaced."""
        self._restore_plain()
        self._packed = None
        self._rows_cache = {}
        self._stack = (None, None)

    def quantize_int8(self, weights: str = "int8") -> Model:
        """Runs every matrix but the embedding lookup in the core with int8 activations, on CPU
        (see specfast.targets.torch.int8), each activation row quantized on its own, so a verify
        pass gives row for row what one-token passes give.

        weights="int8": one scale per output row; a pass reads a quarter of float32's bytes.
        weights="q4": the layers' matrices in llama.cpp's Q4_1 (5 bits a weight), the output
        matrix in int8 (a 4-bit vocabulary projection costs the most agreement for its bytes).

        The quantized matrices replace the float ones (unpack() brings them back dequantized).
        Quantizing changes what the model generates, as a lower dtype does; its speculative
        output still equals its own plain output. Returns self.
        """
        if weights not in QUANTIZED:
            raise ValueError(f"weights must be one of {QUANTIZED}, got {weights!r}")
        if self.device.type != "cpu":
            raise ValueError(f"quantize_int8 runs on CPU only; the model is on {self.device}")
        if self.compiled_step is not None:
            raise ValueError("int8 weights run eagerly on CPU; call compile_steps(False) first")
        self.unpack()
        self.weight_kind = weights
        return self

    # -- forward

    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        pos: int,
        last_only: bool = False,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        aux_layers: Sequence[int] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """ids (T,) at positions [pos, pos+T), cache holding [0, pos) -> logits (T, V), model dtype
        ((1, V) with last_only: a prefill needs only the last row, and the vocabulary projection
        is a fifth of a small model's work per token). `head` (e.g. an OutputRows) replaces the
        vocabulary projection: hidden (T, D) -> logits (T, S).

        With `aux_layers` (layer ids, checked by the caller) -> (logits, features (T, n*D)): the
        residual stream entering each of those layers, concatenated in the order given, for all
        T rows even with last_only (an EAGLE-3 head reads them; vLLM's aux hidden states).

        Writes the T new keys/values into the cache; does not move its length. Shapes follow the
        context: the eager path, for prefill and for CPU decoding.
        """
        if self.in_core and ids.shape[0] <= INT8_SERIAL_ROWS:
            with torch_threads(1):
                return self._forward(ids, cache, pos, last_only, head, aux_layers)
        return self._forward(ids, cache, pos, last_only, head, aux_layers)

    def _forward(self, ids, cache, pos, last_only, head, aux_layers):
        c = self.config
        T, g = ids.shape[0], c.n_heads // c.n_kv_heads
        L = pos + T
        cos, sin = self.rope(L)
        cos, sin = cos[pos:L, None, :], sin[pos:L, None, :]  # (T, 1, hd)

        def attend(i, q, k, v):  # q (H, T, hd); k, v (Hkv, T, hd)
            k_all, v_all = cache.write(i, pos, k, v)  # (Hkv, L, hd)
            if groups:
                return attend_rows(q, cache.k[i], cache.v[i], groups, g)
            return attention(q, k_all, v_all, mask, causal)

        packed = self.packed_weights()
        aux: dict | None = None if aux_layers is None else dict.fromkeys(aux_layers)
        # int8 rounds every activation, so a last-bit difference between a verify pass's row
        # and a one-token pass grows into a different token; int8 passes compute every part
        # of a row as a one-row pass would. In float32 on CPU the whole pass, head included, is
        # one call into the core (rust/layer.rs); in other dtypes torch computes attention row
        # by row.
        if self.in_core and cache.k.dtype in CORE_CACHE_DTYPES:
            rows = 1 if last_only else T
            logits = None if head is not None else torch.empty(rows, self.vocab_size)
            x = self._core_layers(self.embed(ids), cos, sin, packed, aux, cache, pos, logits)
            if logits is None:
                logits = self._head(x[-1:] if last_only else x, head, packed)
            return logits if aux is None else (logits, _features(aux, aux_layers))
        groups = mask = None
        causal = False
        if self.int8 and T <= INT8_SERIAL_ROWS:
            groups = row_groups(pos, T, cache.k.shape[2], ids.device)
        elif T > 1 and pos == 0:
            causal = True  # keys [0, T): query i sees [0, i]
        elif T > 1:
            mask = verify_mask(T, pos, ids.device)  # (for T == 1 every key: no mask)

        with eager_attention_backends(ids.device):
            x = self._layers(self.embed(ids), cos, sin, attend, packed, aux)
        logits = self._head(x[-1:] if last_only else x, head, packed)
        return logits if aux is None else (logits, _features(aux, aux_layers))

    def forward_static(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same pass with every shape fixed, for torch.compile and CUDA graphs.

        ids (B,) and positions (B,) on the device; k_cache, v_cache (n_layers, Hkv, C, hd) written
        at `positions` (index_copy_, no host arithmetic); cos/sin tables (C, hd). Attention reads
        all C slots and masks key j for query i unless j <= positions[i], so stale slots past the
        live length never count and rollback stays one integer. Padding rows (positions C - 1)
        write into a slot no live query sees. -> (logits (B, V), argmax ids (B,)).
        """
        C = k_cache.shape[2]
        cos, sin = cos_table[positions, None, :], sin_table[positions, None, :]  # (B, 1, hd)
        slots = torch.arange(C, device=ids.device)
        mask = slots[None, :] <= positions[:, None]  # (B, C)

        def attend(i, q, k, v):  # q (H, B, hd); k, v (Hkv, B, hd)
            k_cache[i].index_copy_(1, positions, k)
            v_cache[i].index_copy_(1, positions, v)
            return attention(q, k_cache[i], v_cache[i], mask)

        # oneDNN-prepacked weights are opaque to the compiler; inductor lays out its own.
        packed = None if torch.compiler.is_compiling() else self.packed_weights()
        x = self._layers(self.embed(ids), cos, sin, attend, packed)
        logits = self._head(x, None, packed)
        return logits, logits.argmax(dim=-1)

    def _layers(self, x, cos, sin, attend, packed, aux=None) -> torch.Tensor:
        """x (T, D) through every layer; `attend(i, q, k, v)` stores k, v and attends. `aux`
        (layer id -> None) gets the residual stream entering each of its layers."""
        c = self.config
        T, H, Hkv, hd = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
        for i, layer in enumerate(self.layers):
            if aux is not None and i in aux:
                aux[i] = x  # (T, D): the input of layer i = the output of layer i - 1
            pw = packed[i] if packed else (None,) * 4
            h = F.rms_norm(x, (c.dim,), layer.attn_norm, c.norm_eps)
            qkv = linear(h, layer.wqkv.weight, pw[0], layer.wqkv.bias)  # (T, (H + 2Hkv) * hd)
            qk = qkv[:, : (H + Hkv) * hd].view(T, H + Hkv, hd)
            v = qkv[:, (H + Hkv) * hd :].view(T, Hkv, hd)
            x1, x2 = qk.chunk(2, dim=-1)
            qk = qk * cos + torch.cat([-x2, x1], dim=-1) * sin  # RoPE on q and k at once
            q, k = qk.split([H, Hkv], dim=1)  # (T, H, hd), (T, Hkv, hd)
            y = attend(i, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # (H, T, hd)
            y = y.transpose(0, 1).reshape(T, H * hd)
            x = x + linear(y, layer.wo.weight, pw[1])
            h = F.rms_norm(x, (c.dim,), layer.ffn_norm, c.norm_eps)
            gate, up = linear(h, layer.w_gate_up.weight, pw[2]).chunk(2, dim=-1)  # (T, F) each
            x = x + linear(F.silu(gate) * up, layer.w_down.weight, pw[3])
        return x

    def _core_layers(self, x, cos, sin, packed, aux, cache, pos, logits=None) -> torch.Tensor:
        """_layers for a model whose passes run in the core: the whole stack in one call, in
        place on x (T, D). cos, sin (T, 1, hd). `logits` (R, V), if given, gets the head's
        logits for the last R rows from the same call."""
        x = x.float().contiguous()  # (T, D)
        cos, sin = cos[:, 0].contiguous().numpy(), sin[:, 0].contiguous().numpy()  # (T, hd)
        ids = list(aux or ())
        feats = torch.empty(len(ids), *x.shape)  # (n, T, D): the input of each aux layer
        kv = cache.k.numpy(), cache.v.numpy()
        out = None if logits is None else logits.numpy()
        self._core_stack(packed).forward(x.numpy(), cos, sin, *kv, pos, ids, feats.numpy(), out)
        for i, f in zip(ids, feats, strict=True):
            aux[i] = f
        return x

    def _core_stack(self, packed) -> CoreLayers:
        """The core's stack of this model's layers, made once per packing (making the
        arguments of 30 layer calls took ~1 ms of a small model's pass)."""
        if self._stack[0] is not packed:
            args = []
            for layer, (qkv, o, gate_up, down) in zip(self.layers, packed, strict=False):
                bias = layer.wqkv.bias
                bias = None if bias is None else bias.detach().numpy()
                attn, ffn = layer.attn_norm.detach().numpy(), layer.ffn_norm.detach().numpy()
                args.append((attn, qkv, bias, o, ffn, gate_up, down))
            c, norm = self.config, self.norm.detach().numpy()
            self._stack = (packed, CoreLayers(args, c.n_heads, c.norm_eps, norm, packed[-1]))
        return self._stack[1]

    def _head(self, x, head, packed) -> torch.Tensor:
        x = F.rms_norm(x, (self.config.dim,), self.norm, self.config.norm_eps)
        if head is not None:
            return head(x)  # (T, S)
        if packed:  # (output_weight would rebuild a dense copy of a packed head: not read)
            return linear(x, None, packed[-1])  # (T, V)
        return F.linear(x, self.output_weight)  # (T, V)


def _features(aux: dict, aux_layers) -> torch.Tensor:
    """The inputs of the aux layers, concatenated in the order asked for -> (T, n*D)."""
    return torch.cat([aux[i] for i in aux_layers], dim=-1)


class OutputRows:
    """A model's vocabulary projection restricted to the tokens `ids`: hidden (T, D) -> logits
    (T, len(ids)), row i for token ids[i]. A copy of those rows, packed like the model's."""

    def __init__(self, model: Model, ids: torch.Tensor):
        self.ids = ids.to(model.device)
        self.weight = model.output_weight[self.ids].contiguous()  # (S, D)
        self.packed = model._pack(self.weight) if model.packed_weights() else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed)


# -----------------------------------------------------------------------------
# one sequence's decoding state


class Decoder:
    """A static, preallocated KV cache over `model`, plus the length of what it holds.

    forward(ids) appends; rollback(n) only moves the counter: entries past it are never attended
    to and get overwritten by the next forward.
    """

    def __init__(self, model: Model, max_length: int):
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if max_length > model.max_context:
            raise ValueError(
                f"max_length {max_length} exceeds the model's context of {model.max_context}"
            )
        c = model.config
        self.model = model
        self.max_length = max_length
        self.step = model.compiled_step
        self.cold_passes = 0  # passes that compiled a graph or recorded a CUDA graph
        self._core: tuple | None = None  # (packing, embedding, _core_arrays)
        self._logits = np.empty((0, 0), np.float32)  # _core_greedy's, reused
        if self.step is not None:
            model._restore_plain()  # a compiled step reads the plain weights, not the packed
        if self.step is None:
            self.cache = KVCache(
                c.n_layers, c.n_kv_heads, max_length, c.head_dim, model.device, model.kv_dtype
            )
            model.rope(max_length)
        else:
            # A compiled step needs a fixed cache shape: the model's one capacity (a larger
            # power of two if this decoder outgrows it), on buffers kept per model and
            # capacity, so the CUDA graphs recorded for their addresses replay for the next
            # decoder too.
            capacity = max(model.static_capacity, static_capacity(max_length))
            self.cache = static_cache(model, capacity)
            # The same tensors every pass, marked static: CUDA graphs read them in place
            # instead of copying them in before each replay.
            self._tables = tuple(t[:capacity] for t in model.rope(capacity))
            for t in self._tables:
                torch._dynamo.mark_static_address(t, guard=False)

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def torch_threads(self) -> int | None:
        """Threads torch's own ops of a generation round should use, or None for torch's. An
        model's passes that run in the core use its helper thread, which spins on the second
        core all through a generation: beside it, torch's argmax over two rows waited 3-6 ms for
        its second thread (2-core Xeon VM)."""
        return 1 if self.model.in_core else None

    def forward(
        self,
        ids: torch.Tensor,
        last_only: bool = False,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        features: Sequence[int] | bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """ids (T,) LongTensor on the model's device -> float32 logits (T, V), or (1, V) for the
        last position only, or over `head`'s tokens only; appends T tokens.

        `features` (target layer ids, or True for `default_aux_layers`) -> (logits, features):
        features (T, n*D) in the model dtype, the residual stream entering those layers for
        every row, from the same pass (see Model.forward)."""
        m = self.model
        check_ids(ids, m.device, m.vocab_size, self.cache.length, self.max_length)
        aux = check_aux_layers(features, m.config.n_layers)
        # The compiled step returns no hidden states: a pass that wants them runs eager.
        if aux is None and self._is_static(ids, last_only, head):
            return self._static(ids)[0].float()
        T, pos = ids.shape[0], self.cache.length
        with torch.inference_mode():
            out = m(ids.long(), self.cache, pos, last_only, head, aux)
        self.cache.length = pos + T
        if aux is None:
            return out.float()
        return out[0].float(), out[1]

    def forward_greedy(
        self, ids: torch.Tensor, features: Sequence[int] | bool | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """ids (T,) -> (T,) the argmax token of each row, left on the device (computed inside
        the compiled step when there is one); appends T tokens. With `features`: (argmax ids,
        features (T, n*D)), as forward."""
        m = self.model
        if features is None or features is False:
            core = self._core_arrays()
            if core is not None:
                return self._core_greedy(ids, *core)
            check_ids(ids, m.device, m.vocab_size, self.cache.length, self.max_length)
            if self._is_static(ids, False, None):
                return self._static(ids)[1]
            with torch_threads(self.torch_threads or torch.get_num_threads()):
                return argmax_rows(self.forward(ids))
        logits, feats = self.forward(ids, features=features)
        return argmax_rows(logits), feats

    def _core_arrays(self) -> tuple | None:
        """(the core's layer stack, embedding (V, D), cos and sin tables (at least max_length
        rows), keys, values) as NumPy arrays where a pass runs wholly in the core (float32 on
        CPU: see Model.in_core), else None. Kept while the packing and the
        embedding stay the same objects."""
        m = self.model
        k, v = self.cache.k, self.cache.v
        if self.step is not None or not m.in_core or k.dtype not in CORE_CACHE_DTYPES:
            return None
        packed, embed = m.packed_weights(), m.embed.weight
        if self._core is None or self._core[0] is not packed or self._core[1] is not embed:
            cos, sin = m.rope(self.max_length)
            arrays = (m._core_stack(packed), embed.detach().numpy())
            arrays += (cos.numpy(), sin.numpy(), k.numpy(), v.numpy())
            self._core = (packed, embed, arrays)
        return self._core[2]

    def _core_greedy(self, ids, stack, embed, cos, sin, k, v) -> torch.Tensor:
        """forward_greedy over the arrays of _core_arrays, with NumPy between the passes and
        not torch: a pass streams the weights through the caches, so a torch op between passes
        runs cold, at tens of µs, and the dozen in forward() cost a one-row pass 0.3-0.5 ms.
        The same call into the core on the same values, so the same ids."""
        m, pos = self.model, self.cache.length
        check_ids(ids, m.device, m.vocab_size, pos, self.max_length)
        rows, T = ids.numpy(), ids.shape[0]
        if T > INT8_SERIAL_ROWS:  # a prefill's logits: not worth keeping
            logits = np.empty((T, embed.shape[0]), np.float32)
        else:
            if self._logits.shape[0] < T:
                self._logits = np.empty((T, embed.shape[0]), np.float32)
            logits = self._logits[:T]
        x = embed[rows]  # (T, D): a copy, which the core turns into the last hidden states
        stack.forward(x, cos[pos : pos + T], sin[pos : pos + T], k, v, pos, logits=logits)
        self.cache.length = pos + T
        return argmax_array(logits)

    def greedy_ids(self, tokens: list[int]) -> list[int]:
        """forward_greedy over a list of ids -> the argmax id of every row, as ints."""
        # Uploaded without a blocking copy: the ids coming back are the round's one host sync.
        return self.forward_greedy(to_device(tokens, self.model.device)).tolist()

    def _is_static(self, ids, last_only, head) -> bool:
        return self.step is not None and not last_only and head is None and len(ids) <= BUCKETS[-1]

    def _static(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled step over ids padded to a bucket -> (logits (T, V), argmax (T,))."""
        T, pos = ids.shape[0], self.cache.length
        B, C = bucket(T), self.cache.k.shape[2]
        cos, sin = self._tables  # (C, hd) each
        with torch.inference_mode():  # inputs made here are inference tensors, like the cache
            padded = torch.zeros(B, dtype=torch.long, device=ids.device)
            padded[:T] = ids
            # Padding rows sit at slot C - 1, which no live query sees. No host arithmetic on
            # device values, so no sync.
            positions = torch.arange(pos, pos + B, device=ids.device).clamp_max_(C - 1)
            logits, top = self.step(padded, positions, self.cache.k, self.cache.v, cos, sin)
        self.cache.length = pos + T
        m = self.model
        key = (B, id(self.cache.k))  # buffers are kept objects (static_cache): one id each
        m._step_runs[key] = m._step_runs.get(key, 0) + 1
        if m._step_runs[key] <= m.cold_runs:
            self.cold_passes += 1
        # CUDA graphs reuse their output buffers on the next replay: hand out copies.
        return logits[:T].clone(), top[:T].clone()

    def rollback(self, length: int) -> None:
        """Forget everything after the first `length` tokens. O(1)."""
        self.cache.rollback(length)

    def reset(self) -> None:
        self.cache.rollback(0)

    def copy(self) -> Decoder:
        """A new decoder of the same model holding this one's first `length` positions."""
        new = self.model.decoder(self.max_length)
        new.cache.copy_from(self.cache)
        return new
