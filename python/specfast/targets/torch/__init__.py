"""specfast's own torch model (specfast.model) as a Target: `ModelTarget`."""

from specfast.targets.torch.target import ModelTarget

__all__ = ["ModelTarget"]
