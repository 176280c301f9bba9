"""`specfast serve`, run as a real subprocess on 127.0.0.1 and driven by the official openai client:
greedy output equals generate() token for token (float32), conversations reuse their cache,
seeds reproduce, two clients at once, a dropped stream leaves the session as it was, bad input
gets a 400 naming the field, a full queue gets 429, and the corpus survives a restart.

Each check carries its control: the same check that fails on the wrong behaviour (a server
keeping no sessions shows no reuse, another seed gives other text, and so on).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

import specfast
from specfast.chat import render_chat
from specfast.session import corpus_fingerprint
from specfast.settings import encode_text

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.smollm
HOST = "127.0.0.1"  # loopback only
STARTUP_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start(*args: str) -> tuple[subprocess.Popen, str]:
    """`specfast serve` on a free loopback port, float32; returns (process, base URL) once
    /health answers (a bounded wait), or fails with the server's stderr."""
    port = free_port()
    cmd = [sys.executable, "-m", "specfast", "serve", "--host", HOST, "--port", str(port)]
    # The log goes to a file: a pipe nobody reads would block the server once full.
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by stop())
    proc = subprocess.Popen(
        [*cmd, "--dtype", "float32", "--max-length", "2048", *args],
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    proc.log = log  # type: ignore[attr-defined]
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"specfast serve exited with {proc.returncode}:\n{log.read()}")
        try:
            health(url, timeout=1)
            return proc, url
        except OSError:
            pass
        time.sleep(0.25)
    stop(proc)
    pytest.fail(f"specfast serve did not answer /health within {STARTUP_S} s")


def stop(proc: subprocess.Popen) -> int:
    """SIGINT, as Ctrl-C: the server finishes, writes its corpus and exits."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.log.close()
    return proc.returncode


@contextmanager
def serving(*args: str):
    proc, url = start(*args)
    try:
        yield url
    finally:
        stop(proc)


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def post(url: str, data: bytes) -> tuple[int, dict]:
    """A raw POST (bytes the openai client would not send): (status, JSON body)."""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving("--sessions", "4") as url:
        yield url


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A server that keeps no session and lets no request wait (the controls, and 429), with
    a corpus file written after every reply. Yields (URL, corpus path, the specfast stats of
    its first request: the edit turn, drafted from an empty corpus)."""
    path = tmp_path_factory.mktemp("corpus") / "serve.corpus"
    args = ("--sessions", "0", "--queue", "0", "--corpus", str(path), "--save-every", "1")
    with serving(*args) as url:
        yield url, path, first_turn(url)


@pytest.fixture(scope="module")
def bare_server(bare):
    return bare[0]


@pytest.fixture(scope="module")
def api(server):
    return client(server)


@pytest.fixture(scope="module")
def model_id(api):
    return api.models.list().data[0].id


def chat(api, model_id, messages, stream=False, **kw):
    """(text, the specfast object, usage) of one chat request, streamed or not."""
    kw.setdefault("temperature", 0)
    extra = {k: kw.pop(k) for k in ("drafter", "k") if k in kw}
    if not stream:
        r = api.chat.completions.create(
            model=model_id, messages=messages, extra_body=extra or None, **kw
        )
        return r.choices[0].message.content, r.model_extra["specfast"], r.usage
    chunks = api.chat.completions.create(
        model=model_id,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra or None,
        **kw,
    )
    text, last = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
        last = c
    return text, last.model_extra["specfast"], last.usage


_REFERENCE: dict[str, specfast.GenerateOutput] = {}


def reference(model, prompt, n):
    """generate()'s greedy output, once per prompt and length."""
    key = json.dumps([prompt, n])
    if key not in _REFERENCE:
        _REFERENCE[key] = specfast.generate(model, prompt, max_new_tokens=n)
    return _REFERENCE[key]


