"""`tools` and `tool_choice` in `specfast serve` (serve/tools.py, serve/tool_calls.py), on SmolLM2,
whose chat template has no tools: the fallback renders them.

Driven by the official openai client against a live server: required and a named function
make a call whose arguments validate against the function's schema; auto answers in text, or
opens a call that the grammar then holds to the schema; none makes no call; each reply is the
one plain constrained decoding (no speculation) gives for the same prompt and grammar; the
call's result goes back as a `tool` message, a final answer comes out, and the session's cache
is reused across the call; a stream reassembles to the whole reply; bad input gets a 400
naming the field. Without a server: the parser, the auto grammar and the rendering, each with
a negative control (a parser that drops arguments or names the wrong function, a grammar
that never starts the constraint, a call sent back with other arguments).
"""

from __future__ import annotations

import json

import pytest
from test_serve import client, health, post, serving

import specfast
from specfast.constraints import Constraint, check_response_format
from specfast.serve.tool_calls import Calls
from specfast.serve.tools import Tools, fallback, grammar, render
from specfast.settings import encode_text

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.smollm

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# A prompt on which SmolLM2 opens a call by itself (auto), found by trying a few.
CALLER = [
    {
        "role": "system",
        "content": "You are a function-calling AI. You always reply with a <tool_call> block.",
    },
    {"role": "user", "content": "Weather in Paris, celsius."},
]
N = 60


@pytest.fixture(scope="module")
def url():
    with serving("--sessions", "4") as url:
        yield url


@pytest.fixture(scope="module")
def api(url):
    return client(url)


@pytest.fixture(scope="module")
def model_id(api):
    return api.models.list().data[0].id


def ask(api, model_id, messages, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", N)
    return api.chat.completions.create(model=model_id, messages=messages, tools=TOOLS, **kw)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def plain(smollm, messages, choice, parallel=True):
    """(content, [(name, arguments)]) of plain constrained decoding (no drafter) on the prompt
    and grammar the server uses, parsed by tool_calls.Calls."""
    tools = Tools(TOOLS, choice, parallel)
    ids = encode_text(smollm.tokenizer, render(messages, tools, smollm.chat_template))
    rf = {"type": "grammar", "grammar": grammar(tools)}
    out = specfast.generate(smollm, ids, max_new_tokens=N, drafter=None, response_format=rf)
    parsed = Calls()
    content = "".join(d.get("content", "") for d in parsed.feed(out.text, end=True))
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls]
    return content, calls


def assert_valid(calls, names):
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])


# ----------------------------------------------------------------------------
# a live server


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_required_and_named_make_a_valid_call(api, model_id, smollm, choice):
    wire = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    r = ask(api, model_id, ASK, tool_choice=wire, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    calls = calls_of(c.message)
    assert len(calls) == 1 and c.message.tool_calls[0].id.startswith("call_")
    assert_valid(calls, SCHEMAS if choice == "required" else [choice])
    assert calls == plain(smollm, ASK, choice, parallel=False)[1]
    assert r.model_extra["specfast"]["forced_tokens"] > 0  # the call's frame, as free drafts
    # Control: the same question with tool_choice auto gets text and no call.
    free = ask(api, model_id, ASK, tool_choice="auto").choices[0]
    assert free.message.tool_calls is None and free.message.content


def test_auto_answers_in_text_or_opens_a_checked_call(api, model_id, smollm):
    text = ask(api, model_id, ASK).choices[0]  # auto is the default with tools
    assert text.finish_reason in ("stop", "length") and text.message.tool_calls is None
    assert (text.message.content, []) == plain(smollm, ASK, "auto")
    call = ask(api, model_id, CALLER, tool_choice="auto", parallel_tool_calls=False).choices[0]
    assert call.finish_reason == "tool_calls"
    assert_valid(calls_of(call.message), SCHEMAS)
    assert (call.message.content or "", calls_of(call.message)) == plain(
        smollm, CALLER, "auto", parallel=False
    )


def test_none_makes_no_call(api, model_id):
    none = ask(api, model_id, CALLER, tool_choice="none")
    c = none.choices[0]
    assert c.message.tool_calls is None and isinstance(c.message.content, str)
    assert "<tool_call>" not in c.message.content and c.finish_reason in ("stop", "length")
    # The tools were rendered (the prompt is auto's), and auto calls here: the control.
    auto = ask(api, model_id, CALLER, tool_choice="auto", parallel_tool_calls=False)
    assert auto.choices[0].message.tool_calls
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens


def test_the_result_goes_back_and_a_final_answer_comes_out(api, model_id):
    first = ask(api, model_id, ASK, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}

    def follow(arguments):
        function = {"name": call.function.name, "arguments": arguments}
        sent = {"id": call.id, "type": "function", "function": function}
        turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [sent]}, result]
        return ask(api, model_id, turn)

    final = follow(call.function.arguments)
    c = final.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None
    assert isinstance(c.message.content, str) and c.message.content
    # The call renders back to the tokens the model wrote: the whole first turn is reused.
    seen = first.usage.prompt_tokens + first.usage.completion_tokens
    assert final.model_extra["specfast"]["reused_prompt_tokens"] >= seen - 2
    # Control: sent back with other arguments, the cache is reused only up to them.
    other = follow(json.dumps({"city": "Oslo", "unit": "fahrenheit"}))
    assert other.model_extra["specfast"]["reused_prompt_tokens"] < seen - 2


