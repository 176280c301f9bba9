"""auto k: the choice follows measured acceptance and measured pass cost."""

from __future__ import annotations

import pytest

from specfast.autok import AutoK, shared_match_rates, shared_pass_costs


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
    feed(auto, 20, 4, 0, match=3, cost_per_token=0.15)  # fp32-like, and nothing is accepted
    ks = [auto.choose(3) for _ in range(300)]
    assert ks.count(0) > 290  # off, bar a probe with exponential backoff (every 256 here)
    assert any(ks)  # ... which still happens


def test_a_draft_model_off_backs_off_its_probes_unless_two_are_accepted_whole():
    """A draft model that does not pay is probed ever less often, even when probes get a draft
    right now and then (or stop after one, which is right); two drafts accepted whole probe
    again soon."""

    def probes(auto, drafts: int, accepted: int) -> int:
        n = 0
        for _ in range(400):
            if auto.choose(None):  # the draft stops itself after `drafts` (keep_drafting)
                n += 1
                auto.observe(drafts, accepted, 1.0 + 0.5 * drafts, 0.1 * drafts, None)
            auto.observe(0, 0, 1.0, 0.0, None)
        return n

    def switched_off() -> AutoK:
        auto = AutoK()
        feed(auto, 20, 2, 0, match=None, cost_per_token=0.5, draft_seconds=0.1)
        assert auto._best(None)[0] == 0  # off: its drafts were all rejected
        return auto

    for drafts, accepted in ((2, 1), (1, 1)):
        auto = switched_off()
        some = probes(auto, drafts, accepted)
        assert auto._best(None)[0] == 0 and 0 < some < 12  # still off, probes 4, 8, 16... apart
    whole = probes(switched_off(), 2, 2)
    assert whole > 2 * some  # negative control: whole probes keep probing (or turn it on)


def test_short_matches_are_not_probed_once_off():
    auto = AutoK()
    for match in (1, 2, 3):
        feed(auto, 20, 4, 0, match=match, cost_per_token=0.15)
    auto._rate(1).probe_every = auto._rate(2).probe_every = auto._rate(3).probe_every = 4
    assert not any(auto.choose(m) for m in (1, 2) for _ in range(100))
    assert any(auto.choose(3) for _ in range(100))  # negative control: 3 tokens still probe


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


def calibrate(auto: AutoK, rounds: int, confident: float, unsure: float) -> None:
    """Rounds of 8 drafts: the confident ones are all accepted, the unsure one is rejected."""
    for _ in range(rounds):
        auto.observe_confidences([confident] * 7 + [unsure], n_accepted=7)


def test_a_draft_model_keeps_going_while_its_calibrated_drafts_survive():
    auto = AutoK()
    feed(auto, 20, 8, 7, match=None, cost_per_token=0.02, draft_seconds=8 * 0.25)
    calibrate(auto, 30, confident=0.999, unsure=0.5)
    assert auto.keep_drafting([0.999] * 12)
    assert not auto.keep_drafting([0.999] * 3 + [0.5])  # the unsure draft is usually wrong
    assert not auto.keep_drafting([0.999] * auto.max_draft_k)  # the bound holds


def test_costlier_draft_steps_end_rounds_sooner():
    def run_length(draft_step: float) -> int:
        auto = AutoK()
        feed(auto, 20, 8, 4, match=None, cost_per_token=0.02, draft_seconds=8 * draft_step)
        for _ in range(30):  # drafts given 0.9 are accepted 4 times in 5
            auto.observe_confidences([0.9] * 5, n_accepted=4)
        n = 1
        while auto.keep_drafting([0.9] * n):
            n += 1
        return n

    cheap, costly = run_length(0.05), run_length(0.6)
    assert cheap > costly >= 1


def test_pass_costs_carry_over_between_calls_on_one_target():
    """A second call on the same target starts from the pass cost the first one measured (a
    costly batched pass: k stays short at once); a call on another target starts fresh."""
    target, other = Target(), Target()
    first = AutoK()
    first.use_pass_costs(shared_pass_costs(target))
    feed(first, 20, 8, 1, match=2, cost_per_token=0.6)  # llama.cpp-like: 8 drafts cost 5.8 steps
    again, fresh = AutoK(), AutoK()
    again.use_pass_costs(shared_pass_costs(target))
    fresh.use_pass_costs(shared_pass_costs(other))
    assert again.pass_seconds(9) > 4 * again.pass_seconds(1)  # measured, not the flat prior
    assert fresh.pass_seconds(9) < 1.2 * fresh.pass_seconds(1)  # negative control: the prior
    assert again.choose(2) < fresh.choose(2)


