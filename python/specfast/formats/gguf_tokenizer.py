"""A GGUF file's tokenizer from its metadata: byte-level BPE (llama.cpp's "gpt2" tokenizer
model, with the pre-split of `tokenizer.ggml.pre`), or SentencePiece (spm.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

from specfast.formats.spm import spm_tokenizer


def gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception as e:
        raise ValueError(f"bad GGUF metadata field {key}: {e}") from None


# How each `tokenizer.ggml.pre` splits text before BPE (llama.cpp llama-vocab.cpp). Missing: the
# GPT-2 split that ByteLevel applies itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def tokenizer_from_gguf(reader, path: Path):
    """A `tokenizers.Tokenizer` built from a GGUF's metadata, or None (with a warning) when the
    file's tokenizer model is neither byte-level BPE nor SentencePiece (formats/spm.py)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece (Gemma, Llama 2)
        return spm_tokenizer(
            list(gguf_field(reader, "tokenizer.ggml.tokens")),
            [float(s) for s in gguf_field(reader, "tokenizer.ggml.scores") or []],
            [int(t) for t in gguf_field(reader, "tokenizer.ggml.token_type") or []],
            bos_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", True)),
            add_space_prefix=bool(gguf_field(reader, "tokenizer.ggml.add_space_prefix", True)),
            path=path,
        )
    if kind != "gpt2":
        warnings.warn(
            f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', and "
            "SentencePiece, 'llama', are); the model loads without a tokenizer",
            stacklevel=3,
        )
        return None
    tokens = list(gguf_field(reader, "tokenizer.ggml.tokens"))
    types = list(gguf_field(reader, "tokenizer.ggml.token_type") or [])
    merges = gguf_field(reader, "tokenizer.ggml.merges") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(t):  # a token spelled outside the byte alphabet: respell its UTF-8 bytes
        return t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))

    vocab = {spell(t): i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:
        raise ValueError(f"{path}: cannot build the tokenizer: {e}") from None
    pre_type = gguf_field(reader, "tokenizer.ggml.pre")
    split = _PRE_SPLITS.get(pre_type)
    if split is not None:
        tok.pre_tokenizer = pre.Sequence(
            [pre.Split(Regex(split), behavior="isolated"), pre.ByteLevel(False, use_regex=False)]
        )
        if pre_type.startswith("qwen2") or pre_type == "deepseek-r1-qwen":
            tok.normalizer = normalizers.NFC()
    else:
        tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # 3 = CONTROL (like <|im_end|>): special, never split. 4 = USER_DEFINED: added, not special.
    # A control token outside the byte alphabet is a llama.cpp mislabel; adding it would grow the
    # vocabulary past the model's, so it is skipped (as transformers does).
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types, strict=False)
            if ty == 3 and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=False)
            if ty == 4
        ]
    )
    return tok
