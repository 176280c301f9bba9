"""A persistent n-gram corpus: NgramDrafter.save / NgramDrafter.load, and damaged files."""

from __future__ import annotations

import inspect
import os
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specfast
from specfast import NgramDrafter
from specfast.corpus import tokenizer_fingerprint

POLICIES = ["earliest", "recent", "frequent"]
VERSION_AT = slice(8, 12)  # the format version's bytes (after the 8 magic bytes)


# ---- real text: CPython stdlib source, as whitespace-separated words mapped to ids


def stdlib_words(*modules: str) -> list[list[str]]:
    import importlib

    return [inspect.getsource(importlib.import_module(m)).split() for m in modules]


def to_ids(docs: list[list[str]], vocab: dict[str, int]) -> list[list[int]]:
    return [[vocab.setdefault(w, len(vocab)) for w in doc] for doc in docs]


@pytest.fixture(scope="module")
def text() -> tuple[list[list[int]], list[int]]:
    """Corpus documents (stdlib modules) and a live sequence (another one) sharing a vocabulary."""
    vocab: dict[str, int] = {}
    docs = to_ids(stdlib_words("textwrap", "json.decoder", "json.encoder", "shlex"), vocab)
    live = to_ids(stdlib_words("json.scanner", "glob"), vocab)
    return docs, live[0] + live[1]


def build(docs: list[list[int]], **options: object) -> NgramDrafter:
    d = NgramDrafter(**options)  # type: ignore[arg-type]
    for doc in docs:
        d.add_document(doc)
    return d


def proposals(d: NgramDrafter, live: list[int], k: int = 8) -> list[list[int]]:
    """What d proposes after each chunk of `live` (chunks of 1 to 5 tokens, as rounds would)."""
    out = []
    i = 0
    while i < len(live):
        step = 1 + live[i] % 5
        d.extend(live[i : i + step])
        i += step
        out.append(d.propose(k))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_round_trip_on_real_text(tmp_path: Path, text, policy: str) -> None:
    docs, live = text
    options = {"policy": policy, "min_match": 2, "k_factor": 2.0, "k_offset": 1.0}
    d = build(docs, **options)
    path = tmp_path / "stdlib.sfc"
    d.save(path, fingerprint="words")
    e = NgramDrafter.load(path, fingerprint="words")
    assert (e.policy, e.min_match, e.k_factor, e.k_offset) == (policy, 2, 2.0, 1.0)
    assert e.max_corpus_tokens == d.max_corpus_tokens
    assert e.corpus_tokens == d.corpus_tokens == sum(map(len, docs))
    assert len(e) == 0
    before = proposals(d, live)
    after = proposals(e, live)
    assert after == before
    # The comparison has power: the corpus drafts often here, and a corpus missing one document
    # (a loader that dropped it) proposes differently.
    assert sum(map(bool, before)) > len(before) // 4
    assert proposals(build(docs[:-1], **options), live) != before


def test_live_sequence_is_not_saved(tmp_path: Path) -> None:
    d = build([[1, 2, 3, 4]])
    d.extend([9, 8, 9, 8])
    d.save(tmp_path / "c")
    e = NgramDrafter.load(tmp_path / "c")
    assert len(e) == 0
    assert e.propose(4) == []
    e.extend([2])
    assert e.propose(4) == [3, 4]


def test_memory_bound_is_kept(tmp_path: Path) -> None:
    d = NgramDrafter(max_corpus_tokens=100)
    for i in range(30):
        d.add_document(list(range(i * 10, i * 10 + 10)))
    assert d.corpus_tokens <= 100
    d.save(tmp_path / "c")
    e = NgramDrafter.load(tmp_path / "c")
    assert e.max_corpus_tokens == 100
    assert e.corpus_tokens == d.corpus_tokens
    e.add_document(list(range(1000, 1080)))
    assert e.corpus_tokens <= 100


def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "c.sfc"
    build([[1, 2, 3]]).save(path)
    os.chmod(path, 0o600)
    build([[4, 5, 6, 7]]).save(str(path))
    assert os.listdir(tmp_path) == ["c.sfc"]
    assert NgramDrafter.load(path).corpus_tokens == 4
    assert (path.stat().st_mode & 0o777) == 0o600  # the replaced file's permissions are kept
    # A save that fails leaves the previous file whole, and nothing else.
    with pytest.raises(ValueError, match="fingerprint"):
        build([[8, 9]]).save(path, fingerprint="x" * 70_000)
    assert os.listdir(tmp_path) == ["c.sfc"]
    assert NgramDrafter.load(path).corpus_tokens == 4


# ---- refusals


def test_fingerprint_mismatch_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.sfc"
    build([[1, 2, 3]]).save(path, fingerprint="vocab=49152;sha256=aaaa")
    with pytest.raises(ValueError) as e:
        NgramDrafter.load(path, fingerprint="vocab=151936;sha256=bbbb")
    message = str(e.value)
    assert "vocab=49152;sha256=aaaa" in message
    assert "vocab=151936;sha256=bbbb" in message
    assert str(path) in message
    assert NgramDrafter.load(path, fingerprint="vocab=49152;sha256=aaaa").corpus_tokens == 3
    assert NgramDrafter.load(path).corpus_tokens == 3  # None: not checked


def resum(data: bytearray) -> bytearray:
    """Rewrites the trailing CRC-32 (zlib's is the same IEEE CRC), to get past the checksum."""
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    return data