class Target:
    """Any weakly referenceable object stands in for a model; as a Target it is its own
    `source`, which the shared rates are keyed on."""

    @property
    def source(self):
        return self


def test_plain_steps_are_priced_at_their_measured_cost():
    """llama.cpp on a CPU: pass cost is concave at the start (1, 1.6, 1.85 steps at n = 1, 2, 3).
    A straight line through every length puts t(1) at 1.1 and makes a 45 %-right 1-token draft
    look worth it (1.45 tokens for 1.48 against 1 for 1.1); measured, it is not (1.45 for 1.6)."""
    costs = {1: 1.0, 2: 1.6, 3: 1.85, 5: 2.6, 9: 4.1}

    def trained(kind):
        auto = kind()
        for i in range(40):
            for n, t in costs.items():
                auto.observe(n - 1, 0, t, 0.0, 0)
            right = (i * 9) // 20 != ((i + 1) * 9) // 20  # 2-token matches: right 45 %
            auto.observe(1, int(right), costs[2], 0.0, 2)
        return auto

    auto = trained(AutoK)
    assert abs(auto.pass_seconds(1) - 1.0) < 1e-9
    assert 2.1 < auto.pass_seconds(4) < 2.4  # not timed: the line through the timed lengths
    assert 0.35 < auto.acceptance(2) < 0.55
    assert auto._best(2)[0] == 0
    assert trained(LinearFit)._best(2)[0] > 0  # negative control: the straight line drafts


class LinearFit(AutoK):
    """The known-wrong estimate: one least-squares line through every measured length."""

    def pass_seconds(self, n: int, explore: bool = False) -> float:
        means = {m: t / w for m, (w, t) in self._sums.items() if w > 0}
        mx, my = sum(means) / len(means), sum(means.values()) / len(means)
        var = sum((x - mx) ** 2 for x in means)
        slope = sum((x - mx) * (means[x] - my) for x in means) / var
        return my + slope * (n - mx)


def copy_rounds(auto: AutoK, t16: float, rounds: int) -> list[int]:
    """Rounds on a 32-token match where every draft is accepted; returns the k chosen. Pass
    cost is a step per row up to 8 rows (compute-bound), well measured; 12 rows cost 12 and 16
    rows cost t16, never tried before (a block kernel can make 16 rows cheap: llama.cpp's Q4_K)."""
    costs = {n: float(n) for n in (1, 2, 3, 4, 6, 8, 12)} | {16: t16}
    for n in (1, 2, 3, 4, 6, 8):
        for _ in range(3):
            auto.observe(n - 1, n - 1, costs[n], 0.0, 32 if n > 1 else 0)
    ks = []
    for _ in range(rounds):
        k = auto.choose(32)
        auto.observe(k, k, costs[k + 1], 0.0, 32)
        ks.append(k)
    return ks


def test_an_untried_pass_length_is_tried_before_the_line_writes_it_off():
    """A length never timed is priced no dearer than the longest timed shorter one, so the dip
    at 17 rows is found and kept; a length that proves dear is dropped once measured."""
    ks = copy_rounds(AutoK(), t16=9.0, rounds=20)
    assert ks[-10:] == [15] * 10  # found, measured, kept
    dear = copy_rounds(AutoK(), t16=24.0, rounds=20)
    assert 1 <= dear.count(15) <= 3 and 15 not in dear[-10:]  # tried, measured, dropped
    assert 15 not in copy_rounds(LineOnly(), t16=9.0, rounds=20)  # negative control


def test_a_bucket_explores_only_once_its_drafts_have_been_accepted(monkeypatch):
    """On its prior alone a bucket drafts at the measured lengths: in open text the prior of a
    long match is too hopeful, and the tries cost a few percent of a fresh call."""

    def first_k() -> int:
        auto = AutoK()
        for n in (1, 2, 4, 8):  # a pass costs half a step per extra row, well measured
            for _ in range(3):
                auto.observe(n - 1, 0, 1 + 0.5 * (n - 1), 0.0, 0 if n == 1 else 1)
        return auto.choose(32)

    assert 0 < first_k() < 15  # drafting pays on the prior, at a measured length; 15 untried
    monkeypatch.setattr("specfast.autok.EXPLORE_AFTER", 0.0)
    assert first_k() == 15  # negative control: exploring on the prior


