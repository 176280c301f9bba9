"""num_speculative_tokens="auto": choose k each round from measured acceptance and measured cost.

Leviathan et al.: with a per-token acceptance rate a, a round that verifies k drafts yields
(1 - a^(k+1)) / (1 - a) tokens on average and costs one target pass over k+1 tokens (plus k
draft steps for a draft model). Each round we pick the k that maximises tokens per second under
the current estimates, and k = 0 (plain decoding) when nothing pays.

Both estimates are measured online, so the rule adapts to the machine and dtype: on a CPU in
bfloat16 a pass over 9 tokens costs about what a pass over 1 does, so any acceptance pays; in
float32 each extra token costs more and weak evidence switches speculation off.

For the n-gram drafter the acceptance rate is kept per bucket of match length: a 12-token match
is right far more often than a 1-token one, and one global rate would let the many short,
useless matches of open text switch off the long, valuable ones of quoted text (or the reverse).
A bucket of matches of 3+ tokens whose rate says "off" is probed now and then, with exponential
backoff, so a workload that starts repeating is noticed; a long draft accepted whole re-arms
every backed-off bucket. 1-2 token matches are not probed: repeating text outgrows them at once.

The n-gram's rates outlive a call (and a draft model's, when the next call drafts with the same
one): each generate() call on a target starts from a copy of the
rates the last call on it ended with (`shared_match_rates`), as pass costs carry over, weighed
as a prior (two observations' worth) so that a chat after a code edit relearns within two
rounds. A fresh call's prior says a 3-8 token match is usually right; in open chat it is right
far less often, and where a batched pass is dear (llama.cpp on a CPU) relearning that in every
call would cost every answer. Outputs do not change: greedy is
exact whatever k, and n-gram sampling draws each position from (seed, position), whatever the
rounds.

Pass cost: the mean time measured at a pass length where that length was timed often enough
(always for t(1), the plain step), else a line through the means of every measured length. On
llama.cpp the cost is concave at the start (docs/benchmarks.md §4), so the line alone would put
t(1) too high and t(2) too low: plain decoding would look slower than it is, and weak drafts
worth it. The n-gram prices a length longer than any timed one no dearer than the longest
timed one, so it gets tried: llama.cpp's curve has dips the line cannot see (16 rows cheaper
than 13), and a length the line overprices would never be timed.

A draft model's acceptance is anything but uniform: it copies a function it has seen with
near-certainty and guesses at the next idea. So a round's length is not fixed in advance. The
draft runs up to `max_draft_k` steps and stops once the next step is unlikely to pay
(`keep_drafting`): the chance that every draft so far survives, from the draft's own
probabilities calibrated online against what the target accepted (per bucket of probability),
must exceed what the next step costs in tokens at the current rate.
"""

from __future__ import annotations

import bisect
import copy
import weakref

# k such that a pass over k + 1 rows is 1, 2, 3, 4, 6, 8, 12, 16 or 24: powers of two and their
# midpoints. llama.cpp's CPU kernels take rows in blocks (16 rows can cost less than 13-15), and
# compiled steps pad a pass to a power of two (static.BUCKETS), so 17 rows cost as much as 32
# there. The set is chosen by replaying fixed outputs with each candidate set
# (`python benches/llama_replay.py [--costs-of specfast --max-pass 33]`; docs/benchmarks.md
# §14). A pass over 24 pays only where verifying is nearly free (LONG_PASS below).
CANDIDATES = (0, 1, 2, 3, 5, 7, 11, 15, 23)
# Passes past LONG_PASS tokens are candidates only once a LONG_PASS-token pass has been timed at
# no more than LONG_PASS_MAX_COST single steps: verifying is nearly free there. Elsewhere the
# geometric acceptance model overrates long drafts (the n-gram's runs are all-or-nothing), and
# tries on the flat prior before any pass is timed cost more than they find (llama_replay.py).
LONG_PASS, LONG_PASS_MAX_COST = 16, 2.0
MATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # lower edges, in tokens of match length
# Lower edges of the draft model's probability for its token; the last buckets are narrow
# because copying runs live there, where 0.99 and 0.999 mean very different run lengths.
CONFIDENCE_BUCKETS = (0.0, 0.2, 0.4, 0.6, 0.75, 0.85, 0.92, 0.96, 0.98, 0.99, 0.995, 0.999)
CARRIED_WEIGHT = 2.0  # observations' worth of a rate carried from the last call (a fresh prior's)
REARM_K = 8  # a draft at least this long, accepted whole, re-arms backed-off buckets' probes
MODEL_REARM_K = 2  # a draft model's probe re-arms its probing when this many are accepted whole
# Shorter n-gram matches are never probed once their rate says "off": when text starts to repeat,
# its matches grow past this within a token or two and the longer buckets take over; probing 1-2
# token matches never paid in benches/llama_replay.py (docs/benchmarks.md §14).
PROBE_MIN_MATCH = 3
# A bucket explores untried pass lengths (pass_seconds) once its drafts have had this many tokens
# accepted (decayed): on a prior alone, open text paid for the tries and got nothing back.
EXPLORE_AFTER = 4.0
# A pass length timed this often recently (decayed count) is priced at its own mean, not the line.
WELL_MEASURED = 2.0


