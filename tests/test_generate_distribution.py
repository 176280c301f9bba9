"""Level 2 (docs/exactness.md §3.3): the joint distribution of the first 3 tokens through the whole
generate() loop equals the model's exact joint, with one-hot drafts; and the same test, at the
same N, catches a loop that skips the KV rollback or takes the bonus from the wrong position."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

import specfast
import specfast.targets
from specfast.model import Model, ModelConfig

# `specfast.generate` is the function; the loop's module is patched for the negative controls.
generate_module = importlib.import_module("specfast.generate")

V = 4  # 64 joint outcomes over 3 tokens
PROMPT = [1, 2, 3, 0, 2]
N = 3000
ALPHA = 1e-4


def sharpened(config: ModelConfig, seed: int) -> Model:
    m = Model.from_config(config, seed=seed)
    # Random init gives near-uniform next-token distributions, which cannot tell a right rule
    # from a wrong one. Sharpen the logits so every context has its own, uneven distribution.
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    return m


@pytest.fixture(scope="module")
def model() -> Model:
    return sharpened(ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2), 3)


def exact_next(model, context: list[int]) -> np.ndarray:
    dec = model.decoder(len(context))
    logits = dec.forward(torch.tensor(context))[-1].double()
    return torch.softmax(logits, -1).numpy()


@pytest.fixture(scope="module")
def exact_joint(model) -> np.ndarray:
    return joint_of(model)


def joint_of(model) -> np.ndarray:
    """The exact joint of the first 3 tokens after PROMPT, in float64."""
    joint = np.zeros((V, V, V))
    p1 = exact_next(model, PROMPT)
    for a in range(V):
        p2 = exact_next(model, [*PROMPT, a])
        for b in range(V):
            p3 = exact_next(model, [*PROMPT, a, b])
            joint[a, b] = p1[a] * p2[b] * p3
    return joint


class GreedyTableDrafter:
    """One-hot drafts: the exact model's most likely next token, so drafts are often accepted
    (the bonus position is exercised) and often rejected (the residual and rollback are)."""

    def __init__(self, model, memo):
        self.model, self.seq, self.memo = model, [], memo

    def extend(self, tokens):
        self.seq.extend(tokens)

    def propose(self, k):
        out, ctx = [], list(self.seq)
        for _ in range(k):
            key = tuple(ctx)
            if key not in self.memo:
                self.memo[key] = int(np.argmax(exact_next(self.model, ctx)))
            t = self.memo[key]
            out.append(t)
            ctx.append(t)
        return out


def sample_joint(
    model, n: int, new_drafter=None, max_new_tokens: int = 3, prompt=PROMPT, **kwargs
) -> np.ndarray:
    """Counts of the first 3 tokens over n seeds. By default the drafts are one-hot (k = 1).
    A longer `max_new_tokens` lets rounds draft past the third token (their first 3 count)."""
    if new_drafter is None:
        memo: dict[tuple[int, ...], int] = {}
        new_drafter = lambda: GreedyTableDrafter(model, memo)  # noqa: E731
        kwargs.setdefault("num_speculative_tokens", 1)
    counts = np.zeros((V, V, V))
    for seed in range(n):
        out = specfast.generate(
            model,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            seed=seed,
            drafter=new_drafter(),
            ignore_eos=True,
            **kwargs,
        )
        counts[tuple(out.token_ids[:3])] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson χ² with bins of expected count < 5 merged into one."""
    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert np.all(obs[~keep] == 0), "a token with probability 0 was emitted"
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_joint_of_first_three_tokens_is_exact(model, exact_joint):
    assert chi2_pvalue(sample_joint(model, N), exact_joint) > ALPHA


class NoRollback:
    torch_threads, cold_passes = None, 0  # the Decoder protocol's hints

    def __init__(self, inner):
        self.inner = inner

    length = property(lambda self: self.inner.length)

    def forward(self, ids, last_only=False):
        return self.inner.forward(ids, last_only)

    def rollback(self, n):
        pass  # the bug: rejected drafts stay in the cache and condition later tokens


