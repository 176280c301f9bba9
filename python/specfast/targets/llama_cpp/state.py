"""What specfast keeps per llama_cpp.Llama (its vocabulary, EOS ids, the layers whose inputs it
returns, its dequantized embedding, the decoder that owns its cache), in a table keyed weakly by
the Llama: nothing is written onto the user's object, and an entry goes with its Llama."""

from __future__ import annotations

import weakref
from typing import Any

_STATE: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def llama_state(llama) -> dict[str, Any]:
    """This Llama's entry: a dict, empty the first time."""
    return _STATE.setdefault(llama, {})
