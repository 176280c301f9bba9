"""EAGLE-3 over llama.cpp: the layer inputs llama.cpp copies out of each llama_decode, and exact
drafting with a head that reads them.

The tiny target is a GGUF written in the test (F32, llama architecture), which both llama.cpp and
specfast's runtime load; the head learns that model's greedy text from specfast's runtime and
then drafts over llama.cpp, so it drafts well only if llama.cpp hands it the same features.
"""

from __future__ import annotations

import pytest
import torch

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="needs llama-cpp-python: pip install 'specfast[llama]'"
)

from test_eagle import fit_head  # noqa: E402
from test_generate_distribution import ALPHA, N  # noqa: E402
from test_llama_cpp import (  # noqa: E402
    GREEDY_NEW,
    joint_of_3,
    new_llama,
    next_logits,
    pvalue,
    same_up_to_near_ties,
    sharpened_gguf,
    smol_prompts,
)

import specfast  # noqa: E402
from specfast.drafters.eagle import EagleDraft  # noqa: E402
from specfast.targets.llama_cpp import LayerInputs, LlamaDecoder  # noqa: E402
from specfast.targets.llama_cpp.state import llama_state  # noqa: E402
from specfast.targets.llama_cpp.target import llama_embedding  # noqa: E402

PROMPT = [1, 2, 3, 200, 2, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
NEW = 40


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return sharpened_gguf(tmp_path_factory.mktemp("e") / "tiny.gguf", seed=1)


@pytest.fixture(scope="module")
def tiny(gguf_path):
    # n_batch=8: the 20-token prompt goes in three llama_decode calls, and n_ubatch=3: each
    # call computes in ubatches of 3, so rows of every chunk and ubatch must land in place.
    return new_llama(gguf_path, n_batch=8, n_ubatch=3)


@pytest.fixture(scope="module")
def torch_target(gguf_path):
    return specfast.load_model(gguf_path, dtype="float32")


@pytest.fixture(scope="module")
def plain(tiny) -> list[int]:
    return specfast.generate(tiny, PROMPT, NEW, drafter=None, ignore_eos=True).token_ids


@pytest.fixture(scope="module")
def head(torch_target, plain):
    """A float32 head over 200 of the 320 ids, taught the target's greedy text through
    specfast's runtime (features from torch), never through llama.cpp."""
    from specfast.drafters.eagle.head import EagleConfig, random_head

    config = EagleConfig.for_target(torch_target, draft_vocab_size=200, aux_layers=(0, 1, 1))
    head = random_head(config, seed=1)
    head.bind_embedding(torch_target.embed.weight)
    needed = sorted(set(PROMPT + plain))
    rest = [t for t in range(320) if t not in needed]
    head.set_draft_vocab((needed + rest)[:200][::-1])  # draft order != target order: d2t
    return fit_head(torch_target, head, PROMPT + plain)


def features(llama, ids: list[int], layers=(0, 1)) -> torch.Tensor:
    return LlamaDecoder(llama).forward(torch.tensor(ids), features=list(layers))[1]


# ----------------------------------------------------------------------------
# the layer inputs


def test_layer_0_input_is_the_token_embedding_in_every_chunk(tiny):
    feats = features(tiny, PROMPT)  # (20, 2 * D), from 3 llama_decode calls
    emb = llama_embedding(tiny)
    D = emb.shape[1]
    assert feats.shape == (len(PROMPT), 2 * D)
    assert torch.equal(feats[:, :D], emb[PROMPT])  # F32 get_rows: bit for bit
    # Control: rows off by one position would not pass.
    assert not torch.equal(feats[1:, :D], emb[PROMPT[:-1]])


def test_layer_inputs_equal_the_torch_runtimes(tiny, torch_target):
    ours = torch_target.decoder(64).forward(torch.tensor(PROMPT), features=(0, 1))[1]
    theirs = features(tiny, PROMPT)
    D = ours.shape[1] // 2
    scale = ours.abs().max()
    assert (ours - theirs).abs().max() < 1e-2 * scale  # float32, another summation order
    # Control: layer 1's input is far from layer 0's, so reading the wrong layer would show.
    assert (ours[:, D:] - theirs[:, :D]).abs().max() > 0.1 * scale


def test_features_of_a_verify_pass_equal_a_fresh_prefills(tiny):
    dec = LlamaDecoder(tiny)
    dec.forward(torch.tensor(PROMPT[:12]), features=[0, 1])
    _, fresh = dec.forward_greedy(torch.tensor(PROMPT[12:17]), features=[0, 1])
    whole = features(tiny, PROMPT[:17])
    assert torch.allclose(fresh, whole[12:], atol=1e-3)
    assert not torch.allclose(fresh, whole[11:16], atol=1e-3)  # control: one row off


def test_another_layer_set_then_none(tiny):
    both = features(tiny, PROMPT, layers=(0, 1))
    D = both.shape[1] // 2
    assert torch.equal(features(tiny, PROMPT, layers=(1,)), both[:, D:])  # [0, 1] -> [1]
    dec = LlamaDecoder(tiny)
    dec.forward(torch.tensor(PROMPT))  # a pass without features turns them off
    assert llama_state(tiny)["layer_inputs"] == ()
    assert torch.equal(features(tiny, PROMPT, layers=(0, 1)), both)  # and on again


# ----------------------------------------------------------------------------
# drafting


# Mean acceptance length the head must reach with k = 1, 4 (greedy and float32: deterministic).
# It reached 2.0 and 4.3 here; with features one row late, 4 drafts gave 2.8.
ACCEPTANCE = {1: 1.5, 4: 3.5}


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_with_an_eagle_head_over_llama_is_plain_greedy(tiny, plain, head, k):
    out = specfast.generate(
        tiny, PROMPT, NEW, drafter=head, num_speculative_tokens=k, ignore_eos=True
    )
    assert out.token_ids == plain
    assert out.stats.draft_tokens > 0
    if k != "auto":  # auto k weighs measured times, so how much it drafts varies with load
        # The head drafts what the target says only with the features it learned from.
        assert out.stats.mean_acceptance_length > ACCEPTANCE[k]


def test_negative_control_features_of_the_wrong_rows_are_caught(tiny, plain, head, monkeypatch):
    """Features one row late (each position gets its predecessor's): still exact, but the
    head drafts worse, and the acceptance bar above catches it."""
    real = LayerInputs.read_into

    def one_row_late(self, out):
        real(self, out)
        out[1:] = out[:-1].clone()

    monkeypatch.setattr(LayerInputs, "read_into", one_row_late)
    out = specfast.generate(
        tiny, PROMPT, NEW, drafter=head, num_speculative_tokens=4, ignore_eos=True
    )
    assert out.token_ids == plain
    assert out.stats.mean_acceptance_length < ACCEPTANCE[4]


@pytest.mark.parametrize("k", [4, "auto"])
def test_eagle_plus_ngram_over_llama_is_plain_greedy(tiny, plain, head, k):
    """CombinedDrafter(head): the n-gram where the context repeats, the head elsewhere; the
    head's features catch up after n-gram rounds."""
    drafter = specfast.CombinedDrafter(head)
    out = specfast.generate(
        tiny, PROMPT, NEW, drafter=drafter, num_speculative_tokens=k, ignore_eos=True
    )
    assert out.token_ids == plain
    assert out.stats.draft_tokens > 0
    if k != "auto":  # auto k weighs measured times
        assert out.stats.mean_acceptance_length > ACCEPTANCE[k]


def test_session_turns_with_an_eagle_head_over_llama_equal_generate(tiny, head):
    s = specfast.Session(tiny, drafter=head, num_speculative_tokens=4)
    first = s.send(PROMPT[:12], max_new_tokens=16, ignore_eos=True)
    second = s.send([5, 6, 7], max_new_tokens=16, ignore_eos=True)
    ctx = PROMPT[:12]
    want1 = specfast.generate(tiny, ctx, 16, drafter=None, ignore_eos=True).token_ids
    ctx = ctx + want1 + [5, 6, 7]
    want2 = specfast.generate(tiny, ctx, 16, drafter=None, ignore_eos=True).token_ids
    assert (first.token_ids, second.token_ids) == (want1, want2)


# ----------------------------------------------------------------------------
# Level 2: sampling with the head's q through a llama.cpp target
#
# The joint of the first 3 tokens after PROMPT (where the head drafts well, so the ratio test
# decides), top_k=3 at temperature 3: there the head's top-3 q and its unfiltered q differ
# (L1 1.2 on average; at temperature 1 the fitted head is so sharp that they agree to 0.04,
# and the negative control would pass unseen).

TEMPERATURE = 3.0
TOP_K = 3


def top_k_next(llama, context, memo) -> dict[int, float]:
    key = tuple(context)
    if key not in memo:
        p = torch.softmax(next_logits(llama, context) / TEMPERATURE, -1)
        top = torch.topk(p, TOP_K)
        total = top.values.sum()
        memo[key] = {int(t): float(v / total) for v, t in zip(*top, strict=True)}
    return memo[key]


@pytest.fixture(scope="module")
def exact_joint(tiny) -> dict[tuple[int, int, int], float]:
    memo: dict = {}
    return joint_of_3(lambda context: top_k_next(tiny, context, memo), PROMPT)


def sample_joint(llama, head, n: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(n):
        out = specfast.generate(
            llama, PROMPT, max_new_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=seed,
            drafter=head, num_speculative_tokens=2, ignore_eos=True,
        )  # fmt: skip
        key = tuple(out.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_level2_joint_with_an_eagle_head_over_llama_is_exact(tiny, head, exact_joint):
    assert pvalue(sample_joint(tiny, head, N), exact_joint) > ALPHA


def test_level2_negative_control_q_from_unfiltered_logits_is_caught(
    tiny, head, exact_joint, monkeypatch
):
    """The draft drawn from the top-k filtered q, but the unfiltered softmax reported as q."""
    from specfast.sampling import logits_to_probs

    def report_unfiltered(self, logits):
        q = logits_to_probs(logits, **self.sampling)
        token = torch.multinomial(q, 1, generator=self.generator)[0]
        return token, torch.softmax(logits / self.sampling["temperature"], -1)

    monkeypatch.setattr(EagleDraft, "_choose", report_unfiltered)
    assert pvalue(sample_joint(tiny, head, N), exact_joint) < ALPHA


# ----------------------------------------------------------------------------
# what is refused


def test_an_architecture_without_layer_inputs_is_refused(tiny, head, monkeypatch):
    # llama.cpp would abort the process (GGML_ABORT) if asked for a qwen2 graph's layer inputs.
    monkeypatch.setitem(tiny.metadata, "general.architecture", "qwen2")
    with pytest.raises(ValueError, match=r"architectures llama, qwen3, qwen3moe \(.*this GGUF is"):
        specfast.generate(tiny, PROMPT, 8, drafter=head)
    with pytest.raises(ValueError, match="architectures llama"):
        LlamaDecoder(tiny).forward(torch.tensor(PROMPT), features=[0])


def test_feature_layers_past_the_llama_are_refused(tiny):
    with pytest.raises(ValueError, match=r"ints in \[0, 2\)"):
        LlamaDecoder(tiny).forward(torch.tensor(PROMPT), features=[2])


def test_a_head_for_another_hidden_size_is_refused(tiny, torch_target):
    from specfast.drafters.eagle.head import EagleConfig, random_head

    config = EagleConfig.for_target(torch_target, draft_vocab_size=50, aux_layers=(0, 1, 1))
    config.target_hidden_size = 2 * config.target_hidden_size
    wrong = random_head(config, seed=2)
    with pytest.raises(ValueError, match="hidden size"):
        specfast.generate(tiny, PROMPT, 8, drafter=wrong)


# ----------------------------------------------------------------------------
# SmolLM2's GGUF with the head shipped for it


@pytest.fixture(scope="module")
def smol(smollm_gguf):
    return new_llama(smollm_gguf, n_ctx=1024)


@pytest.mark.smollm
def test_shipped_head_over_smollm2_gguf_is_greedy_up_to_near_ties(smol):
    identical = 0
    prompts = smol_prompts(smol)
    for ids in prompts:
        ref = specfast.generate(smol, ids, GREEDY_NEW, drafter=None, ignore_eos=True).token_ids
        out = specfast.generate(
            smol, ids, GREEDY_NEW, drafter="eagle", num_speculative_tokens=3, ignore_eos=True
        )
        assert out.stats.draft_tokens > 0
        identical += same_up_to_near_ties(smol, ids, out.token_ids, ref)
    print(f"identical to the plain loop over llama.cpp: {identical}/{len(prompts)}")
    assert identical >= 1


@pytest.mark.smollm
def test_smollm2_gguf_features_are_close_to_the_torch_models(smol, smollm_gguf):
    """The shipped head learned from specfast's runtime; llama.cpp's Q4_1 model hands it
    features of the same layers that differ only by quantisation."""
    from specfast.targets.base import default_aux_layers

    ids = smol_prompts(smol)[1]
    model = specfast.load_model(smollm_gguf, dtype="float32")
    layers = default_aux_layers(model.config.n_layers)
    ours = model.decoder(len(ids)).forward(torch.tensor(ids), features=layers)[1]
    theirs = LlamaDecoder(smol).forward(torch.tensor(ids), features=list(layers))[1]
    cos = torch.nn.functional.cosine_similarity(ours[1:], theirs[1:], dim=-1)  # BOS: outlier
    assert cos.min() > 0.99, cos.min()  # 0.9993 measured
    # Control: the next layer's features are not that close.
    shifted = model.decoder(len(ids)).forward(torch.tensor(ids), features=[i + 1 for i in layers])
    assert torch.nn.functional.cosine_similarity(ours[1:], shifted[1][1:], dim=-1).min() < cos.min()
