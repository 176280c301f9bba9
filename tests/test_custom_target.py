"""A target that is none of specfast's runtimes, in this one file and no change to the package:
specfast's Model wrapped so that it counts its passes. Anything with the target surface
(`specfast.targets.is_target`: vocab_size, max_context, device, decoder(max_length)) is a
target, and its decoder needs forward, forward_greedy, greedy_ids, rollback and length."""

import specfast
from specfast import Model, ModelConfig
from specfast.targets import is_target


class CountingTarget:
    def __init__(self, model: Model, broken_rollback: bool = False):
        self.model, self.passes, self.broken_rollback = model, 0, broken_rollback
        self.vocab_size, self.max_context, self.device = (
            model.vocab_size,
            model.max_context,
            model.device,
        )

    def decoder(self, max_length: int | None = None):
        return CountingDecoder(self, self.model.decoder(max_length))


class CountingDecoder:
    def __init__(self, target: CountingTarget, inner):
        self.target, self.inner = target, inner

    @property
    def length(self) -> int:
        return self.inner.length

    def forward(self, ids, last_only=False, features=None):
        self.target.passes += 1
        if features is None:
            return self.inner.forward(ids, last_only=last_only)
        return self.inner.forward(ids, last_only=last_only, features=features)

    def forward_greedy(self, ids, features=None):
        self.target.passes += 1
        return self.inner.forward_greedy(ids, features=features)

    def greedy_ids(self, tokens):
        self.target.passes += 1
        return self.inner.greedy_ids(tokens)

    def rollback(self, length: int) -> None:
        # broken_rollback: off by one, dropping a committed token's keys and values too
        self.inner.rollback(length - 1 if self.target.broken_rollback else length)


def tiny() -> Model:
    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    return Model.from_config(cfg, seed=0)


PROMPT = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 3]


def test_a_wrapped_model_is_a_target_and_speculates_exactly():
    model = tiny()
    target = CountingTarget(model)
    assert is_target(target) and not is_target(object())
    want = specfast.generate(model, PROMPT, max_new_tokens=40, drafter=None).token_ids
    out = specfast.generate(target, PROMPT, max_new_tokens=40, drafter="ngram")
    assert out.token_ids == want
    assert target.passes == out.stats.target_passes and out.stats.accepted_tokens > 0


def test_negative_control_a_decoder_that_rolls_back_wrong_is_caught():
    model = tiny()
    want = specfast.generate(model, PROMPT, max_new_tokens=40, drafter=None).token_ids
    target = CountingTarget(model, broken_rollback=True)
    out = specfast.generate(target, PROMPT, max_new_tokens=40, drafter="ngram")
    assert out.token_ids != want
