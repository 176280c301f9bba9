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

import ctypes
import functools
import importlib.util
import platform
import re
import signal
import subprocess
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specfast import _core
from specfast.hardware import proc_cpu_flags
from specfast.kv_cache import check_rollback
from specfast.model import check_aux_layers, check_fits, check_id_range, check_id_tensor

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
    from specfast.loading import default_model_path

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
    exactly as `specfast.model.Decoder`; forward_greedy -> argmax ids. With `features`, both
    also return the inputs of those layers (LayerInputs). rollback(n) removes the cache entries
    past n.
    """

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
        llama._specfast_owner = weakref.ref(self)

    @property
    def device(self) -> torch.device:
        return _CPU

    @property
    def length(self) -> int:
        return self._length

    def _check_owner(self) -> None:
        owner = getattr(self.llama, "_specfast_owner", None)
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
        call on the way: right after a llama_decode the caches are cold and each costs 40-50
        us (the plain loop's time outside llama_decode went from 0.50 to 0.26 ms a token on
        SmolLM2 Q4_1; llama-cpp-python's own loop takes 0.22-0.25)."""
        return self._run(tokens, False, greedy=True).tolist()

    def forward(self, ids: torch.Tensor, last_only: bool = False, features=None):
        """ids (T,) -> float32 logits (T, V), or (1, V) with last_only. `features` (target
        layer ids, or True for default_aux_layers) -> (logits, features (T, n*D) float32): the
        residual stream entering those layers at every row, as `specfast.model.Decoder`
        returns it, for an EAGLE head (see LayerInputs)."""
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
        feats = None if inputs is None else torch.empty(T, len(layers) * inputs.dim)
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
                if inputs is not None:
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


# ----------------------------------------------------------------------------
# the target's features for an EAGLE head
#
# The llama.cpp vendored by llama-cpp-python 0.3.36 copies the residual stream entering chosen
# layers out of every llama_decode: llama_set_embeddings_layer_inp / llama_get_embeddings_layer_inp,
# in its staging header src/llama-ext.h, written for its own EAGLE-3 driver. libllama exports them
# only as C++ symbols and llama-cpp-python binds neither; their arguments are plain C types, so
# ctypes calls them by their Itanium-mangled names.

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
    import ctypes

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
        if layers:
            check_layer_inputs(llama)
        self.layers, self.ctx = layers, llama.ctx
        self.dim = int(_lib().llama_model_n_embd(llama.model))
        on = getattr(llama, "_specfast_layer_inputs", ())
        if tuple(on) != layers:
            set_, _ = _layer_input_calls()
            for i in set(on) - set(layers):
                set_(llama.ctx, i, False)
            for i in layers:
                set_(llama.ctx, i, True)
            llama._specfast_layer_inputs = layers
        self._get = _layer_input_calls()[1] if layers else None

    def read_into(self, out: torch.Tensor) -> None:
        """out (rows, n*D) <- the last decode's first `rows` tokens' inputs, one block per
        layer."""
        rows, D = out.shape[0], self.dim
        for j, i in enumerate(self.layers):
            got = np.ctypeslib.as_array(self._get(self.ctx, i), shape=(rows, D))
            out[:, j * D : (j + 1) * D] = torch.from_numpy(got)  # a copy: the buffer is reused


