"""Static-shape compiled steps (model/static.py, Model.forward_static) and dtype="auto".

The claims: a step never synchronises with the host; every bucket compiles to one graph with no
break, and no acceptance count causes a recompile; compiled output is token for token what
eager and plain greedy give in float32; sampling through the compiled path stays exact (Level 2);
"auto" picks bf16 only where the hardware computes it natively.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specfast
from specfast import hardware
from specfast.autok import measured_pass_costs
from specfast.model import Model, ModelConfig
from specfast.model import static as steps
from specfast.model.config import resolve_dtype

CONFIG = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_context=512)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12]


def tiny(seed: int = 1) -> Model:
    return Model.from_config(CONFIG, seed=seed)


def repetitive_prompt(model: Model) -> list[int]:
    """A prompt whose continuation repeats it, so n-gram drafts are sometimes accepted."""
    out = specfast.generate(model, PROMPT, max_new_tokens=24, drafter=None, ignore_eos=True)
    return PROMPT + out.token_ids + PROMPT


# ----------------------------------------------------------------------------
# no host sync inside a step

# Ops that copy a device value to the host (or need one to decide a shape).
SYNC_OPS = ("_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal", "unique")


class FailOnSync(TorchDispatchMode):
    """Raises on any op that would synchronise a device with the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in SYNC_OPS:
            raise AssertionError(f"host sync inside the step: aten.{name}")
        return func(*args, **(kwargs or {}))


def static_inputs(model: Model, n: int, pos: int = 20, capacity: int = 256):
    decoder = model.decoder(200)
    cos, sin = model.rope(capacity)
    k = torch.zeros_like(decoder.cache.k[:, :, :1]).expand(-1, -1, capacity, -1).contiguous()
    v = torch.zeros_like(k)
    ids = torch.arange(1, n + 1)
    positions = torch.arange(pos, pos + n)
    return ids, positions, k, v, cos[:capacity], sin[:capacity]


@pytest.mark.parametrize("n", [1, 8])
def test_static_step_makes_no_host_sync(n):
    model = tiny()
    args = static_inputs(model, n)
    with torch.inference_mode(), FailOnSync():
        logits, top = model.forward_static(*args)
    assert logits.shape == (n, CONFIG.vocab_size) and top.shape == (n,)


def test_negative_control_a_step_with_item_is_caught():
    model = tiny()
    args = static_inputs(model, 4)

    def step_with_a_sync(ids, positions, *rest):
        _ = int(positions[0].item())  # the bug: a host read inside the step
        return model.forward_static(ids, positions, *rest)

    with torch.inference_mode(), FailOnSync(), pytest.raises(AssertionError, match="host sync"):
        step_with_a_sync(*args)


def test_static_step_equals_the_eager_forward():
    """Same logits as the context-shaped eager pass, with stale slots past the live length
    holding garbage (they must be masked), and padding rows ignored."""
    model = tiny()
    torch.manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (40,))
    eager = model.decoder(64)
    ref = eager.forward(ids)  # (40, V)
    capacity = 64
    k = torch.randn_like(eager.cache.k[:, :, :capacity]) * 100  # garbage everywhere
    v = torch.randn_like(k) * 100
    cos, sin = model.rope(capacity)
    with torch.inference_mode():
        model.forward_static(ids[:32], torch.arange(32), k, v, cos[:capacity], sin[:capacity])
        # rows 32..36 real, 37..39 padding at the last slot
        positions = torch.tensor([32, 33, 34, 35, 36, capacity - 1, capacity - 1, capacity - 1])
        padded = torch.cat([ids[32:37], torch.zeros(3, dtype=torch.long)])
        logits, top = model.forward_static(padded, positions, k, v, cos[:capacity], sin[:capacity])
    torch.testing.assert_close(logits[:5].float(), ref[32:37], rtol=1e-4, atol=1e-4)
    assert top[:5].tolist() == ref[32:37].argmax(-1).tolist()