def test_negative_control_no_rollback_is_caught(model, exact_joint, monkeypatch):
    real = generate_module.make_decoder
    monkeypatch.setattr(generate_module, "make_decoder", lambda m, n: NoRollback(real(m, n + 4)))
    assert chi2_pvalue(sample_joint(model, N), exact_joint) < ALPHA


def test_negative_control_bonus_from_wrong_position_is_caught(model, exact_joint, monkeypatch):
    import specfast.sampling as sampling_module  # where the round draws its rows

    real = sampling_module.sample_rows

    def bonus_from_previous_row(probs, uniforms):
        # The bug: the bonus (the row after the last draft) is drawn from row k-1, not row k.
        if len(probs) > 1:
            probs = torch.cat([probs[:-1], probs[-2:-1]])
        return real(probs, uniforms)

    monkeypatch.setattr(sampling_module, "sample_rows", bonus_from_previous_row)
    assert chi2_pvalue(sample_joint(model, N), exact_joint) < ALPHA


def test_exact_joint_sums_to_one(exact_joint):
    assert exact_joint.sum() == pytest.approx(1.0, abs=1e-12)


# ----------------------------------------------------------------------------
# a stochastic draft model: the ratio test and the residual through the loop

TOP_K = 3  # the draft samples from a filtered q; the acceptance must see that very q


@pytest.fixture(scope="module")
def draft_model() -> Model:
    return sharpened(ModelConfig(vocab_size=V, dim=32, n_layers=1, n_heads=2, n_kv_heads=1), 11)