EDIT = (
    "Here is a Python function:\n```python\ndef add_all(values, start=0):\n    total = start\n"
    "    for value in values:\n        total = total + value\n    return total\n```\n"
    "Rename the parameter `values` to `numbers` everywhere. Reply with the whole function."
)
TURNS = [
    EDIT,
    "Now add a one-line docstring. Reply with the whole function.",
    "Now add type hints. Reply with the whole function.",
    "Now rename the function to `add_all_v2`. Reply with the whole function.",
]


# ----------------------------------------------------------------------------
# what it serves


def test_models_and_health(server, api, model_id):
    assert model_id == "SmolLM2-135M-Instruct.Q4_1"
    h = health(server)
    assert h["status"] == "ok" and h["model"] == model_id


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_greedy_equals_generate(api, model_id, smollm, stream):
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    text, stats, usage = chat(api, model_id, messages, stream=stream, max_tokens=24)
    want = reference(smollm, messages, 24)
    assert text == want.text
    ids = encode_text(smollm.tokenizer, render_chat(messages, smollm.chat_template))
    assert usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == len(want.token_ids)
    assert stats["target_passes"] >= 1 and stats["mean_acceptance_length"] >= 1
    assert {"draft_tokens", "accepted_tokens", "reused_prompt_tokens"} <= set(stats)
    # Control: the comparison sees the prompt's rendering (the raw text says something else).
    assert reference(smollm, messages[0]["content"], 24).text != text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_greedy_equals_generate(api, model_id, smollm, stream):
    prompt = "def fibonacci(n):\n"
    r = api.completions.create(
        model=model_id, prompt=prompt, max_tokens=32, temperature=0, stream=stream
    )
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    want = reference(smollm, prompt, 32)
    assert text == want.text
    assert reference(smollm, "def fib(n):\n", 32).text != text  # control


def test_stop_strings_cut_the_text(api, model_id, smollm):
    prompt = "Count: 1, 2, 3, 4,"
    full = reference(smollm, prompt, 24).text
    stop = full.strip().split(" ")[2]  # a word a few tokens in
    for stream in (False, True):
        r = api.completions.create(
            model=model_id, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
            stream=stream,
        )  # fmt: skip
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks)
        assert text == full[: full.index(stop)] and stop not in text
        assert chunks[-1].choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------
# conversations keep their cache


def conversation(api, model_id, smollm=None) -> list[int]:
    """The 4-turn edit conversation; each turn resends the whole history. Returns the reused
    prompt tokens per turn, checking each reply against generate() when given the model."""
    messages, reused = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        text, stats, _ = chat(api, model_id, messages, max_tokens=32)
        if smollm is not None:
            assert text == reference(smollm, messages, 32).text
        reused.append(stats["reused_prompt_tokens"])
        messages.append({"role": "assistant", "content": text})
    return reused


def test_a_conversation_reuses_its_cache(api, model_id, smollm):
    reused = conversation(api, model_id, smollm)
    # (The first turn may reuse the system prompt other conversations here began with.)
    assert all(b > a for a, b in itertools.pairwise(reused)) and reused[-1] > reused[0] + 100


def test_control_no_sessions_means_no_reuse(bare_server, model_id):
    assert conversation(client(bare_server), model_id) == [0, 0, 0, 0]


def test_another_conversation_keeps_the_first_ones_cache(api, model_id):
    first = [{"role": "user", "content": "Name three colours."}]
    a = chat(api, model_id, first, max_tokens=12)[0]
    other = [{"role": "user", "content": "Name three animals."}]
    chat(api, model_id, other, max_tokens=12)
    follow = [*first, {"role": "assistant", "content": a}, {"role": "user", "content": "More?"}]
    _, stats, usage = chat(api, model_id, follow, max_tokens=8)
    # The first conversation's session was not cut back by the second: all of it is reused
    # but the reply's end (the template's closing tokens after the reply).
    assert stats["reused_prompt_tokens"] >= usage.prompt_tokens - 20


