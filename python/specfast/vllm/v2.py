"""vLLM's V2 model runner (0.34): specfast's drafter as the registered method "specfast".

speculative_config={"method": "specfast", "num_speculative_tokens": K}. vLLM builds the
speculator with its request state, tells it of new and finished requests, and asks each step for
a [num_reqs, K] tensor of drafts; rows short of K are padded with the request's last token (an
ordinary draft that verification may reject, so padding costs verify work, never exactness).
vLLM resolves both classes by name, in every process, after `specfast.vllm.register()`.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

from specfast.vllm.drafts import RequestDrafts, draft_budget

DEFAULT_K = 5


class SpecfastSpeculatorConfig(SpeculatorConfig):
    """How vLLM sets up method "specfast": no draft model; the target's config stands in."""

    speculator_class = "specfast.vllm.v2.SpecfastSpeculator"
    adaptive_verification_uses_draft_logits = False

    @classmethod
    def configure(cls, spec) -> None:
        super().configure(spec)
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = DEFAULT_K


class SpecfastSpeculator(BaseSpeculator):
    """Per-request n-gram drafters over vLLM's token history (read from `req_states`)."""

    def __init__(self, vllm_config, device: torch.device, req_states):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.device, self.req_states = device, req_states
        max_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        # This runner verifies K tokens a row, drafted or padded, so a draft costs nothing over
        # padding: every row with a match may fill its K (draft_cap's free tokens never run out).
        self.drafts = RequestDrafts(free_tokens=max_reqs * (self.k + 1))
        self.out = torch.zeros(max_reqs, self.k, dtype=torch.int64, device=device)

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        """Nothing to capture: drafting runs on the host."""

    def capture(self) -> None:
        """Nothing to capture: drafting runs on the host."""

    def add_request(self, req_index: int) -> None:
        """A resumed request keeps its index: `propose` checks it against the history first."""

    def on_requests_finished(self, finished_req_ids) -> None:
        self.drafts.finish(finished_req_ids)

    def reset_state(self) -> None:
        self.drafts.reset()

    @torch.inference_mode()
    def propose(
        self,
        input_batch,
        attn_metadata,
        slot_mappings,
        last_hidden_states,
        aux_hidden_states,
        num_sampled: torch.Tensor,  # [num_reqs]
        num_rejected: torch.Tensor,  # [num_reqs]
        last_sampled: torch.Tensor,  # [max_num_reqs] (or [max_num_reqs, 1])
        next_prefill_tokens,
        temperature,
        seeds,
        dp_sync_state=None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs=None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        n = input_batch.num_reqs
        if dummy_run or n == 0:
            return self.out[:n]
        slots = np.asarray(input_batch.idx_mapping_np[:n], dtype=np.int64)
        lengths = self.req_states.total_len.gpu[:].cpu().numpy()[slots]
        sampled = num_sampled[:n].cpu().numpy()
        last = last_sampled.reshape(-1).cpu().numpy()[slots]
        rows = self.req_states.all_token_ids.gpu
        drafts = np.repeat(last[:, None], self.k, axis=1)  # [n, K], the padding
        batch = int((sampled > 0).sum())  # rows that decode this step
        for b, req_id in enumerate(input_batch.req_ids[:n]):
            length = int(lengths[b])
            budget = draft_budget(self.k, length, self.max_model_len)
            if sampled[b] == 0 or budget == 0:
                continue  # a chunk of prefill samples nothing
            self.drafts.sync(req_id, rows[int(slots[b]), :length])
            tokens = self.drafts.propose(req_id, budget, batch)
            drafts[b, : len(tokens)] = tokens
        self.out[:n].copy_(torch.from_numpy(drafts))
        return self.out[:n]