# A pass's cost belongs to the target and the machine, not to one call: the decayed sums are kept
# per target, so each generate() call starts from what earlier ones measured, not from a prior
# that calls verification free.
_PASS_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_pass_costs(target) -> dict[int, list[float]]:
    """The target's pass-cost sums (n -> [weight, seconds])."""
    return _per_target(_PASS_COSTS, target)


def measured_pass_costs(target) -> dict[int, float]:
    """n -> seconds of one target pass over n tokens, as auto k has measured them on `target`
    (decayed means, so recent passes weigh most); empty before any auto-k round ran on it."""
    sums = shared_pass_costs(target)
    return {n: t / w for n, (w, t) in sorted(sums.items()) if w > 0}


# The n-gram's acceptance per match length, per target: the rates of the latest call's AutoK.
_MATCH_RATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_match_rates(target) -> dict:
    """The target's holder of the latest call's rates, and of its draft model's name."""
    return _per_target(_MATCH_RATES, target)


def _per_target(table: weakref.WeakKeyDictionary, target) -> dict:
    """The target's dict in `table`; a new one for an object that cannot be weakly referenced."""
    try:
        return table.setdefault(target, {})
    except TypeError:
        return {}


def _reference(draft):
    """What names a draft model from one call to the next: its name, or a weak reference."""
    if isinstance(draft, str):
        return draft
    try:
        return weakref.ref(draft)
    except TypeError:
        return None


def _is(reference, draft) -> bool:
    if isinstance(draft, str):
        return reference == draft
    return isinstance(reference, weakref.ref) and reference() is draft


def match_bucket(match_length: int | None) -> int | None:
    if match_length is None:
        return None  # a draft model: one rate for everything
    return max((b for b in MATCH_BUCKETS if b <= match_length), default=0)


class _Rate:
    """A decayed count of accepted drafts and of rejections (rounds that stopped early)."""

    def __init__(self, prior: float, weight: float = 2.0):
        self.accepts, self.rejects = prior * weight, (1 - prior) * weight
        self.off_rounds, self.probe_every = 0, 4

    @property
    def value(self) -> float:
        return self.accepts / (self.accepts + self.rejects)


def confidence_bucket(p: float) -> float:
    return CONFIDENCE_BUCKETS[max(bisect.bisect_right(CONFIDENCE_BUCKETS, p) - 1, 0)]


