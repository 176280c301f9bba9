"""llama.cpp as the target (or the draft): a `llama_cpp.Llama` behind the decoder protocol.

`LlamaDecoder` drives one sequence through llama.cpp's batch API: one `llama_decode` over
[last, d1..dk] with logits asked for only at the rows the loop reads, and a rollback that is one
`llama_memory_seq_rm` call. Threads, context size and batch size are whatever the `Llama` was
built with. llama_cpp is imported lazily, only when a Llama is actually used.

The decoder owns the Llama's memory while it lives: it clears it on creation and leaves
`Llama.n_tokens` at 0, so the Llama's own `generate()` afterwards re-evaluates its prompt instead
of trusting a cache that specfast has changed.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import torch

from specfast.targets.base import (
    check_aux_layers,
    check_fits,
    check_id_range,
    check_id_tensor,
    check_rollback,
    default_model_path,
)
from specfast.targets.llama_cpp.build import check_llama_build, llama_threads, tile_restorer
from specfast.targets.llama_cpp.features import LayerInputs
from specfast.targets.llama_cpp.state import llama_state

_CPU = torch.device("cpu")
# What llama_decode's return codes mean (llama.h).
_DECODE_ERRORS = {
    1: "no KV slot for the batch: build the Llama with a larger n_ctx",
    2: "aborted",
    -1: "invalid input batch",
}


def is_llama(obj) -> bool:
    """True for a llama_cpp.Llama (or a subclass), checked without importing llama_cpp."""
    return any(
        c.__name__ == "Llama" and c.__module__.startswith("llama_cpp") for c in type(obj).__mro__
    )


def llama_facts(llama) -> tuple[int, int, torch.device]:
    """(vocabulary size, n_ctx, device) of a Llama; llama.cpp's logits come back to the CPU."""
    return int(llama.n_vocab()), int(llama.n_ctx()), _CPU


def load_llama(path=None, device=None, **kwargs):
    """A GGUF file -> llama_cpp.Llama; keyword arguments (n_ctx, n_threads, ...) go to Llama.

    Defaults: n_ctx=4096, verbose=False. path=None is the default model.
    """
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ImportError(
            'backend="llama.cpp" needs llama-cpp-python: pip install "specfast[llama]"'
        ) from e

    if device is not None and str(device) != "cpu":
        raise ValueError(
            f'backend="llama.cpp" runs on the CPU; device must be None or "cpu", got {device!r}'
        )
    path = default_model_path() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}: llama.cpp loads single GGUF files")
    # Before the Llama: loading repacks the weights with the build's instruction sets.
    check_llama_build()
    kwargs.setdefault("n_ctx", 4096)
    kwargs.setdefault("verbose", False)
    return Llama(model_path=str(path), **kwargs)


