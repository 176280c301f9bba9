"""specfast: exact speculative decoding for local LLMs. Same text, sooner."""

from specfast._core import NgramDrafter
from specfast.drafters.combined import CombinedDrafter
from specfast.drafters.eagle import EagleConfig, EagleHead, load_eagle, save_eagle
from specfast.formats import load_model
from specfast.generate import generate
from specfast.model import Model, ModelConfig, ModelDecoder
from specfast.sampling import accept_greedy, accept_sampled, accept_sampled_torch, logits_to_probs
from specfast.session import Session, Turn
from specfast.stats import GenerateOutput, GenerationStats
from specfast.targets import HFDecoder, LlamaDecoder, make_decoder
from specfast.targets.base import default_model_path

__version__ = "0.1.0"

__all__ = [
    "CombinedDrafter",
    "EagleConfig",
    "EagleHead",
    "GenerateOutput",
    "GenerationStats",
    "HFDecoder",
    "LlamaDecoder",
    "Model",
    "ModelConfig",
    "ModelDecoder",
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
