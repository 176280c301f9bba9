"""EAGLE-3 training: data split, captured features, the training-time-test forward against a
step-by-step drafting reference, determinism, resume, the saved layout and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from specfast.bench import workloads
from specfast.model import Model, ModelConfig
from specfast.targets.base import default_aux_layers
from specfast.train import acceptance, heads, ttt
from specfast.train import answers as ea
from specfast.train import data as ed
from specfast.train import fit as et


def tiny_target(seed: int = 0, layers: int = 8) -> Model:
    config = ModelConfig(
        vocab_size=200, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2,
        intermediate_size=48, max_context=256,
    )  # fmt: skip
    return Model.from_config(config, seed=seed)


def random_docs(n: int, vocab: int, seed: int = 0, lo: int = 12, hi: int = 40):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        yield f"doc{i}", torch.randint(0, vocab, (length,), generator=g).tolist()


@pytest.fixture
def captured(tmp_path):
    """(target, data dir, aux layers) with 24 random documents captured."""
    target = tiny_target()
    aux = default_aux_layers(target.config.n_layers)
    ed.capture(target, random_docs(24, 200), tmp_path / "cap", aux, shard_tokens=300)
    return target, tmp_path / "cap", aux


def tiny_cfg(**kw) -> et.TrainConfig:
    base = dict(
        steps=6, docs_per_step=2, ttt_steps=3, lr=3e-3, warmup=2, draft_vocab_size=64,
        eval_every=3, eval_docs=2, val_every=8, checkpoint_every=3,
    )  # fmt: skip
    return et.TrainConfig(**(base | kw))


# ---------------------------------------------------------------------------- the split


def test_training_data_excludes_the_benchmark_text():
    assert not set(ed.QUESTIONS) & set(workloads.OPEN_QUESTIONS)
    assert len(ed.QUESTIONS) >= 100
    names = [m for m, _ in ed.stdlib_files()]
    assert names and not {n.split(".")[0] for n in names} & ed.HELD_OUT_MODULES
    assert {"textwrap", "difflib", "shlex"} <= ed.HELD_OUT_MODULES
    assert {rel for rel, _ in ed.plays()}.isdisjoint(workloads.PLAYS)
    # every HumanEval problem the benchmark uses is held out (negative control: #1 is not)
    bench = [w.name.removeprefix("complete/") for w in workloads.complete_workloads(20)]
    assert bench and all(ed.humaneval_held_out(t) for t in bench)
    assert not ed.humaneval_held_out("HumanEval/1")
    trained = {t for t, _ in ed.humaneval_train()}
    assert not trained & set(bench) and len(trained) == 164 - len(range(0, 164, 16))
    prompts = ed.training_prompts(None, seed=0, scale=0.2)
    for w in workloads.code_edit_workloads(12):
        src = w.messages[0][1].split("```python\n")[1].split("\n```")[0]
        assert not any(src in p.text for p in prompts), w.name


def test_batched_answers_equal_plain_greedy():
    from specfast import generate

    target = tiny_target()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    eos = 7
    outs = ea.batched_greedy(target, prompts, 12, eos_ids=[eos])
    for p, out in zip(prompts, outs, strict=True):
        plain = generate(target, p, max_new_tokens=12, drafter=None, eos_token_id=eos)
        assert out == plain.token_ids
    # rows of different lengths keep their own positions: the same prompt at two batch
    # positions next to others gives the batch-of-one text
    same = ea.batched_greedy(target, [prompts[2], prompts[0], prompts[2]], 12)
    assert same[0] == same[2] == outs[2] and same[1] == outs[0]


# ---------------------------------------------------------------------------- capture


def test_features_are_the_residual_stream_entering_the_aux_layers():
    pytest.importorskip("transformers")
    target = tiny_target()
    ids = torch.randint(0, 200, (17,), generator=torch.Generator().manual_seed(1))
    aux = [1, 3, 4]
    feats, normed, top = ed.target_features(target, ids, aux)
    with torch.no_grad():
        hs = ea.hf_twin(target)(ids[None], output_hidden_states=True).hidden_states
    for j, a in enumerate(aux):  # hidden_states[i] enters layer i
        assert torch.allclose(feats[:, 32 * j : 32 * (j + 1)], hs[a][0], atol=1e-5)
    assert not torch.allclose(feats[:, :32], hs[2][0], atol=1e-3)  # wrong layer: differs
    logits = target.decoder().forward(ids)
    assert torch.allclose(normed @ target.output_weight.T, logits, atol=1e-4)
    assert torch.equal(top, logits.argmax(-1))


def test_capture_writes_documents_that_read_back(captured):
    target, folder, aux = captured
    data = et.Captured(folder)
    assert len(data) == 24 and len(data.files) > 1
    docs = list(random_docs(24, 200))
    _name, ids = docs[5]
    d = data.get(5)
    assert d["tokens"].tolist() == ids
    feats, _normed, top = ed.target_features(target, torch.tensor(ids), aux)
    assert torch.equal(d["features"], feats) and torch.equal(d["argmax"], top.int())


# ---------------------------------------------------------------------------- the recipe


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = heads.draft_vocabulary(counts, 3)
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [2, 3, 5]
    assert t2d.tolist() == [False, False, True, True, False, True]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        heads.draft_vocabulary(counts, 7)


def reference_chain(head, feats, tokens, embed, t: int, steps: int, own=False) -> list:
    """Drafting as inference does it, written out one position at a time: step 0 over
    positions 0..t with the target's features, then step j at position t+j reading the
    previous output hidden state, its token (the text's, or with `own` the draft it just made)
    and every key so far. -> logits of each step at t."""
    c = head.config
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    m = head.midlayer
    ks, vs = [], []
    cos_t, sin_t = head.rope(t + steps)

    def rotate(x, p):  # RoPE at position p, rotate-half layout
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos_t[p] + torch.cat([-x2, x1], dim=-1) * sin_t[p]

    def one(emb, hidden, p):  # one position p, attending to everything cached so far
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)])
        q = rotate(m.self_attn.q_proj(x).view(nh, hd), p)
        k = rotate(m.self_attn.k_proj(x).view(nkv, hd), p)
        ks.append(k)
        vs.append(m.self_attn.v_proj(x).view(nkv, hd))
        K = torch.stack(ks).repeat_interleave(nh // nkv, dim=1)  # (P, nh, hd)
        V = torch.stack(vs).repeat_interleave(nh // nkv, dim=1)
        w = torch.einsum("hd,phd->hp", q, K).div(math.sqrt(hd)).softmax(-1)
        y = torch.einsum("hp,phd->hd", w, V).reshape(-1)
        x = hidden + m.self_attn.o_proj(y)
        h = m.post_attention_layernorm(x)
        return x + m.mlp.down_proj(F.silu(m.mlp.gate_proj(h)) * m.mlp.up_proj(h))

    for p in range(t + 1):  # step 0: target features at 0..t, tokens 1..t+1
        out = one(embed[tokens[p + 1]], head.fc(feats[p]), p)
    logits = [head.logits(out[None])[0]]
    for j in range(1, steps):
        tok = head.target_ids[logits[-1].argmax()] if own else tokens[t + 1 + j]
        out = one(embed[tok], out, t + j)
        logits.append(head.logits(out[None])[0])
    return logits


def test_training_time_test_sees_what_drafting_sees():
    target = tiny_target()
    config = heads.head_config(target, 50, [1, 3, 4])
    d2t, t2d = heads.draft_vocabulary(torch.arange(200).flip(0), 50)
    head = heads.init_head(target, config, d2t, t2d, seed=3)
    with torch.no_grad():  # make every part matter
        for p in head.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    ids = torch.randint(0, 200, (14,), generator=torch.Generator().manual_seed(2))
    feats, _, _ = ed.target_features(target, ids, [1, 3, 4])
    embed = target.embed.weight
    head.bind_embedding(embed)
    steps = 4
    # the TTT forward, as ttt_loss runs it
    T = len(ids) - 1
    pos = torch.arange(T)
    hidden, keys, values, outs = head.fc(feats[:T]), [], [], []
    with torch.no_grad():
        for s in range(steps):
            idx = (pos + 1 + s).clamp_max(len(ids) - 1)
            hidden = ttt.ttt_step(head, ids[idx], hidden, pos + s, keys, values)
            outs.append(head.logits(hidden))
        for t in (0, 4, 9):
            ref = reference_chain(head, feats, ids, embed, t, steps)
            for s in range(steps):
                assert torch.allclose(outs[s][t], ref[s], atol=1e-4), (t, s)
        # negative control: step 2 at the step-0 RoPE position is not what drafting sees
        keys2, values2, h = [], [], head.fc(feats[:T])
        for s in range(steps):
            idx = (pos + 1 + s).clamp_max(len(ids) - 1)
            h = ttt.ttt_step(head, ids[idx], h, pos, keys2, values2)
            if s == 2:
                assert not torch.allclose(head.logits(h)[4], outs[2][4], atol=1e-3)


def test_loss_masks_targets_outside_the_draft_vocabulary(captured):
    target, folder, aux = captured
    data = et.Captured(folder)
    d2t, t2d = heads.draft_vocabulary(torch.ones(200), 20)
    head = heads.init_head(target, heads.head_config(target, 20, aux), d2t, t2d, seed=0)
    out_rows = target.output_weight[head.target_ids].float()
    doc = data.get(0)
    loss, stats = ttt.ttt_loss(head, doc, target.embed.weight, out_rows, steps=2)
    assert loss > 0 and stats["positions"] == len(doc["tokens"]) - 1
    head.t2d.zero_()  # nothing in the draft vocabulary: every position masked
    loss0, _ = ttt.ttt_loss(head, doc, target.embed.weight, out_rows, steps=2)
    assert loss0 == 0


def test_chain_drafts_are_what_greedy_drafting_proposes():
    target = tiny_target()
    d2t, t2d = heads.draft_vocabulary(torch.arange(200).flip(0), 50)
    head = heads.init_head(target, heads.head_config(target, 50, [1, 3, 4]), d2t, t2d, seed=3)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    ids = torch.randint(0, 200, (12,), generator=torch.Generator().manual_seed(4))
    feats, _, _ = ed.target_features(target, ids, [1, 3, 4])
    drafts = acceptance.chain_drafts(head, feats, ids, target.embed.weight, 3)
    with torch.no_grad():
        for t in (0, 5, 10):
            ref = reference_chain(head, feats, ids, target.embed.weight, t, 3, own=True)
            assert drafts[:, t].tolist() == [int(head.target_ids[r.argmax()]) for r in ref]


def test_greedy_acceptance_counts_rounds():
    tokens = list(range(10))
    perfect = torch.tensor([[t + 2 + s for t in range(9)] for s in range(3)])
    assert acceptance.greedy_acceptance(perfect, tokens, start=3, k=2) == [3, 3, 1]
    assert acceptance.greedy_acceptance(perfect, tokens, start=3, k=3) == [4, 3]
    wrong = perfect.clone()
    wrong[1] = -1  # the second draft is always wrong: 1 accepted + 1 per round
    assert acceptance.greedy_acceptance(wrong, tokens, start=3, k=3) == [2, 2, 2, 1]
    assert sum(acceptance.greedy_acceptance(wrong * 0, tokens, start=3, k=3)) == 7


# ---------------------------------------------------------------------------- training


def state(head) -> dict:
    return {k: v.clone() for k, v in head.state_dict().items()}


def test_training_is_deterministic_for_a_seed_and_learns(captured, tmp_path):
    target, folder, aux = captured
    a = et.train(target, folder, tmp_path / "a", tiny_cfg(), aux)
    b = et.train(target, folder, tmp_path / "b", tiny_cfg(), aux)
    c = et.train(target, folder, tmp_path / "c", tiny_cfg(seed=1), aux)
    sa, sb, sc = state(a), state(b), state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    curve = json.loads((tmp_path / "a" / "curve.json").read_text())
    assert [p["step"] for p in curve] == [0, 3, 6]
    assert curve[-1]["val_loss"] < curve[0]["val_loss"]
    assert 1.0 <= curve[-1]["val_tau"] <= 1 + 3


def test_resume_continues_exactly(captured, tmp_path):
    target, folder, aux = captured
    straight = state(et.train(target, folder, tmp_path / "s", tiny_cfg(), aux))
    et.train(target, folder, tmp_path / "r", tiny_cfg(), aux, stop_at=3)
    assert not (tmp_path / "r" / "model.safetensors").exists()
    resumed = state(et.train(target, folder, tmp_path / "r", tiny_cfg(), aux, resume=True))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # negative control: a fresh optimizer at step 3 does not land on the same weights
    ckpt = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 6
    with pytest.raises(ValueError, match="different settings"):
        et.train(target, folder, tmp_path / "r", tiny_cfg(lr=1e-2), aux, resume=True)


def test_a_timed_run_fits_its_schedule_to_the_time(captured, tmp_path, monkeypatch):
    """With max_minutes, a fresh run times its first steps and ends its cosine schedule (lr
    down to its floor, head saved) at a step that fits, well before cfg.steps here; the
    checkpoint keeps that schedule. Without it the schedule is cfg.steps. The clock is the
    test's: every reading moves it on 50 ms."""
    target, folder, aux = captured
    clock = iter(range(10**9))
    monkeypatch.setattr(et.time, "perf_counter", lambda: 0.05 * next(clock))
    cfg = tiny_cfg(steps=100_000, eval_every=1000, checkpoint_every=1000)
    et.train(target, folder, tmp_path / "t", cfg, aux, max_minutes=0.05)
    ckpt = torch.load(tmp_path / "t" / "checkpoint.pt", weights_only=True)
    assert et.FIT_STEPS < ckpt["schedule"] < cfg.steps
    assert (
        ckpt["step"]
        == ckpt["schedule"]
        == json.loads((tmp_path / "t" / "curve.json").read_text())[-1]["step"]
    )
    last_lr = ckpt["opt"]["param_groups"][0]["lr"]
    assert last_lr == et.lr_at(cfg, ckpt["schedule"] - 1, ckpt["schedule"])
    assert last_lr == pytest.approx(cfg.lr * cfg.min_lr_ratio, rel=0.05)  # at the floor
    assert (tmp_path / "t" / "model.safetensors").is_file()
    # resumed after its schedule ended, the run goes on to cfg.steps (an extension)
    more = tiny_cfg(steps=ckpt["schedule"] + 2, eval_every=1000, checkpoint_every=1000)
    et.train(target, folder, tmp_path / "t", more, aux, resume=True)
    ckpt = torch.load(tmp_path / "t" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == ckpt["schedule"] == more.steps
    et.train(target, folder, tmp_path / "u", cfg, aux, stop_at=3)
    assert torch.load(tmp_path / "u" / "checkpoint.pt", weights_only=True)["schedule"] == cfg.steps


def test_saved_head_has_specforge_layout(captured, tmp_path):
    from safetensors.torch import load_file

    target, folder, aux = captured
    et.train(target, folder, tmp_path / "h", tiny_cfg(steps=2, eval_every=2), aux)
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(aux) == [2, 4, 5]
    assert config["draft_vocab_size"] == 64 and config["vocab_size"] == 200
    t = load_file(tmp_path / "h" / "model.safetensors")
    H, nh, nkv, hd, inter = 32, 4, 2, 8, 48
    shapes = {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, nh * hd),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (64, H),
        "d2t": (64,),
        "t2d": (200,),
    }
    assert {k: tuple(v.shape) for k, v in t.items()} == shapes
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert t["fc.weight"].dtype == torch.bfloat16
    ids = torch.arange(64) + t["d2t"]
    assert torch.equal(t["t2d"].nonzero()[:, 0], ids)  # d2t and t2d name the same tokens


# ---------------------------------------------------------------------------- the command


def test_train_eagle_command_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    from conftest import tiny_llama_gguf

    from specfast.cli import main

    gguf = tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "head"
    args = ["train-eagle", "--target", str(gguf), "--out", str(out), "--dtype", "float32"]
    args += ["--steps", "3", "--docs-per-step", "2", "--max-prompts", "6", "--draft-vocab", "40"]
    args += ["--max-new-tokens", "8", "--corpus-tokens", "400", "--max-len", "48"]
    args += ["--eval-every", "3", "--ttt-steps", "2"]
    assert main(args) == 0
    record = json.loads((out / "data" / "captured" / "done.json").read_text())
    assert record["prompts"] == 6 and 0 < record["corpus_tokens"] <= 400 + 48
    answers = ea.read_jsonl(out / "data" / "answers.jsonl")
    assert len(answers) == 6 and all(0 < len(a["answer_ids"]) <= 8 for a in answers)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 40
    info = json.loads((out / "training.json").read_text())
    assert [p["step"] for p in info["curve"]] == [0, 3]
    assert "| 3 |" in (out / "TRAINING.md").read_text()
    # a second run reuses the data and continues from the checkpoint
    assert (
        main([*args[:-4], "--eval-every", "3", "--ttt-steps", "2", "--steps", "3", "--resume"]) == 0
    )


def test_trained_head_drafts_as_the_specfast_head_and_loads_back(captured, tmp_path):
    """The trainer's training-time-test step (its diagonal attention) equals EagleHead.forward
    with the TTT mask, and the saved head loads back through load_eagle."""
    from specfast.drafters.eagle.files import load_eagle

    target, folder, aux = captured
    et.train(target, folder, tmp_path / "h", tiny_cfg(steps=2, eval_every=2), aux)
    trained = torch.load(tmp_path / "h" / "checkpoint.pt", weights_only=True)["head"]
    head = heads.new_head(json.loads((tmp_path / "h" / "config.json").read_text()))
    head.load_state_dict(trained)
    head.bind_embedding(target.embed.weight)
    eagle = heads.to_eagle_head(head).bind_embedding(target.embed.weight)
    ids = torch.tensor(next(iter(random_docs(1, 200, seed=5)))[1])
    feats, _, _ = ed.target_features(target, ids, aux)
    T, steps = len(ids) - 1, 3
    pos = torch.arange(T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    eye = torch.eye(T, dtype=torch.bool)
    with torch.no_grad():
        h_ours = h_theirs = head.fc(feats[:T])
        keys, values, k_prev, v_prev = [], [], None, None
        for s in range(steps):
            tok = ids[(pos + 1 + s).clamp_max(T)]
            h_ours = ttt.ttt_step(head, tok, h_ours, pos + s, keys, values)
            mask = torch.cat([causal] + [eye] * s, dim=1)  # step 0 causally, the chain diagonally
            h_theirs, logits, k, v = eagle(h_theirs, tok, pos + s, k_prev, v_prev, mask)
            k_prev = k if k_prev is None else torch.cat([k_prev, k], dim=-2)
            v_prev = v if v_prev is None else torch.cat([v_prev, v], dim=-2)
            assert torch.allclose(h_ours, h_theirs, atol=1e-4), s
            assert torch.allclose(head.logits(h_ours), logits, atol=1e-4), s
    loaded = load_eagle(tmp_path / "h", target)  # saved in bf16, loaded in the target's dtype
    for k, v in loaded.state_dict().items():
        want = trained[k].to(torch.bfloat16) if trained[k].is_floating_point() else trained[k]
        assert torch.equal(v, want.to(v.dtype)), k


def test_bf16_autocast_on_cuda_and_where_the_cpu_has_native_bf16(monkeypatch):
    # Emulated bf16 made a training step 24x slower than float32 on an AVX2-only CPU.
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(et, "cpu_has_native_bf16", lambda: False)
    assert et.autocast_bf16(et.TrainConfig(), cpu) is False
    assert et.autocast_bf16(et.TrainConfig(), cuda) is True
    assert et.autocast_bf16(et.TrainConfig(bf16=True), cpu) is True
    monkeypatch.setattr(et, "cpu_has_native_bf16", lambda: True)
    assert et.autocast_bf16(et.TrainConfig(), cpu) is True
    assert et.autocast_bf16(et.TrainConfig(bf16=False), cpu) is False
    assert et.autocast_bf16(et.TrainConfig(bf16=False), cuda) is False


def test_bad_settings_are_refused(captured, tmp_path):
    with pytest.raises(ValueError, match="lr must be"):
        et.TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="ttt_steps must be"):
        et.TrainConfig(ttt_steps=0)
    target, folder, aux = captured
    with pytest.raises(ValueError, match="no checkpoint"):
        et.train(target, folder, tmp_path / "none", tiny_cfg(), aux, resume=True)
    with pytest.raises(ValueError, match="no captured shards"):
        et.train(target, tmp_path, tmp_path / "x", tiny_cfg(), aux)
    with pytest.raises(ValueError, match="draft vocabulary size"):
        et.train(target, folder, tmp_path / "y", tiny_cfg(draft_vocab_size=201), aux)


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_training_on_cuda_learns_and_resumes_on_the_cpu(tmp_path):
    """Every stage on the target's device: batched answers equal plain greedy there, capture
    writes host shards, the head trains on the GPU (bf16 autocast) and learns, and its
    checkpoint goes on training on the CPU."""
    from specfast import generate

    target = Model.from_config(tiny_target().config, seed=0, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (5, 9, 17)]
    for p, out in zip(prompts, ea.batched_greedy(target, prompts, 8), strict=True):
        assert out == generate(target, p, max_new_tokens=8, drafter=None).token_ids
    aux = default_aux_layers(target.config.n_layers)
    ed.capture(target, random_docs(24, 200), tmp_path / "cap", aux, shard_tokens=300)
    data = et.Captured(tmp_path / "cap")
    assert data.get(0)["features"].device.type == "cpu"
    assert data.get(0, target.device)["features"].device.type == "cuda"
    head = et.train(target, tmp_path / "cap", tmp_path / "h", tiny_cfg(), aux)
    assert head.fc.weight.device.type == "cuda"
    curve = json.loads((tmp_path / "h" / "curve.json").read_text())
    assert curve[-1]["val_loss"] < curve[0]["val_loss"]
    cpu_target = Model.from_config(tiny_target().config, seed=0)
    more = et.train(cpu_target, tmp_path / "cap", tmp_path / "h", tiny_cfg(steps=9), aux,
                    resume=True)  # fmt: skip
    assert more.fc.weight.device.type == "cpu"
    assert json.loads((tmp_path / "h" / "curve.json").read_text())[-1]["step"] == 9