class LineOnly(AutoK):
    """The known-wrong pricing: a length never timed costs what the line says, so it is never
    tried."""

    def pass_seconds(self, n: int, explore: bool = False) -> float:
        return super().pass_seconds(n)


def test_ngram_rates_carry_over_between_calls_on_one_target():
    """A call starts from the n-gram rates the last call on its target ended with: after one
    call learns that 4-token matches are wrong, the next drafts nothing on them at once, while a
    call on another target starts from the prior and drafts."""
    target, other = Target(), Target()
    first = AutoK()
    first.use_match_rates(shared_match_rates(target))
    feed(first, 20, 2, 0, match=4, cost_per_token=0.6)
    again, fresh = AutoK(), AutoK()
    again.use_match_rates(shared_match_rates(target))
    fresh.use_match_rates(shared_match_rates(other))
    for auto in (again, fresh):
        auto.use_pass_costs(first._sums)
    assert again.choose(4) == 0
    assert fresh.choose(4) > 0  # negative control: the prior (4 / 5.5) drafts
    # A copy, not the same object: the new call's evidence does not rewrite the old call's.
    feed(again, 20, 2, 2, match=4, cost_per_token=0.6)
    assert first.acceptance(4) < 0.2 < 0.8 < again.acceptance(4)
    assert shared_match_rates(target)["rates"] is again._rates  # the next call starts here


def test_a_draft_models_rate_carries_over_to_the_next_call_with_the_same_draft():
    """After a call whose draft model was never right, the next call with the same draft model
    starts off (its rate, backoff and step cost carried), while a call with another draft
    model starts from the prior and drafts."""

    class Draft:  # a draft model, as far as identity goes
        pass

    target, head, other_head = Target(), Draft(), Draft()
    first = AutoK()
    first.use_match_rates(shared_match_rates(target), draft=head)
    feed(first, 20, 2, 0, match=None, cost_per_token=0.2, draft_seconds=0.02)
    again = AutoK()
    again.use_match_rates(shared_match_rates(target), draft=head)
    again.use_pass_costs(first._sums)
    assert again.draft_step_seconds == pytest.approx(0.01)
    assert [again.choose(None) for _ in range(20)] == [0] * 20
    fresh = AutoK()
    fresh.use_match_rates(shared_match_rates(target), draft=other_head)  # negative control
    fresh.use_pass_costs(first._sums)
    assert fresh.choose(None) > 0 and fresh.draft_step_seconds == 0.0
    named = AutoK()  # a head named by a string is the same head the next time
    named.use_match_rates(shared_match_rates(target), draft="eagle")
    feed(named, 20, 2, 0, match=None, cost_per_token=0.2, draft_seconds=0.02)
    by_name = AutoK()
    by_name.use_match_rates(shared_match_rates(target), draft="eagle")
    by_name.use_pass_costs(named._sums)
    assert by_name.choose(None) == 0


def test_a_long_draft_accepted_whole_rearms_backed_off_buckets():
    auto = AutoK()
    feed(auto, 20, 2, 0, match=3, cost_per_token=0.6)  # 3-token matches: backed off to 256
    assert auto._rate(3).probe_every == 256
    auto.observe(8, 8, 1.0, 0.0, 16)
    assert auto._rate(3).probe_every == 4
    auto2 = AutoK()
    feed(auto2, 20, 2, 0, match=3, cost_per_token=0.6)
    auto2.observe(8, 7, 1.0, 0.0, 16)  # negative control: not whole
    assert auto2._rate(3).probe_every == 256


def test_generate_drafters_start_from_the_last_calls_rates():
    from specfast.drafters import make_drafter
    from specfast.drafters.base import DraftSetup

    def make(target):
        return make_drafter("ngram", DraftSetup(target, None, 64, vocabulary=None))

    target = Target()
    first = make(target)
    feed(first.auto, 20, 2, 0, match=4, cost_per_token=0.6)
    second, unrelated = make(target), make(Target())
    assert abs(second.auto.acceptance(4) - first.auto.acceptance(4)) < 1e-12
    assert second.auto.acceptance(4) < 0.2
    assert unrelated.auto.acceptance(4) > 0.7  # negative control: another target, the prior


