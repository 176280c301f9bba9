"""Where one generate() call's time goes: torch.profiler over a plain and an n-gram generation
of the same real prompt, after one untimed warm-up each: the time of a run without the profiler,
then the operators that took the most self time on the host and on the device in a profiled one.

    python benches/profile_generate.py                               # SmolLM2, this CPU
    python benches/profile_generate.py --model M.gguf --device cuda --compile off --tokens 64

Each engine's line gives tokens/s, target passes, the prefill's seconds, and the time per pass
after it; the tables say whether that time is the model's arithmetic, the host's Python and
kernel launches, or something per call (an allocation, a library building a plan for each new
shape). scripts/gpu_check.sh runs it on a lent GPU before the end-to-end bench.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import specfast
from specfast.bench.workloads import code_edit_workloads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2-135M)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    ap.add_argument("--top", type=int, default=12, help="operators per table")
    args = ap.parse_args()

    model = specfast.load_model(
        args.model, device=args.device, dtype=args.dtype, compile=args.compile
    )
    prompt = code_edit_workloads(1)[0].render(getattr(model, "chat_template", None))
    ids = list(model.tokenizer.encode(prompt).ids)
    print(
        "\n".join(repr(model).splitlines()[:2]), f"\nprompt: {len(ids)} tokens, {args.tokens} new"
    )
    cuda = torch.device(args.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def run(drafter: str | None):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = specfast.generate(
            model, ids, max_new_tokens=args.tokens, drafter=drafter, eos_token_id=[]
        )
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out.stats

    for drafter in (None, "ngram"):
        name = drafter or "plain"
        run(drafter)  # warm-up: allocations, lazy imports, first kernels of each shape
        seconds, s = run(drafter)  # timed without the profiler, which slows every op
        with profile(activities=activities) as prof:
            run(drafter)
        per_pass = (seconds - s.prefill_seconds) / max(1, s.target_passes - 1)
        print(
            f"\n== {name}: {s.new_tokens / seconds:.1f} tok/s, {s.target_passes} passes, "
            f"prefill {s.prefill_seconds * 1e3:.1f} ms, then {per_pass * 1e3:.2f} ms a pass"
        )
        events = prof.key_averages()
        print(
            events.table(
                sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60
            )
        )
        if cuda:
            print(
                events.table(
                    sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60
                )
            )


if __name__ == "__main__":
    main()
