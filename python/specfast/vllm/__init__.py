"""specfast's n-gram drafter inside vLLM, as a plugin (docs/vllm.md).

Two interfaces, by vLLM release:
- V1 runner (0.22-0.33): method "custom_class" with model "specfast.vllm.SpecfastProposer". The
  proposer hooks the runner that builds it, so it needs no plugin entry point.
- V2 runner (0.34): method "specfast", which `register()` adds. `register()` is the
  `vllm.general_plugins` entry point, so vLLM runs it in every process.
On another vLLM, `register()` registers nothing and says so, and building the proposer raises
with the versions supported. Importing this module does not import vLLM.
"""

from specfast.vllm.drafts import RequestDrafts
from specfast.vllm.plugin import check_version, interface, register
from specfast.vllm.v1 import SpecfastProposer

__all__ = ["RequestDrafts", "SpecfastProposer", "check_version", "interface", "register"]
