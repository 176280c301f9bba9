"""specfast: exact speculative decoding for local LLMs. Same text, sooner."""

from specfast._core import NgramDrafter as NgramDrafter

__version__ = "0.1.0"