@pytest.mark.parametrize(
    ("messages", "choice"), [(ASK, "required"), (CALLER, "auto"), (ASK, "auto")]
)
def test_a_stream_reassembles_to_the_whole_reply(api, model_id, messages, choice):
    whole = ask(api, model_id, messages, tool_choice=choice, parallel_tool_calls=False)
    chunks = list(
        ask(api, model_id, messages, tool_choice=choice, parallel_tool_calls=False, stream=True)
    )
    content, calls, pieces = "", {}, 0
    for ch in chunks:
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first delta: id, type, name and arguments ""
                assert tc.id and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = [tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index][1] += tc.function.arguments
                pieces += 1
    want = whole.choices[0]
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert (content or None) == want.message.content
    assert [tuple(v) for _, v in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in want.message.tool_calls or []
    ]
    if want.message.tool_calls:
        assert pieces >= 2  # the arguments streamed as they came, not in one piece at the end


def tool(**function) -> dict:
    return {"type": "function", "function": function}


BAD = [
    ({"tools": "get_weather"}, "tools", "non-empty array"),
    ({"tools": []}, "tools", "non-empty array"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "code", "function": WEATHER["function"]}]}, "tools", "tools[0] must be"),
    ({"tools": [tool(name="a b")]}, "tools", "letters"),
    ({"tools": [tool(name="f", colour="red")]}, "tools", "tools[0].function must be"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "own name"),
    ({"tools": [tool(name="f", parameters={"type": "string"})]}, "tools", "schema of an object"),
    (
        {"tools": [tool(name="f", parameters={"properties": {"x": {"type": "no"}}})]},
        "tools",
        "llguidance refuses the schema",
    ),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
    (
        {"messages": [*ASK, {"role": "tool", "content": "18"}]},
        "messages[1].tool_call_id",
        "id of the call",
    ),
    (
        {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        "messages[1].tool_calls[0]",
        "arguments",
    ),
    (
        {"messages": [*ASK, {"role": "user", "content": "hi", "tool_calls": [{}]}]},
        "messages[1].tool_calls",
        "assistant",
    ),
]


def test_bad_tools_get_400_naming_the_field(url, api, model_id):
    body = {"model": model_id, "messages": ASK, "max_tokens": 4, "tools": TOOLS}
    for change, param, words in BAD:
        data = {**body, **change}
        data = {k: v for k, v in data.items() if v is not None}
        status, reply = post(f"{url}/v1/chat/completions", json.dumps(data).encode())
        assert status == 400, (change, reply)
        err = reply["error"]
        assert err["param"] == param and words in err["message"], (change, err)
        assert health(url)["status"] == "ok"
    # Control: the body unchanged is served.
    status, reply = post(f"{url}/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, reply


# ----------------------------------------------------------------------------
# without a server

TEXT = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": '
    '"a } and </tool_call> inside", "n": [1, {"a": 2}]}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>\n'
)
WANT = [
    ("get_weather", '{"city": "Paris", "note": "a } and </tool_call> inside", "n": [1, {"a": 2}]}'),
    ("get_time", '{"timezone": "CET"}'),
]


