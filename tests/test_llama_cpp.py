"""llama.cpp as the target: greedy output against llama.cpp's own loop (near-tie rule), rollback
through llama_memory_seq_rm, Level 2 sampling through a Llama (and a draft Llama), bad input.

Tiny targets are GGUF files written in the test (conftest.write_tiny_gguf: a 2-layer llama,
F32 tensors, 320 tokens), which llama.cpp loads like any other model. Their sampling tests
restrict the distribution with top_k=3, so the joint of 3 tokens has 27 outcomes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="needs llama-cpp-python: pip install 'specfast[llama]'"
)

from conftest import make_hf_model, write_tiny_gguf  # noqa: E402
from test_generate_distribution import (  # noqa: E402
    ALPHA,
    N,
    chi2_pvalue,
    sample_filtered_report_unfiltered,
)

import specfast  # noqa: E402
import specfast.targets  # noqa: E402
from specfast.targets.llama_cpp import (  # noqa: E402
    LlamaDecoder,
    LlamaTokenizer,
    check_llama_build,
    llama_eos_ids,
)

TOP_K = 3


def sharpened_gguf(path, seed: int, vocab_size: int | None = None, scale: float = 4.0):
    # Random weights give near-uniform next-token distributions, which cannot tell a right rule
    # from a wrong one; scaled up, every context gets its own uneven distribution.
    m = make_hf_model("llama-tied-gqa", seed=seed)
    if vocab_size is not None:
        m.resize_token_embeddings(vocab_size)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.mul_(scale)
    return write_tiny_gguf(m, path)


def new_llama(path, **kw):
    kw.setdefault("n_ctx", 256)
    # One thread: llama.cpp's OpenMP workers spin at barriers, and on a shared 2-core machine a
    # preempted worker stalls every pass (two threads ran 30x slower than one here).
    kw.setdefault("n_threads", 1)
    kw.setdefault("n_threads_batch", 1)
    # A build for another CPU fails these tests with its RuntimeError instead of killing pytest.
    check_llama_build()
    return llama_cpp.Llama(model_path=str(path), verbose=False, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return new_llama(sharpened_gguf(tmp_path_factory.mktemp("t") / "tiny.gguf", seed=1))


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    # The target's weights, less sharpened: its drafts mostly fall in the target's top 3 (so
    # the ratio test decides), and its q spreads past its own top 3, so a ratio taken with the
    # unfiltered q (the negative control below) is far from the filtered q it sampled from.
    path = sharpened_gguf(tmp_path_factory.mktemp("d") / "draft.gguf", seed=1, scale=2.0)
    return new_llama(path)


@pytest.fixture(scope="module")
def smol(smollm_gguf):
    return new_llama(smollm_gguf, n_ctx=1024)


def next_logits(llama, context: list[int]) -> torch.Tensor:
    """The last row of a fresh prefill of `context`: what llama.cpp says comes next."""
    dec = LlamaDecoder(llama, len(context))
    return dec.forward(torch.tensor(context), last_only=True)[0].double()


# ----------------------------------------------------------------------------
# greedy: the same text as llama.cpp's own one-token-at-a-time loop

GREEDY_NEW = 48
NEAR_TIE = 0.7  # logits of a k+1-row pass differ from one-row passes by up to ~0.65 (issue #15)


def smol_prompts(smol) -> list[list[int]]:
    import inspect
    import json

    enc = LlamaTokenizer(smol).encode
    code = inspect.getsource(json.dumps)[:1200]
    return [
        enc(f"Rewrite this function with a docstring:\n{code}\n\nHere it is:\n"),
        enc("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
        enc("one two three four five six seven eight nine ten one two three four five"),
    ]


def llama_greedy(llama, ids: list[int], n: int) -> list[int]:
    """llama-cpp-python's own greedy loop (temp=0: its greedy sampler), one token per pass."""
    llama.reset()
    out = []
    for t in llama.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(t))
        if len(out) == n:
            return out
    return out


