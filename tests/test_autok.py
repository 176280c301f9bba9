"""auto k: the choice follows measured acceptance and measured pass cost."""

from __future__ import annotations

from specfast.autok import AutoK


def feed(
    auto: AutoK,
    rounds: int,
    n_draft: int,
    n_accepted: int,
    match,
    cost_per_token: float,
    draft_seconds: float = 0.0,
) -> None:
    for _ in range(rounds):
        seconds = 1.0 + cost_per_token * n_draft  # a pass over n_draft + 1 tokens
        auto.observe(n_draft, n_accepted, seconds, draft_seconds, match)
        auto.observe(0, 0, 1.0, 0.0, 0)  # plain steps measure t(1)


def test_flat_cost_speculates_even_on_weak_evidence():
    auto = AutoK()
    feed(auto, 20, 4, 1, match=1, cost_per_token=0.01)  # bf16-like: verification nearly free
    assert auto.choose(1) > 0


def test_costly_verification_switches_weak_evidence_off():
    auto = AutoK()
    feed(auto, 20, 4, 0, match=1, cost_per_token=0.15)  # fp32-like, and nothing is accepted
    ks = [auto.choose(1) for _ in range(300)]
    assert ks.count(0) > 290  # off, bar a probe with exponential backoff (every 256 here)
    assert any(ks)  # ... which still happens


def test_long_matches_keep_their_own_rate():
    auto = AutoK()
    feed(auto, 20, 4, 0, match=1, cost_per_token=0.15)
    feed(auto, 20, 8, 8, match=12, cost_per_token=0.15)
    assert auto.choose(12) >= 8
    assert auto.choose(0) == 0  # no match: nothing to verify


def test_combined_takes_the_source_that_pays():
    auto = AutoK()
    # A draft model that is right 90 % of the time but costs 0.3 of a pass per token ...
    feed(auto, 20, 4, 4, match=None, cost_per_token=0.02, draft_seconds=1.2)
    # ... against an n-gram whose 2-token matches are wrong and 16-token matches are right.
    feed(auto, 20, 4, 0, match=2, cost_per_token=0.02)
    feed(auto, 20, 10, 10, match=16, cost_per_token=0.02)
    assert auto.choose_source(16)[0] is True
    use_ngram, k = auto.choose_source(2)
    assert use_ngram is False and k > 0