def test_a_seed_gives_the_same_sample(api, model_id):
    messages = [{"role": "user", "content": "Tell me a short story about a fox."}]
    kw = dict(max_tokens=32, temperature=0.9, top_p=0.95)
    a = chat(api, model_id, messages, seed=7, **kw)[0]
    b = chat(api, model_id, messages, seed=7, stream=True, **kw)[0]
    c = chat(api, model_id, messages, seed=8, **kw)[0]
    assert a == b
    assert c != a  # control: the seed matters


def test_two_clients_at_once(server, model_id, smollm):
    prompts = ["The capital of France is", "def is_prime(n):\n"]
    results: dict[int, str] = {}

    def ask(i):
        r = client(server).completions.create(
            model=model_id, prompt=prompts[i], max_tokens=16, temperature=0
        )
        results[i] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(2)] == [reference(smollm, p, 16).text for p in prompts]
    assert results[0] != results[1]  # control: answers that were swapped would fail


def test_a_dropped_stream_leaves_the_session_as_it_was(server, api, model_id, smollm):
    prompt = "Here is a list of the numbers from 1 to 200, separated by commas: 1, 2, 3,"
    api.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0)
    before = health(server)  # a session holds the prompt now; the stream below runs on it
    stream = api.completions.create(
        model=model_id, prompt=prompt, max_tokens=300, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while health(server)["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = health(server)
    assert after["cancelled"] == before["cancelled"] + 1  # stopped, not run to the end
    assert after["served"] == before["served"]
    r = api.completions.create(model=model_id, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == reference(smollm, prompt, 24).text
    # Control: the request ran on the session the dropped stream had used (its prompt was
    # cached), so a session left inconsistent would have shown here.
    assert r.model_extra["specfast"]["reused_prompt_tokens"] > 0


# ----------------------------------------------------------------------------
# bad input


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "no"}}}},
        "response_format",
        "llguidance refuses it",
    ),
    (b'{"model": ', None, "JSON"),
    ([1, 2], None, "object"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": "hi"}, "messages", "array"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ({"model": "gpt-4o"}, "model", "unknown model"),
    ({"max_tokens": 10**6}, "max_tokens", "at most"),
    ({"max_tokens": "ten"}, "max_tokens", "integer"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"seed": "x"}, "seed", "integer"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"n": 2}, "n", "must be 1"),
    ({"drafter": "eagle7"}, "drafter", "ngram, none"),
    ({"k": 0}, "k", '"auto"'),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"presence_penalty": 1}, "presence_penalty", "not supported"),
    ({"frobnicate": 1}, "frobnicate", "unrecognized"),
]


def test_bad_input_gets_400_naming_the_field(server, api, model_id, smollm):
    body = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for change, param, words in BAD:
        if isinstance(change, dict):
            data = json.dumps({**body, **change}).encode()
        else:
            data = change if isinstance(change, bytes) else json.dumps(change).encode()
        status, reply = post(f"{server}/v1/chat/completions", data)
        assert status == 400, (change, reply)
        err = reply["error"]
        assert err["param"] == param and words in err["message"], (change, err)
        assert err["type"] == "invalid_request_error"
        assert health(server)["status"] == "ok"
    # Control: the same body, unchanged, is served, correctly.
    assert post(f"{server}/v1/chat/completions", json.dumps(body).encode())[0] == 200
    text, _, _ = chat(api, model_id, body["messages"], max_tokens=8)
    assert text == reference(smollm, body["messages"], 8).text


def test_bad_completion_prompts(server):
    for prompt in (5, [], [["a"]], "", [10**9]):
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": 2}
        status, reply = post(f"{server}/v1/completions", json.dumps(body).encode())
        assert status == 400 and reply["error"]["param"] == "prompt", (prompt, reply)
    good = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Hi", "max_tokens": 2}
    assert post(f"{server}/v1/completions", json.dumps(good).encode())[0] == 200