def same_up_to_near_ties(llama, ids: list[int], got: list[int], ref: list[int]) -> bool:
    """True if got == ref; else asserts they part where llama.cpp's top-2 logits are within
    NEAR_TIE of each other (docs/exactness.md §4), and returns False."""
    if got == ref:
        return True
    i = next(i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
    top2 = torch.topk(next_logits(llama, ids + ref[:i]), 2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"diverged at {i} where llama.cpp's top-2 gap is {gap:.3f}"
    return False


@pytest.mark.smollm
def test_greedy_equals_llama_cpp_own_loop_up_to_near_ties(smol):
    identical = 0
    prompts = smol_prompts(smol)
    for ids in prompts:
        ref = llama_greedy(smol, ids, GREEDY_NEW)
        plain = specfast.generate(smol, ids, GREEDY_NEW, drafter=None, ignore_eos=True)
        # One token per pass on both sides: the same shapes, so exactly the same tokens.
        assert plain.token_ids == ref
        for k in ("auto", 4):
            out = specfast.generate(
                smol, ids, GREEDY_NEW, num_speculative_tokens=k, ignore_eos=True
            )
            identical += same_up_to_near_ties(smol, ids, out.token_ids, ref)
    print(f"identical to llama.cpp's own greedy loop: {identical}/{2 * len(prompts)}")
    assert identical >= 1


@pytest.mark.smollm
def test_speculation_actually_ran(smol):
    ids = smol_prompts(smol)[2]
    out = specfast.generate(smol, ids, 32, num_speculative_tokens=4, ignore_eos=True)
    assert out.stats.accepted_tokens > 0
    assert out.stats.target_passes < 32


@pytest.mark.smollm
def test_same_prompt_twice_gives_the_same_output(smol):
    # llama.cpp is deterministic per pass shape, so k is fixed: auto k carries what it learnt
    # from the first call into the second, whose passes then differ in length, and a near-tie
    # can go the other way (seen with the AMX build, whose one-row and batched kernels differ:
    # top-2 logits 37.70 and 37.63 at the token that flipped).
    ids = smol_prompts(smol)[0]
    a = specfast.generate(smol, ids, 32, num_speculative_tokens=4, ignore_eos=True).token_ids
    b = specfast.generate(smol, ids, 32, num_speculative_tokens=4, ignore_eos=True).token_ids
    assert a == b


@pytest.mark.smollm
def test_str_prompt_tokenizer_and_eos_of_a_llama(smol):
    eos = llama_eos_ids(smol)
    im_end = LlamaTokenizer(smol).encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in eos
    prompt = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
    out = specfast.generate(smol, prompt, max_new_tokens=64)
    assert isinstance(out.text, str) and out.text.strip()
    assert "<|im_end|>" not in out.text
    if out.finish_reason == "eos":
        assert out.token_ids[-1] in eos


# ----------------------------------------------------------------------------
# rollback: llama_memory_seq_rm, one call per round

ROLLBACK_TOL = 1e-3  # batch shapes differ; an F32 two-layer model agrees to ~1e-5


class NoRemoval(LlamaDecoder):
    """The bug: rollback moves the counter but leaves the rejected drafts in llama.cpp's cache."""

    def rollback(self, length):
        self._length = length


def round_then_next_logits(decoder_cls, llama, prompt, drafts, n_accept, nxt):
    dec = decoder_cls(llama, 64)
    dec.forward(torch.tensor(prompt[:-1]))
    dec.forward(torch.tensor([prompt[-1], *drafts]))  # a verification round over k drafts
    dec.rollback(len(prompt) + n_accept)  # kept: [last, d1..dn]
    return dec.forward(torch.tensor([nxt]))[0].double()


def test_rollback_then_next_pass_equals_a_fresh_prefill(tiny):
    prompt, drafts, nxt = [5, 17, 99, 3, 250, 8], [40, 41, 42, 43], 77
    for n_accept in (0, 1, 3):
        got = round_then_next_logits(LlamaDecoder, tiny, prompt, drafts, n_accept, nxt)
        want = next_logits(tiny, [*prompt, *drafts[:n_accept], nxt])
        assert torch.allclose(got, want, atol=ROLLBACK_TOL), (got - want).abs().max()


def test_negative_control_rollback_without_removal_is_caught(tiny):
    prompt, drafts, nxt = [5, 17, 99, 3, 250, 8], [40, 41, 42, 43], 77
    try:
        got = round_then_next_logits(NoRemoval, tiny, prompt, drafts, 1, nxt)
    except RuntimeError as e:  # llama.cpp refuses positions that do not follow its cache
        assert "llama_decode returned" in str(e)
        return
    want = next_logits(tiny, [*prompt, drafts[0], nxt])
    assert not torch.allclose(got, want, atol=ROLLBACK_TOL)


class ZeroDrafter:
    """Always proposes token 0, which the target rarely wants: most rounds roll back."""

    def extend(self, tokens):
        pass

    def propose(self, k):
        return [0] * k


def test_rollback_is_one_seq_rm_call_when_drafts_are_rejected(tiny, monkeypatch):
    calls = []
    real_rm = llama_cpp.llama_memory_seq_rm
    monkeypatch.setattr(
        llama_cpp, "llama_memory_seq_rm", lambda *a: calls.append(a[1:]) or real_rm(*a)
    )
    rounds = []  # (length before, length after, seq_rm calls made)
    real_rollback = LlamaDecoder.rollback

    def spy(self, length):
        before, n = self.length, len(calls)
        real_rollback(self, length)
        rounds.append((before, length, len(calls) - n))

    monkeypatch.setattr(LlamaDecoder, "rollback", spy)
    specfast.generate(tiny, [5, 17, 99, 3], 16, drafter=ZeroDrafter(), num_speculative_tokens=3)
    assert any(after < before for before, after, _ in rounds)
    for before, after, n in rounds:
        assert n == (1 if after < before else 0)
    assert all(seq == 0 and end == -1 for seq, _, end in calls)


# ----------------------------------------------------------------------------
# Level 2: the joint of the first 3 tokens through generate() over a Llama

PROMPT = [1, 2, 3, 200, 2]


def top_k_next(llama, context, memo) -> dict[int, float]:
    key = tuple(context)
    if key not in memo:
        p = torch.softmax(next_logits(llama, context), -1).numpy()
        keep = np.argsort(p)[-TOP_K:]
        memo[key] = {int(t): float(p[t] / p[keep].sum()) for t in keep}
    return memo[key]


@pytest.fixture(scope="module")
def memo():
    return {}


def joint_of_3(next_probs, prompt: list[int]) -> dict[tuple[int, int, int], float]:
    """The exact joint of the 3 tokens after `prompt`; next_probs(context) -> {token: p}."""
    joint = {}
    for a, pa in next_probs(prompt).items():
        for b, pb in next_probs([*prompt, a]).items():
            for c, pc in next_probs([*prompt, a, b]).items():
                joint[(a, b, c)] = pa * pb * pc
    return joint


@pytest.fixture(scope="module")
def exact_joint(tiny, memo) -> dict[tuple[int, int, int], float]:
    return joint_of_3(lambda context: top_k_next(tiny, context, memo), PROMPT)


class TopDrafter:
    """One-hot drafts: the target's own most likely next token, so drafts are often accepted
    (the bonus row is exercised) and often rejected (the residual and the rollback are)."""

    def __init__(self, llama, memo):
        self.llama, self.memo, self.seq = llama, memo, []

    def extend(self, tokens):
        self.seq.extend(tokens)

    def propose(self, k):
        out, ctx = [], list(self.seq)
        for _ in range(k):
            p = top_k_next(self.llama, ctx, self.memo)
            out.append(max(p, key=p.get))
            ctx.append(out[-1])
        return out


def sample_joint(llama, n, new_drafter, **kw) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(n):
        out = specfast.generate(
            llama,
            PROMPT,
            max_new_tokens=3,
            temperature=1.0,
            top_k=TOP_K,
            seed=seed,
            drafter=new_drafter(),
            ignore_eos=True,
            **kw,
        )
        key = tuple(out.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def pvalue(counts, joint) -> float:
    """χ² p-value of the counts against the exact joint; 0 if an impossible outcome occurred."""
    if set(counts) - set(joint):
        return 0.0  # a token outside the top-k was emitted: certainly not the target's joint
    keys = sorted(joint)
    return chi2_pvalue(
        np.array([counts.get(k, 0) for k in keys]), np.array([joint[k] for k in keys])
    )


def test_level2_joint_with_one_hot_drafts_is_exact(tiny, memo, exact_joint):
    counts = sample_joint(tiny, N, lambda: TopDrafter(tiny, memo), num_speculative_tokens=2)
    assert pvalue(counts, exact_joint) > ALPHA


def test_level2_negative_control_bonus_from_wrong_row_is_caught(
    tiny, memo, exact_joint, monkeypatch
):
    import importlib

    sampling_module = importlib.import_module("specfast.sampling")  # the round's draws
    real = sampling_module.sample_rows

    def bonus_from_previous_row(probs, uniforms):
        if len(probs) > 1:
            probs = torch.cat([probs[:-1], probs[-2:-1]])
        return real(probs, uniforms)

    monkeypatch.setattr(sampling_module, "sample_rows", bonus_from_previous_row)
    counts = sample_joint(tiny, N, lambda: TopDrafter(tiny, memo), num_speculative_tokens=2)
    assert pvalue(counts, exact_joint) < ALPHA


def test_level2_joint_with_a_draft_llama_is_exact(tiny, tiny_draft, exact_joint):
    counts = sample_joint(tiny, N, lambda: tiny_draft, num_speculative_tokens=2)
    assert pvalue(counts, exact_joint) > ALPHA


def test_level2_negative_control_q_from_unfiltered_logits_is_caught(
    tiny, tiny_draft, exact_joint, monkeypatch
):
    import specfast.drafters.model

    monkeypatch.setattr(
        specfast.drafters.model.DraftModelDrafter, "_choose", sample_filtered_report_unfiltered
    )
    counts = sample_joint(tiny, N, lambda: tiny_draft, num_speculative_tokens=2)
    assert pvalue(counts, exact_joint) < ALPHA


# ----------------------------------------------------------------------------
# bad input and failures inside llama.cpp


def test_context_too_small_names_n_ctx(tiny):
    with pytest.raises(ValueError, match="n_ctx"):
        specfast.generate(tiny, list(range(1, 200)), max_new_tokens=100)
    with pytest.raises(ValueError, match="n_ctx"):
        LlamaDecoder(tiny, 10_000)


def test_draft_with_another_vocabulary_is_refused(tiny, tmp_path):
    other = new_llama(sharpened_gguf(tmp_path / "v300.gguf", seed=3, vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        specfast.generate(tiny, [1, 2, 3], 4, drafter=other)


def test_the_same_llama_as_target_and_draft_is_refused(tiny):
    with pytest.raises(RuntimeError, match="two Llama objects"):
        specfast.generate(tiny, [1, 2, 3], 4, drafter=tiny, num_speculative_tokens=2)


def test_llama_decode_failure_is_a_python_exception(tiny, monkeypatch):
    dec = LlamaDecoder(tiny, 32)
    dec.forward(torch.tensor([1, 2, 3]))
    monkeypatch.setattr(llama_cpp, "llama_decode", lambda ctx, batch: 1)
    with pytest.raises(RuntimeError, match=r"llama_decode returned 1 .*n_ctx"):
        dec.forward(torch.tensor([4, 5]))
    assert dec.length == 3  # the failed call left the sequence as it was


def test_greedy_ids_is_forward_greedy_on_lists_and_checks_them(tiny):
    # greedy_ids is what generate()'s greedy rounds call: lists in and out, no torch.
    a, b = LlamaDecoder(tiny, 16), LlamaDecoder(new_llama(tiny.model_path), 16)
    assert a.greedy_ids([5, 6, 7]) == b.forward_greedy(torch.tensor([5, 6, 7])).tolist()
    assert a.greedy_ids([8]) == b.forward_greedy(torch.tensor([8])).tolist()
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 320\)"):
        a.greedy_ids([1, 320])
    with pytest.raises(ValueError, match=r"max_length 16"):
        a.greedy_ids(list(range(13)))
    with pytest.raises(ValueError, match="cannot append 0 tokens"):
        a.greedy_ids([])
    assert a.length == 4  # the refused calls appended nothing


def test_decoder_checks_ids_and_rollback(tiny):
    dec = LlamaDecoder(tiny, 8)
    with pytest.raises(ValueError, match="token ids must be in"):
        dec.forward(torch.tensor([1, 320]))
    with pytest.raises(TypeError, match="integer"):
        dec.forward(torch.tensor([1.0]))
    dec.forward(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="roll back"):
        dec.rollback(3)
    with pytest.raises(ValueError, match="max_length"):
        dec.forward(torch.arange(7))


def test_long_prompt_is_fed_in_n_batch_chunks(tmp_path):
    path = sharpened_gguf(tmp_path / "t.gguf", seed=1)
    small_batch = new_llama(path, n_batch=8)
    ids = [int(t) for t in torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(0))]
    got = LlamaDecoder(small_batch, 64).forward(torch.tensor(ids))  # (30, V) over 4 decodes
    want = LlamaDecoder(new_llama(path), 64).forward(torch.tensor(ids))
    assert got.shape == (30, 320)
    assert torch.allclose(got, want, atol=ROLLBACK_TOL)


def test_load_model_with_the_llama_backend(smollm_gguf):
    llama = specfast.load_model(smollm_gguf, backend="llama.cpp", n_ctx=512)
    assert llama.n_ctx() == 512
    with pytest.raises(ValueError, match="backend"):
        specfast.load_model(smollm_gguf, backend="vllm")
    with pytest.raises(TypeError, match=r"llama\.cpp"):
        specfast.load_model(smollm_gguf, n_ctx=300)


def test_bench_over_llama_reports_the_pass_costs_auto_k_measured(smollm_gguf, tmp_path, capsys):
    import json

    from specfast import cli

    out = tmp_path / "out"
    argv = ["bench", "--backend", "llama.cpp", "--model", str(smollm_gguf), "--workloads", "open"]
    argv += ["--engines", "llama.cpp-plain,specfast-llama-plain,specfast-llama-ngram"]
    argv += ["--prompts-per-workload", "1", "--repeats", "1", "--max-new-tokens", "8"]
    argv += ["--llama-threads", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    assert {e: f["new_tokens"] for e, f in doc["summary"]["open"].items()} == {
        "llama.cpp-plain": 8,
        "specfast-llama-plain": 8,
        "specfast-llama-ngram": 8,
    }
    # The n-gram engine's auto k timed every one of its rounds on the Llama (k = 0 included),
    # so t(1) is there; the plain loop runs no auto k and the torch runtime was not loaded.
    costs = doc["meta"]["pass_costs_ms"]
    assert list(costs) == ["llama.cpp"] and 0 < costs["llama.cpp"]["1"] < 10_000
    assert "pass cost on llama.cpp, as auto k measured it: t(1) = " in stdout
