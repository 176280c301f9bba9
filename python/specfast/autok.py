"""num_speculative_tokens="auto": choose k each round from measured acceptance and measured cost.

Leviathan et al.: with a per-token acceptance rate a, a round that verifies k drafts yields
(1 - a^(k+1)) / (1 - a) tokens on average and costs one target pass over k+1 tokens (plus k
draft steps for a draft model). We pick the k that maximises tokens per second under the
current estimates, and k = 0 (plain decoding) when nothing pays.

Both estimates are measured online, so the rule adapts to the machine and dtype: on a CPU in
bfloat16 a pass over 9 tokens costs about what a pass over 1 does, so any acceptance pays; in
float32 each extra token costs ~5-10% and low acceptance switches speculation off. While off, a
short probe round runs with exponential backoff so a workload that starts repeating is noticed.
"""

from __future__ import annotations

CANDIDATES = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16)


class AutoK:
    def __init__(self, max_k: int = 16, draft_model: bool = False, decay: float = 0.9):
        self.max_k = max_k
        self.draft_model = draft_model
        self.decay = decay
        # Acceptance, as decayed counts of accepted tokens and of rejections (a round that
        # stopped before its last draft). Prior: 1 accept, 1 reject -> a = 0.5.
        self.accepts, self.rejects = 1.0, 1.0
        # Pass cost t(n) = base + slope * (n - 1), fitted from decayed sums per n.
        self._sums: dict[int, list[float]] = {}  # n -> [weight, total seconds]
        self.draft_step_seconds = 0.0  # a draft model's cost per proposed token
        self._off_rounds = 0
        self._probe_every = 4

    @property
    def acceptance(self) -> float:
        return self.accepts / (self.accepts + self.rejects)

    def observe(self, n_draft: int, n_accepted: int, seconds: float, draft_seconds: float = 0.0):
        """Records one round: drafts verified, drafts accepted, and the target pass time."""
        if n_draft:
            self.accepts = self.decay * self.accepts + n_accepted
            self.rejects = self.decay * self.rejects + (n_accepted < n_draft)
            if n_accepted:
                self._probe_every = 4  # the workload repeats again: probe often
            else:
                self._probe_every = min(self._probe_every * 2, 256)
            if draft_seconds:
                per = draft_seconds / n_draft
                d = self.draft_step_seconds
                self.draft_step_seconds = per if d == 0 else 0.8 * d + 0.2 * per
        w_t = self._sums.setdefault(n_draft + 1, [0.0, 0.0])
        w_t[0] = 0.8 * w_t[0] + 1.0
        w_t[1] = 0.8 * w_t[1] + seconds

    def pass_seconds(self, n: int) -> float:
        """Estimated target pass time over n tokens (linear fit; a weak prior fills the gaps)."""
        means = {m: t / w for m, (w, t) in self._sums.items() if w > 0}
        if not means:
            return 1.0
        base = means.get(1, min(means.values()))
        if len(means) < 2:
            return base * (1 + 0.02 * (n - 1))
        xs = list(means)
        mx = sum(xs) / len(xs)
        my = sum(means.values()) / len(xs)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (means[x] - my) for x in xs) / var if var else 0.0
        intercept = my - slope * mx
        return max(intercept + slope * n, base * 0.5)

    def expected_tokens(self, k: int) -> float:
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def choose(self) -> int:
        best_k, best_rate = 0, 0.0
        for k in CANDIDATES:
            if k > self.max_k:
                break
            cost = self.pass_seconds(k + 1) + k * self.draft_step_seconds
            rate = self.expected_tokens(k) / cost
            if rate > best_rate * 1.001:
                best_k, best_rate = k, rate
        if best_k:
            self._off_rounds = 0
            return best_k
        # Off: probe now and then so a workload that starts repeating is noticed.
        self._off_rounds += 1
        if self._off_rounds % self._probe_every == 0:
            return 2
        return 0
