"""OpenAI's `tools` and `tool_choice` in `specfast serve`: checked, rendered, constrained, parsed.

A call is the block Qwen2.5, Qwen3 and Hermes models were trained to write, one per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rendering. A chat template that takes `tools` and speaks this format (its text names `tools`
and `<tool_call>`) gets the tools, the assistant's tool_calls (arguments as objects) and the
`tool` messages as transformers passes them. Any other template (SmolLM2's, Llama 3's own JSON
format, no template) gets the fallback: a system message listing the tools as JSON and asking
for the block above, earlier calls written back into the assistant's text as those blocks, and
each run of `tool` messages as one user message of <tool_response> blocks. Every tool_choice
renders the same prompt, so an agent's turns share the session's cache whatever it sends.

The constraint (constraints.py, exact under speculation). "required" or a named function: the
reply is call blocks of the allowed functions (one block with parallel_tool_calls false), each
arguments object valid against its function's parameters schema. "auto": free text, or free
text then calls: any text is allowed until `<tool_call>` opens (a lazy lexeme; the special
token where the vocabulary has one), which starts the same call grammar; after the last call
only EOS. "none": no grammar; `<tool_call>` is a stop string, so no call is made and the reply
is the text before it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from specfast.chat import render_chat
from specfast.constraints import is_special

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
CHOICES = '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
# Arguments as json.dumps (and transformers' tojson) writes them, so a call the client sends
# back renders to the tokens the model wrote, and the separators are forced (free drafts).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolsError(ValueError):
    """A 400 whose `param` names the field; app.py answers it as protocol's BadRequest."""

    status = 400

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's checked tools."""

    tools: list[dict]  # as the client sent them: what the template or the preamble shows
    choice: str  # "auto" | "none" | "required" | the one function's name
    parallel: bool  # more than one call per reply


# ----------------------------------------------------------------------------
# checking a request


def with_tools(req: Any, body: dict) -> Any:
    """`req` (protocol.Request) with its tools checked; a request without tools is unchanged."""
    tools = parse_tools(body)
    if tools is None:
        return req
    if tools.choice != "none" and req.response_format is not None:
        raise ToolsError(
            'response_format shapes a text reply; with tools it needs tool_choice "none"',
            "response_format",
        )
    req.tools = tools
    if tools.choice == "none":
        req.stop = [*req.stop, OPEN]  # no call: the reply ends where one would open
    return req


def parse_tools(body: dict) -> Tools | None:
    """The checked tools, tool_choice and parallel_tool_calls of a chat body (None: no tools)."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolsError(
            f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls"
        )
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "auto", "none"):
            raise ToolsError(f"tool_choice {choice!r} needs tools; none were given", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolsError(
            'tools must be a non-empty array of {"type": "function", "function": {"name": ..., '
            f'"description": ..., "parameters": {{...}}}}}} objects, got {tools!r}'[:300],
            "tools",
        )
    names = [_check_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if len(set(names)) < len(names):
        raise ToolsError(f"tools: each function needs its own name, got {names}", "tools")
    return Tools(tools, _choice(choice, names), parallel is not False)


def _check_tool(tool: Any, where: str) -> str:
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or set(tool) != {"type", "function"}
    ):
        raise ToolsError(
            f'{where} must be {{"type": "function", "function": {{...}}}}, got {tool!r}'[:300],
            "tools",
        )
    f = tool["function"]
    if not isinstance(f, dict) or not set(f) <= FUNCTION_KEYS:
        raise ToolsError(
            f"{where}.function must be an object with {sorted(FUNCTION_KEYS)}", "tools"
        )
    name = f.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolsError(
            f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}", "tools"
        )
    if not isinstance(f.get("description", ""), str):
        raise ToolsError(f"{where}.function.description must be a string", "tools")
    if not isinstance(f.get("strict", False), (bool, type(None))):
        raise ToolsError(f"{where}.function.strict must be true or false", "tools")
    params = f.get("parameters")
    if params is not None:
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            what = f"{where}.function.parameters must be a JSON schema of an object"
            raise ToolsError(f"{what}, got {params!r}"[:300], "tools")
        import llguidance as ll  # a dependency; imported here, as constraints.py does

        grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(params))
        is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ToolsError(
                f"{where}.function.parameters: llguidance refuses the schema: {messages[0]}",
                "tools",
            )
    return name


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and choice.get("type") == "function":
        name = function.get("name")
        if name in names:
            return name
        raise ToolsError(
            f"tool_choice names the function {name!r}, which is not in tools ({names})",
            "tool_choice",
        )
    raise ToolsError(f"tool_choice must be {CHOICES}, got {choice!r}"[:300], "tool_choice")


def check_message(m: dict, role: str, content: str | None, where: str) -> dict:
    """A checked chat message: {role, content}, with a tool message's tool_call_id or an
    assistant's tool_calls ({id, type, function: {name, arguments: a JSON string}})."""
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise ToolsError(
                f"{where}.tool_call_id must be the id of the call it answers",
                f"{where}.tool_call_id",
            )
        out["tool_call_id"] = m["tool_call_id"]
    calls = m.get("tool_calls")
    if calls:  # [] and null: no calls
        if role != "assistant" or not isinstance(calls, list):
            raise ToolsError(
                f"{where}.tool_calls must be an array, on an assistant message",
                f"{where}.tool_calls",
            )
        out["tool_calls"] = [
            _check_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)
        ]
    return out