def test_a_full_queue_gets_429(bare_server, model_id):
    api = client(bare_server)
    stream = api.completions.create(
        model=model_id, prompt="1, 2, 3,", max_tokens=200, temperature=0, stream=True
    )
    next(iter(stream))  # it is running now
    with pytest.raises(openai.RateLimitError) as e:
        api.completions.create(model=model_id, prompt="Hi", max_tokens=2)
    assert "busy" in e.value.body["message"]
    stream.close()
    deadline = time.monotonic() + 60
    while health(bare_server)["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    # Control: with the queue free again, the same request is served.
    assert api.completions.create(model=model_id, prompt="Hi", max_tokens=2).choices


# ----------------------------------------------------------------------------
# the corpus


def first_turn(url: str):
    api = client(url)
    model_id = api.models.list().data[0].id
    messages = [{"role": "user", "content": EDIT}]
    return chat(api, model_id, messages, max_tokens=48, k=4)


def test_the_corpus_survives_a_restart(bare, tmp_path):
    _, written, (text, fresh, _) = bare
    path = tmp_path / "copy.corpus"  # one writer per file: the bare server still runs
    path.write_bytes(written.read_bytes())
    with serving("--corpus", str(path)) as url:
        again, learned, _ = first_turn(url)
    assert again == text
    # Control: `fresh` is this very turn from an empty corpus (k is fixed, so drafting is
    # deterministic); a server that did not load the file would accept exactly as many.
    assert learned["accepted_tokens"] > fresh["accepted_tokens"]


def test_a_damaged_corpus_is_refused_and_left_as_it_was(tmp_path, smollm, monkeypatch, capsys):
    from specfast.cli import main
    from specfast.serve.pool import CorpusError, load_corpus

    path = tmp_path / "damaged.corpus"
    good = specfast.NgramDrafter()
    good.add_document(list(range(100)))
    good.save(path, fingerprint=corpus_fingerprint(smollm))
    assert load_corpus(str(path), smollm, reset=False).corpus_tokens == 100  # control
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorpusError, match="--corpus-reset"):
        load_corpus(str(path), smollm, reset=False)
    assert load_corpus(str(path), smollm, reset=True).corpus_tokens == 0
    # The command refuses to start, says why, and leaves the file alone.
    monkeypatch.setattr(specfast.cli.serve, "load_model", lambda *a, **kw: smollm)
    assert main(["serve", "--corpus", str(path), "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert "cannot load the corpus" in err and "--corpus-reset" in err
    assert path.read_bytes() == bytes(data)


def test_cli_help_names_the_options():
    r = subprocess.run(
        [sys.executable, "-m", "specfast", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == 0
    for option in ("--sessions", "--queue", "--corpus", "--corpus-reset", "--host", "--port"):
        assert option in r.stdout


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_is_generates(api, model_id, smollm, stream):
    messages = [{"role": "user", "content": "Alice Smith is 34. Give her name and age as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    text, stats, _ = chat(api, model_id, messages, stream=stream, max_tokens=40, response_format=rf)
    want = specfast.generate(smollm, messages, max_new_tokens=40, response_format=rf)
    assert text == want.text
    if want.finish_reason == "eos":  # the grammar completed: the reply is the schema's JSON
        reply = json.loads(text)
        assert set(reply) == {"name", "age"} and isinstance(reply["age"], int)
    # Control: without the format the same request gives other text.
    free, _, _ = chat(api, model_id, messages, stream=stream, max_tokens=40)
    assert free != text
    assert stats["forced_tokens"] > 0


def test_response_format_json_object_and_text(api, model_id, smollm):
    messages = [{"role": "user", "content": "Describe a cat as a JSON object."}]
    text, _, _ = chat(
        api, model_id, messages, max_tokens=32, response_format={"type": "json_object"}
    )
    want = specfast.generate(
        smollm, messages, max_new_tokens=32, response_format={"type": "json_object"}
    )
    assert text == want.text and text.lstrip().startswith("{")
    plain, _, _ = chat(api, model_id, messages, max_tokens=16, response_format={"type": "text"})
    assert plain == reference(smollm, messages, 16).text