# ----------------------------------------------------------------------------
# graphs: no breaks, no recompiles


def counting_backend():
    graphs: list[tuple] = []

    def backend(gm, example_inputs):
        graphs.append(tuple(tuple(t.shape) for t in example_inputs if hasattr(t, "shape")))
        return gm.forward

    return backend, graphs


def test_every_bucket_is_one_graph_without_breaks():
    model = tiny()
    for n in steps.BUCKETS:
        explanation = torch._dynamo.explain(model.forward_static)(*static_inputs(model, n))
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


def test_no_acceptance_count_or_position_recompiles():
    """After one pass per bucket, generate() with every k and every acceptance count compiles
    nothing new: positions and lengths are data, not shapes."""
    torch._dynamo.reset()
    model = tiny()
    prompt = repetitive_prompt(model)
    backend, graphs = counting_backend()
    steps.allow_graphs_per_bucket()
    model.compiled_step = torch.compile(
        model.forward_static, fullgraph=True, dynamic=False, backend=backend
    )
    max_length = len(prompt) + 40
    steps.warmup(model, max_length, log=None)
    assert len(graphs) == len(steps.BUCKETS)
    seen_accepts = set()
    for k in (1, 2, 4, 8, 16, "auto"):
        out = specfast.generate(
            model, prompt, max_new_tokens=40, num_speculative_tokens=k, ignore_eos=True
        )
        seen_accepts |= {n for n, c in enumerate(out.stats.acceptance_histogram) if c}
    assert len(graphs) == len(steps.BUCKETS), graphs[len(steps.BUCKETS) :]
    assert len(seen_accepts) >= 3  # rejections, partial and full acceptance all ran

    # The counter does see a recompile: a cache of another capacity is another shape.
    specfast.generate(model, prompt, max_new_tokens=400, drafter=None, ignore_eos=True)
    assert len(graphs) == len(steps.BUCKETS) + 1


# ----------------------------------------------------------------------------
# compiles outside the clock: load_model warms up; auto k never prices a pass that compiled

generate_module = importlib.import_module("specfast.generate")  # the module, not the function
formats = importlib.import_module("specfast.formats")


class SlowCompileClock:
    """generate.py's clock (its `time` module, nothing else's): 1 ms a reading, plus
    COMPILE_SECONDS for every graph compiled since the last reading."""

    COMPILE_SECONDS = 100.0

    def __init__(self):
        self.now = 0.0
        self.graphs = 0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now

    def backend(self, gm, example_inputs):
        self.graphs += 1
        self.now += self.COMPILE_SECONDS
        return gm.forward


def pass_costs_of_a_cold_generate(monkeypatch) -> tuple[dict[int, float], int]:
    """An auto-k generate() on a compiled model that was never warmed up, so verify passes of
    new lengths compile midway -> (the pass costs auto k recorded, graphs compiled midway)."""
    torch._dynamo.reset()
    clock = SlowCompileClock()
    model = tiny().compile_steps(backend=clock.backend)
    prompt = repetitive_prompt(tiny())
    monkeypatch.setattr(generate_module, "time", clock)
    specfast.generate(model, prompt, max_new_tokens=40, ignore_eos=True)
    return measured_pass_costs(model), clock.graphs  # (the prefill runs eager)


def test_auto_k_never_records_a_pass_that_compiled(monkeypatch):
    costs, compiled_midway = pass_costs_of_a_cold_generate(monkeypatch)
    assert compiled_midway >= 2  # the plain step and at least one verify length
    assert len(costs) >= 2 and max(costs.values()) < 1.0, costs


def test_control_without_the_guard_a_compile_is_priced_as_a_pass(monkeypatch):
    monkeypatch.setattr(generate_module, "cold_passes", lambda decoder: 0)
    costs, _ = pass_costs_of_a_cold_generate(monkeypatch)
    assert max(costs.values()) > SlowCompileClock.COMPILE_SECONDS / 10, costs