def _check_call(call: Any, where: str) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(f, dict)
        or call.get("type", "function") != "function"
        or not isinstance(call.get("id", ""), str)
        or not isinstance(f.get("name"), str)
        or not isinstance(f.get("arguments"), str)
    ):
        raise ToolsError(
            f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
            f'"arguments": "<JSON string>"}}}}, got {call!r}'[:300],
            where,
        )
    name, arguments = f["name"], f["arguments"]
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


# ----------------------------------------------------------------------------
# rendering


def render(messages: list[dict], tools: Tools | None, chat_template: str | None) -> str:
    """The prompt text of checked chat messages (module doc: the template's own tools, or the
    fallback). Messages without tools or tool messages render as render_chat renders them."""
    if tools is None and not any(m["role"] == "tool" or "tool_calls" in m for m in messages):
        return render_chat(messages, chat_template)
    listed = None if tools is None else tools.tools
    try:
        if takes_tools(chat_template):
            return render_chat([_native(m) for m in messages], chat_template, tools=listed)
        return render_chat(fallback(messages, listed), chat_template)
    except Exception as e:  # jinja2's errors, a template's raise_exception: the messages' fault
        raise ToolsError(
            f"the chat template cannot render these messages: {e}", "messages"
        ) from None


def takes_tools(chat_template: str | None) -> bool:
    """A template that renders `tools` itself and asks for <tool_call> blocks (Qwen2.5, Qwen3,
    Hermes). Llama 3's asks for another format; it gets the fallback, as SmolLM2's does."""
    if not chat_template:
        return False
    return OPEN in chat_template and re.search(r"\btools\b", chat_template) is not None


def _native(m: dict) -> dict:
    """A message as transformers gives it to a template: content a str, arguments an object."""
    if "tool_calls" not in m:
        return m
    calls = [
        {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "content": m["content"] or "", "tool_calls": calls}


def fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Plain {role, content} messages any template renders (module doc)."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":  # one user message per run of results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif "tool_calls" in m:
            blocks = [
                call_text(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m["content"] else []) + blocks)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble(tools)}
        else:
            out.insert(0, {"role": "system", "content": preamble(tools)})
    return out


def preamble(tools: list[dict]) -> str:
    """The fallback's system text: the tools as JSON, and the call format."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        f"You can call these functions, given as JSON:\n<tools>\n{listed}\n</tools>\n\n"
        "To call one, reply with its name and arguments as a JSON object inside "
        f"{OPEN}{CLOSE} tags:\n{OPEN}\n"
        '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n'
        f"{CLOSE}\nTo make several calls, write one block after another. "
        "Otherwise reply in plain text."
    )


def call_text(name: str, arguments: str) -> str:
    """A call's block, as the model writes it under the grammar."""
    args = json.dumps(_arguments(arguments), ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{CLOSE}'


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:  # not JSON: shown as the string it is
        return arguments


# ----------------------------------------------------------------------------
# the constraint


def constrain(req: Any, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
    """Sets the grammar of a request whose tools may be called (its response_format)."""
    if not parses(req):
        return
    special = [is_special(tag, tokenizer, vocab_size, eos_ids) for tag in (OPEN, CLOSE)]
    req.response_format = {"type": "grammar", "grammar": grammar(req.tools, *special)}


def parses(req: Any) -> bool:
    """Whether the reply may hold calls (tools given, tool_choice not "none")."""
    return req.tools is not None and req.tools.choice != "none"


def grammar(tools: Tools, open_special: bool = False, close_special: bool = False) -> str:
    """The Lark grammar (llguidance's) a reply is held to (module doc). A tag the vocabulary
    has as a special token is named <tag>: free text cannot match it."""
    o = OPEN if open_special else json.dumps(OPEN)
    c = CLOSE if close_special else json.dumps(CLOSE)
    functions = [t["function"] for t in tools.tools]
    if tools.choice not in ("auto", "required"):
        functions = [f for f in functions if f["name"] == tools.choice]
    lines = ["%llguidance {}"]
    more = ' ("\\n" call)*' if tools.parallel else ""
    if tools.choice == "auto":
        lines.append(f"start: TEXT | first{more}")
        if open_special:
            lines.append(f'first: TEXT {o} "\\n" body "\\n" {c}')
        else:  # lazy: the text ends at the first <tool_call>, which opens the call
            lines += [f'first: head "\\n" body "\\n" {c}', f"head[lazy]: TEXT {o}"]
        lines.append("TEXT: /(.|\\n)*/")
    else:
        lines.append(f"start: call{more}")
    lines.append(f'call: {o} "\\n" body "\\n" {c}')
    lines.append("body: " + " | ".join(f"f{i}" for i in range(len(functions))))
    for i, f in enumerate(functions):
        head = json.dumps(f'{{"name": "{f["name"]}", "arguments": ')
        schema = {**(f.get("parameters") or NO_PARAMETERS), "x-guidance": JSON_STYLE}
        lines.append(f'f{i}: {head} %json {json.dumps(schema)} "}}"')
    return "\n".join(lines) + "\n"
