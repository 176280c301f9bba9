"""The whole EAGLE-3 training job behind `specfast train-eagle`: make the data (answers and
captured features: data.py, answers.py), train (fit.py), save the head and a record."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from specfast.drafters.eagle.head import EagleHead
from specfast.formats import load_model
from specfast.targets.base import default_aux_layers
from specfast.train import answers as ea
from specfast.train import data as ed
from specfast.train.fit import TrainConfig, train


def _capped(docs, max_tokens: int):
    total = 0
    for name, ids in docs:
        if total >= max_tokens:
            return
        total += len(ids)
        yield name, ids


def make_data(
    target,
    data_dir: Path,
    aux_layers,
    max_len: int = 512,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    max_prompts: int | None = None,
    prompt_scale: float = 1.0,
    corpus_tokens: int = 200_000,
    seed: int = 0,
    log=sys.stderr,
) -> dict:
    """Answers (data_dir/answers.jsonl, resumable) then one capture pass (data_dir/captured,
    redone from scratch unless complete). Returns the data record (captured/done.json)."""
    captured = data_dir / "captured"
    done = captured / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    prompts = ed.training_prompts(target.chat_template, seed=seed, scale=prompt_scale)
    prompts = prompts[:max_prompts]
    records = ea.answer_prompts(
        target, prompts, data_dir / "answers.jsonl", max_new_tokens, batch_size, "batched", log
    )
    t_answers = time.perf_counter() - t0
    for f in captured.glob("shard_*"):
        f.unlink()  # a capture that did not finish: start it again
    answers = list(ed.answer_documents(records, max_len))
    corpus = list(_capped(ed.corpus_documents(target.tokenizer, max_len, seed), corpus_tokens))
    t1 = time.perf_counter()
    positions = ed.capture(target, ed.interleave(answers, corpus), captured, aux_layers, log=log)
    record = {
        "prompts": len(records),
        "answer_tokens": sum(len(r["answer_ids"]) for r in records),
        "answer_doc_tokens": sum(len(ids) for _, ids in answers),
        "corpus_docs": len(corpus),
        "corpus_tokens": sum(len(ids) for _, ids in corpus),
        "positions": positions,
        "prompt_kinds": {
            k: sum(r["kind"] == k for r in records) for k in sorted({r["kind"] for r in records})
        },
        "answer_seconds": round(t_answers, 1),
        "capture_seconds": round(time.perf_counter() - t1, 1),
        "target_dtype": str(target.dtype).removeprefix("torch."),
        "max_len": max_len,
        "max_new_tokens": max_new_tokens,
        "aux_layers": list(aux_layers),
    }
    done.write_text(json.dumps(record, indent=1))
    return record


def train_eagle(
    target_path,
    out_dir: Path,
    cfg: TrainConfig,
    data_dir: Path | None = None,
    dtype: str = "auto",
    resume: bool = False,
    log=sys.stderr,
    command: str | None = None,
    max_minutes: float | None = None,
    device: str = "cpu",
    **data_options,
) -> EagleHead:
    """`specfast train-eagle`: the target answers the training prompts, one forward per
    document captures its features and distributions, then the head trains; the head lands
    in out_dir (SpecForge layout) with curve.json and the data record. On `device` ("cuda":
    every stage there, the captured shards on disk in the target's dtype)."""
    target = load_model(target_path, dtype=dtype, compile="off", device=device)
    aux = default_aux_layers(target.config.n_layers)
    data_dir = data_dir or out_dir / "data"
    record = make_data(target, data_dir, aux, seed=cfg.seed, log=log, **data_options)
    print(f"data: {json.dumps(record)}", file=log, flush=True)
    t0 = time.perf_counter()
    head = train(
        target, data_dir / "captured", out_dir, cfg, aux, resume=resume, log=log,
        max_minutes=max_minutes,
    )  # fmt: skip
    command = " ".join(["specfast", *sys.argv[1:]]) if command is None else command
    write_record(out_dir, record, cfg, time.perf_counter() - t0, command)
    return head


def write_record(out_dir: Path, record: dict, cfg: TrainConfig, seconds: float, command: str):
    """training.json (everything) and TRAINING.md (the table a reader wants) next to the head."""
    curve = (
        json.loads((out_dir / "curve.json").read_text())
        if (out_dir / "curve.json").is_file()
        else []
    )
    last = curve[-1] if curve else {}
    seconds = last.get("seconds", seconds)  # counts every resumed leg
    info = {
        "command": command,
        "data": record,
        "train": asdict(cfg),
        "train_seconds": round(seconds, 1),
        "trained_positions": last.get("tokens", 0),
        "curve": curve,
    }
    (out_dir / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    lines = [
        "# How this head was trained",
        "",
        f"Command: `{command}`",
        "",
        f"- data: {record.get('prompts', 0)} prompts answered by the target "
        f"({record.get('answer_tokens', 0)} answer tokens), {record.get('corpus_tokens', 0)} "
        f"corpus tokens teacher-forced; {record.get('positions', 0)} captured positions "
        f"(target dtype {record.get('target_dtype')}, aux layers {record.get('aux_layers')})",
        f"- training: {last.get('step', cfg.steps)} steps x {cfg.docs_per_step} documents, "
        f"TTT steps {cfg.ttt_steps}, lr {cfg.lr}, draft vocabulary {cfg.draft_vocab_size}, "
        f"seed {cfg.seed}; "
        f"{last.get('tokens', 0)} positions trained in {seconds / 60:.1f} min",
        "",
        "tau is 1 + the mean run of steps whose top-1 agrees with the target's (an estimate of",
        "the mean acceptance length at k = TTT steps, greedy), on held-out captured documents.",
        "",
        "| step | positions trained | val loss | val top-1 agreement per step | val tau |",
        "|---:|---:|---:|---|---:|",
    ]
    for p in curve:
        acc = ", ".join(f"{a:.3f}" for a in p.get("val_acc", []))
        lines.append(
            f"| {p['step']} | {p['tokens']} | {p.get('val_loss', '')} | {acc} | "
            f"{p.get('val_tau', '')} |"
        )
    (out_dir / "TRAINING.md").write_text("\n".join(lines) + "\n")