class AutoK:
    def __init__(self, max_k: int = 24, decay: float = 0.9, max_draft_k: int = 32):
        self.max_k = max_k
        self.max_draft_k = max_draft_k
        self.decay = decay
        self._rates: dict[int | None, _Rate] = {}
        self._calibration: dict[float, _Rate] = {}  # confidence bucket -> acceptance
        # Decayed sums of tokens committed and seconds spent per round: the running rate.
        self._tokens, self._seconds = 0.0, 0.0
        # Pass cost t(n): decayed sums per n, and what pass_seconds reads from them.
        self._sums: dict[int, list[float]] = {}  # n -> [weight, total seconds]; use_pass_costs
        self._fit: tuple[dict[int, float], float, float, float] | None = None
        self.draft_step_seconds = 0.0  # a draft model's cost per proposed token

    def use_pass_costs(self, sums: dict[int, list[float]]) -> None:
        """Fits pass cost from `sums` (shared_pass_costs(target)), updating them in place."""
        self._sums, self._fit = sums, None

    def use_match_rates(self, latest: dict, draft=None) -> None:
        """Starts the n-gram rates from a copy of the last call's on this target (`latest`, from
        shared_match_rates), probe backoff included, and leaves this call's there for the next
        call. `draft` is the draft model (the object, or the string naming an EAGLE head): when
        the last call drafted with the same one, its rate and step cost carry over too, so a
        call does not spend its first rounds relearning that the draft does not pay here. Its
        confidence calibration stays per call."""
        last = latest.get("draft")  # (weak reference or name, that call's AutoK)
        same_draft = draft is not None and last is not None and _is(last[0], draft)
        if same_draft and last is not None:
            self.draft_step_seconds = last[1].draft_step_seconds
        for bucket, r in list(latest.get("rates", {}).items()):  # one C call: thread-safe
            if bucket is not None or same_draft:
                mine = self._rates[bucket] = copy.copy(r)
                # The last call's rate is a prior for this one, not evidence about it: as strong
                # as a fresh prior, so a chat after a code edit stops drafting within two rounds.
                weight = mine.accepts + mine.rejects
                if weight > CARRIED_WEIGHT:
                    mine.accepts *= CARRIED_WEIGHT / weight
                    mine.rejects *= CARRIED_WEIGHT / weight
        latest["rates"] = self._rates
        if draft is not None:
            latest["draft"] = (_reference(draft), self)

    def _rate(self, bucket: int | None) -> _Rate:
        if bucket not in self._rates:
            # Prior: longer matches are likelier right (a = L / (L + 1.5)); a draft model: 0.6.
            prior = 0.6 if bucket is None else bucket / (bucket + 1.5)
            self._rates[bucket] = _Rate(prior)
        return self._rates[bucket]

    def acceptance(self, match_length: int | None = None) -> float:
        return self._rate(match_bucket(match_length)).value

    def observe(
        self,
        n_draft: int,
        n_accepted: int,
        seconds: float | None,
        draft_seconds: float = 0.0,
        match_length: int | None = None,
    ) -> None:
        """Records one round: drafts verified, drafts accepted, and the target pass time.
        seconds None: the pass's time is no pass cost (it compiled a graph or recorded a CUDA
        graph, seconds where a pass takes milliseconds): only the acceptance is recorded. The
        costs are shared by every call on the target, so one such time would price that pass
        length out for good."""
        if n_draft:
            r = self._rate(match_bucket(match_length))
            r.accepts = self.decay * r.accepts + n_accepted
            r.rejects = self.decay * r.rejects + (n_accepted < n_draft)
            # A probe that found something re-arms frequent probing; one that did not backs off.
            # For the n-gram, any accepted draft is news (text that repeats). A draft model
            # whose rate says "off" still gets its first draft right now and then (an EAGLE
            # head in open text often does, and often stops itself after one), and re-arming on
            # that would probe every few rounds for good, each probe a catch-up and a longer
            # pass. Only a run of 2+ drafts accepted whole is news for it; its rate still counts
            # every draft, and turns it on if they pay.
            if match_length is None:
                found = n_accepted == n_draft >= MODEL_REARM_K
            else:
                found = n_accepted > 0
            r.probe_every = 4 if found else min(r.probe_every * 2, 256)
            if n_accepted == n_draft >= REARM_K and match_length is not None:
                # The text repeats after all: look again where short matches were written off.
                for other in self._rates.values():
                    other.probe_every = min(other.probe_every, 4)
            if draft_seconds and match_length is None:  # a draft model's round
                per = draft_seconds / n_draft
                d = self.draft_step_seconds
                self.draft_step_seconds = per if d == 0 else 0.8 * d + 0.2 * per
        if seconds is None:
            return
        self._tokens = 0.9 * self._tokens + n_accepted + 1
        self._seconds = 0.9 * self._seconds + seconds + draft_seconds
        w_t = self._sums.setdefault(n_draft + 1, [0.0, 0.0])
        w_t[0] = 0.8 * w_t[0] + 1.0
        w_t[1] = 0.8 * w_t[1] + seconds
        self._fit = None

    def pass_seconds(self, n: int, explore: bool = False) -> float:
        """Estimated target pass time over n tokens: its measured mean where well measured, else
        a line through every measured length; a weak, nearly flat prior before any.

        explore=True prices a length longer than every well-measured one optimistically: no
        dearer than the longest of them. llama.cpp's cost curve has dips (Q4_K on a CPU: 16 rows
        cost less than 13) that the line cannot see, and a length the line overprices is never
        tried, so it never gets measured. It is tried only where its drafts would pay even at
        that price, and three tries measure it; lengths between measured ones keep the line."""
        if self._fit is None:
            self._fit = self._fit_pass_cost()
        measured, intercept, slope, floor = self._fit
        if n in measured:
            return measured[n]
        line = max(intercept + slope * n, floor)
        if explore and measured and n > max(measured):
            return min(line, measured[max(measured)])
        return line

    def _fit_pass_cost(self) -> tuple[dict[int, float], float, float, float]:
        """(the well-measured means, intercept, slope, floor), refitted once per observation,
        not per candidate. t(1) always counts as well measured: it is the baseline."""
        means = {m: t / w for m, (w, t) in self._sums.items() if w > 0}
        if not means:
            return {}, 1.0, 0.0, 1.0
        measured = {m: t for m, t in means.items() if m == 1 or self._sums[m][0] >= WELL_MEASURED}
        base = means.get(1, min(means.values()))
        if len(means) < 2:
            return measured, base * 0.98, base * 0.02, base * 0.5
        xs = list(means)
        mx = sum(xs) / len(xs)
        my = sum(means.values()) / len(xs)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (means[x] - my) for x in xs) / var if var else 0.0
        return measured, my - slope * mx, slope, base * 0.5

    def _best(self, match_length: int | None) -> tuple[int, float]:
        """The best k for this evidence and its expected tokens per second (k = 0: plain)."""
        r = self._rate(match_bucket(match_length))
        a = min(r.value, 0.999)
        step = self.draft_step_seconds if match_length is None else 0.0  # n-gram: microseconds
        explore = match_length is not None and r.accepts >= EXPLORE_AFTER
        best_k, best_rate = 0, 1.0 / self.pass_seconds(1)
        for k in CANDIDATES[1:]:
            if k > self.max_k:
                break
            if k + 1 > LONG_PASS and not self._long_passes_pay():
                break
            cost = self.pass_seconds(k + 1, explore) + k * step
            rate = (1 - a ** (k + 1)) / (1 - a) / cost
            if rate > best_rate * 1.001:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def _long_passes_pay(self) -> bool:
        """Has a LONG_PASS-token pass been timed at no more than LONG_PASS_MAX_COST steps?"""
        if self._fit is None:
            self._fit = self._fit_pass_cost()
        measured = self._fit[0]
        t1, long = measured.get(1), measured.get(LONG_PASS)
        return t1 is not None and long is not None and long <= LONG_PASS_MAX_COST * t1

    def _or_probe(self, k: int, match_length: int | None) -> int:
        r = self._rate(match_bucket(match_length))
        if k:
            r.off_rounds = 0
            return k
        # Off for this evidence: probe now and then so a change of workload is noticed.
        if match_length is not None and match_length < PROBE_MIN_MATCH:
            return 0
        r.off_rounds += 1
        return 2 if r.off_rounds % r.probe_every == 0 else 0

    def choose(self, match_length: int | None = None) -> int:
        """k for this round; 0 means plain decoding. match_length 0: the n-gram has nothing."""
        if match_length == 0:
            return 0
        return self._or_probe(self._best(match_length)[0], match_length)

    def observe_confidences(self, confidences: list[float], n_accepted: int) -> None:
        """Calibrates the draft's probabilities: which of this round's drafts were accepted."""
        for i, p in enumerate(confidences[: n_accepted + 1]):
            r = self._confidence_rate(p)
            r.accepts = 0.98 * r.accepts + (i < n_accepted)
            r.rejects = 0.98 * r.rejects + (i == n_accepted)

    def _confidence_rate(self, p: float) -> _Rate:
        b = confidence_bucket(p)
        if b not in self._calibration:
            self._calibration[b] = _Rate(prior=min(b + 0.05, 0.99))
        return self._calibration[b]

    def keep_drafting(self, confidences: list[float]) -> bool:
        """After a draft-model step: is one more step worth it? The next draft adds a token only
        if it and every earlier draft are accepted; that chance (the calibrated probabilities
        so far, times the last one again as the guess for the next) must beat the tokens the
        step's cost would buy at the running rate."""
        n = len(confidences)
        if n >= self.max_draft_k:
            return False
        survive = self._confidence_rate(confidences[-1]).value
        for p in confidences:
            survive *= self._confidence_rate(p).value
        if self.draft_step_seconds == 0 or self._seconds == 0:
            return survive >= 0.5  # nothing measured yet
        step = self.draft_step_seconds + self.pass_seconds(n + 2) - self.pass_seconds(n + 1)
        return survive >= step * self._tokens / self._seconds

    def choose_draft(self) -> int:
        """A draft model's k bound for this round: 0 (plain) when drafting does not pay,
        else `max_draft_k`, with `keep_drafting` ending the round early."""
        return self.max_draft_k if self.choose(None) else 0

    def choose_source(self, match_length: int) -> tuple[bool, int]:
        """For an n-gram + draft-model pair: (draft with the n-gram?, k), whichever pays more."""
        ngram_k, ngram_rate = self._best(match_length) if match_length else (0, 0.0)
        model_k, model_rate = self._best(None)
        if ngram_k and ngram_rate >= model_rate:
            return True, ngram_k
        return False, self._or_probe(model_k, None)
