"""specfast: exact speculative decoding for local LLMs. Same text, sooner."""

__version__ = "0.1.0"
