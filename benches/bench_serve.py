"""`specfast serve` against llama-cpp-python's own OpenAI server, through the openai client.

    python benches/bench_serve.py [--tokens 128] [--engines specfast,specfast-llama,llama-server]

Servers, each a subprocess on 127.0.0.1, on the same GGUF file (the default model):
- specfast:        `specfast serve` on its torch runtime (dtype and weights "auto", as the CLI);
- specfast-llama:  `specfast serve --backend llama.cpp --sessions 1`: llama.cpp as the target;
- llama-server:    `python -m llama_cpp.server` (llama-cpp-python's `[server]` extra), which
                   keeps its previous prompt's KV cache and reuses its common prefix.
llama.cpp runs on --threads threads in both llama.cpp servers.

Workloads, 4 turns each, every turn resending the whole conversation with the server's own
earlier replies (as a client does):
- edit:  a code-editing conversation on a CPython stdlib function (benches/bench_session.py);
- agent: an agent loop that pastes the function again as tool output every turn;
- chat:  four open questions in one conversation.

Per turn the engines take turns (interleaved), greedy, streamed. TTFT is the wall time from
sending the request to the first chunk with text; decode tok/s is (tokens - 1) / (time from the
first to the last chunk), tokens counted by re-tokenizing the reply with the model's tokenizer
(the same count for every engine). `--memory` also measures the specfast server's resident
memory (VmRSS) as it opens 1..N sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

import specfast
from specfast.bench.workloads import OPEN_QUESTIONS
from specfast.hardware import cpu_flags_label

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_session import agent_turns, edit_turns

HOST = "127.0.0.1"
ENGINES = ("specfast", "specfast-llama", "llama-server")
SPECFAST: set[str] = set()  # base URLs of the specfast servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def command(engine: str, model: str, port: int, args) -> list[str]:
    where = ["--host", HOST, "--port", str(port)]
    if engine == "llama-server":
        return [sys.executable, "-m", "llama_cpp.server", "--model", model, *where,
                "--n_ctx", str(args.n_ctx), "--n_threads", str(args.threads)]  # fmt: skip
    cmd = [sys.executable, "-m", "specfast", "serve", "--model", model, *where]
    if engine == "specfast-llama":
        return [*cmd, "--backend", "llama.cpp", "--sessions", "1", "--max-length",
                str(args.n_ctx)]  # fmt: skip
    return [*cmd, "--dtype", args.dtype, "--weights", args.weights]


def start(cmd: list[str], timeout: float = 300) -> tuple[subprocess.Popen, str]:
    port = cmd[cmd.index("--port") + 1]
    # Its log goes to a file: an unread pipe fills up and blocks the server (llama.cpp's is long).
    log = tempfile.NamedTemporaryFile("w+", prefix="bench_serve_", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited; its log: {log.name}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} did not answer within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def turn(client, model_id: str, messages: list[dict], max_tokens: int, tokenizer) -> dict:
    """One streamed greedy request: text, TTFT, decode rate, and specfast's stats if any."""
    t0 = time.perf_counter()
    # specfast sends its stats on the usage chunk; llama-cpp-python's server is asked nothing
    # it might not know.
    usage = {"stream_options": {"include_usage": True}} if str(client.base_url) in SPECFAST else {}
    stream = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        **usage,
    )  # fmt: skip
    text, first, last, extra = "", None, None, {}
    for chunk in stream:
        extra = (chunk.model_extra or {}).get("specfast") or extra
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            text += chunk.choices[0].delta.content
    n = len(tokenizer.encode(text).ids)
    decode_s = (last - first) if first is not None else 0.0
    return {
        "text": text,
        "tokens": n,
        "ttft_s": (first - t0) if first is not None else None,
        "tok_s": (n - 1) / decode_s if decode_s > 0 else None,
        "tokens_per_pass": extra.get("mean_acceptance_length"),
        "reused": extra.get("reused_prompt_tokens"),
    }