def test_load_model_warms_every_bucket_of_one_capacity(monkeypatch, tmp_path, capsys):
    """compile="on": every bucket compiled before load_model returns, for the capacity of
    max_length; generate() calls of any length up to it compile nothing and no pass of theirs
    is cold."""
    torch._dynamo.reset()
    backend, graphs = counting_backend()
    compile_steps = Model.compile_steps
    monkeypatch.setattr(formats, "_load", lambda *args: tiny())
    monkeypatch.setattr(
        Model, "compile_steps", lambda self, **kw: compile_steps(self, backend=backend, **kw)
    )
    model = specfast.load_model(tmp_path / "m.gguf", compile="on", dtype="float32", max_length=300)
    assert model.static_capacity == 512
    assert len(graphs) == len(steps.BUCKETS)
    assert len(capsys.readouterr().err.splitlines()) == len(steps.BUCKETS)  # a line a bucket
    cold = []
    real = generate_module.cold_passes

    def cold_passes(decoder):
        cold.append(real(decoder))
        return cold[-1]

    monkeypatch.setattr(generate_module, "cold_passes", cold_passes)
    prompt = repetitive_prompt(tiny())
    for n in (8, 40, 300 - len(prompt)):
        specfast.generate(model, prompt, max_new_tokens=n, ignore_eos=True)
    assert len(graphs) == len(steps.BUCKETS)
    assert cold and set(cold) == {0}


def test_capacity_is_a_power_of_two_above_the_length():
    assert steps.static_capacity(1) == steps.MIN_CAPACITY
    assert steps.static_capacity(255) == 256
    assert steps.static_capacity(256) == 512  # slot capacity - 1 must stay free for padding
    assert [steps.bucket(n) for n in (1, 2, 3, 9, 17, 64)] == [1, 2, 4, 16, 32, 64]
    with pytest.raises(ValueError, match="at most 64"):
        steps.bucket(65)
    assert steps.model_capacity(512) == 1024  # the whole context
    assert steps.model_capacity(32768) == steps.STATIC_SLOTS  # up to 4095 tokens
    assert steps.model_capacity(32768, max_length=5000) == 8192


# ----------------------------------------------------------------------------
# compiled output is exact


@pytest.fixture(scope="module")
def inductor_model() -> Model:
    torch._dynamo.reset()
    return tiny().compile_steps()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4, 16, "auto"])
def test_compiled_greedy_equals_eager_and_plain(inductor_model, k):
    eager = tiny()
    prompt = repetitive_prompt(eager)
    plain = specfast.generate(eager, prompt, max_new_tokens=48, drafter=None, ignore_eos=True)
    spec_eager = specfast.generate(
        eager, prompt, max_new_tokens=48, num_speculative_tokens=k, ignore_eos=True
    )
    compiled = specfast.generate(
        inductor_model, prompt, max_new_tokens=48, num_speculative_tokens=k, ignore_eos=True
    )
    assert spec_eager.token_ids == plain.token_ids
    assert compiled.token_ids == plain.token_ids
    assert compiled.stats.accepted_tokens > 0  # drafts were verified by the compiled step


@pytest.mark.smollm
def test_static_path_on_smollm_equals_plain():
    """SmolLM2's 30 layers through the static-shape step (traced by dynamo, run eagerly: an
    inductor build of this model takes minutes here), against plain eager greedy."""
    model = specfast.load_model(dtype="float32", compile="off")
    prompt = model.tokenizer.encode("def add(a, b):\n    return a + b\n\n# the same, again:\n").ids
    plain = specfast.generate(model, prompt, max_new_tokens=32, drafter=None, ignore_eos=True)
    model.compile_steps(backend="eager")
    for k in (4, "auto"):
        out = specfast.generate(
            model, prompt, max_new_tokens=32, num_speculative_tokens=k, ignore_eos=True
        )
        assert out.token_ids == plain.token_ids


