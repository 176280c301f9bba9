"""A lean Llama-family transformer (llama, qwen2, qwen3, mistral, SmolLM; gemma3's text
layers) for batch-1 decoding.

One sequence, no batch dimension: activations are (T, D). This file holds the weights and what
is set on them (dtype, quantization, compiled steps); their packing for the CPU kernels is in
packing.py, the layers' math in layers.py. A pass runs through decoder.py, by one of eager.py,
core.py or static.py, with attention in attention.py. The KV cache lives in a
`ModelDecoder`, so one set of weights can serve several independent sequences (the target can be its
own draft).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from specfast.hardware import torch_threads
from specfast.model.config import ModelConfig, resolve_device, resolve_dtype, rope_inv_freq
from specfast.model.core import CORE_CACHE_DTYPES, forward_in_core, runs_in_core
from specfast.model.decoder import ModelDecoder
from specfast.model.eager import forward_eager
from specfast.model.embedding import FileEmbedding
from specfast.model.kv_cache import KVCache
from specfast.model.layers import HAS_MKLDNN_LINEAR, Layer
from specfast.model.packing import OutputRows, PackedWeights
from specfast.model.quantize import (
    INT8_SERIAL_ROWS,
    QUANTIZED,
    int8_kernel,
)
from specfast.model.static import compile_step, forward_static, model_capacity


class Model(PackedWeights, nn.Module):
    """Weights of a Llama-family model. `decoder(max_length)` gives one sequence's state."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        # (a GGUF loaded with quantized weights keeps its quantized table: FileEmbedding)
        self.embed: nn.Embedding | FileEmbedding = nn.Embedding(c.vocab_size, c.dim)
        self.layers: list[Layer] = nn.ModuleList(Layer(c) for _ in range(c.n_layers))  # type: ignore[assignment]
        self.norm = nn.Parameter(torch.ones(c.dim))
        self.lm_head = None if c.tie_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)
        self.requires_grad_(False)
        # set by the loaders
        self.tokenizer: Any = None  # encode / decode (a tokenizers.Tokenizer from the loaders)
        self.eos_token_ids: list[int] = []
        self.chat_template: str | None = None
        self._rope_cache: dict = {}
        self._packed: list | None = None  # packed CPU weights (packed_weights), built on first use
        self._plain_released = False  # the packed copy replaced the plain weights
        self._rows_cache: dict[int, OutputRows] = {}  # first_rows(n) by n
        self._stack: tuple = (None, None)  # (packing, its CoreLayers): see _core_stack
        self.prepack = True
        self.weight_kind = "float"  # "int8", "q4" or "file" after quantize_int8
        self._kv_dtype: torch.dtype | None = None  # kv_dtype's choice; None: by weights
        # The ggml types of a GGUF's layer matrices (none for other files): weights="auto"
        # picks its candidates by them.
        self.file_types: frozenset[str] = frozenset()
        self.compiled_step = None  # torch.compile'd forward_static (static.compile_step)
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
        """'int8', 'q4' or 'file' after quantize_int8(), else 'float'."""
        return self.weight_kind

    @property
    def quantized(self) -> bool:
        """True once the matrices run in the core with int8 activations (int8, q4 or file
        weights)."""
        return self.weight_kind != "float"

    @property
    def in_core(self) -> bool:
        """True where passes run wholly in the core (crates/kernels/src/layer.rs), over a cache of
        CORE_CACHE_DTYPES: float32 activations on CPU, with quantized weights, or with float32
        weights (`FloatMatrix`) unless `prepack` is off or the passes run compiled steps."""
        cpu32 = self.dtype == torch.float32 and self.device.type == "cpu"
        return cpu32 and (self.quantized or (self.prepack and self.compiled_step is None))

    def _packing(self) -> str | None:
        """What packed_weights() packs the matrices for on CPU: "core" (quantized weights, or
        float32 passes in the core), "oneDNN" (other dtypes, with prepack), or None (torch reads
        the plain weights)."""
        if self.device.type != "cpu":
            return None
        if self.quantized or self.in_core:
            return "core"
        return "oneDNN" if self.prepack and HAS_MKLDNN_LINEAR else None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of a decoder's KV cache: float16 where a quantized model's passes run in
        the core, the model's dtype elsewhere. Where passes run in the core, set it to
        torch.float16 or torch.float32 (a float16 cache halves what a pass reads at long
        context, and rounds each key and value once), or to None for the default; new decoders
        take it."""
        if not self.in_core:
            return self.dtype
        if self._kv_dtype is None:
            return torch.float16 if self.quantized else self.dtype
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
        steps (enabled=False: eager again). See specfast.model.static. Their KV cache
        has one capacity, for `max_length` tokens (None: the whole context, up to 4095), so
        generations up to that long share one compile per bucket; a longer decoder gets a
        larger capacity and compiles again. static.warmup compiles ahead. Returns self."""
        if enabled and self.quantized:
            raise ValueError("int8 weights run eagerly on CPU; compile a float model instead")
        if enabled and self.config.sliding_layers:
            raise ValueError(
                f"{self.config.arch} runs eager steps only (its sliding-window layers have no "
                'compiled step); pass compile="off" or "auto"'
            )
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

    # (Read off the final norm: the embedding may be a FileEmbedding, whose weight is a copy.)
    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_context

    def decoder(self, max_length: int | None = None) -> ModelDecoder:
        return ModelDecoder(self, self.max_context if max_length is None else max_length)

    # -- rope

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T, D): the embedding rows, times embed_scale (gemma3), rounded to the
        model dtype as transformers rounds it."""
        x = self.embed(ids)
        s = self.config.embed_scale
        return x if s == 1.0 else x * torch.tensor(s, dtype=x.dtype)

    def rope(self, length: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(length, head_dim) cos and sin tables in the model dtype, cached per device/dtype;
        `local`: the sliding layers' tables."""
        key = (self.device, self.dtype, local)
        cached = self._rope_cache.get(key)
        if cached is None or cached[0].shape[0] < length:
            n = max(length, cached[0].shape[0] if cached else 0)
            pos = torch.arange(n, dtype=torch.float64)
            freqs = torch.outer(pos, rope_inv_freq(self.config, local)).float()  # (n, hd/2)
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

    def quantize_int8(self, weights: str = "int8") -> Model:
        """Runs every matrix but the embedding lookup in the core with int8 activations, on CPU
        (see specfast.model.quantize), each activation row quantized on its own, so a verify
        pass gives row for row what one-token passes give. Where the core does not run the
        layers (gemma3), torch runs them around the core's matrix products.

        weights="int8": one scale per output row; a pass reads a quarter of float32's bytes.
        weights="q4": the layers' matrices in llama.cpp's Q4_1 (5 bits a weight; a GGUF loaded
        with q4 keeps Q4_0 matrices as Q4_0, 4.5 bits), the output matrix in int8 (a 4-bit
        vocabulary projection costs the most agreement for its bytes).
        weights="file": a GGUF loaded with it keeps each tensor in its file's blocks
        (formats/gguf.py); float matrices have none, so here (and where such a model packs
        again after unpack()) they become Q8_0 (a scale per 32 weights), the output matrix int8.

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
        return self.pass_for(cache)(ids, cache, pos, last_only, head, aux_layers)

    def pass_for(self, cache: KVCache) -> Callable[..., Any]:
        """How a pass over `cache` runs, with forward's arguments: wholly in the Rust core
        (core.py) where the weights, dtype and device allow it and the cache has a dtype the
        core reads, else torch's eager layers (eager.py). A ModelDecoder picks it once, when it
        is made; its compiled steps (static.py), where the model has them, come before it."""
        run = forward_in_core if runs_in_core(self, cache) else forward_eager
        if not self.in_core:
            return partial(run, self)

        def few_rows_on_one_thread(ids, *args):
            # A pass of a few rows is the core's: torch's own ops wait on its helper thread.
            if ids.shape[0] > INT8_SERIAL_ROWS:
                return run(self, ids, *args)
            with torch_threads(1):
                return run(self, ids, *args)

        return few_rows_on_one_thread

    def forward_static(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass with every shape fixed, for torch.compile and CUDA graphs
        (static.forward_static) -> (logits (B, V), argmax ids (B,))."""
        return forward_static(self, ids, positions, k_cache, v_cache, cos_table, sin_table)
