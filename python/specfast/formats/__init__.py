"""load_model(): a GGUF file or a Hugging Face checkpoint folder -> Model (+ tokenizer).

Files are untrusted: weights come only from safetensors or GGUF (never pickle), no code from the
checkpoint folder runs, and a malformed file raises ValueError naming it. transformers is never
imported here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specfast.formats.gguf import auto_candidates, gguf_summary, load_gguf
from specfast.formats.hf_folder import load_hf_folder
from specfast.model import Model
from specfast.model.config import resolve_device, resolve_dtype
from specfast.model.packing import trim_heap
from specfast.model.quantize import (
    QUANTIZED,
    auto_float_dtype,
    auto_weights,
    cached_weights,
    check_weights,
)
from specfast.model.static import resolve_compile, warmup
from specfast.targets import load_llama
from specfast.targets.base import default_model_path


def load_model(
    path=None,
    device=None,
    dtype="auto",
    compile="auto",
    backend="specfast",
    weights="auto",
    max_length=None,
    **llama_kwargs,
):
    """A GGUF file or a HF checkpoint folder (config.json + *.safetensors) -> Model.

    path=None loads the default model (SmolLM2-135M-Instruct). dtype "auto" picks by hardware:
    bf16 on CUDA (fp16 without bf16); on CPU float32, or with AMX-BF16 whichever of bf16 and
    float32 steps faster for this model (timed once per CPU and file); "float32" |
    "bfloat16" | "float16" are honoured as given. `model.dtype` is the dtype chosen. compile
    "auto" | "on" | "off": "auto" compiles the decode and verify steps on CUDA (static shapes,
    CUDA graphs) and runs eager on CPU, where it measured faster.
    A compiled model is warmed up here, every step compiled (a progress line per step on
    stderr), for one KV capacity: `max_length` tokens (prompt and new tokens; None: the
    context, up to 4095), so no generate() that fits compiles inside its clock.
    weights (CPU, float32 activations): "int8" or "q4" quantize the layers' matrices as they
    load (a GGUF's Q4_0, Q4_1 and Q4_K tensors keep their own values and scales, and a
    quantized embedding stays in the file's blocks); "file" (a GGUF only) keeps each tensor in
    the file's own blocks (the types of gguf_block_types(): Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K, Q8_0; other types, 16- and 32-bit floats too, as Q8_0), the output matrix too where
    the core holds its type (else int8); "auto" times float and quantized steps once per CPU
    and file and keeps the fastest: int8 for a checkpoint folder or a float GGUF, "file" for a
    quantized GGUF, and int8 beside it only where every layer tensor has under 8 bits a
    weight; "float" keeps the dtype.

    backend="llama.cpp" returns a llama_cpp.Llama over the GGUF file instead (its own quantized
    weights; dtype and compile are not used); extra keyword arguments (n_ctx, n_threads, ...)
    go to Llama.
    """
    if backend == "llama.cpp":
        return load_llama(path, device=device, **llama_kwargs)
    if backend != "specfast":
        raise ValueError(f'backend must be "specfast" or "llama.cpp", got {backend!r}')
    if llama_kwargs:
        raise TypeError(
            f"load_model got unexpected arguments {sorted(llama_kwargs)}; extra keyword "
            'arguments are for backend="llama.cpp"'
        )
    weights = check_weights(weights)
    device = resolve_device(device)
    quantized = weights in QUANTIZED
    if quantized and device.type != "cpu":
        raise ValueError(f"weights={weights!r} runs on CPU only; the device is {device}")
    compiled = resolve_compile(compile, device)
    try_int8 = weights == "auto" and dtype == "auto" and device.type == "cpu" and not compiled
    if quantized and compiled:
        raise ValueError(f'weights={weights!r} runs eagerly on CPU; pass compile="off" or "auto"')
    path = default_model_path() if path is None else Path(path)
    if quantized:
        dtype = resolve_dtype(dtype, device) if dtype != "auto" else None
        return _load(path, device, dtype, weights)
    float_dtype = resolve_dtype(dtype, device)
    if try_int8 and path.is_file() and float_dtype != torch.bfloat16:
        # auto's choice, timed before on this CPU: that kind alone, without the float model
        config, types, reader = gguf_summary(path)
        choice = cached_weights(float_dtype, config, auto_candidates(types))
        if choice in QUANTIZED:
            return _load(path, device, None, choice, reader)
    if dtype == "auto" and float_dtype == torch.bfloat16 and device.type == "cpu" and not compiled:
        model, _ = auto_float_dtype(path, lambda dtype: _load(path, device, dtype, "float"))
    else:
        model = _load(path, device, float_dtype, "float")
    if try_int8:
        kinds = auto_candidates(model.file_types)
        model, _ = auto_weights(model, lambda kind: _load(path, device, None, kind), kinds)
        if model.quantized:
            return model
    if compiled:
        model.compile_steps(max_length=max_length)
        warmup(model)
    return model


def _load(path: Path, device, dtype, weights: str, reader=None) -> Model:
    """The model at `path` in `dtype` (None: float32), with quantized weights if asked
    (`reader`: a GGUF file's reader, already open)."""
    dtype = torch.float32 if dtype is None else dtype
    # Quantized as read, where the model stays on the CPU in float32 (the core's activations):
    # a float copy of the whole model never exists. A file's own blocks can only be read.
    as_read = weights if weights in QUANTIZED and dtype == torch.float32 else "float"
    if weights == "file":
        as_read = weights
    if path.is_dir():
        model = load_hf_folder(path, dtype, as_read)
    elif path.is_file():
        model = load_gguf(path, dtype, as_read, reader)
    else:
        raise FileNotFoundError(f"no model at {path}: expected a GGUF file or a checkpoint folder")
    if model.device != torch.device(device) or model.dtype != dtype:
        model = model.to(device=device, dtype=dtype)
    if weights in QUANTIZED and as_read == "float":
        model.quantize_int8(weights).packed_weights()  # quantized now: the float copies go now
    trim_heap()  # the loader's temporaries
    return model
