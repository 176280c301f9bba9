"""vLLM's V1 model runner (0.22-0.33): a `custom_class` proposer and the runner hooks it needs.

vLLM calls a custom proposer with rows only (`sampled_token_ids`, `num_tokens_no_spec`,
`token_ids_cpu`), not request ids. So the proposer hooks the runner class that builds it
(`wrap_runner`): each step it learns which request each row holds and which requests finished.
State is keyed by request id: a request that moves to another row keeps its index, and only
finished requests are freed.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from specfast.vllm.drafts import RequestDrafts, draft_budget
from specfast.vllm.plugin import check_version

logger = logging.getLogger(__name__)


class SpecfastProposer:
    """specfast's n-gram drafter as a vLLM V1 proposer.

    speculative_config={"method": "custom_class", "model": "specfast.vllm.SpecfastProposer",
    "num_speculative_tokens": K}. If the runner cannot be hooked, drafts are keyed by batch row:
    still right (a row whose history changed is rebuilt) but rebuilt more often.
    """

    def __init__(self, vllm_config, *, drafts: RequestDrafts | None = None):
        check_version()
        # vLLM's runner module is loaded by now: the runner is what builds this proposer.
        runner_module = sys.modules.get("vllm.v1.worker.gpu_model_runner")
        if runner_module is not None:
            wrap_runner(runner_module.GPUModelRunner)
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.drafts = drafts if drafts is not None else RequestDrafts()
        self.req_ids: list[str | None] | None = None  # this step's rows, from the runner hook
        self.warned = False

    def set_batch(self, req_ids: Sequence[str | None]) -> None:
        """The request id in each batch row for the coming `propose` (the runner hook calls it)."""
        self.req_ids = list(req_ids)

    def finish(self, req_ids: Iterable[str]) -> None:
        """Frees the state of finished requests (the runner hook calls it)."""
        self.drafts.finish(req_ids)

    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_
    ) -> list[list[int]]:
        """A draft for each row ([] for rows mid-prefill, at max_model_len, or without a match)."""
        req_ids, self.req_ids = self.req_ids, None
        if req_ids is None and not self.warned:
            logger.warning(
                "specfast.vllm.SpecfastProposer: the runner hook is not installed (is the "
                "specfast plugin disabled by VLLM_PLUGINS?); keying drafts by batch row"
            )
            self.warned = True
        drafts: list[list[int]] = []
        # Rows that decode this step (a partial prefill samples nothing): the batch that verifies.
        batch = sum(1 for sampled in sampled_token_ids if len(sampled))
        for row, sampled in enumerate(sampled_token_ids):
            length = int(num_tokens_no_spec[row])
            budget = draft_budget(self.k, length, self.max_model_len)
            key = req_ids[row] if req_ids is not None and row < len(req_ids) else f"row {row}"
            if not len(sampled) or budget == 0 or key is None:
                drafts.append([])  # a partial prefill samples nothing
                continue
            self.drafts.sync(key, np.asarray(token_ids_cpu[row, :length]))
            drafts.append(self.drafts.propose(key, budget, batch))
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        """vLLM asks every drafter to load a model; this one has none."""


def wrap_runner(runner_cls) -> bool:
    """Hooks `runner_cls` (vLLM's GPUModelRunner, whose subclasses include the CPU runner) so a
    SpecfastProposer learns finished requests and each step's rows. False if already hooked."""
    if getattr(runner_cls, "_specfast_hooked", False):
        return False
    update_states = runner_cls._update_states
    propose_draft_token_ids = runner_cls.propose_draft_token_ids

    @functools.wraps(update_states)
    def _update_states(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecfastProposer):
            # Before the runner drops them: a resubmitted id that finished is then new.
            drafter.finish(scheduler_output.finished_req_ids)
        return update_states(self, scheduler_output, *args, **kwargs)

    @functools.wraps(propose_draft_token_ids)
    def _propose_draft_token_ids(self, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecfastProposer):
            drafter.set_batch(self.input_batch.req_ids)
        return propose_draft_token_ids(self, *args, **kwargs)

    runner_cls._update_states = _update_states
    runner_cls.propose_draft_token_ids = _propose_draft_token_ids
    runner_cls._specfast_hooked = True
    return True
