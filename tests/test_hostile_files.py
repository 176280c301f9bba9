"""Hostile files: mutated and truncated GGUF files, safetensors weights, config.json and
tokenizer.json. Loading gives a model or a ValueError / TypeError / FileNotFoundError with a
message: never a panic, a hang, another exception, or an allocation past what the file holds.

A few hundred cases per kind here; `python benches/fuzz_loaders.py` runs thousands.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("transformers")

from hostile_files import (
    apply,
    byte_mutations,
    dump_json,
    gguf_header_length,
    json_mutations,
    load_outcome,
    mutated_folder,
    safetensors_header_length,
    write_seeds,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CASES = 250
FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,  # the same cases every CI run; the bench explores new ones
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seeds")
    paths = write_seeds(folder)
    assert load_outcome(paths["gguf"]) == "ok"
    assert load_outcome(paths["ckpt"]) == "ok"
    return paths


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("work")


@FUZZ
@given(data=st.data())
def test_mutated_gguf(seeds, work, data):
    raw = seeds["gguf"].read_bytes()
    edits = data.draw(byte_mutations(len(raw), gguf_header_length(seeds["gguf"])))
    path = work / "m.gguf"
    path.write_bytes(apply(raw, edits))
    load_outcome(path)


@FUZZ
@given(data=st.data())
def test_mutated_safetensors(seeds, work, data):
    seed = seeds["ckpt"] / "model.safetensors"
    edits = data.draw(byte_mutations(seed.stat().st_size, safetensors_header_length(seed)))
    folder = mutated_folder(seeds["ckpt"], work / "st", "model.safetensors",
                            lambda b: apply(b, edits))  # fmt: skip
    load_outcome(folder)


@FUZZ
@given(data=st.data())
def test_mutated_config_json(seeds, work, data):
    config = json.loads((seeds["ckpt"] / "config.json").read_text())
    if data.draw(st.booleans()):
        text = dump_json(data.draw(json_mutations(config)))
    else:
        raw = dump_json(config)
        text = apply(raw, data.draw(byte_mutations(len(raw), len(raw))))
    load_outcome(mutated_folder(seeds["ckpt"], work / "cfg", "config.json", lambda _: text))


@FUZZ
@given(data=st.data())
def test_mutated_tokenizer_json(seeds, work, data):
    tok = json.loads((seeds["ckpt"] / "tokenizer.json").read_text())
    if data.draw(st.booleans()):
        text = dump_json(data.draw(json_mutations(tok)))
    else:
        raw = dump_json(tok)
        text = apply(raw, data.draw(byte_mutations(len(raw), len(raw))))
    load_outcome(mutated_folder(seeds["ckpt"], work / "tok", "tokenizer.json", lambda _: text))


# ----------------------------------------------------------------------------
# a tensor claiming 2**40 elements is refused before anything is allocated

_PEAK = """
import resource, sys
sys.path.insert(0, {tests!r})
from hostile_files import load_outcome
import specfast, torch  # imported first, so the peak below is the load's own
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
outcome = load_outcome({path!r})
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(outcome, (after - before) // 1024)
"""


def _huge_gguf(seed: Path, dest: Path, dims: list[int]) -> Path:
    """`seed` with token_embd.weight's dims rewritten (same byte length: same n_dims)."""
    from gguf import GGUFReader

    reader = GGUFReader(seed)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    dims_part = t.field.parts[3]  # the uint64 dims, a view into the file
    offset = dims_part.ctypes.data - reader.data.ctypes.data
    raw = bytearray(seed.read_bytes())
    assert len(dims) == len(dims_part)
    raw[offset : offset + 8 * len(dims)] = b"".join(d.to_bytes(8, "little") for d in dims)
    dest.write_bytes(bytes(raw))
    return dest


@pytest.mark.parametrize("dims", [[64, 2**34], [2**20, 2**20], [2**32, 2**32]])
def test_tensor_claiming_2_40_elements_is_refused_without_allocating(seeds, work, dims):
    path = _huge_gguf(seeds["gguf"], work / "huge.gguf", dims)
    code = _PEAK.format(tests=str(Path(__file__).parent), path=str(path))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    outcome, grown_mb = out.stdout.split()
    assert outcome == "ValueError"
    # 2**40 float32 elements would be 4 TiB; the tiny file itself is well under 1 MB.
    assert int(grown_mb) < 64, f"peak RSS grew {grown_mb} MB"


def test_huge_gguf_message_names_the_file_and_the_shape(seeds, work):
    from specfast import load_model

    path = _huge_gguf(seeds["gguf"], work / "huge2.gguf", [64, 2**34])
    with pytest.raises(ValueError, match=r"huge2.gguf: not a readable GGUF file.*17179869184"):
        load_model(path)
