"""llama.cpp as the target (or the draft): a `llama_cpp.Llama` behind the decoder protocol.

decoder.py drives one sequence (`LlamaDecoder`), features.py reads the inputs of chosen layers
out of it for an EAGLE head, tokenizer.py answers what generate() asks of a Llama's vocabulary,
and build.py checks that the installed llama.cpp was built for this CPU. llama_cpp itself is
imported lazily, only when a Llama is actually used.
"""

from specfast.targets.llama_cpp.build import (
    LLAMA_PIN,
    check_llama_build,
    llama_threads,
    tile_restorer,
)
from specfast.targets.llama_cpp.decoder import LlamaDecoder, is_llama, llama_facts, load_llama
from specfast.targets.llama_cpp.features import LayerInputs, check_layer_inputs
from specfast.targets.llama_cpp.tokenizer import LlamaTokenizer, llama_eos_ids

__all__ = [
    "LLAMA_PIN",
    "LayerInputs",
    "LlamaDecoder",
    "LlamaTokenizer",
    "check_layer_inputs",
    "check_llama_build",
    "is_llama",
    "llama_eos_ids",
    "llama_facts",
    "llama_threads",
    "load_llama",
    "tile_restorer",
]
