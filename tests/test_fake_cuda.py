"""The CUDA path on a machine without CUDA: whole generate() rounds under FakeTensorMode with the
device cuda (tensors carry a device and a shape, no data), through the torch runtime.

`FakeCuda` fails a run on any device mismatch (FakeTensorMode's own check), on any tensor made
on the CPU inside a step (a target, draft or EAGLE pass), and on a CPU generator used for a CUDA
op; it counts host syncs (values read back, blocking host-to-device copies) for test_syncs.py.
A value read back from the device is 0: enough for a round to go on (n-gram drafts of 0 are
accepted, so verify passes grow), never a claim about what is generated.

Also here: the static KV cache is marked for CUDA graphs, and its buffers are reused per model
and capacity.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import traceback
import weakref

import pytest
import torch
import torch._subclasses.fake_tensor as fake_tensor
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

try:  # torch >= 2.12; before it, fake tensors raise a plain RuntimeError on mixed devices
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
except ImportError:
    FakeTensorDeviceMismatchError = RuntimeError
from torch.utils._python_dispatch import TorchDispatchMode

import specfast
from specfast.model import Model, ModelConfig
from specfast.model import attention as attention_module
from specfast.model.kv_cache import KVCache, static_cache

CONFIG = ModelConfig(vocab_size=300, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_context=512)
DRAFT = ModelConfig(vocab_size=300, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_context=512)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12]
CUDA = torch.device("cuda", 0)
generate_module = importlib.import_module("specfast.generate")  # the module, not the function

aten = torch.ops.aten
# Ops whose result the host needs (a value, or a shape that depends on values).
READ_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default}
READ_NAMES = {"nonzero", "equal", "unique", "_unique2", "masked_select"}
COPY_OPS = {aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.to.dtype}


def _device_of(x):
    return x.device if isinstance(x, torch.Tensor) else None


class _Watch(TorchDispatchMode):
    """Sits above FakeTensorMode: sees every op first."""

    def __init__(self, owner: FakeCuda):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_device = any(t.device.type != "cpu" for t in tensors)
        if func in READ_OPS or func.__name__.split(".")[0] in READ_NAMES:
            if on_device and not o.in_tolist:
                o.sync("read", func)
            if func in READ_OPS:
                return o.value  # what the tensor "holds" (a fake host tensor holds no data either)
        if func in COPY_OPS or func is aten.copy_.default:
            o.check_copy(func, args, kwargs)
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch._C.Generator):  # torch.Generator is the stand-in class here
                o.check_generator(a, tensors, kwargs, func)
        if func in (aten.pin_memory.default, aten._pin_memory.default):  # NYI when fake: a copy
            return args[0].clone()
        out = func(*args, **kwargs)
        if o.step_depth:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    o.fail(f"a tensor made on the CPU inside a step: aten.{func.__name__}")
        return out


def written_lower_right(T: int, L: int) -> torch.Tensor:
    return torch.ones(T, L, dtype=torch.bool, device="cuda").tril_(L - T)


class FakeCuda:
    """FakeTensorMode with the device cuda, plus the checks above. Build models inside it with
    `cuda_model`. `syncs` lists every host sync seen (one per .tolist()); `rounds` the syncs of
    each generate() round, and `verify_syncs` those of each round's target pass."""

    def __init__(self, value: int = 0):
        self.value = value
        self.syncs: list[str] = []
        self.details: list[str] = []  # the same, with the op
        self.rounds: list[list[str]] = []
        self.verify_syncs: list[list[str]] = []
        self.in_tolist = False
        self.step_depth = 0
        self._stand_ins: list[tuple[torch.Generator, torch.device]] = []
        self._undo: list = []

    # -- what is checked

    def fail(self, message: str):
        raise AssertionError(message + "\n" + "".join(traceback.format_stack(limit=12)[:-2]))

    def sync(self, kind: str, op) -> None:
        """kind: "tolist", "read" (.item() and the like), "upload" (blocking host-to-device
        copy) or "download" (blocking device-to-host copy)."""
        self.syncs.append(kind)
        self.details.append(f"{kind}: aten.{op.__name__}" if op is not None else kind)

    def check_copy(self, func, args, kwargs) -> None:
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            target = dst.device
        else:
            src = args[0]
            target = kwargs.get("device") or next(
                (a for a in args[1:] if isinstance(a, torch.device)), src.device
            )
        non_blocking = kwargs.get("non_blocking", False) or (
            func is aten.copy_.default and len(args) > 2 and args[2]
        )
        if src.device.type == "cpu" and torch.device(target).type != "cpu" and not non_blocking:
            self.sync("upload", func)
        if src.device.type != "cpu" and torch.device(target).type == "cpu" and not non_blocking:
            self.sync("download", func)

    def check_generator(self, g: torch.Generator, tensors, kwargs, func) -> None:
        # An op gets a new Python object for the same generator, so a stand-in is known by
        # its state (the stream it is at), compared outside FakeTensorMode.
        where = g.device
        with fake_tensor.unset_fake_temporarily():
            state = g.get_state()
            for stand_in, device in self._stand_ins:
                if torch.equal(stand_in.get_state(), state):
                    where = device
        device = kwargs.get("device") or next((t.device for t in tensors), None)
        if device is not None and torch.device(device).type != where.type:
            self.fail(f"a {where.type} generator for a {device} op: aten.{func.__name__}")

    # -- plumbing

    def _patch(self, owner, name, value) -> None:
        self._undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def _step(self, fn):
        def step(*args, **kwargs):
            self.step_depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.step_depth -= 1

        return step

    def __enter__(self) -> FakeCuda:
        from specfast.drafters.eagle.head import EagleHead

        real_generator = torch.Generator
        real_tolist = FakeTensor.tolist

        stand_ins = self._stand_ins

        class generator(real_generator):
            """torch.Generator("cuda") needs a driver: a CPU one stands in, known as cuda's."""

            def __new__(cls, device=None):
                return real_generator.__new__(cls)

            def __init__(self, device=None):
                super().__init__()
                stand_ins.append((self, torch.device(device or "cpu")))

        def tolist(t):
            if t.device.type != "cpu" and not self.in_tolist:
                self.sync("tolist", None)
                self.in_tolist = True
                try:
                    return real_tolist(t)
                finally:
                    self.in_tolist = False
            return real_tolist(t)

        self._limit = fake_tensor.CONSTANT_NUMEL_LIMIT
        # FakeTensorMode runs ops on 1-element "constants" for real, which for a copy to cuda
        # needs a driver: no constants.
        fake_tensor.CONSTANT_NUMEL_LIMIT = 0
        self._patch(torch, "Generator", generator)
        self._patch(FakeTensor, "tolist", tolist)
        for cls, name in ((Model, "forward"), (Model, "forward_static"), (EagleHead, "forward")):
            self._patch(cls, name, self._step(cls.__dict__[name]))
        # A decoder's passes run what Model.pass_for chose when it was made: each is a step.
        pass_for = Model.__dict__["pass_for"]
        self._patch(Model, "pass_for", lambda model, cache: self._step(pass_for(model, cache)))
        # SDPA's causal bias is a host tensor subclass FakeTensorMode cannot run; the same mask
        # written on the device stands in (test_model checks they are one mask).
        self._patch(attention_module, "causal_lower_right", written_lower_right)
        self._patch(generate_module, "speculate", self._round(generate_module.speculate))
        self._patch(generate_module, "_verify", self._verify(generate_module._verify))
        self.mode = FakeTensorMode()
        self.mode.__enter__()
        self.watch = _Watch(self)
        self.watch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.watch.__exit__(*exc)
        self.mode.__exit__(*exc)
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        fake_tensor.CONSTANT_NUMEL_LIMIT = self._limit

    def _round(self, speculate):
        def counted(*args, **kwargs):
            start = len(self.syncs)
            out = speculate(*args, **kwargs)
            self.rounds.append(self.syncs[start:])
            return out

        return counted

    def _verify(self, verify):
        def counted(*args, **kwargs):
            start = len(self.syncs)
            out = verify(*args, **kwargs)
            self.verify_syncs.append(self.syncs[start:])
            return out

        return counted