def test_newer_version_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.sfc"
    build([[1, 2, 3]]).save(path)
    data = bytearray(path.read_bytes())
    assert struct.unpack("<I", data[VERSION_AT]) == (1,)
    data[VERSION_AT] = struct.pack("<I", 2)
    path.write_bytes(resum(data))
    with pytest.raises(ValueError, match=r"version 2 was written by a newer specfast"):
        NgramDrafter.load(path)


def test_foreign_files_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b'{"__metadata__": {}}' + bytes(100))
    with pytest.raises(ValueError, match="not a specfast corpus"):
        NgramDrafter.load(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="truncated"):
        NgramDrafter.load(path)


def test_io_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.sfc"
    with pytest.raises(FileNotFoundError) as e:
        NgramDrafter.load(missing)
    assert e.value.filename == str(missing)
    with pytest.raises(IsADirectoryError):
        NgramDrafter.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        build([[1]]).save(tmp_path / "no" / "dir" / "c.sfc")
    with pytest.raises(OSError):
        build([[1]]).save(tmp_path)  # a directory is in the way
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError):
        NgramDrafter.load(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        NgramDrafter.load(tmp_path / "c", fingerprint=3)  # type: ignore[arg-type]


# ---- fuzzing: damaged files give ValueError, and only ValueError


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("corpus") / "small.sfc"
    d = build([[1, 2, 3, 4, 5], [2**32 - 1, 0, 7], [6]], policy="recent", min_match=2)
    d.save(path, fingerprint="vocab=8;sha256=0123")
    return path.read_bytes()


def mutations() -> st.SearchStrategy:
    index = st.integers(min_value=0, max_value=10_000)
    return st.lists(
        st.one_of(
            st.tuples(st.just("flip"), index, st.integers(1, 255)),
            st.tuples(st.just("set"), index, st.integers(0, 255)),
            st.tuples(st.just("truncate"), index, st.just(0)),
            st.tuples(st.just("insert"), index, st.integers(0, 255)),
            st.tuples(st.just("delete"), index, st.just(0)),
            st.tuples(st.just("u32"), index, st.sampled_from([0, 1, 2**31, 2**32 - 1])),
        ),
        min_size=1,
        max_size=4,
    )


def mutate(data: bytes, edits: list[tuple[str, int, int]]) -> bytearray:
    out = bytearray(data)
    for kind, at, value in edits:
        i = at % (len(out) + 1)
        if kind == "flip" and i < len(out):
            out[i] ^= value
        elif kind == "set" and i < len(out):
            out[i] = value
        elif kind == "truncate":
            del out[i:]
        elif kind == "insert":
            out.insert(i, value)
        elif kind == "delete" and i < len(out):
            del out[i]
        elif kind == "u32" and i + 4 <= len(out):
            out[i : i + 4] = struct.pack("<I", value)
    return out


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edits=mutations(), fix_checksum=st.booleans())
def test_fuzzed_files_give_only_value_error(
    tmp_path: Path, small_file: bytes, edits, fix_checksum: bool
) -> None:
    data = mutate(small_file, edits)
    if fix_checksum and len(data) >= 16:
        resum(data)  # lets the damage reach the field checks behind the checksum
    path = tmp_path / "fuzzed.sfc"
    path.write_bytes(bytes(data))
    try:
        d = NgramDrafter.load(path)
    except ValueError as e:
        assert str(path) in str(e)
        return
    # Only a file whose checksum matches can load, and then it is a working drafter.
    assert bytes(data) == small_file or fix_checksum
    assert d.corpus_tokens <= d.max_corpus_tokens
    d.extend([1, 2])
    d.propose(4)


def test_every_byte_flip_and_truncation_refused(tmp_path: Path, small_file: bytes) -> None:
    path = tmp_path / "c.sfc"
    for i in range(len(small_file)):
        for data in (
            small_file[:i],
            small_file[:i] + bytes([small_file[i] ^ 0x01]) + small_file[i + 1 :],
        ):
            path.write_bytes(data)
            with pytest.raises(ValueError):
                NgramDrafter.load(path)


# ---- the tokenizer fingerprint


class Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_tokenizer_fingerprint() -> None:
    a = tokenizer_fingerprint(Vocab({"a": 0, "b": 1, "ab": 2}))
    assert a.startswith("vocab=3;sha256=")
    assert tokenizer_fingerprint(Vocab({"ab": 2, "a": 0, "b": 1})) == a  # order does not matter
    assert tokenizer_fingerprint(Vocab({"a": 0, "b": 2, "ab": 1})) != a  # ids do
    assert tokenizer_fingerprint(Vocab({"a": 0, "b": 1, "ac": 2})) != a  # strings do
    with pytest.raises(TypeError, match="get_vocab"):
        tokenizer_fingerprint("gpt2")


def test_tokenizer_fingerprint_of_a_real_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, "[UNK]"))
    fp = tokenizer_fingerprint(tok)
    assert fp.startswith("vocab=3;")
    d = build([[0, 1, 0]])
    d.save(tmp_path / "c", fingerprint=fp)
    assert NgramDrafter.load(tmp_path / "c", fingerprint=fp).corpus_tokens == 3
    other = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "c": 1, "[UNK]": 2}, "[UNK]"))
    with pytest.raises(ValueError, match="another tokenizer"):
        NgramDrafter.load(tmp_path / "c", fingerprint=tokenizer_fingerprint(other))


def test_exported() -> None:
    assert specfast.NgramDrafter.load is NgramDrafter.load
