"""`specfast serve` logprobs through the official openai client: chat's `logprobs` and
`top_logprobs`, whole and streamed, and the legacy /v1/completions `logprobs`, carry generate()'s
numbers for the tokens of the returned text; bad values get a 400 naming the field and the server
keeps serving. (test_serve.py starts the server the same way.)"""

from __future__ import annotations

import json

import pytest
from test_serve import client, health, post, serving

import specfast

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.smollm

HI = [{"role": "user", "content": "Say hi."}]  # SmolLM2 ends this one with EOS
COUNT = "1, 2, 3, 4,"


@pytest.fixture(scope="module")
def server():
    with serving("--sessions", "2") as url:
        yield url


@pytest.fixture(scope="module")
def api(server):
    return client(server)


@pytest.fixture(scope="module")
def model_id(api):
    return api.models.list().data[0].id


def chat(api, model_id, messages, stream: bool, **kw):
    """(text, logprobs.content entries, finish_reason) of a greedy chat request. Streamed, the
    entries must come in more than one chunk."""
    kw = dict(temperature=0, logprobs=True) | kw
    if not stream:
        r = api.chat.completions.create(model=model_id, messages=messages, **kw)
        c = r.choices[0]
        return c.message.content, c.logprobs.content, c.finish_reason
    text, entries, finish, carrying = "", [], None, 0
    for chunk in api.chat.completions.create(model=model_id, messages=messages, stream=True, **kw):
        c = chunk.choices[0]
        text += c.delta.content or ""
        entries += c.logprobs.content if c.logprobs is not None else []
        carrying += bool(c.logprobs and c.logprobs.content)
        finish = c.finish_reason or finish
    assert carrying > 1 or len(entries) < 2  # streamed as the text goes, not all at the end
    return text, entries, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_generates(api, model_id, smollm, stream):
    text, entries, finish = chat(api, model_id, HI, stream, max_tokens=40, top_logprobs=3)
    want = specfast.generate(smollm, HI, max_new_tokens=40, logprobs=True, top_logprobs=3)
    assert text == want.text and finish == "stop" and want.finish_reason == "eos"
    # One entry per token of the text: the EOS that ended it is not one.
    assert len(entries) == len(want.token_ids) - 1
    assert [e.logprob for e in entries] == want.logprobs[:-1]
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode()
    for e, top in zip(entries, want.top_logprobs, strict=False):
        assert e.token == bytes(e.bytes).decode("utf-8", errors="replace")
        assert [t.logprob for t in e.top_logprobs] == [v for _, v in top]
        tokens = [smollm.tokenizer.decode([t]) for t, _ in top]
        assert [t.token for t in e.top_logprobs] == tokens
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    # Control: another question gives other numbers.
    _, other, _ = chat(
        api, model_id, [{"role": "user", "content": "Say bye."}], stream, max_tokens=8
    )
    assert [e.logprob for e in other] != [e.logprob for e in entries][: len(other)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_stop_at_a_stop_string(api, model_id, stream):
    text, entries, _ = chat(api, model_id, HI, stream, max_tokens=40, stop=["!"])
    assert text and "!" not in text
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode()  # not the stop's tokens
    assert all(e.top_logprobs == [] for e in entries)  # top_logprobs left out: none asked for
    _, all_entries, _ = chat(api, model_id, HI, stream, max_tokens=40)
    assert len(all_entries) > len(entries)  # control: without the stop there are more


def test_chat_without_logprobs_has_none(api, model_id):
    r = api.chat.completions.create(model=model_id, messages=HI, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_legacy_completion_logprobs(api, model_id, smollm, stream):
    r = api.completions.create(
        model=model_id, prompt=COUNT, max_tokens=10, temperature=0, logprobs=2, stream=stream
    )
    choices = [c.choices[0] for c in r] if stream else [r.choices[0]]
    text = "".join(c.text for c in choices)
    lp = [c.logprobs for c in choices if c.logprobs is not None]
    tokens = [t for x in lp for t in x.tokens]
    logprobs = [v for x in lp for v in x.token_logprobs]
    tops = [d for x in lp for d in x.top_logprobs]
    offsets = [o for x in lp for o in x.text_offset]
    want = specfast.generate(smollm, COUNT, max_new_tokens=10, logprobs=True, top_logprobs=2)
    assert text == want.text and logprobs == want.logprobs
    assert "".join(tokens) == text
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    for t, v, top in zip(tokens, logprobs, tops, strict=True):
        assert top[t] == v and len(top) in (2, 3)  # the best 2, and the chosen token


BAD = [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "[0, 20]"),
    ("chat", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "integer"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ("chat", {"logprobs": False, "top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ("chat", {"logprobs": "yes"}, "logprobs", "true or false"),
    ("chat", {"logprobs": 1}, "logprobs", "true or false"),
    ("completion", {"logprobs": 6}, "logprobs", "[0, 5]"),
    ("completion", {"logprobs": True}, "logprobs", "[0, 5]"),
    ("completion", {"logprobs": "2"}, "logprobs", "[0, 5]"),
]


def test_bad_logprob_values_get_400_naming_the_field(server, api, model_id):
    for kind, change, param, words in BAD:
        if kind == "chat":
            path, body = "chat/completions", {"messages": HI}
        else:
            path, body = "completions", {"prompt": COUNT}
        data = json.dumps({"model": model_id, "max_tokens": 2, **body, **change}).encode()
        status, reply = post(f"{server}/v1/{path}", data)
        assert status == 400, (change, reply)
        assert reply["error"]["param"] == param and words in reply["error"]["message"], reply
        assert health(server)["status"] == "ok"
    # Control: the good values are served, after all the bad ones.
    text, entries, _ = chat(api, model_id, HI, False, max_tokens=4, top_logprobs=20)
    assert text and len(entries) == 4 and all(len(e.top_logprobs) == 20 for e in entries)
    for top in (0, None):
        body = {"model": model_id, "messages": HI, "max_tokens": 2, "top_logprobs": top}
        assert post(f"{server}/v1/chat/completions", json.dumps(body).encode())[0] == 200
