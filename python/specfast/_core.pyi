"""Type stubs for the compiled core, `specfast._core`."""

import os
from collections.abc import Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

# PyO3 fills the runtime __all__ from the registered functions; keep this list in step.
__all__ = [
    "CoreLayers",
    "FloatMatrix",
    "GgufMatrix",
    "Int8Matrix",
    "NgramDrafter",
    "Q4Matrix",
    "accept_greedy",
    "accept_sampled",
    "accept_sampled_with_uniforms",
    "advise_huge_pages",
    "amx_usable",
    "ggml_tile_restorer",
    "gguf_block_types",
    "int8_kernel",
    "row_attention",
    "rule_tables",
    "thread_round_trip",
    "uniforms",
]

# ---- accept --------------------------------------------------------------------------------------
# Probability matrices: 2-D float32/float64 numpy arrays or CPU torch tensors (read zero-copy).

def accept_greedy(draft: Sequence[int], target_ids: Sequence[int]) -> list[int]: ...
def accept_sampled(
    target_probs: Any, draft: Sequence[int], draft_probs: Any | None = None, *, seed: int
) -> list[int]: ...
def accept_sampled_with_uniforms(
    target_probs: Any,
    draft: Sequence[int],
    draft_probs: Any | None,
    accept_uniforms: Sequence[float],
    sample_uniforms: Sequence[float],
) -> list[int]: ...
def uniforms(seed: int, k: int) -> tuple[list[float], list[float]]: ...
def rule_tables(
    target_probs: Any, draft: Sequence[int], draft_probs: Any | None = None
) -> tuple[list[float], npt.NDArray[np.float64]]: ...

# ---- llama.cpp's AMX tiles (crates/kernels/src/tiles.rs) -----------------------------------------

def amx_usable() -> bool: ...
def ggml_tile_restorer() -> int: ...

# ---- the helper thread that products and attention split their work with (kernels' helper.rs) ----

def thread_round_trip() -> float | None: ...

# ---- memory (crates/core/src/bigvec.rs) ----------------------------------------------------------

def advise_huge_pages(address: int, nbytes: int) -> int: ...

# ---- int8, 4-bit and GGUF-block matrix products (crates/kernels: int8.rs, q4.rs, gguf.rs) --------

@final
class Int8Matrix:
    def __new__(cls, weight: npt.NDArray[np.float32]) -> Int8Matrix: ...
    def matmul(
        self, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], kernel: str = "auto"
    ) -> None: ...
    def weights(self) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]: ...
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class Q4Matrix:
    def __new__(cls, weight: npt.NDArray[np.float32]) -> Q4Matrix: ...
    @staticmethod
    def from_parts(
        q: npt.NDArray[np.uint8],
        d: npt.NDArray[np.float32],
        m: npt.NDArray[np.float32] | None = None,
    ) -> Q4Matrix: ...
    def matmul(
        self, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], kernel: str = "auto"
    ) -> None: ...
    def parts(
        self,
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32], npt.NDArray[np.float32] | None]: ...
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class FloatMatrix:
    def __new__(cls, weight: npt.NDArray[np.float32]) -> FloatMatrix: ...
    def matmul(
        self, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], kernel: str = "auto"
    ) -> None: ...
    def weights(self) -> npt.NDArray[np.float32]: ...
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class GgufMatrix:
    """GGUF tensors in their own ggml blocks (the types of gguf_block_types()), stacked by rows:
    `parts` are (type name, raw blocks (rows, bytes a row) uint8)."""

    @staticmethod
    def from_tensors(parts: list[tuple[str, npt.NDArray[np.uint8]]], cols: int) -> GgufMatrix: ...
    def matmul(
        self, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], kernel: str = "auto"
    ) -> None: ...
    def dequantize(self) -> npt.NDArray[np.float32]: ...
    def types(self) -> list[tuple[str, int]]: ...
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

def gguf_block_types() -> list[str]: ...
def int8_kernel() -> str: ...

_Float32 = npt.NDArray[np.float32]
_Float16 = npt.NDArray[np.float16]
_Matrix = Int8Matrix | Q4Matrix | GgufMatrix | FloatMatrix
_LayerWeights = tuple[_Float32, _Matrix, _Float32 | None, _Matrix, _Float32, _Matrix, _Matrix]

@final
class CoreLayers:
    """A model's int8, 4-bit, GGUF-block or float32 layers and its head, run over a pass in one
    call. layers: per layer (attn_norm, qkv, qkv_bias or None, o, ffn_norm, gate_up, down); norm
    and output: the final norm and the vocabulary projection; qk_norms: per layer (q_norm, k_norm),
    applied to every query and key head before RoPE (Qwen3, Gemma 3), or None. Gemma 3's:
    post_norms per layer (post_attn_norm, post_ffn_norm), act "gelu_tanh", attn_scale, and
    sliding_layers that see only their last `window` keys."""

    def __new__(
        cls,
        layers: Sequence[_LayerWeights],
        heads: int,
        eps: float,
        norm: _Float32,
        output: _Matrix,
        *,
        qk_norms: Sequence[tuple[_Float32, _Float32]] | None = None,
        post_norms: Sequence[tuple[_Float32, _Float32]] | None = None,
        act: str = "silu",
        attn_scale: float | None = None,
        sliding_layers: Sequence[int] = ...,
        window: int = 0,
    ) -> CoreLayers: ...
    def forward(
        self,
        x: _Float32,
        cos: _Float32,
        sin: _Float32,
        k_cache: _Float32 | _Float16,
        v_cache: _Float32 | _Float16,
        pos: int,
        feature_layers: Sequence[int] = ...,
        features: _Float32 | None = None,
        logits: _Float32 | None = None,
        local: tuple[_Float32, _Float32] | None = None,
    ) -> None: ...
    def __len__(self) -> int: ...

# ---- attention -----------------------------------------------------------------------------------

def row_attention(
    q: npt.NDArray[np.float32],
    k: npt.NDArray[np.float32],
    v: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
    pos: int,
    path: str = "auto",
) -> None: ...

# ---- drafter -------------------------------------------------------------------------------------

@final
class NgramDrafter:
    """Proposes draft tokens by suffix-automaton lookup over everything committed so far.

    Safe to share between threads: calls serialise on an internal lock, whole call by whole call.
    """

    def __new__(
        cls,
        *,
        min_match: int | None = None,
        policy: str = "earliest",
        k_factor: float = ...,
        k_offset: float = 0.0,
        max_corpus_tokens: int | None = None,
    ) -> NgramDrafter: ...
    def extend(self, tokens: Any) -> None: ...
    def propose(self, k: int) -> list[int]: ...
    def add_document(self, tokens: Any) -> None: ...
    def reset(self) -> None: ...
    def __copy__(self) -> NgramDrafter: ...
    def __deepcopy__(self, memo: object) -> NgramDrafter: ...
    def save(self, path: str | os.PathLike[str], *, fingerprint: str = "") -> None: ...
    @staticmethod
    def load(path: str | os.PathLike[str], *, fingerprint: str | None = None) -> NgramDrafter: ...
    def __len__(self) -> int: ...
    def memory_bytes(self) -> int: ...
    @property
    def match_length(self) -> int: ...
    @property
    def corpus_tokens(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def min_match(self) -> int: ...
    @property
    def k_factor(self) -> float: ...
    @property
    def k_offset(self) -> float: ...
    @property
    def max_corpus_tokens(self) -> int: ...
