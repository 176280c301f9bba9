"""A token embedding kept as a GGUF file's quantized blocks, each looked-up row dequantized.

A lookup reads a few rows, so the table need not be float: a 7B's 152k x 3584 embedding is
2.2 GB in float32 and 0.3-0.6 GB in its file's 4-8 bit blocks, as llama.cpp keeps it. Rows come
out as gguf's dequantization gives them, so a model runs on the same values as with the float
table (and `weight` rebuilds that table, for the few readers of the whole matrix).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class FileEmbedding(nn.Module):
    """nn.Embedding's lookup over `blocks` ((V, a row's bytes or values), of ggml type `kind`,
    as gguf's reader holds the tensor)."""

    like: torch.Tensor

    def __init__(self, blocks: np.ndarray, kind, dim: int, dtype: torch.dtype):
        super().__init__()
        self.blocks, self.kind = blocks, kind
        self.num_embeddings, self.embedding_dim = blocks.shape[0], dim
        # Shape-less: it only carries the dtype and device that .to() gives the model.
        self.register_buffer("like", torch.empty(0, dtype=dtype), persistent=False)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """ids (T,) -> (T, D) float32."""
        from gguf.quants import dequantize

        rows = dequantize(self.blocks[ids], self.kind).reshape(len(ids), self.embedding_dim)
        return rows.astype(np.float32, copy=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(ids.reshape(-1).cpu().numpy())
        out = torch.from_numpy(rows).to(self.like.device, self.like.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole (V, D) table, dequantized: a copy, made at each call."""
        return self(torch.arange(self.num_embeddings))

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.name} blocks"