def test_a_carried_rate_is_a_prior_that_the_new_calls_evidence_soon_outweighs(monkeypatch):
    """A chat after a code edit: 4-token matches were right every time in the last call and are
    wrong in this one. Carried as a prior (two observations' worth), the rate says "off" after
    two failed rounds; carried with all the last call's evidence, it would keep drafting."""
    from specfast import autok

    def rounds_until_off() -> int:
        target = Target()
        edit = AutoK()
        edit.use_match_rates(shared_match_rates(target))
        feed(edit, 40, 2, 2, match=4, cost_per_token=0.6)  # right every time
        chat = AutoK()
        chat.use_match_rates(shared_match_rates(target))
        chat.use_pass_costs(edit._sums)
        n = 0
        while chat.choose(4) and n < 50:
            chat.observe(2, 0, 2.2, 0.0, 4)  # wrong every time
            n += 1
        return n

    assert rounds_until_off() <= 2
    monkeypatch.setattr(autok, "CARRIED_WEIGHT", 1e9)  # negative control: all the evidence
    assert rounds_until_off() > 4


def test_measured_pass_costs_are_the_decayed_means_per_length():
    from specfast.autok import measured_pass_costs

    target = ReplayLikeTarget()
    assert measured_pass_costs(target) == {}
    auto = AutoK()
    auto.use_pass_costs(shared_pass_costs(target))
    for seconds in (0.010, 0.020):  # two plain rounds: t(1)'s weights are 0.8 and 1
        auto.observe(0, 0, seconds)
    auto.observe(3, 1, 0.050)  # one pass over 4 tokens
    got = measured_pass_costs(target)
    assert list(got) == [1, 4]
    assert got[1] == pytest.approx((0.8 * 0.010 + 0.020) / 1.8) and got[4] == pytest.approx(0.05)
    assert measured_pass_costs(ReplayLikeTarget()) == {}  # per target


def test_pass_cost_line_names_the_runtime_and_ratios():
    from specfast.bench import format_pass_costs

    line = format_pass_costs("llama.cpp", {1: 0.0125, 4: 0.025, 16: 0.1})
    assert line == (
        "pass cost on llama.cpp, as auto k measured it: t(1) = 12.5 ms; "
        "t(n)/t(1) for n tokens: 4:2.00 16:8.00; with every draft accepted, at most "
        "2.00x plain (n = 4)"
    )
    # The ceiling is the best n t(1) / t(n), not the longest pass's.
    assert format_pass_costs("x", {1: 0.01, 4: 0.03, 16: 0.04}).endswith("4.00x plain (n = 16)")
    assert "no longer pass measured" in format_pass_costs("specfast", {1: 0.01})


class ReplayLikeTarget:
    """A stand-in target: AutoK's tables are keyed weakly, so it needs a class of its own."""


def flat_copy_auto(per_row: float, lengths=(1, 2, 4, 8, 12, 16)) -> AutoK:
    """Every draft of a 32-token match accepted; a pass over n costs 1 + per_row (n - 1), timed
    three times at each of `lengths`."""
    auto = AutoK()
    for n in lengths:
        for _ in range(3):
            auto.observe(n - 1, n - 1, 1 + per_row * (n - 1), 0.0, 32 if n > 1 else 0)
    return auto


def test_a_long_copy_uses_a_24_token_pass_where_verifying_is_nearly_free():
    """torch in bf16 on a CPU: 24 tokens cost about 1.6 of one, so a copy that is always right
    is verified 23 drafts at a time, not 15."""
    assert flat_copy_auto(per_row=0.03).choose(32) == 23
    assert flat_copy_auto(per_row=1.0).choose(32) < 23  # negative control: a step per row


def test_a_pass_past_16_is_tried_only_once_16_tokens_were_timed_nearly_free(monkeypatch):
    """llama.cpp on a CPU: 16 tokens cost 8.5 steps here. Every draft is right, so the rate
    model says 24 pays (24 tokens for 12.5 against 16 for 8.5), but real runs end early and
    long passes lost in the replay; so 24 is left to runtimes where 16 proved nearly free, and
    not tried before 16 was timed at all."""
    assert flat_copy_auto(per_row=0.5).choose(32) == 15
    assert flat_copy_auto(per_row=0.03, lengths=(1, 2, 4, 8)).choose(32) < 23  # 16 untimed
    monkeypatch.setattr("specfast.autok.LONG_PASS_MAX_COST", float("inf"))
    assert flat_copy_auto(per_row=0.5).choose(32) == 23  # negative control: no bound