def cuda_model(config: ModelConfig = CONFIG, static: bool = False) -> Model:
    """A Model made on fake cuda (inside FakeCuda). static=True: decoders take the static path
    (Model.forward_static, uncompiled), as a compiled model's do."""
    with torch.device(CUDA):
        model = Model(config)
    if static:
        model.compiled_step = model.forward_static
    return model


def cuda_head(target: Model):
    from specfast.drafters.eagle.head import EagleConfig, EagleHead

    with torch.device(CUDA):
        head = EagleHead(EagleConfig.for_target(target, draft_vocab_size=50))
    # d2t = 0: the first 50 target ids (set_draft_vocab's checks read values: done on load)
    head.bind_embedding(target.embed.weight)
    return head


def run(model, **kw):
    kw = {"max_new_tokens": 12, "ignore_eos": True, "num_speculative_tokens": 3, **kw}
    return specfast.generate(model, PROMPT, **kw)


# ----------------------------------------------------------------------------
# whole rounds on fake cuda


@pytest.mark.parametrize("static", [False, True], ids=["eager-step", "static-step"])
@pytest.mark.parametrize("drafter", [None, "ngram", "draft-model", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_rounds_run_on_cuda_with_no_cpu_tensor_in_a_step(static, drafter, temperature):
    with FakeCuda() as fc:
        target = cuda_model(static=static)
        d = {"draft-model": lambda: cuda_model(DRAFT), "eagle": lambda: cuda_head(target)}
        the_drafter = d[drafter]() if drafter in d else drafter
        out = run(target, drafter=the_drafter, temperature=temperature, seed=3)
    assert len(out.token_ids) == 12
    assert len(fc.rounds) >= 3
    if drafter == "ngram":  # drafts of 0 after 0s: accepted, so passes of several tokens ran
        assert out.stats.accepted_tokens > 0


def test_eager_cuda_passes_never_offer_cudnn_attention(monkeypatch):
    """cuDNN's attention builds a graph for each new key length, which every eager decode step
    has: eager CUDA passes leave it out; the compiled (fixed-shape) step may take it."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def watch(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", watch)
    with FakeCuda():
        model = cuda_model()
        run(model, drafter="ngram")
        run(model, drafter=None)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # left as it was outside the passes

    seen.clear()  # control: an SDPA call outside an eager pass sees cuDNN offered
    with FakeCuda():
        q = torch.zeros(1, 2, 3, 8, device=CUDA)
        F.scaled_dot_product_attention(q, q, q)
    assert seen == [True]


def test_the_whole_model_is_on_cuda():
    with FakeCuda():
        model = cuda_model()
        dec = model.decoder(64)
        assert {p.device for p in model.parameters()} == {CUDA}
        assert dec.cache.k.device == CUDA and model.rope(64)[0].device == CUDA


# ----------------------------------------------------------------------------
# negative controls: the checker catches what it is for


def test_control_a_tensor_made_without_a_device_inside_a_step_is_caught(monkeypatch):
    real = Model.pass_for

    def planted(self, cache):
        run = real(self, cache)

        def cpu_tensor(ids, *args):
            _ = torch.zeros(ids.shape[0])  # the bug: no device=, so a CPU tensor
            return run(ids, *args)

        return cpu_tensor

    monkeypatch.setattr(Model, "pass_for", planted)
    with pytest.raises(AssertionError, match="made on the CPU inside a step"), FakeCuda():
        run(cuda_model(), drafter=None)


def test_control_mixing_a_cpu_tensor_into_a_cuda_op_is_caught(monkeypatch):
    real = Model.pass_for

    def planted(self, cache):
        run = real(self, cache)

        def mixed(ids, *args):
            return run(ids, *args) + torch.ones(self.vocab_size, device="cpu")

        return mixed

    monkeypatch.setattr(Model, "pass_for", planted)
    with pytest.raises((FakeTensorDeviceMismatchError, AssertionError)), FakeCuda():
        run(cuda_model(), drafter=None)


def test_control_a_cpu_generator_for_cuda_sampling_is_caught(monkeypatch):
    from specfast.drafters.model import DraftModelDrafter

    real_init = DraftModelDrafter.__init__

    def planted(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.generator = torch.Generator()  # the bug: no device=, so a CPU generator

    monkeypatch.setattr(DraftModelDrafter, "__init__", planted)
    with pytest.raises(AssertionError, match="cpu generator for a cuda"), FakeCuda():
        target = cuda_model()
        run(target, drafter=cuda_model(DRAFT), temperature=0.8, seed=1)


def test_control_the_same_run_on_a_device_generator_passes():
    with FakeCuda():
        run(cuda_model(), drafter=cuda_model(DRAFT), temperature=0.8, seed=1)


# ----------------------------------------------------------------------------
# CUDA graphs: the static cache is a static input, one set of buffers per model and capacity


def test_the_cache_is_marked_static_for_cuda_graphs():
    cache = KVCache(2, 2, 16, 8, "cpu", torch.float32)
    for t in (cache.k, cache.v):
        # "unguarded": cudagraph trees take it as a static input, and a new cache is no
        # recompile (torch._dynamo.mark_static_address(guard=False))
        assert getattr(t, "_dynamo_static_input_type", None) == "unguarded"
    decoder = Model.from_config(CONFIG).decoder(32)
    assert decoder.cache.k._dynamo_static_input_type == "unguarded"


def test_static_cache_buffers_are_reused_per_model_and_capacity():
    model = Model.from_config(CONFIG)
    a = static_cache(model, 256)
    with torch.inference_mode():
        a.k.fill_(7.0)
    b = static_cache(model, 256)  # alive at once: buffers of its own
    assert a.k.data_ptr() != b.k.data_ptr()
    address = a.k.data_ptr()
    del a
    gc.collect()
    c = static_cache(model, 256)  # the next decoder: the same addresses, zeroed
    assert c.k.data_ptr() == address and not c.k.any()
    assert c.k._dynamo_static_input_type == "unguarded"
    assert static_cache(model, 512).k.data_ptr() not in (address, b.k.data_ptr())
    other = Model.from_config(CONFIG)
    assert static_cache(other, 256).k.data_ptr() not in (address, b.k.data_ptr())


def test_static_cache_buffers_go_with_the_model():
    model = Model.from_config(CONFIG)
    cache = static_cache(model, 256)
    buffer = weakref.ref(cache.k)
    del cache, model
    gc.collect()
    assert buffer() is None


def mutated_inputs(model: Model, cache: KVCache) -> dict[str, str | None]:
    """The graph inputs the compiled step writes in place -> how each is marked static (None:
    not). Inductor's CUDA graphs skip a graph with an unmarked one (cudagraph_skips)."""
    out: dict[str, str | None] = {}

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            name = node.target if isinstance(node.target, str) else node.target.__name__
            if node.op in ("call_method", "call_function") and name.endswith("_"):
                base = node.args[0]
                while base.op != "placeholder":  # through k_cache[i] and other views
                    base = base.args[0]
                out[base.name] = base.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(model.forward_static, fullgraph=True, dynamic=False, backend=backend)
    cos, sin = model.rope(cache.max_length)
    C = cache.max_length
    with torch.inference_mode():
        step(torch.zeros(4, dtype=torch.long), torch.arange(4), cache.k, cache.v, cos[:C], sin[:C])
    return out


def test_every_input_the_compiled_step_writes_is_static():
    model = Model.from_config(CONFIG)
    assert mutated_inputs(model, static_cache(model, 256)) == {
        "l_k_cache_": "unguarded",
        "l_v_cache_": "unguarded",
    }


def test_control_an_unmarked_cache_is_a_mutated_non_static_input():
    model = Model.from_config(CONFIG)
    cache = static_cache(model, 256)
    del cache.k._dynamo_static_input_type  # the cache as it was made before the marking
    assert mutated_inputs(model, cache)["l_k_cache_"] is None


def test_compiled_step_on_marked_static_buffers_equals_eager():
    """torch.compile (AOT autograd, which handles the in-place cache writes) over the marked
    buffers of static_cache gives the eager step's logits, and writes the cache it was given."""
    torch._dynamo.reset()
    model = Model.from_config(CONFIG, seed=2).compile_steps(backend="aot_eager")
    ids = torch.randint(0, CONFIG.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    step = model.compiled_step
    outs = []
    for fn in (model.forward_static, step):
        cache = static_cache(model, 256)
        cos, sin = model.rope(256)
        with torch.inference_mode():
            fn(ids[:16], torch.arange(16), cache.k, cache.v, cos[:256], sin[:256])
            outs.append(fn(ids[16:], torch.arange(16, 20), cache.k, cache.v, cos[:256], sin[:256]))
            outs.append(cache.k[:, :, :20].clone())
        del cache
        gc.collect()
    (eager_logits, eager_top), eager_k, (logits, top), k = outs
    torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
    assert top.tolist() == eager_top.tolist()
    torch.testing.assert_close(k, eager_k, rtol=1e-4, atol=1e-4)
    assert k.abs().sum() > 0  # the compiled step wrote the buffers it was handed


# ----------------------------------------------------------------------------
# real CUDA (scripts/gpu_check.sh): graphs recorded, none skipped, none re-recorded


@pytest.mark.cuda
def test_cuda_compiled_generate_records_graphs_and_skips_none():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # test_steps.py's CONFIG: the two CUDA tests share compiled graphs (inductor's cache)
    config = dataclasses.replace(CONFIG, n_layers=2)
    eager = Model.from_config(config, seed=1, device="cuda")
    compiled = Model.from_config(config, seed=1, device="cuda").compile_steps()
    want = run(eager, drafter=None).token_ids
    for _ in range(3):  # later generate() calls replay the first one's graphs
        assert run(compiled, drafter="ngram").token_ids == want
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