def conversation(clients: dict, turns: list[str], max_tokens: int, tokenizer) -> list[dict]:
    histories: dict[str, list[dict]] = {name: [] for name in clients}
    rows = []
    for i, msg in enumerate(turns):
        row: dict = {"turn": i + 1}
        for name, (client, model_id) in clients.items():
            history = histories[name]
            history.append({"role": "user", "content": msg})
            r = turn(client, model_id, history, max_tokens, tokenizer)
            history.append({"role": "assistant", "content": r.pop("text")})
            row[name] = r
        rows.append(row)
        print(format_row(row, list(clients)), flush=True)
    return rows


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def format_row(row: dict, engines: list[str]) -> str:
    cells = [str(row["turn"])]
    for e in engines:
        r = row[e]
        cells += [_f(r["ttft_s"] and r["ttft_s"] * 1e3, ".0f"), _f(r["tok_s"], ".1f")]
    base = row.get("llama-server")
    if base and base["tok_s"] and row.get("specfast", {}).get("tok_s"):
        cells.append(f"{row['specfast']['tok_s'] / base['tok_s']:.2f}×")
    s = row.get("specfast")
    if s:
        cells += [_f(s["tokens_per_pass"], ".2f"), _f(s["reused"], "d")]
    return "| " + " | ".join(cells) + " |"


def header(engines: list[str]) -> str:
    cols = ["turn"]
    for e in engines:
        cols += [f"{e} TTFT (ms)", f"{e} tok/s"]
    if "llama-server" in engines and "specfast" in engines:
        cols.append("specfast / llama-server tok/s")
    if "specfast" in engines:
        cols += ["specfast tokens/pass", "specfast reused tokens"]
    return "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|"


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def memory(model: str, args, tokenizer) -> list[dict]:
    """The specfast server's VmRSS with 0..--sessions live sessions (distinct conversations)."""
    port = free_port()
    cmd = command("specfast", model, port, args)
    cmd += ["--sessions", str(args.sessions), "--max-length", str(args.n_ctx)]
    proc, url = start(cmd)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    SPECFAST.add(str(client.base_url))
    model_id = client.models.list().data[0].id
    rows = [{"sessions": 0, "rss_mib": rss_kib(proc.pid) / 1024}]
    for i in range(args.sessions):
        msg = [{"role": "system", "content": f"Conversation {i}."},
               {"role": "user", "content": OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)]}]  # fmt: skip
        turn(client, model_id, msg, 16, tokenizer)
        rows.append({"sessions": i + 1, "rss_mib": rss_kib(proc.pid) / 1024})
        print(f"| {i + 1} | {rows[-1]['rss_mib']:.0f} |", flush=True)
    stop(proc)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per turn")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--workloads", default="edit,agent,chat")
    p.add_argument("--function", default="textwrap.dedent")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--weights", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--n-ctx", type=int, default=4096, help="context of every server")
    p.add_argument("--memory", action="store_true", help="also measure RSS per session")
    p.add_argument("--sessions", type=int, default=4, help="sessions for --memory")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    model = str(specfast.default_model_path())
    tokenizer = specfast.load_model(model, dtype="float32", weights="float").tokenizer
    info = {
        "model": os.path.basename(model),
        "cpu_flags": cpu_flags_label(),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "dtype": args.dtype,
        "weights": args.weights,
        "max_tokens": args.tokens,
    }
    print(info, flush=True)
    procs, clients = [], {}
    try:
        for e in engines:
            proc, url = start(command(e, model, free_port(), args))
            procs.append(proc)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            if e.startswith("specfast"):
                SPECFAST.add(str(client.base_url))
            model_id = client.models.list().data[0].id
            turn(client, model_id, [{"role": "user", "content": "Hi"}], 4, tokenizer)  # warm-up
            clients[e] = (client, model_id)
        workloads = {
            "edit": edit_turns(args.function),
            "agent": agent_turns(args.function),
            "chat": list(OPEN_QUESTIONS[:4]),
        }
        results: dict = {"info": info}
        for name in filter(None, args.workloads.split(",")):
            print(f"\n{name}\n{header(engines)}", flush=True)
            results[name] = conversation(clients, workloads[name], args.tokens, tokenizer)
            for e in engines:
                rates = [r[e]["tok_s"] for r in results[name] if r[e]["tok_s"]]
                if rates:
                    print(f"{e}: median decode {statistics.median(rates):.1f} tok/s")
    finally:
        for proc in procs:
            stop(proc)
    if args.memory:
        print("\nmemory\n| sessions | RSS (MiB) |\n|---|---|", flush=True)
        results["memory"] = memory(model, args, tokenizer)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