def joint_top_k(model, prompt: list[int]) -> np.ndarray:
    def filtered(context):
        p = exact_next(model, context)
        keep = p >= np.sort(p)[-TOP_K]
        return np.where(keep, p, 0) / p[keep].sum()

    joint = np.zeros((V, V, V))
    p1 = filtered(prompt)
    for a in range(V):
        p2 = filtered([*prompt, a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * filtered([*prompt, a, b])
    return joint


@pytest.fixture(scope="module")
def exact_joint_top_k(model) -> np.ndarray:
    return joint_top_k(model, PROMPT)


def sample_joint_with_draft(model, draft, n: int) -> np.ndarray:
    return sample_joint(model, n, lambda: draft, top_k=TOP_K, num_speculative_tokens=2)


def test_joint_with_a_draft_model_is_exact(model, draft_model, exact_joint_top_k):
    counts = sample_joint_with_draft(model, draft_model, N)
    assert chi2_pvalue(counts, exact_joint_top_k) > ALPHA


def sample_filtered_report_unfiltered(self, logits):
    """A known-wrong DraftModelDrafter._choose, the bug of transformers #32867: sample from the
    filtered q, put the raw one in the ratio."""
    q = specfast.logits_to_probs(logits, **self.sampling)
    token = torch.multinomial(q, 1, generator=self.generator)[0]
    return token, torch.softmax(logits.float(), dim=-1)


def test_negative_control_q_from_unfiltered_logits_is_caught(
    model, draft_model, exact_joint_top_k, monkeypatch
):
    import specfast.drafters.model

    monkeypatch.setattr(
        specfast.drafters.model.DraftModelDrafter, "_choose", sample_filtered_report_unfiltered
    )
    counts = sample_joint_with_draft(model, draft_model, N)
    assert chi2_pvalue(counts, exact_joint_top_k) < ALPHA


# ----------------------------------------------------------------------------
# "auto" k with a draft model: rounds end on the draft's own probabilities

UNSURE = 0.45  # a draft given less than this ends its round (the top q here is 0.3-0.55)


def stop_when_unsure(self, confidences):
    return confidences[-1] >= UNSURE and len(confidences) < 3


def sample_joint_stopping_early(model, draft, monkeypatch):
    """Auto k whose rounds end on the draft's probabilities (stop_when_unsure), and that always
    drafts: the pass costs earlier calls measured may say a draft this size does not pay."""
    from specfast.autok import AutoK

    monkeypatch.setattr(AutoK, "keep_drafting", stop_when_unsure)
    monkeypatch.setattr(AutoK, "choose_draft", lambda self: self.max_draft_k)
    return sample_joint(model, N, lambda: draft, max_new_tokens=5, top_k=TOP_K)


def test_rounds_that_stop_on_the_drafts_probabilities_are_exact(
    model, draft_model, exact_joint_top_k, monkeypatch
):
    counts = sample_joint_stopping_early(model, draft_model, monkeypatch)
    assert chi2_pvalue(counts, exact_joint_top_k) > ALPHA


def test_negative_control_dropping_an_unsure_draft_is_caught(
    model, draft_model, exact_joint_top_k, monkeypatch
):
    import specfast.drafters.model
    from specfast.drafters.base import Proposal

    real_draft = specfast.drafters.model.DraftModelDrafter.draft

    def drop_unsure(self, k):
        # The bug: the round ends on an unsure draft *and throws that draft away*. Which
        # drafts reach the target then depends on the draft's own token, so q is no longer
        # the distribution the verified drafts came from.
        p = real_draft(self, k)
        if p.tokens and p.confidences and p.confidences[-1] < UNSURE:
            q = None if p.q is None else p.q[:-1]
            return Proposal(p.tokens[:-1], q, p.evidence, p.confidences[:-1])
        return p

    monkeypatch.setattr(specfast.drafters.model.DraftModelDrafter, "draft", drop_unsure)
    counts = sample_joint_stopping_early(model, draft_model, monkeypatch)
    assert chi2_pvalue(counts, exact_joint_top_k) < ALPHA


# ----------------------------------------------------------------------------
# a draft that may propose only part of the vocabulary (DraftVocabulary)

# Token 0 is "common"; the prompt adds 2; 1 and 3 join once the target emits them. So the draft's
# rows change mid-sequence, and q must carry zeros for the tokens it cannot propose.
GAPPY_PROMPT = [0, 2, 0, 2, 0]


def sample_joint_with_part_vocabulary(model, draft):
    return sample_joint(
        model,
        N,
        lambda: draft,
        max_new_tokens=5,
        prompt=GAPPY_PROMPT,
        top_k=TOP_K,
        num_speculative_tokens=2,
        draft_vocabulary=1,
    )


def test_joint_with_a_draft_of_part_of_the_vocabulary_is_exact(model, draft_model, monkeypatch):
    import specfast.drafters.model

    rows = []
    real_scatter = specfast.drafters.model.DraftModelDrafter._scatter

    def scatter(self, q, ids):
        rows.append(q.shape[1])  # the draft vocabulary's size this round
        return real_scatter(self, q, ids)

    monkeypatch.setattr(specfast.drafters.model.DraftModelDrafter, "_scatter", scatter)
    counts = sample_joint_with_part_vocabulary(model, draft_model)
    assert min(rows) == 2 and max(rows) == V  # the subset was partial, then grew
    assert chi2_pvalue(counts, joint_top_k(model, GAPPY_PROMPT)) > ALPHA


def test_negative_control_q_on_the_wrong_rows_is_caught(model, draft_model, monkeypatch):
    import specfast.drafters.model

    def first_rows(self, q, ids):
        # The bug: q's columns taken for tokens 0..S-1, as if the subset were the lowest ids.
        full = q.new_zeros(q.shape[0], self.vocab_size)
        full[:, : q.shape[1]] = q
        return full

    monkeypatch.setattr(specfast.drafters.model.DraftModelDrafter, "_scatter", first_rows)
    # A draft of token 2 then has q = 0 there: the acceptance core refuses it rather than
    # letting a wrong distribution through.
    with pytest.raises(ValueError, match="draft probability 0"):
        sample_joint_with_part_vocabulary(model, draft_model)
