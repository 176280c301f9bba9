"""A/B of auto k: this checkout's autok.py against another revision's, interleaved.

    python benches/autok_ab.py --base REV [--kinds open,code-edit] [--model PATH] [--prompts 3]
        [--repeats 3] [--candidates 7,15] [--backend llama.cpp|specfast]

Per prompt and repeat, in alternating order: llama.cpp plain, specfast's plain loop, then the
n-gram drafter with auto k from this checkout ("new") and from `git show REV:python/specfast/
autok.py` ("base"). Each AutoK module keeps its own per-target state, so the kinds run in the
order given show what carries from one kind to the next. `--candidates` adds k values to the
new side only (one line of autok.CANDIDATES). Prints the decode rate (tokens after the first
over the time after the first) as a ratio to llama.cpp plain of the same prompt and repeat:
median and mean over prompts and repeats. `--backend specfast` runs the same over specfast's
torch runtime (dtype auto) instead, with its plain loop as the reference. Figures move by about
10 % between runs on a shared 2-core machine; read differences smaller than that as noise.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import specfast
from specfast import autok, drafters
from specfast.bench.llama import llama_cpp_engine, load_llamas
from specfast.bench.workloads import build_workloads
from specfast.drafters import ngram
from specfast.hardware import cpu_flags_label
from specfast.targets.base import default_model_path


def load_autok(rev: str):
    """autok.py as of git revision `rev`, as a module of its own (its own per-target state)."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{rev}:python/specfast/autok.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "autok_base.py"
    path.write_text(source)
    module = module_from(path)
    if not hasattr(module, "shared_match_rates"):  # before the rates carried over
        module.AutoK.use_match_rates = lambda self, latest: None
        module.shared_match_rates = lambda target: {}
    return module


def module_from(path: Path):
    """The Python file at `path` as a fresh module, sharing no state with any other import."""
    spec = importlib.util.spec_from_file_location(f"autok_{path.stem}_{id(path)}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use(module) -> None:
    """make_drafter builds its AutoK from `module` from now on (the n-gram drafter's: ngram.py)."""
    ngram.AutoK = module.AutoK
    drafters.shared_pass_costs = module.shared_pass_costs
    drafters.shared_match_rates = module.shared_match_rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the git revision to compare against")
    p.add_argument("--kinds", default="open,code-edit")
    p.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M Q4_1)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--candidates", default="", help="extra k values for the new side")
    p.add_argument("--backend", choices=("llama.cpp", "specfast"), default="llama.cpp")
    args = p.parse_args()
    base = load_autok(args.base)
    new = autok
    if args.candidates:
        new = module_from(Path(autok.__file__))  # a copy: the extra candidates stay on this side
        new.CANDIDATES = tuple(sorted({*autok.CANDIDATES, *map(int, args.candidates.split(","))}))
    path = args.model or default_model_path()
    if args.backend == "llama.cpp":
        target = load_llamas(path, ["llama.cpp-plain"], None, n_threads=args.threads)["target"]
        template = target.metadata.get("tokenizer.chat_template")
        plain = llama_cpp_engine(target, max_new_tokens=args.tokens)
        ref_name = "llama.cpp plain"

        def encode(text: str) -> list[int]:
            return list(target.tokenize(text.encode(), add_bos=True, special=True))
    else:
        target = specfast.load_model(path)
        template = getattr(target, "chat_template", None)
        ref_name = "specfast plain"

        def encode(text: str) -> list[int]:
            return list(target.tokenizer.encode(text).ids)

    print(f"{path}  ({cpu_flags_label()}, {args.backend}), base {args.base}")
    for kind in args.kinds.split(","):
        rates: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            for w in build_workloads([kind], args.prompts):
                ids = encode(w.render(template) if w.chat else w.render())
                order = ["llama.cpp plain"] if args.backend == "llama.cpp" else []
                order += ["specfast plain", "new", "base"]
                for name in order if rep % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    if name == "llama.cpp plain":
                        out = plain(ids)
                        n, prefill = len(out.token_ids), out.prefill_seconds
                    else:
                        use(base if name == "base" else new)
                        run = specfast.generate(
                            target,
                            ids,
                            max_new_tokens=args.tokens,
                            drafter=None if name == "specfast plain" else "ngram",
                            eos_token_id=[],
                        )
                        n, prefill = len(run.token_ids), run.stats.prefill_seconds
                    seconds = time.perf_counter() - t0 - prefill
                    rates.setdefault(name, []).append((n - 1) / seconds)
        use(autok)
        ref = rates[ref_name] if args.backend == "specfast" else rates.pop(ref_name)
        print(f"{kind}: {ref_name} {statistics.median(ref):.1f} tok/s decode")
        for name, values in rates.items():
            ratios = [v / r for v, r in zip(values, ref, strict=True)]
            print(
                f"  {name:15s} x {ref_name}: median {statistics.median(ratios):.3f}"
                f"  mean {statistics.mean(ratios):.3f}"
            )


if __name__ == "__main__":
    sys.exit(main())