@pytest.mark.slow
def test_level2_sampling_through_the_compiled_step():
    """The Level 2 joint test (test_generate_distribution) on a compiled copy of its model."""
    dist = importlib.import_module("test_generate_distribution")
    config = ModelConfig(vocab_size=dist.V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    model = dist.sharpened(config, 3)
    exact = dist.joint_of(model)
    torch._dynamo.reset()
    model.compile_steps()
    counts = dist.sample_joint(model, dist.N)
    assert dist.chi2_pvalue(counts, exact) > dist.ALPHA


# ----------------------------------------------------------------------------
# dtype="auto"


def test_auto_dtype_follows_the_amx_bf16_probe(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_amx_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(hardware, "cpu_has_amx_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    # AVX512-BF16 without AMX (a Zen 4): float32, whose passes run in the core
    feats = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": False}
    monkeypatch.undo()
    monkeypatch.setattr(hardware, "cpu_features", lambda: feats)
    assert hardware.cpu_has_native_bf16() and resolve_dtype("auto", "cpu") == torch.float32
    feats["amx_bf16"] = True
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32  # explicit is honoured
    assert resolve_dtype(torch.bfloat16) == torch.bfloat16


def test_native_bf16_means_avx512_bf16_or_amx(monkeypatch):
    feats = {"avx2": True, "avx512_f": True, "avx512_bf16": False, "amx_bf16": False}
    monkeypatch.setattr(hardware, "cpu_features", lambda: feats)
    assert not hardware.cpu_has_native_bf16()
    assert hardware.cpu_flags_label() == "avx2 avx512_f"
    feats["amx_bf16"] = True
    assert hardware.cpu_has_native_bf16()


def test_load_model_auto_sets_model_dtype(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "cpu_has_amx_bf16", lambda: False)
    model = tiny()
    assert "dtype=torch.float32" in repr(model) and "step=eager" in repr(model)
    assert steps.resolve_compile("auto", torch.device("cpu")) is False
    assert steps.resolve_compile("auto", torch.device("cuda")) is True
    with pytest.raises(ValueError, match="compile must be"):
        steps.resolve_compile("fast", torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int4")


def test_cli_choices_match_the_runtime():
    from specfast import cli
    from specfast.model.config import DTYPE_CHOICES

    assert cli.common.DTYPE_CHOICES == DTYPE_CHOICES
    assert cli.common.COMPILE_CHOICES == steps.COMPILE_CHOICES


# ----------------------------------------------------------------------------
# CUDA (scripts/gpu_check.sh runs these on a lent GPU)


@pytest.mark.cuda
def test_cuda_compiled_step_syncs_nowhere_and_matches_eager():
    """CUDA graphs (reduce-overhead) over every bucket: no hidden device->host sync inside a
    step (sync debug mode "error"), and float32 greedy output equal to the eager CUDA run."""
    torch._dynamo.reset()
    eager = Model.from_config(CONFIG, seed=1, device="cuda")
    compiled = Model.from_config(CONFIG, seed=1, device="cuda").compile_steps()
    prompt = repetitive_prompt(eager)
    plain = specfast.generate(eager, prompt, max_new_tokens=48, drafter=None, ignore_eos=True)
    for k in (1, 4, 16, "auto"):
        out = specfast.generate(
            compiled, prompt, max_new_tokens=48, num_speculative_tokens=k, ignore_eos=True
        )
        assert out.token_ids == plain.token_ids
    dec = compiled.decoder(len(prompt) + 64)
    dec.forward(torch.tensor(prompt, device="cuda"), last_only=True)
    feeds = {b: torch.arange(1, b + 1, device="cuda") for b in steps.BUCKETS}
    for b in steps.BUCKETS:  # record every graph first
        for _ in range(3):
            dec.rollback(len(prompt))
            dec.forward_greedy(feeds[b])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in steps.BUCKETS:
            dec.rollback(len(prompt))
            dec.forward_greedy(feeds[b])
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
def test_cuda_auto_dtype_is_bf16_or_fp16():
    assert resolve_dtype("auto", "cuda") in (torch.bfloat16, torch.float16)
