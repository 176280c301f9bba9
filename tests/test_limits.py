"""Resource limits behave as documented: the context, a draft model larger than the target (allowed,
with a warning), a draft model with a shorter context, and the n-gram corpus memory bound."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import specfast
from specfast import NgramDrafter
from specfast.model import Model, ModelConfig


def _model(dim=64, layers=2, max_context=256, seed=0):
    config = ModelConfig(
        vocab_size=300, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2,
        intermediate_size=96, max_context=max_context,
    )  # fmt: skip
    return Model.from_config(config, seed=seed)


PROMPT = [5, 6, 7, 8] * 5


def test_prompt_plus_new_tokens_beyond_context_is_refused_before_any_work():
    model = _model(max_context=64)
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ max_new_tokens \(45\) exceeds"):
        specfast.generate(model, PROMPT, max_new_tokens=45)
    with pytest.raises(ValueError, match="context of 64"):
        specfast.generate(model, [1] * 65, max_new_tokens=1)
    # The boundary itself is allowed: 20 + 44 = 64 positions.
    out = specfast.generate(model, PROMPT, max_new_tokens=44, ignore_eos=True)
    assert len(out.token_ids) == 44


def test_draft_larger_than_target_is_allowed_with_a_warning_and_stays_exact():
    target, big = _model(seed=0), _model(dim=128, layers=3, seed=1)
    plain = specfast.generate(target, PROMPT, max_new_tokens=24, drafter=None, ignore_eos=True)
    with pytest.warns(UserWarning, match="larger than the target") as record:
        out = specfast.generate(target, PROMPT, max_new_tokens=24, drafter=big,
                                num_speculative_tokens=3, ignore_eos=True)  # fmt: skip
    assert record[0].filename == __file__  # pointed at the caller's line
    assert out.token_ids == plain.token_ids


def test_draft_of_equal_size_does_not_warn():
    target = _model(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specfast.generate(target, PROMPT, max_new_tokens=8, drafter=target)  # its own draft
        specfast.generate(target, PROMPT, max_new_tokens=8, drafter=_model(seed=2))


def test_draft_with_a_shorter_context_is_refused():
    target, short = _model(max_context=256), _model(max_context=32, seed=1)
    with pytest.raises(ValueError, match="exceeds the model's context of 32"):
        specfast.generate(target, PROMPT, max_new_tokens=40, drafter=short)


def test_corpus_memory_stays_bounded():
    # 40x the bound in documents: the indexed corpus never exceeds max_corpus_tokens, and its
    # memory stops growing once eviction starts.
    bound = 20_000
    d = NgramDrafter(max_corpus_tokens=bound)
    rng = np.random.default_rng(0)
    sizes = []
    for _ in range(200):
        d.add_document(rng.integers(0, 5000, 4000).astype(np.uint32))
        assert d.corpus_tokens <= bound
        sizes.append(d.memory_bytes())
    assert max(sizes[100:]) <= 1.05 * max(sizes[:100])
    # A single document longer than the bound keeps its last `bound` tokens.
    doc = np.arange(3 * bound, dtype=np.uint32)
    d.add_document(doc)
    assert d.corpus_tokens == bound
    d.reset()
    d.extend([3 * bound - 5])
    assert d.propose(3) == [3 * bound - 4, 3 * bound - 3, 3 * bound - 2]


def test_corpus_bound_above_the_index_limit_is_refused():
    with pytest.raises(ValueError, match="max_corpus_tokens"):
        NgramDrafter(max_corpus_tokens=2**28)


@pytest.mark.parametrize("fn", ["accept_sampled", "rule_tables"])
def test_acceptance_with_an_overflowing_shape_is_a_value_error(fn):
    # Found by fuzz/accept: a (0, 2**60) array holds nothing, but 16 rows of it overflow usize;
    # the wrapped product matched the empty buffer and the row slicing panicked.
    from specfast import _core

    target = np.zeros((0, 2**60), np.float32)
    with pytest.raises(ValueError, match="target_probs must have shape"):
        if fn == "accept_sampled":
            _core.accept_sampled(target, [1] * 15, seed=1)
        else:
            _core.rule_tables(target, [1] * 15)
