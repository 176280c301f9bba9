"""specfast: exact speculative decoding for local LLMs. Same text, sooner."""

from .hf import HFDecoder, make_decoder
from .loading import default_model_path, load_model
from .model import Decoder, Model, ModelConfig

__version__ = "0.1.0"

__all__ = [
    "Decoder",
    "HFDecoder",
    "Model",
    "ModelConfig",
    "default_model_path",
    "load_model",
    "make_decoder",
]
