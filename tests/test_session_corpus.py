"""Session with a persistent corpus: each finished turn is saved; a later session drafts from
it; a damaged or foreign corpus file is refused."""

from __future__ import annotations

import pytest
from test_cli import tiny_model_dir  # noqa: F401  (the fixture: a tiny HF folder)
from test_session import context_of, messages, plain, tiny

import specfast
from specfast.model import Model, ModelConfig
from specfast.session import Session


def test_a_saved_corpus_is_loaded_and_drafts_more_with_the_same_output(tmp_path):
    model = tiny()
    path = tmp_path / "chat.corpus"
    msgs = messages(4, seed=9)
    first = Session(model, corpus=path, max_new_tokens=24, ignore_eos=True)
    for msg in msgs:
        first.send(msg)
        assert path.exists()
        assert specfast.NgramDrafter.load(path).corpus_tokens == len(first.token_ids)
    # A new conversation that starts like the old one: the corpus knows what comes.
    loaded = Session(model, corpus=path, max_new_tokens=24, ignore_eos=True)
    fresh = Session(model, max_new_tokens=24, ignore_eos=True)
    for i, msg in enumerate(msgs[:2]):
        a, b = loaded.send(msg), fresh.send(msg)
        assert (
            a.token_ids == b.token_ids == plain(model, context_of(loaded, a), 24, ignore_eos=True)
        )
        if i == 0:
            assert a.stats.accepted_tokens > b.stats.accepted_tokens
            assert a.stats.target_passes < b.stats.target_passes


def test_a_corpus_of_another_vocabulary_is_refused(tmp_path):
    path = tmp_path / "chat.corpus"
    Session(tiny(), corpus=path, max_new_tokens=4).send([1, 2, 3])
    other = Model.from_config(ModelConfig(vocab_size=80, dim=32, n_layers=1, n_heads=2), seed=0)
    with pytest.raises(ValueError, match="fingerprint"):
        Session(other, corpus=path)
    with pytest.raises(ValueError, match="corpus"):
        Session(tiny(), drafter=None, corpus=path)


@pytest.mark.parametrize("damage", ["truncated", "byte flipped", "empty", "foreign"])
def test_a_damaged_corpus_file_is_a_value_error_and_is_left_as_it_was(tmp_path, damage):
    path = tmp_path / "chat.corpus"
    Session(tiny(), corpus=path, max_new_tokens=4).send([1, 2, 3])
    data = path.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "byte flipped": data[:20] + bytes([data[20] ^ 0xFF]) + data[21:],
        "empty": b"",
        "foreign": b"GGUF" + data[4:],
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match=r"chat\.corpus"):
        Session(tiny(), corpus=path)
    assert path.read_bytes() == damaged  # nothing overwrote what the user had


def test_generate_cli_corpus_grows_and_drafts(tiny_model_dir, tmp_path, capsys):  # noqa: F811
    from specfast.cli import main

    path = tmp_path / "cli.corpus"
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "abc abc abc",
            "--max-new-tokens", "12", "--corpus", str(path)]  # fmt: skip
    assert main(argv) == 0
    n = specfast.NgramDrafter.load(path).corpus_tokens
    assert n > 12
    assert main(argv) == 0
    assert specfast.NgramDrafter.load(path).corpus_tokens == 2 * n
    out = capsys.readouterr().out  # the same text twice: the corpus changes speed, not output
    assert out and out[: len(out) // 2] == out[len(out) // 2 :]


def test_a_transformers_target_session_equals_generate_and_forks():
    pytest.importorskip("transformers")
    from conftest import make_hf_model

    hf = make_hf_model("qwen2-bias")
    s = Session(hf, max_new_tokens=10, ignore_eos=True)
    msgs = [[5, 9, 17, 5, 9, 17], [5, 9, 30, 31], [17, 5, 9]]
    s.send(msgs[0])
    f = s.fork()
    for session in (s, f):
        for msg in msgs[1:]:
            out = session.send(msg)
            assert out.token_ids == plain(hf, context_of(session, out), 10, ignore_eos=True)
            assert out.stats.reused_tokens > 0
