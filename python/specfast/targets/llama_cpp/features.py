"""The target's features for an EAGLE head, out of llama.cpp.

The llama.cpp vendored by llama-cpp-python 0.3.36 copies the residual stream entering chosen
layers out of every llama_decode: llama_set_embeddings_layer_inp / llama_get_embeddings_layer_inp,
in its staging header src/llama-ext.h, written for its own EAGLE-3 driver. libllama exports them
only as C++ symbols and llama-cpp-python binds neither; their arguments are plain C types, so
ctypes calls them by their Itanium-mangled names.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from specfast.targets.llama_cpp.build import LLAMA_PIN
from specfast.targets.llama_cpp.state import llama_state

_SET_LAYER_INPUT = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
_GET_LAYER_INPUT = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"
# The architectures specfast lets llama.cpp return layer inputs for: those whose graph it has
# checked records every layer's input in that llama.cpp (src/models/llama.cpp, qwen3.cpp and
# qwen3moe.cpp set res->t_layer_inp in their layer loop; several others do too, unchecked). For
# a graph that records none (qwen2's, say), llama.cpp aborts the process (GGML_ABORT) when
# asked, so specfast refuses first.
LAYER_INPUT_ARCHS = ("llama", "qwen3", "qwen3moe")


@functools.cache
def _layer_input_calls():
    """(set, get): the two C++ functions, typed; RuntimeError if this libllama lacks them."""
    from llama_cpp import llama_cpp as low

    try:
        set_, get = getattr(low._lib, _SET_LAYER_INPUT), getattr(low._lib, _GET_LAYER_INPUT)
    except AttributeError:
        raise RuntimeError(
            "this llama-cpp-python's libllama has no llama_get_embeddings_layer_inp (by its "
            "Itanium C++ name, so a Linux or macOS build), which an EAGLE head over llama.cpp "
            f"needs; install {LLAMA_PIN}"
        ) from None
    set_.argtypes, set_.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
    get.argtypes, get.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
    return set_, get


def check_layer_inputs(llama) -> None:
    """ValueError unless llama.cpp can return this Llama's per-layer inputs (its architecture)."""
    arch = llama.metadata.get("general.architecture")
    if arch not in LAYER_INPUT_ARCHS:
        raise ValueError(
            f"specfast reads the per-layer inputs an EAGLE head needs from llama.cpp only for the "
            f"architectures {', '.join(LAYER_INPUT_ARCHS)} (llama.cpp aborts the process for a "
            f"graph that does not record them); this GGUF is {arch!r}. Load it with "
            "specfast.load_model(path) to draft with EAGLE on specfast's runtime"
        )
    _layer_input_calls()


class LayerInputs:
    """The inputs of `layers` that each llama_decode of `llama` copies out; an empty `layers`
    turns every layer off again.

    Turning a layer on or off makes llama.cpp re-plan its graph, so the set in force is kept on
    the Llama and changed only when another set is asked for. The Llama's own loop
    (Llama.generate) runs with whatever set specfast's last call left on."""

    def __init__(self, llama, layers: tuple[int, ...]):
        import llama_cpp

        if layers:
            check_layer_inputs(llama)
        self.layers, self.ctx = layers, llama.ctx
        self.dim = int(llama_cpp.llama_model_n_embd(llama.model))
        on = llama_state(llama).get("layer_inputs", ())
        if tuple(on) != layers:
            set_, _ = _layer_input_calls()
            for i in set(on) - set(layers):
                set_(llama.ctx, i, False)
            for i in layers:
                set_(llama.ctx, i, True)
            llama_state(llama)["layer_inputs"] = layers
        self._get = _layer_input_calls()[1] if layers else None

    def read_into(self, out: torch.Tensor) -> None:
        """out (rows, n*D) <- the last decode's first `rows` tokens' inputs, one block per
        layer."""
        rows, D = out.shape[0], self.dim
        assert self._get is not None  # made with layers: read_into is called only then
        for j, i in enumerate(self.layers):
            got = np.ctypeslib.as_array(self._get(self.ctx, i), shape=(rows, D))
            out[:, j * D : (j + 1) * D] = torch.from_numpy(got)  # a copy: the buffer is reused
