"""JSON-schema extraction from a document: specfast constrained plain decoding, the constrained
n-gram, and llama.cpp with the same schema as a grammar (llama-cpp-python's LlamaGrammar).

    python scripts/structured_check.py [--model FILE] [--max-new-tokens 160]

Each prompt gives a standard-library function's documentation and asks for its name,
parameters and summary as JSON. Greedy, at specfast's defaults (dtype and weights auto), engines
interleaved prompt by prompt, 2 threads. Printed per engine: tokens per second (prefill
included), the forced, drafted and accepted tokens, whether every reply is valid JSON with the
schema's keys, and whether the n-gram's text is plain constrained decoding's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os.path
import shutil
import statistics
import textwrap
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "function": {"type": "string"},
        "parameters": {"type": "array", "items": {"type": "string"}, "maxItems": 12},
        "summary": {"type": "string"},
    },
    "required": ["function", "parameters", "summary"],
    "additionalProperties": False,
}
DOCUMENTS = [json.dumps, textwrap.wrap, shutil.copyfile, os.path.join, textwrap.dedent]


def prompt(fn) -> list[dict]:
    doc = f"def {fn.__name__}{inspect.signature(fn)}:\n{inspect.getdoc(fn)}"
    ask = (
        "Here is the documentation of a Python function:\n\n"
        f"{doc[:1500]}\n\nGive its name, its parameters and the first sentence of its "
        "documentation as the summary, as a JSON object."
    )
    return [{"role": "user", "content": ask}]


def valid(text: str) -> bool:
    try:
        reply = json.loads(text)
    except ValueError:
        return False
    return set(reply) == set(SCHEMA["required"]) and all(
        isinstance(p, str) for p in reply["parameters"]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M)")
    p.add_argument("--max-new-tokens", type=int, default=160)
    a = p.parse_args()

    import llama_cpp
    from llama_cpp.llama_grammar import LlamaGrammar

    import specfast
    from specfast.chat import render_chat
    from specfast.cli.common import resolve_model

    path = str(resolve_model(a.model))
    model = specfast.load_model(path)
    rf = {"type": "json_schema", "json_schema": {"name": "function", "schema": SCHEMA}}
    llm = llama_cpp.Llama(path, n_ctx=2048, n_threads=2, n_batch=512, verbose=False)
    grammar = LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
    rows: dict[str, list] = {"specfast-plain": [], "specfast-ngram": [], "llama.cpp": []}
    for fn in DOCUMENTS:
        text = render_chat(prompt(fn), model.chat_template)
        for name, drafter in (("specfast-plain", None), ("specfast-ngram", "ngram")):
            out = specfast.generate(
                model, text, max_new_tokens=a.max_new_tokens, drafter=drafter, response_format=rf
            )
            s = out.stats
            rows[name].append(
                (s.new_tokens / s.seconds, out.text, s.forced_tokens, s.draft_tokens,
                 s.accepted_tokens)
            )  # fmt: skip
        llm.reset()
        start = time.perf_counter()
        r = llm.create_completion(
            text, grammar=grammar, temperature=0.0, max_tokens=a.max_new_tokens
        )
        seconds = time.perf_counter() - start
        rows["llama.cpp"].append(
            (r["usage"]["completion_tokens"] / seconds, r["choices"][0]["text"], 0, 0, 0)
        )
    plain_texts = [r[1] for r in rows["specfast-plain"]]
    base = statistics.mean(r[0] for r in rows["llama.cpp"])
    print(f"{os.path.basename(path)}, {len(DOCUMENTS)} documents, greedy, {a.max_new_tokens} "
          "new tokens at most")  # fmt: skip
    for name, rs in rows.items():
        tps = statistics.mean(r[0] for r in rs)
        same = sum(r[1] == t for r, t in zip(rs, plain_texts, strict=True))
        print(
            f"  {name:15s} {tps:6.1f} tok/s  {tps / base:4.2f}x llama.cpp  "
            f"forced {sum(r[2] for r in rs):4d}  drafted {sum(r[3] for r in rs):4d}  "
            f"accepted {sum(r[4] for r in rs):4d}  valid {sum(valid(r[1]) for r in rs)}/{len(rs)}"
            f"  = specfast-plain {same}/{len(rs)}"
        )


if __name__ == "__main__":
    main()