def parse(text: str, step: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of the reply, fed whole or `step` characters at a time."""
    calls, content = Calls(), ""
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    for piece in pieces:
        content += "".join(d.get("content", "") for d in calls.feed(piece))
    content += "".join(d.get("content", "") for d in calls.feed("", end=True))
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls.calls]


def check_parser(parse) -> None:
    assert parse(TEXT) == ("Sure.", WANT)
    assert parse("Just text, no <tool_ call.\n") == ("Just text, no <tool_ call.\n", [])
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CE'  # max_tokens
    assert parse(cut) == ("", [("get_time", '{"timezone": "CE')])


def test_the_parser_reads_content_and_calls():
    check_parser(parse)
    for step in (1, 3, 7):  # streamed: the same reply, however the text arrives
        check_parser(lambda text, step=step: parse(text, step))


@pytest.mark.parametrize("mutant", ["drops the arguments", "takes the wrong function"])
def test_control_a_broken_parser_is_caught(mutant):
    def broken(text):
        content, calls = parse(text)
        if mutant == "drops the arguments":
            return content, [(name, "{}") for name, _ in calls]
        return content, [(calls[0][0], args) for _, args in calls]

    with pytest.raises(AssertionError):
        check_parser(broken)


def walk(smollm, text: str, lark: str) -> int:
    """How many tokens of `text` the grammar takes before it refuses one (all: len)."""
    eos = set(smollm.eos_token_ids)
    g = check_response_format(
        {"type": "grammar", "grammar": lark}, smollm.tokenizer, smollm.vocab_size, eos
    )
    c, ids = Constraint(g), encode_text(smollm.tokenizer, text)
    for i, t in enumerate(ids):
        if not c.plan([], None, 0).allowed[0, t]:
            return i
        c.commit([t])
    return len(ids)


def test_auto_starts_the_constraint_when_a_call_opens(smollm):
    auto = grammar(Tools(TOOLS, "auto", True))
    good = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"timezone": "CET"}}\n</tool_call>'
    )
    assert walk(smollm, good, auto) == len(encode_text(smollm.tokenizer, good))
    free = "Free text: {json}, <tags>, </tool_call>."
    assert walk(smollm, free, auto) == len(encode_text(smollm.tokenizer, free))
    bad = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}'
    stops = walk(smollm, bad, auto)
    assert 0 < stops < len(encode_text(smollm.tokenizer, bad))  # at "town"
    required = grammar(Tools(TOOLS, "required", True))
    assert walk(smollm, good, required) == 0  # required: no text before the call
    # Control: a grammar whose text does not end at <tool_call> (not lazy) lets it through.
    assert "head[lazy]" in auto
    loose = auto.replace("head[lazy]", "head")
    assert walk(smollm, bad, loose) == len(encode_text(smollm.tokenizer, bad))


def test_rendering_writes_a_call_back_as_the_model_wrote_it():
    args = '{"city": "Paris", "unit": "celsius"}'
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18"},
        {"role": "tool", "tool_call_id": "c2", "content": "19"},
    ]
    out = fallback(messages, TOOLS)
    assert out[0]["role"] == "system" and json.dumps(WEATHER) in out[0]["content"]
    block = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    assert out[2] == {"role": "assistant", "content": block}
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\n18\n</tool_response>\n<tool_response>\n19\n</tool_response>",
    }
    # A template that takes tools gets them, and the arguments as an object (tojson unescaped).
    template = (
        "{% for t in tools %}T:{{ t.function.name }};{% endfor %}{% for m in messages %}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments | tojson }}"
        "{% endfor %}{% endfor %}"
    )
    text = render(messages, Tools(TOOLS, "auto", True), template)
    assert text == f"T:get_weather;T:get_time;<tool_call>{args}"
    # Control: the fallback's text depends on the arguments sent back.
    other = {**call, "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert fallback([*ASK, {**messages[1], "tool_calls": [other]}], None)[1]["content"] != block
