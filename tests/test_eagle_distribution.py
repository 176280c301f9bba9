"""EAGLE-3, level 2: the joint distribution of the first 3 tokens and of what was accepted,
with the head's q, against the exact joint; each known-wrong variant must be caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_generate_distribution import chi2_pvalue

from specfast.model import Model, ModelConfig

V2 = 4
PROMPT2 = [1, 2, 3, 0, 2]
N2 = 1000  # every negative control below gives p < 1e-30 at 600
ALPHA = 1e-4
TOP_K = 3


@pytest.fixture(scope="module")
def target2() -> Model:
    from test_generate_distribution import sharpened

    config = ModelConfig(vocab_size=V2, dim=32, n_layers=4, n_heads=4, n_kv_heads=2)
    return sharpened(config, 3)


def head2(target2, vd: int, order):
    """A sharp random head (its q varies a lot with its inputs) over `vd` of the 4 tokens.
    A small rope_theta makes it sensitive to positions (so a cache that is not rolled back,
    which shifts them by one, shows)."""
    from specfast.drafters.eagle.head import EagleConfig, random_head

    config = EagleConfig.for_target(
        target2, draft_vocab_size=vd, aux_layers=(0, 1, 2), rope_theta=3.0
    )
    head = random_head(config, seed=7, scale=60)
    return head.set_draft_vocab(order) or head.bind_embedding(target2.embed.weight)


@pytest.fixture(scope="module")
def permuted_head(target2):
    return head2(target2, 4, [2, 0, 3, 1])  # the whole vocabulary, in another order


@pytest.fixture(scope="module")
def partial_head(target2):
    return head2(target2, 3, [3, 1, 0])  # token 2 is never drafted: q(2) = 0


def filtered(probs: np.ndarray) -> np.ndarray:
    keep = probs >= np.sort(probs)[-TOP_K]
    return np.where(keep, probs, 0) / probs[keep].sum()


def p_exact(target, context: list[int]) -> np.ndarray:
    logits = target.decoder(len(context)).forward(torch.tensor(context))[-1].double()
    return filtered(torch.softmax(logits, -1).numpy())


def q_exact(target, head, context: list[int], drafts: list[int]) -> np.ndarray:
    """The head's q for the next draft after `drafts`, from scratch: the target's features of
    a separate pass over the context, the head over every position, then its own chain."""
    n = len(context)
    ids = torch.tensor(context)
    feats = target.decoder(n).forward(ids[:-1], features=head.aux_layers)[1]
    with torch.inference_mode():
        out, logits, k, v = head(head.fc(feats), ids[1:], torch.arange(n - 1))
        for j, d in enumerate(drafts):
            out, logits, k2, v2 = head(out[-1:], torch.tensor([d]), torch.tensor([n - 1 + j]), k, v)
            k, v = torch.cat([k, k2], dim=-2), torch.cat([v, v2], dim=-2)
    qd = filtered(torch.softmax(logits[-1].double(), -1).numpy())
    q = np.zeros(V2)
    q[head.target_ids.numpy()] = qd
    return q


def exact_outcomes(target, head) -> np.ndarray:
    """P(t1, t2, t3, how round 1 and 2 went) with k = 2 and max_new_tokens = 4, in float64.

    Outcome codes: 0 = round 1 accepted none and round 2 (k = 1) none, 1 = round 1 none and
    round 2 its draft, 2 = round 1 one of two, 3 = round 1 both. Accepting a draft x drawn from
    q has probability min(p(x), q(x)); a rejection followed by the residual gives x with
    probability max(0, p(x) - q(x))."""
    joint = np.zeros((V2, V2, V2, 4))
    p1 = p_exact(target, PROMPT2)
    for t1 in range(V2):
        ctx = [*PROMPT2, t1]
        pa, qa = p_exact(target, ctx), q_exact(target, head, ctx, [])
        for x in range(V2):
            # round 1 rejects its first draft; t2 = x from the residual; round 2 drafts once
            ctx2 = [*ctx, x]
            pb, qb = p_exact(target, ctx2), q_exact(target, head, ctx2, [])
            joint[t1, x, :, 0] += p1[t1] * max(0, pa[x] - qa[x]) * np.maximum(0, pb - qb)
            joint[t1, x, :, 1] += p1[t1] * max(0, pa[x] - qa[x]) * np.minimum(pb, qb)
            # round 1 accepts its first draft x; the second is drawn from q after x
            pc, qc = p_exact(target, ctx2), q_exact(target, head, ctx, [x])
            joint[t1, x, :, 2] += p1[t1] * min(pa[x], qa[x]) * np.maximum(0, pc - qc)
            joint[t1, x, :, 3] += p1[t1] * min(pa[x], qa[x]) * np.minimum(pc, qc)
    return joint


def sample_outcomes(target, head, n: int = N2) -> np.ndarray:
    import specfast

    code = {(3, 0): 0, (3, 1): 1, (2, 1): 2, (2, 2): 3}  # (drafted, accepted) -> outcome
    counts = np.zeros((V2, V2, V2, 4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits (10x slower when busy)
    try:
        for seed in range(n):
            out = specfast.generate(
                target, PROMPT2, max_new_tokens=4, temperature=1.0, top_k=TOP_K, seed=seed,
                drafter=head, num_speculative_tokens=2, ignore_eos=True,
            )  # fmt: skip
            s = out.stats
            counts[(*out.token_ids[:3], code[s.draft_tokens, s.accepted_tokens])] += 1
    finally:
        torch.set_num_threads(threads)
    return counts


@pytest.fixture(scope="module")
def exact_permuted(target2, permuted_head):
    return exact_outcomes(target2, permuted_head)


def test_exact_outcomes_sum_to_one_and_marginal_is_the_target(target2, exact_permuted):
    assert exact_permuted.sum() == pytest.approx(1.0, abs=1e-12)
    tokens = exact_permuted.sum(-1)
    p1 = p_exact(target2, PROMPT2)
    for a in range(V2):
        p2 = p_exact(target2, [*PROMPT2, a])
        for b in range(V2):
            want = p1[a] * p2[b] * p_exact(target2, [*PROMPT2, a, b])
            np.testing.assert_allclose(tokens[a, b], want, atol=1e-12)


@pytest.mark.parametrize("which", ["permuted", "partial"])
def test_joint_with_the_heads_q_is_exact(target2, permuted_head, partial_head, which):
    head = permuted_head if which == "permuted" else partial_head
    exact = exact_outcomes(target2, head)
    # The controls below need rounds that both accept and reject, in numbers.
    assert exact[..., 2:].sum() > 0.1 and exact[..., 1].sum() > 0.1
    assert chi2_pvalue(sample_outcomes(target2, head), exact) > ALPHA


def test_negative_control_q_before_the_draft_vocabulary_mapping(
    target2, permuted_head, exact_permuted, monkeypatch
):
    import specfast.drafters.eagle.draft

    def unmapped(self, q, ids):
        # The bug: draft id i's probability put on target id i, as if d2t were all zeros.
        full = q.new_zeros(q.shape[0], self.vocab_size)
        full[:, : q.shape[1]] = q
        return full

    monkeypatch.setattr(specfast.drafters.eagle.EagleDraft, "_scatter", unmapped)
    # The filtered q has zeros (top-k), so some draft lands where the unmapped q is 0: the
    # acceptance core refuses it rather than letting a wrong distribution through.
    with pytest.raises(ValueError, match="draft probability 0"):
        sample_outcomes(target2, permuted_head)


def test_negative_control_features_from_the_wrong_layer(
    target2, permuted_head, exact_permuted, monkeypatch
):
    import specfast.drafters.eagle.draft

    real_init = specfast.drafters.eagle.EagleDraft.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        # The bug: the output of each aux layer (the next layer's input) instead of its input.
        self.feature_layers = tuple(i + 1 for i in self.feature_layers)

    monkeypatch.setattr(specfast.drafters.eagle.EagleDraft, "__init__", init)
    assert chi2_pvalue(sample_outcomes(target2, permuted_head), exact_permuted) < ALPHA


def test_negative_control_features_paired_with_the_wrong_position(
    target2, permuted_head, exact_permuted, monkeypatch
):
    import specfast.drafters.eagle.draft

    def feed_same_position(self, features):
        # The bug: position t's features read with token t instead of token t + 1.
        pos, n = self.fed, features.shape[0]
        tokens = torch.tensor(self.committed[pos : pos + n])
        return self._step(self.head.fc(features), tokens)[-1:]

    monkeypatch.setattr(specfast.drafters.eagle.EagleDraft, "_feed", feed_same_position)
    assert chi2_pvalue(sample_outcomes(target2, permuted_head), exact_permuted) < ALPHA


def test_negative_control_head_cache_not_rolled_back(
    target2, permuted_head, exact_permuted, monkeypatch
):
    import specfast.drafters.eagle.draft
    from specfast.model.kv_cache import KVCache

    class NoRollback(KVCache):
        def rollback(self, length):
            pass  # the bug: last round's drafts stay in the head's cache, positions shift

    monkeypatch.setattr(specfast.drafters.eagle.draft, "KVCache", NoRollback)
    assert chi2_pvalue(sample_outcomes(target2, permuted_head), exact_permuted) < ALPHA