class LlamaDecoder:
    """One sequence (seq 0) over a Llama's context.

    forward(ids (T,)) -> float32 logits (T, V), or (1, V) with last_only, appending T tokens,
    exactly as `specfast.model.model.Decoder`; forward_greedy -> argmax ids. With
    `features`, both also return the inputs of those layers (LayerInputs). rollback(n) removes
    the cache entries past n.
    """

    torch_threads = None  # torch runs no op between llama.cpp's passes
    cold_passes = 0  # llama.cpp compiles nothing

    def __init__(self, llama, max_length: int | None = None):
        import llama_cpp

        if not is_llama(llama):
            raise TypeError(f"expected a llama_cpp.Llama, got {type(llama).__name__}")
        check_llama_build()
        self.llama = llama
        self._lib = llama_cpp
        self.vocab_size, self.max_context, _ = llama_facts(llama)
        max_length = self.max_context if max_length is None else max_length
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if max_length > self.max_context:
            raise ValueError(
                f"{max_length} tokens do not fit the Llama's context of {self.max_context}: "
                f"build it with a larger n_ctx (Llama(..., n_ctx={max_length}) or more)"
            )
        self.max_length = max_length
        self._ctx = llama.ctx
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        if self._memory is None:
            raise ValueError("this Llama's context has no memory (KV cache); specfast needs one")
        self._n_batch = int(llama.n_batch)
        self.n_layers = int(llama_cpp.llama_model_n_layer(llama.model))
        self._inputs: LayerInputs | None = None
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
        self._finalizer = weakref.finalize(self, llama_cpp.llama_batch_free, self._batch)
        self._restore_tiles = tile_restorer()
        self._threads = llama_threads(llama)
        self._length = 0
        # Take the context over: whatever the Llama (or an earlier decoder) left goes.
        llama_cpp.llama_memory_clear(self._memory, False)
        llama.n_tokens = 0
        llama_state(llama)["owner"] = weakref.ref(self)

    @property
    def device(self) -> torch.device:
        return _CPU

    @property
    def length(self) -> int:
        return self._length

    def _check_owner(self) -> None:
        owner = llama_state(self.llama).get("owner")
        if owner is None or owner() is not self or self.llama.n_tokens != 0:
            raise RuntimeError(
                "this Llama's cache was used by something else since this decoder was made "
                "(a target and its draft must be two Llama objects)"
            )

    def forward_greedy(self, ids: torch.Tensor, features=None):
        """ids (T,) -> (T,) argmax ids; appends T tokens. The argmax reads llama.cpp's own
        logits buffer, so the (T, V) rows are never copied. With `features`: (ids, features)."""
        check_id_tensor(ids, _CPU)  # the ids themselves are checked, as a list, in _run
        out = self._run(ids.tolist(), False, greedy=True, features=features)
        if isinstance(out, tuple):  # (ids, features)
            return torch.from_numpy(out[0]), out[1]
        return torch.from_numpy(out)

    def greedy_ids(self, tokens: list[int]) -> list[int]:
        """forward_greedy over a list of ids -> the argmax id of every row, as ints. No torch
        call on the way: right after a llama_decode the caches are cold and each torch call
        costs tens of microseconds (docs/benchmarks.md §14)."""
        return self._run(tokens, False, greedy=True).tolist()

    def forward(self, ids: torch.Tensor, last_only: bool = False, features=None):
        """ids (T,) -> float32 logits (T, V), or (1, V) with last_only. `features` (target
        layer ids, or True for default_aux_layers) -> (logits, features (T, n*D) float32): the
        residual stream entering those layers at every row, as
        `specfast.model.model.Decoder` returns it, for an EAGLE head (see LayerInputs)."""
        check_id_tensor(ids, _CPU)
        return self._run(ids.tolist(), last_only, greedy=False, features=features)

    def _run(self, tokens: list[int], last_only: bool, greedy: bool, features=None):
        """Decodes tokens in n_batch chunks -> float32 logits (rows, V), or argmax ids (rows,)
        as numpy int64; with features, also their (T, n*D) layer inputs."""
        T, start, V = len(tokens), self._length, self.vocab_size
        check_fits(T, start, self.max_length)
        check_id_range(min(tokens), max(tokens), V)
        self._check_owner()
        layers = check_aux_layers(features, self.n_layers)
        inputs = self._layer_inputs(layers)
        rows = 1 if last_only else T
        out = np.empty(rows, dtype=np.int64) if greedy else torch.empty(rows, V)
        feats = None if inputs is None else torch.empty(T, len(inputs.layers) * inputs.dim)
        row = 0
        try:
            for lo in range(0, T, self._n_batch):  # llama_decode takes at most n_batch tokens
                chunk = tokens[lo : lo + self._n_batch]
                n_out = int(lo + len(chunk) == T) if last_only else len(chunk)
                self._decode(chunk, self._length, n_out)
                self._length += len(chunk)
                if n_out:
                    ptr = self._lib.llama_get_logits(self._ctx)
                    logits = np.ctypeslib.as_array(ptr, shape=(n_out, V))  # llama's own buffer
                    # Copied out (argmax or rows): the next decode reuses the buffer.
                    if greedy:
                        out[row : row + n_out] = logits.argmax(axis=1)
                    else:
                        out[row : row + n_out] = torch.from_numpy(logits)
                    row += n_out
                if inputs is not None and feats is not None:
                    inputs.read_into(feats[lo : lo + len(chunk)])
        except BaseException:
            # Leave the sequence as it was before this call, whatever part of it went in.
            self._lib.llama_memory_seq_rm(self._memory, 0, start, -1)
            self._length = start
            raise
        return out if feats is None else (out, feats)

    def _layer_inputs(self, layers: tuple[int, ...] | None) -> LayerInputs | None:
        """The reader of `layers`' inputs, made once per set; None (the empty set) also turns
        off a set an earlier call turned on, so plain passes run llama.cpp's plain graph."""
        wanted = layers or ()
        if self._inputs is None or self._inputs.layers != wanted:
            self._inputs = LayerInputs(self.llama, wanted)
        return self._inputs if wanted else None

    def _decode(self, chunk: list[int], pos: int, n_out: int) -> None:
        """One llama_decode of `chunk` at `pos`, with logits for its last n_out rows."""
        b = self._batch
        first_out = len(chunk) - n_out
        for i, t in enumerate(chunk):
            b.token[i] = t
            b.pos[i] = pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i >= first_out
        b.n_tokens = len(chunk)
        if self._restore_tiles is not None:
            self._restore_tiles(self._threads)
        rc = self._lib.llama_decode(self._ctx, b)
        if rc != 0:
            why = _DECODE_ERRORS.get(rc, "fatal error")
            raise RuntimeError(f"llama_decode returned {rc} ({why}) at position {pos}")

    def rollback(self, length: int) -> None:
        """Forget everything after the first `length` tokens: one llama_memory_seq_rm call."""
        check_rollback(length, self._length)
        if length < self._length:
            self._check_owner()
            if not self._lib.llama_memory_seq_rm(self._memory, 0, length, -1):
                raise RuntimeError(
                    f"llama.cpp could not remove positions {length}.. of the sequence "
                    "(a recurrent model cannot roll back part of its state)"
                )
        self._length = length

    def reset(self) -> None:
        self.rollback(0)

    def copy(self) -> LlamaDecoder:
        """Refused: one Llama holds one sequence, so a fork would need a second Llama."""
        raise TypeError("fork() cannot copy a llama.cpp cache: one Llama holds one sequence")
