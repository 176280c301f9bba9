"""specfast's own torch model: a lean Llama-family transformer for batch-1 decoding.

- model.py: the weights (`Model`), their packing for the CPU kernels, the layers' math;
- decoder.py: one sequence over a Model (`ModelDecoder`): its KV cache (kv_cache.py) and
  the way its passes run, chosen when it is made: compiled static-shape steps (static.py), one
  call into the Rust core (core.py) or torch's eager layers (eager.py, attention in attention.py);
- quantize.py: the core's quantized and float matrices, and the threads they run on;
- config.py, embedding.py: the architecture's numbers; a GGUF's quantized embedding table.

The loop never sees this package: targets/torch/ adapts a Model to the Target protocol.
"""

from specfast.model.config import ModelConfig
from specfast.model.decoder import ModelDecoder
from specfast.model.model import Model

__all__ = ["Model", "ModelConfig", "ModelDecoder"]
