"""Training an EAGLE-3 head on data the target made (see data.py), in SpecForge's layout.

The recipe is EAGLE-3's "training-time test" as SpecForge implements it: step 0 reads fc(target
features of position t) with token t+1 and predicts token t+2; step s > 0 reads the previous
step's output hidden state with token t+1+s, at RoPE position t+s, and attends to step-0 keys at
positions <= t plus its own chain's keys of steps 1..s at position t (what drafting sees).
The loss of step s is the soft cross-entropy against the target's distribution on the draft
vocabulary, positions whose target argmax lies outside the draft vocabulary masked (as
SpecForge does), weighted 0.8^s. AdamW, linear warmup then cosine decay.

Deterministic for a seed (no dropout; data order from the seed), resumable from
`checkpoint.pt` (weights, optimizer state, step; the data order is recomputed).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specfast.drafters.eagle.head import EagleHead
from specfast.hardware import cpu_has_native_bf16
from specfast.train.heads import draft_vocabulary, head_config, init_head, new_head, save_head
from specfast.train.ttt import merge_stats, summary, ttt_loss

# ---------------------------------------------------------------------------- captured data


class Captured:
    """Documents captured by train.data.capture, read lazily from their shards."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files = sorted(Path(folder).glob("shard_*.safetensors"))
        if not self.files:
            raise ValueError(f"no captured shards (shard_*.safetensors) in {folder}")
        self.handles = [safe_open(str(f), framework="pt") for f in self.files]
        self.docs: list[tuple[int, int, int]] = []  # (shard, start, end)
        for i, h in enumerate(self.handles):
            off = h.get_tensor("offsets").tolist()
            self.docs += [(i, a, b) for a, b in itertools.pairwise(off) if b - a >= 2]

    def __len__(self) -> int:
        return len(self.docs)

    def get(self, i: int, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        s, a, b = self.docs[i]
        h = self.handles[s]
        doc = {k: h.get_slice(k)[a:b] for k in ("tokens", "features", "normed", "argmax")}
        return doc if device is None else {k: v.to(device) for k, v in doc.items()}

    def token_counts(self, vocab_size: int, docs: list[int]) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for i in docs:
            t = self.get(i)["tokens"].long()
            counts += torch.bincount(t, minlength=vocab_size)[:vocab_size]
        return counts


# ---------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    docs_per_step: int = 4
    ttt_steps: int = 4
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    draft_vocab_size: int = 4096
    seed: int = 0
    # Autocast the matrix products to bf16 (float32 master weights). None: on CUDA, and on a
    # CPU with native bf16; elsewhere torch emulates it, far slower than float32.
    bf16: bool | None = None
    eval_every: int = 100
    eval_docs: int = 32
    val_every: int = 50  # every val_every-th document is held out for the curve
    checkpoint_every: int = 50
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("steps", "docs_per_step", "ttt_steps", "draft_vocab_size", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")


# A timed run's steps before it fits its schedule to the time left, and the share of that time
# it plans to use (evaluations and checkpoints take the rest).
FIT_STEPS = 10
FIT_MARGIN = 0.85


def autocast_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether training on `device` autocasts to bf16 (cfg.bf16, or its default there)."""
    if cfg.bf16 is not None:
        return cfg.bf16
    return device.type == "cuda" or cpu_has_native_bf16()


def lr_at(cfg: TrainConfig, step: int, total: int | None = None) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio at `total` steps (default cfg.steps)."""
    total = cfg.steps if total is None else total
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min((step - cfg.warmup) / max(total - cfg.warmup, 1), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def split_docs(n: int, val_every: int) -> tuple[list[int], list[int]]:
    val = list(range(0, n, val_every)) if n >= 2 * val_every else []
    held = set(val)
    return [i for i in range(n) if i not in held], val


@functools.lru_cache(maxsize=4)
def doc_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of n training documents in `epoch`, fixed by the seed."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def evaluate(head, data: Captured, docs: list[int], embed, out_rows, cfg: TrainConfig) -> dict:
    stats, loss, n = None, 0.0, 0
    device = embed.device
    with torch.no_grad(), _autocast(autocast_bf16(cfg, device), device):
        for i in docs:
            doc_loss, s = ttt_loss(head, data.get(i, device), embed, out_rows, cfg.ttt_steps)
            stats = merge_stats(stats, s)
            loss, n = loss + float(doc_loss) * s["positions"], n + s["positions"]
    if stats is None:
        return {}
    return {
        "val_loss": round(loss / max(n, 1), 4),
        **{"val_" + k: v for k, v in summary(stats).items()},
    }


def _autocast(enabled: bool, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def train(
    target,
    data_dir: Path,
    out_dir: Path,
    cfg: TrainConfig,
    aux_layers,
    resume: bool = False,
    log=sys.stderr,
    save: Callable[[EagleHead, Path], None] | None = None,
    stop_at: int | None = None,
    max_minutes: float | None = None,
) -> EagleHead:
    """Train a head on the shards in data_dir; checkpoint.pt, curve.json and the head (config.json
    + model.safetensors) go to out_dir. `resume` continues from out_dir/checkpoint.pt;
    `stop_at` stops (with a checkpoint) after that many steps of the cfg.steps schedule;
    `max_minutes` stops this leg when its time is up, saving the checkpoint and the head; a
    fresh run with it times its first steps and, where cfg.steps would not fit, ends its
    cosine schedule at the step that does (kept in the checkpoint for a resumed leg). Trains
    on the target's device; the checkpoint loads on any device."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save = save or save_head
    data = Captured(data_dir)
    train_docs, val_docs = split_docs(len(data), cfg.val_every)
    val_docs = val_docs[: cfg.eval_docs]
    ckpt_path = out_dir / "checkpoint.pt"
    device = target.embed.weight.device
    embed = target.embed.weight.detach().float()
    if resume:
        if not ckpt_path.is_file():
            raise ValueError(f"--resume: no checkpoint at {ckpt_path}")
        ckpt = torch.load(ckpt_path, weights_only=True, map_location="cpu")
        # The schedule's length and the logging may change (a run extended), and bf16 with the
        # machine it goes on on; the recipe not.
        free = {"steps", "eval_every", "eval_docs", "checkpoint_every", "bf16"}
        changed = sorted(
            k for k, v in asdict(cfg).items() if k not in free and ckpt["cfg"].get(k) != v
        )
        if changed:
            raise ValueError(
                f"--resume with different settings ({', '.join(changed)}) than {ckpt_path}"
            )
        head = new_head(ckpt["head_config"])
        head.load_state_dict(ckpt["head"])
        start, curve, seen = ckpt["step"], ckpt["curve"], ckpt["tokens"]
        before = ckpt.get("seconds", 0.0)
        # a leg of the same schedule; once that ended, going on is an extension to cfg.steps
        schedule = ckpt.get("schedule", cfg.steps)
        schedule = cfg.steps if start >= schedule else min(schedule, cfg.steps)
    else:
        counts = data.token_counts(target.vocab_size, train_docs)
        d2t, t2d = draft_vocabulary(counts, cfg.draft_vocab_size)
        config = head_config(target, cfg.draft_vocab_size, aux_layers)
        head = init_head(target, config, d2t, t2d, cfg.seed)
        coverage = float(counts[t2d].sum()) / max(int(counts.sum()), 1)
        start, curve, seen = 0, [{"step": 0, "tokens": 0, "draft_coverage": round(coverage, 4)}], 0
        before = 0.0
        schedule = cfg.steps
    head.to(device)
    out_rows = target.output_weight.detach()[head.target_ids].float()
    opt = torch.optim.AdamW(
        head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    if resume:
        opt.load_state_dict(ckpt["opt"])
    if start == 0 and val_docs:
        curve[0] |= evaluate(head, data, val_docs, embed, out_rows, cfg)

    def checkpoint(step: int):
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "tokens": seen,
             "curve": curve, "cfg": asdict(cfg), "head_config": head.config.to_dict(),
             "seconds": before + time.perf_counter() - t0, "schedule": schedule},
            tmp,
        )  # fmt: skip
        tmp.replace(ckpt_path)
        (out_dir / "curve.json").write_text(json.dumps(curve, indent=1))

    bf16 = autocast_bf16(cfg, device)
    bar = _progress(cfg.steps, start, log)
    window, t0 = None, time.perf_counter()
    n_train = len(train_docs)
    end = schedule if stop_at is None else min(stop_at, schedule)
    # A fresh timed run fits its schedule to the time after FIT_STEPS steps (the first one
    # timed apart: it warms allocators and kernels).
    fit_at = start + FIT_STEPS if max_minutes is not None and not resume else None
    t_fit = time.perf_counter()  # set again at the first step
    for step in range(start, end):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(cfg, step, schedule)
        opt.zero_grad(set_to_none=True)
        docs: list[int] = []
        stats: dict | None = None  # merge_stats starts from the first doc's
        loss_sum = 0.0
        for j in range(cfg.docs_per_step):
            k = step * cfg.docs_per_step + j
            docs.append(train_docs[doc_order(n_train, cfg.seed, k // n_train)[k % n_train]])
        n_pos = sum(data.docs[i][2] - data.docs[i][1] - 1 for i in docs)
        for i in docs:
            with _autocast(bf16, device):
                loss, s = ttt_loss(head, data.get(i, device), embed, out_rows, cfg.ttt_steps)
            (loss * s["positions"] / n_pos).backward()
            stats = merge_stats(stats, s)
            loss_sum += float(loss.detach()) * s["positions"]
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        seen += n_pos
        assert stats is not None  # docs_per_step >= 1
        window = merge_stats(window, {**stats, "loss": loss_sum})
        summ = summary(window)
        bar.update(
            step + 1,
            loss=window["loss"] / window["positions"],
            acc0=summ["acc"][0],
            tau=summ["tau"],
        )
        if step == start:
            t_fit = time.perf_counter()
        if fit_at is not None and max_minutes is not None and step + 1 == fit_at < end:
            per_step = (time.perf_counter() - t_fit) / (FIT_STEPS - 1)
            left = 60 * max_minutes - (time.perf_counter() - t0)
            fitted = max(step + 2, step + 1 + int(FIT_MARGIN * left / per_step))
            if fitted < schedule:
                schedule, end = fitted, min(end, fitted)
                bar.write(f"{per_step:.3f} s a step: the schedule ends at step {schedule}")
        out_of_time = max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes
        last = step + 1 == end or out_of_time
        if (step + 1) % cfg.eval_every == 0 or last:
            point = {
                "step": step + 1,
                "tokens": seen,
                "seconds": round(before + time.perf_counter() - t0, 1),
                "train_loss": round(window["loss"] / window["positions"], 4),
                **{"train_" + k: v for k, v in summ.items()},
                **evaluate(head, data, val_docs, embed, out_rows, cfg),
            }
            curve.append(point)
            window = None
            bar.write(json.dumps(point))
            save(head, out_dir / "snapshots" / f"step_{step + 1:06d}")
        if (step + 1) % cfg.checkpoint_every == 0 or last:
            checkpoint(step + 1)
        if out_of_time:
            bar.write(f"time is up ({max_minutes} min) after step {step + 1} of {cfg.steps}")
            save(head, out_dir)
            break
        if step + 1 >= end:  # a fitted schedule ends before the range does
            break
    bar.close()
    if end == schedule:
        save(head, out_dir)
    return head


class _progress:
    """tqdm when installed, else one line per 10 steps."""

    def __init__(self, total: int, initial: int, log):
        self.log, self.total = log, total
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, file=log, dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.n = initial

    def update(self, n: int, **post):
        text = {k: round(v, 4) for k, v in post.items()}
        if self.bar is not None:
            self.bar.set_postfix(text, refresh=False)
            self.bar.update(n - self.n)
        elif n % 10 == 0 or n == self.total:
            print(f"step {n}/{self.total} {text}", file=self.log, flush=True)
        self.n = n

    def write(self, s: str):
        if self.bar is not None:
            self.bar.write(s, file=self.log)
        else:
            print(s, file=self.log, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
