"""A `llama_cpp.Llama` as a Target: its facts, its decoder, and what an EAGLE head needs."""

from __future__ import annotations

import torch

from specfast.targets.base import LayerFacts
from specfast.targets.llama_cpp.decoder import LlamaDecoder, llama_facts
from specfast.targets.llama_cpp.features import check_layer_inputs
from specfast.targets.llama_cpp.state import llama_state
from specfast.targets.llama_cpp.tokenizer import LlamaTokenizer, llama_eos_ids


class LlamaTarget:
    """llama.cpp behind the Target protocol. Its logits come back to the CPU; its decoders
    return layer inputs where check_layer_inputs passes (docs/llama-cpp.md)."""

    chat_template: str | None = None
    weights = "float"  # llama.cpp's own quantization is the file's: no specfast kernels
    features = True
    supports_head = False
    context_hint = "; build the Llama with a larger n_ctx"

    def __init__(self, llama):
        self.source = llama
        self.vocab_size, self.max_context, self.device = llama_facts(llama)
        self.tokenizer = LlamaTokenizer(llama)  # Llama.tokenizer is a method, not a tokenizer
        self.eos_token_ids = llama_eos_ids(llama)

    def decoder(self, max_length: int | None = None) -> LlamaDecoder:
        return LlamaDecoder(self.source, max_length)

    def parameter_count(self) -> int:
        import llama_cpp

        return int(llama_cpp.llama_model_n_params(self.source.model))

    def layer_facts(self) -> LayerFacts:
        """The head runs in torch at dtype "auto" on the CPU, on features llama.cpp returns."""
        import llama_cpp

        from specfast.hardware import auto_dtype

        llama = self.source
        check_layer_inputs(llama)
        return LayerFacts(
            int(llama.n_vocab()),
            int(llama_cpp.llama_model_n_embd(llama.model)),
            int(llama_cpp.llama_model_n_layer(llama.model)),
            auto_dtype(torch.device("cpu")),
            torch.device("cpu"),
            # llama.cpp gives no embedding matrix: its GGUF has it
            lambda dtype: llama_embedding(llama, dtype),
        )

    def describe(self) -> dict[str, str]:
        return {"runtime": "llama.cpp", "weights": "the file's", "step": "llama_decode"}


def llama_embedding(llama, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Llama's token embedding (V, D) dequantized from its GGUF file, in `dtype`: what an
    EAGLE head without its own embed_tokens embeds its tokens with. Cached per Llama and
    dtype for the Llama's lifetime (SmolLM2's: 113 MB in float32); dequantizing takes a float32 copy
    of the whole matrix, a few GB for a 150k-token vocabulary at 4096 wide."""
    from specfast.formats.gguf import gguf_tensor  # (formats imports this package first)

    cache = llama_state(llama).setdefault("embedding", {})
    if dtype not in cache:
        cache[dtype] = gguf_tensor(llama.model_path, "token_embd.weight").to(dtype)
    return cache[dtype]
