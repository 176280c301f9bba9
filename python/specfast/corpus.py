"""Naming a tokenizer for a saved n-gram corpus.

A corpus file (`NgramDrafter.save(path, fingerprint=...)`) holds token ids, which mean something
only under the tokenizer that produced them. `tokenizer_fingerprint` gives a short string for that
tokenizer, to store on save and to demand on load (`NgramDrafter.load(path, fingerprint=...)`),
so that a corpus built with another vocabulary is refused instead of drafting nonsense.
"""

from __future__ import annotations

import hashlib
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """``"vocab=<size>;sha256=<hash>"`` of a tokenizer's vocabulary (every token string by id,
    added tokens included). Takes a `tokenizers.Tokenizer` or a `transformers` tokenizer.

    Two tokenizers get the same fingerprint exactly when they map the same ids to the same token
    strings, which is what decides whether a corpus of ids means the same text.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        raise TypeError(
            "tokenizer must be a tokenizers.Tokenizer or a transformers tokenizer "
            f"(something with get_vocab()), got {type(tokenizer).__name__}"
        )
    vocab = get_vocab()
    h = hashlib.sha256()
    for token, i in sorted(vocab.items(), key=lambda item: item[1]):
        # Length-prefixed, so that no token string can imitate a boundary.
        raw = token.encode("utf-8", "surrogatepass")
        h.update(f"{i}:{len(raw)}:".encode())
        h.update(raw)
    return f"vocab={len(vocab)};sha256={h.hexdigest()[:32]}"
