"""Hostile model files for the loader fuzz tests and benches/fuzz_loaders.py: tiny valid files of
each kind, the mutations applied to them, and the one allowed outcome of loading (a model, or a
ValueError / TypeError / FileNotFoundError with a message).
"""

from __future__ import annotations

import json
import shutil
import signal
import struct
from collections.abc import Callable
from pathlib import Path

from hypothesis import strategies as st

from specfast import load_model

ALLOWED = (ValueError, TypeError, FileNotFoundError)
# Integers that lengths, counts and shapes are made to claim: zero, off-by-one, sign-bit, 2**40
# elements and the largest values of each width.
HOSTILE_INTS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1]


# ----------------------------------------------------------------------------
# valid seeds


def write_seeds(folder: Path) -> dict[str, Path]:
    """A tiny GGUF file and a tiny checkpoint folder (config.json, model.safetensors,
    tokenizer.json) under `folder`."""
    from conftest import make_hf_model, write_tiny_gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf = make_hf_model("llama-tied-gqa")
    gguf_path = write_tiny_gguf(hf, folder / "tiny.gguf")
    ckpt = folder / "ckpt"
    hf.save_pretrained(ckpt, safe_serialization=True)
    vocab = {chr(33 + i): i for i in range(90)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(ckpt / "tokenizer.json"))
    return {"gguf": gguf_path, "ckpt": ckpt}


def gguf_header_length(path: Path) -> int:
    """Bytes before the first tensor's data: where the metadata and tensor infos live."""
    from gguf import GGUFReader

    return min(t.data_offset for t in GGUFReader(path).tensors)


def safetensors_header_length(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


# ----------------------------------------------------------------------------
# mutations


@st.composite
def byte_mutations(draw, size: int, hot: int) -> list[tuple]:
    """1-4 edits of a file of `size` bytes, mostly inside its first `hot` bytes (the header):
    truncation, random bytes, or a 4- or 8-byte little-endian hostile integer."""
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        limit = hot if draw(st.integers(0, 9)) < 8 else size
        pos = draw(st.integers(0, max(limit - 1, 0)))
        kind = draw(st.sampled_from(["truncate", "bytes", "int4", "int8"]))
        if kind == "truncate":
            edits.append(("truncate", pos))
        elif kind == "bytes":
            edits.append(("bytes", pos, draw(st.binary(min_size=1, max_size=8))))
        else:
            width = 4 if kind == "int4" else 8
            value = draw(st.sampled_from(HOSTILE_INTS)) % 2 ** (8 * width)
            edits.append(("bytes", pos, value.to_bytes(width, "little")))
    return edits


def apply(data: bytes, edits: list[tuple]) -> bytes:
    out = bytearray(data)
    for edit in edits:
        if edit[0] == "truncate":
            del out[edit[1] :]
        else:
            _, pos, chunk = edit
            if pos < len(out):
                out[pos : pos + len(chunk)] = chunk
    return bytes(out)


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([*HOSTILE_INTS, -1, -(2**63)]),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(0, 3), max_size=2),
)


@st.composite
def json_mutations(draw, obj: dict) -> dict:
    """`obj` with 1-4 keys set to hostile values, deleted, or added (top level only)."""
    out = dict(obj)
    keys = sorted(out)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["set", "set", "delete", "add"]))
        if action == "add" or not keys:
            out[draw(st.text(max_size=12))] = draw(JSON_VALUES)
        elif action == "delete":
            out.pop(draw(st.sampled_from(keys)), None)
        else:
            out[draw(st.sampled_from(keys))] = draw(JSON_VALUES)
    return out


# ----------------------------------------------------------------------------
# the outcome


class Hang(Exception):
    pass


def load_outcome(path: Path, timeout_s: int = 60) -> str:
    """Loads `path`: "ok", or the name of an allowed exception. Anything else (a panic, a
    KeyError, a MemoryError, a hang past `timeout_s`) propagates and fails the caller."""

    def on_alarm(signum, frame):
        raise Hang(f"loading {path} took over {timeout_s} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout_s)
    try:
        load_model(path)
        return "ok"
    except ALLOWED as e:
        if not str(e).strip():
            raise AssertionError(f"{type(e).__name__} without a message") from e
        return type(e).__name__
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def mutated_folder(seed: Path, dest: Path, name: str, transform: Callable[[bytes], bytes]) -> Path:
    """A copy of checkpoint folder `seed` in `dest` with file `name` transformed."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(seed, dest)
    (dest / name).write_bytes(transform((seed / name).read_bytes()))
    return dest


def dump_json(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()
