"""A drafter that is none of specfast's, in this one file and no change to the package: it
proposes what followed the last earlier occurrence of the last token (a bigram lookup). Any
object with the drafter protocol (`specfast.drafters.base.Drafter`) is taken as it is."""

import copy
from typing import ClassVar

import specfast
from specfast import Model, ModelConfig
from specfast.drafters.base import Proposal


class BigramDrafter:
    wants_features = False
    feature_layers = ()

    def __init__(self, k: int = 4):
        self.k, self.tokens, self.proposed, self.accepted = k, [], 0, 0

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)

    def prefill(self, features=None) -> None:
        pass

    def start_turn(self, seed, params) -> None:
        pass

    def propose(self, budget: int) -> Proposal:
        last = self.tokens[-1]
        for i in range(len(self.tokens) - 2, -1, -1):
            if self.tokens[i] == last:
                draft = self.tokens[i + 1 : i + 1 + min(self.k, budget)]
                self.proposed += len(draft)
                return Proposal(draft)
        return Proposal([])

    def observe(self, proposal, n_accepted, verify_seconds, verified) -> None:
        self.accepted += n_accepted

    def rollback(self, kept) -> None:
        self.tokens = list(kept)

    def fork(self, ids):
        new = copy.copy(self)
        new.tokens = list(ids)
        return new


def test_a_drafter_of_ones_own_speculates_exactly():
    model = Model.from_config(
        ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2), seed=5
    )
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 3]
    want = specfast.generate(model, prompt, max_new_tokens=40, drafter=None).token_ids
    drafter = BigramDrafter()
    out = specfast.generate(model, prompt, max_new_tokens=40, drafter=drafter)
    assert out.token_ids == want
    # The round used it: its proposals were drafted and its feedback came back.
    assert drafter.proposed == out.stats.draft_tokens > 0
    assert drafter.accepted == out.stats.accepted_tokens


class NamedBigram(BigramDrafter):
    """The same drafter under a name of its own: a class that binds itself to the generation
    (`bind(name, setup)`) and one line in drafters.NAMED, as a drafter of the package is added."""

    made: ClassVar[list] = []

    @classmethod
    def bind(cls, name, setup):
        made = cls(k=setup.fixed_k or 4)
        cls.made.append((name, setup.max_length, made))
        return made


def test_a_named_drafter_is_one_class_and_one_line(monkeypatch):
    import pytest

    from specfast import drafters

    model = Model.from_config(
        ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2), seed=5
    )
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 3]
    want = specfast.generate(model, prompt, max_new_tokens=40, drafter=None).token_ids
    with pytest.raises(ValueError, match='"ngram", "eagle"'):  # not a name yet
        specfast.generate(model, prompt, max_new_tokens=40, drafter="bigram")
    monkeypatch.setitem(drafters.NAMED, "bigram", NamedBigram.bind)
    out = specfast.generate(
        model, prompt, max_new_tokens=40, drafter="bigram", num_speculative_tokens=3
    )
    assert out.token_ids == want
    name, max_length, made = NamedBigram.made[-1]
    assert (name, max_length, made.k) == ("bigram", len(prompt) + 40, 3)
    assert made.proposed == out.stats.draft_tokens > 0
