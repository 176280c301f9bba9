"""Type stubs for the compiled core, `specfast._core`."""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

# PyO3 fills the runtime __all__ from the registered functions; keep this list in step.
__all__ = [
    "accept_greedy",
    "accept_sampled",
    "accept_sampled_with_uniforms",
    "rule_tables",
    "uniforms",
]

# ---- accept -------------------------------------------------------------------------------------
# Probability matrices: 2-D float32/float64 numpy arrays or CPU torch tensors (read zero-copy).

def accept_greedy(draft: Sequence[int], target_ids: Sequence[int]) -> list[int]: ...
def accept_sampled(
    target_probs: Any, draft: Sequence[int], draft_probs: Any | None = None, *, seed: int
) -> list[int]: ...
def accept_sampled_with_uniforms(
    target_probs: Any,
    draft: Sequence[int],
    draft_probs: Any | None,
    accept_uniforms: Sequence[float],
    sample_uniforms: Sequence[float],
) -> list[int]: ...
def uniforms(seed: int, k: int) -> tuple[list[float], list[float]]: ...
def rule_tables(
    target_probs: Any, draft: Sequence[int], draft_probs: Any | None = None
) -> tuple[list[float], npt.NDArray[np.float64]]: ...