def llama_embedding(llama, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Llama's token embedding (V, D) dequantized from its GGUF file, in `dtype`: what an
    EAGLE head without its own embed_tokens embeds its tokens with. Cached on the Llama per
    dtype for its lifetime (SmolLM2's: 113 MB in float32); dequantizing takes a float32 copy
    of the whole matrix, a few GB for a 150k-token vocabulary at 4096 wide."""
    cache = llama.__dict__.setdefault("_specfast_embedding", {})
    if dtype not in cache:
        from specfast.loading import gguf_tensor

        cache[dtype] = gguf_tensor(llama.model_path, "token_embd.weight").to(dtype)
    return cache[dtype]


# ----------------------------------------------------------------------------
# tokenizer and EOS: what generate() reads of a model


class LlamaTokenizer:
    """A Llama's own tokenizer with the two methods generate() uses, plus get_vocab()."""

    def __init__(self, llama):
        self.llama = llama

    def encode(self, text: str) -> list[int]:
        # add_bos: llama.cpp adds BOS only where the GGUF says the model wants one; special:
        # chat-template markers such as <|im_start|> become their control tokens, as in HF.
        return list(self.llama.tokenize(text.encode("utf-8"), add_bos=True, special=True))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = self.llama.detokenize([int(t) for t in ids], special=not skip_special_tokens)
        return data.decode("utf-8", errors="replace")

    def get_vocab(self) -> dict[str, int]:
        """token text -> id, as the GGUF spells the tokens (cached on the Llama)."""
        cached = getattr(self.llama, "_specfast_vocab", None)
        if cached is None:
            lib = _lib()
            vocab = lib.llama_model_get_vocab(self.llama.model)
            cached = {
                lib.llama_vocab_get_text(vocab, i).decode("utf-8", errors="replace"): i
                for i in range(self.llama.n_vocab())
            }
            self.llama._specfast_vocab = cached
        return cached


def llama_eos_ids(llama) -> list[int]:
    """Every end-of-generation id of the vocabulary (EOS, EOT, <|im_end|>, ...), cached."""
    cached = getattr(llama, "_specfast_eos", None)
    if cached is None:
        lib = _lib()
        vocab = lib.llama_model_get_vocab(llama.model)
        cached = [i for i in range(llama.n_vocab()) if lib.llama_vocab_is_eog(vocab, i)]
        llama._specfast_eos = cached
    return list(cached)


def _lib():
    import llama_cpp

    return llama_cpp


# ----------------------------------------------------------------------------
# is this llama.cpp build for this CPU?
#
# pip caches the llama-cpp-python wheel it compiled (-march=native) by sdist, not by CPU. Reused
# on a CPU without the build's instruction sets it imports fine and then dies with SIGILL, a
# crash that no `except` catches, at the first matrix product. These helpers turn that into a
# RuntimeError that says what is missing and how to fix it.

LLAMA_PIN = "llama-cpp-python==0.3.36"
_FIX = (
    "reinstall llama-cpp-python for this CPU: `bash scripts/install.sh` in a specfast checkout, "
    f"or `pip install --no-cache-dir --force-reinstall {LLAMA_PIN}`"
)
# llama.cpp's names for the x86 instruction sets compiled in (ggml_backend_cpu_get_features) ->
# the /proc/cpuinfo flags each needs. The kernel spells SSE3 "pni" and AVX512_VBMI "avx512vbmi".
BUILD_FLAGS = {
    "SSE3": ("pni",),
    "SSSE3": ("ssse3",),
    "AVX": ("avx",),
    "AVX2": ("avx2",),
    "AVX_VNNI": ("avx_vnni",),
    "F16C": ("f16c",),
    "FMA": ("fma",),
    "BMI2": ("bmi2",),
    "AVX512": ("avx512f",),
    "AVX512_VBMI": ("avx512vbmi",),
    "AVX512_VNNI": ("avx512_vnni",),
    "AVX512_BF16": ("avx512_bf16",),
    "AMX_INT8": ("amx_tile", "amx_int8"),
}
# The child that reads the build report. Not this process: the report is compile-time macros,
# but reading it registers ggml's CPU backend, and ggml_cpu_init runs the build's own code. In
# the -march=native AVX-512 build of 2026-11-30, llama_print_system_info() executed 32 zmm loads
# and stores inside ggml_cpu_init (benches/llama_isa_trace.py, under gdb), so on an AVX2-only CPU
# the report itself dies with SIGILL. `import llama_cpp` alone executed none.
#
# An AMX build can report the right instruction sets and still die: GCC 12 drops the stores that
# fill llama.cpp's AMX tile configuration unless built with -fno-dse (scripts/install.sh adds it),
# and its first batched pass (tile instructions; one-token passes use AVX512-VNNI) is SIGILL. So
# when the report names AMX_INT8, the child also runs one 40-token pass over the GGUF given as its
# argument (the default SmolLM2, about 0.3 s), when there is one.
_PROBE = """import sys, llama_cpp
info = llama_cpp.llama_print_system_info().decode()
sys.stdout.write(info)
sys.stdout.flush()
if "AMX_INT8 = 1" in info and len(sys.argv) > 1:
    llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False).eval(list(range(100, 140)))
"""
_AMX_FIX = (
    "reinstall llama-cpp-python: `bash scripts/install.sh` in a specfast checkout, or "
    '`CMAKE_ARGS="-DCMAKE_C_FLAGS=-fno-dse -DCMAKE_CXX_FLAGS=-fno-dse" '
    f"pip install --no-cache-dir --force-reinstall {LLAMA_PIN}`"
)


def read_cpu_flags() -> frozenset[str] | None:
    """The flags of /proc/cpuinfo on Linux x86-64; None elsewhere (nothing to check)."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return proc_cpu_flags()


def build_instructions(system_info: str) -> list[str]:
    """The x86 instruction sets a llama_print_system_info() string reports as compiled in."""
    return [n for n in re.findall(r"(\w+) = 1\b", system_info) if n in BUILD_FLAGS]


def llama_system_info() -> str | None:
    """llama_print_system_info() of the installed llama_cpp, read in a child process.

    For a build with AMX the child also runs one batched pass (see _PROBE). None when llama_cpp
    is not installed or the child failed without crashing (with a warning).
    Raises RuntimeError when the child was killed by a signal: the build crashed on this CPU.
    """
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    # The child imports the very package this process would, wherever it came from.
    where = str(Path(spec.origin).parent.parent)
    code = f"import sys; sys.path.insert(0, {where!r}); {_PROBE}"
    from specfast.loading import default_model_path

    try:
        gguf = [str(default_model_path())]
    except FileNotFoundError:
        gguf = []
    try:
        run = subprocess.run(
            [sys.executable, "-c", code, *gguf], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(
            f"could not check the llama.cpp build for this CPU: {e}", RuntimeWarning, stacklevel=2
        )
        return None
    if run.returncode < 0:
        try:
            name = signal.Signals(-run.returncode).name
        except ValueError:
            name = f"signal {-run.returncode}"
        if "AMX_INT8 = 1" in run.stdout:  # the report was read: the AMX pass crashed
            raise RuntimeError(
                f"llama-cpp-python at {Path(spec.origin).parent}: its AMX kernels killed a child "
                f"process with {name} on a 40-token pass over {gguf[0]}, and a batched pass "
                "would crash this process the same way (GCC 12 drops their tile configuration "
                f"unless llama.cpp is built with -fno-dse); {_AMX_FIX}"
            )
        raise RuntimeError(
            f"llama-cpp-python at {Path(spec.origin).parent} was built for another CPU: "
            f"reading its build report killed a child process with {name} (an instruction this "
            f"CPU lacks), and a model would crash this process the same way; {_FIX}"
        )
    if run.returncode != 0:
        tail = run.stderr.strip().splitlines()[-1:] or ["no output"]
        warnings.warn(
            f"could not check the llama.cpp build for this CPU: {tail[0]}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return run.stdout


def check_llama_build(
    system_info: str | None = None, cpu_flags: set[str] | frozenset[str] | None = None
) -> None:
    """Raises RuntimeError when llama.cpp was compiled for instructions this CPU lacks.

    With no arguments: the installed llama_cpp's build report against /proc/cpuinfo, checked
    once per process; a no-op off Linux x86-64. The report names only the instruction sets ggml
    asks about, so a build that uses others (-march=native may emit AVX512-FP16, say) can still
    pass here; installs through scripts/install.sh, whose wheel cache is keyed by the CPU's
    flags, are covered for those too.
    """
    if isinstance(cpu_flags, str) or isinstance(system_info, bytes):
        raise TypeError(
            "check_llama_build takes system_info as str (llama_print_system_info().decode()) "
            "and cpu_flags as a set of /proc/cpuinfo flag names"
        )
    if system_info is None and cpu_flags is None:
        problem = _this_build_problem()
    else:
        flags = read_cpu_flags() if cpu_flags is None else cpu_flags
        info = llama_system_info() if system_info is None else system_info
        problem = None if flags is None or info is None else _build_problem(info, flags)
    if problem is not None:
        raise RuntimeError(problem)


def _this_build_problem() -> str | None:
    return _this_build()[1]


@functools.cache
def _this_build() -> tuple[str | None, str | None]:
    """(the installed llama_cpp's build report, the problem with it on this CPU), read once."""
    flags = read_cpu_flags()
    if flags is None:
        return None, None
    try:
        info = llama_system_info()
    except RuntimeError as e:
        return None, str(e)
    return info, None if info is None else _build_problem(info, flags)


@functools.cache
def tile_restorer() -> Callable[[int], None] | None:
    """restore(n_threads), which reloads ggml's AMX tile configuration on this thread and on the
    OpenMP threads of a team of n_threads; None for a llama.cpp built without AMX kernels.

    ggml loads the configuration once per thread; torch's oneDNN releases the tiles after each
    bf16 matrix product, on the same OpenMP threads (rust/tiles.rs). Without this, a llama_decode
    after a torch bf16 matmul in the same process dies with SIGILL. Costs microseconds a call.
    """
    info = _this_build()[0]
    if info is None or "AMX_INT8 = 1" not in info or not _core.amx_usable():
        return None
    restore = ctypes.c_void_p(_core.ggml_tile_restorer())
    if "OPENMP = 1" not in info:  # ggml's own thread pool: only the calling thread is shared
        on_this_thread = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(restore.value)
        return lambda n_threads: on_this_thread(None)
    # The libgomp that libggml-cpu and torch share: the first libgomp.so.1 loaded.
    gomp_parallel = ctypes.CDLL("libgomp.so.1").GOMP_parallel
    gomp_parallel.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
    gomp_parallel.restype = None
    return lambda n_threads: gomp_parallel(restore, None, max(1, n_threads), 0)


def llama_threads(llama) -> int:
    """The most threads a llama_decode of this Llama runs on."""
    return max(int(llama.n_threads), int(llama.n_threads_batch))


def _build_problem(system_info: str, flags: set[str] | frozenset[str]) -> str | None:
    """The error message for a build that needs flags missing from `flags`, else None."""
    missing = {}
    for name in build_instructions(system_info):
        lacks = [f for f in BUILD_FLAGS[name] if f not in flags]
        if lacks:
            missing[name] = lacks
    if not missing:
        return None
    needs = ", ".join(f"{n} ({' '.join(f)})" for n, f in missing.items())
    return (
        f"llama-cpp-python was compiled for instruction sets this CPU lacks: {needs}. "
        "Using it would crash the process (SIGILL) at the first matrix product; " + _FIX
    )
