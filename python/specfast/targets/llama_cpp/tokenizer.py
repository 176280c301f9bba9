"""A Llama's tokenizer and EOS ids: what generate() reads of a model."""

from __future__ import annotations

from specfast.targets.llama_cpp.state import llama_state


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
        """token text -> id, as the GGUF spells the tokens (cached per Llama)."""
        cached = llama_state(self.llama).get("vocab")
        if cached is None:
            lib = _lib()
            vocab = lib.llama_model_get_vocab(self.llama.model)
            cached = {
                lib.llama_vocab_get_text(vocab, i).decode("utf-8", errors="replace"): i
                for i in range(self.llama.n_vocab())
            }
            llama_state(self.llama)["vocab"] = cached
        return cached


def llama_eos_ids(llama) -> list[int]:
    """Every end-of-generation id of the vocabulary (EOS, EOT, <|im_end|>, ...), cached."""
    cached = llama_state(llama).get("eos")
    if cached is None:
        lib = _lib()
        vocab = lib.llama_model_get_vocab(llama.model)
        cached = [i for i in range(llama.n_vocab()) if lib.llama_vocab_is_eog(vocab, i)]
        llama_state(llama)["eos"] = cached
    return list(cached)


def _lib():
    import llama_cpp

    return llama_cpp
