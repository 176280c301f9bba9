"""specfast: exact speculative decoding for local LLMs. Same text, sooner."""

from specfast._core import NgramDrafter
from specfast.draft import CombinedDrafter
from specfast.eagle import EagleConfig, EagleHead, load_eagle, save_eagle
from specfast.generate import GenerateOutput, GenerationStats, generate
from specfast.hf import HFDecoder
from specfast.llama_cpp import LlamaDecoder
from specfast.loading import default_model_path, load_model
from specfast.model import Decoder, Model, ModelConfig
from specfast.runtime import make_decoder
from specfast.sampling import accept_greedy, accept_sampled, accept_sampled_torch, logits_to_probs
from specfast.session import Session, Turn

__version__ = "0.1.0"

__all__ = [
    "CombinedDrafter",
    "Decoder",
    "EagleConfig",
    "EagleHead",
    "GenerateOutput",
    "GenerationStats",
    "HFDecoder",
    "LlamaDecoder",
    "Model",
    "ModelConfig",
    "NgramDrafter",
    "Session",
    "Turn",
    "accept_greedy",
    "accept_sampled",
    "accept_sampled_torch",
    "default_model_path",
    "generate",
    "load_eagle",
    "load_model",
    "logits_to_probs",
    "make_decoder",
    "save_eagle",
]
