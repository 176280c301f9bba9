"""The target's own answers to the training prompts: through specfast.generate one prompt at a
time, batched greedy decoding in torch, or a transformers twin of the model, batched
(`answer_prompts`); each answer a line of answers.jsonl (`read_jsonl`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specfast.generate import generate
from specfast.model.layers import final_logits, run_layers
from specfast.train.data import Prompt

# ---------------------------------------------------------------------------- answers


def hf_twin(model):
    """A transformers LlamaForCausalLM with `model`'s weights (same dtype), for batched
    generation: batch-1 decoding is bound by reading the weights, so answering 32 prompts at
    once costs little more per step than one."""
    import transformers

    c = model.config
    if c.arch not in ("llama", "mistral") or c.attn_bias or c.rope_scaling:
        raise ValueError(f"hf_twin covers plain llama models, got {c.arch}")
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_context,
        tie_word_embeddings=c.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )
    hf = transformers.LlamaForCausalLM(config).to(model.dtype).eval()
    model.unpack()  # the plain weights back (packing leaves placeholders on CPU)
    H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
    sd = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        q, k, v = layer.wqkv.weight.split([H * hd, Hkv * hd, Hkv * hd])
        gate, up = layer.w_gate_up.weight.chunk(2)
        pre = f"model.layers.{i}."
        sd |= {
            pre + "input_layernorm.weight": layer.attn_norm,
            pre + "post_attention_layernorm.weight": layer.ffn_norm,
            pre + "self_attn.q_proj.weight": q,
            pre + "self_attn.k_proj.weight": k,
            pre + "self_attn.v_proj.weight": v,
            pre + "self_attn.o_proj.weight": layer.wo.weight,
            pre + "mlp.gate_proj.weight": gate,
            pre + "mlp.up_proj.weight": up,
            pre + "mlp.down_proj.weight": layer.w_down.weight,
        }
    missing, _ = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    if [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"hf_twin: weights not set: {missing}")
    if c.tie_embeddings:
        hf.tie_weights()
    return hf


def answer_prompts(
    model,
    prompts: list[Prompt],
    out_path: Path,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    engine: str = "specfast",
    log=sys.stderr,
) -> list[dict]:
    """Greedy answers of the target to `prompts`, in order.

    engine "specfast": specfast.generate with the n-gram drafter, one prompt at a time;
    "batched": `batch_size` prompts decoded together (batched_greedy), the fastest on a CPU;
    "hf": transformers' batched generate through hf_twin (slower than "specfast" on a CPU; it
    may pay on a GPU). docs/eagle.md has the rates.
    Appends one JSON line per prompt to `out_path` ({"name", "kind", "prompt_ids",
    "answer_ids"}) and skips prompts already there, so an interrupted run continues.
    """
    if engine not in ("specfast", "batched", "hf"):
        raise ValueError(f'engine must be "specfast", "batched" or "hf", got {engine!r}')
    done = read_jsonl(out_path)
    have = {d["name"] for d in done}
    todo = [p for p in prompts if p.name not in have]
    if not todo:
        return done
    tok = model.tokenizer
    t0, n_new = time.perf_counter(), 0
    # A prompt longer than the context leaves keeps its end (what the answer continues).
    keep = max(model.max_context - max_new_tokens, 1)
    max_new_tokens = min(max_new_tokens, model.max_context - 1)
    enc = [(tok.encode(p.text).ids[-keep:], p) for p in todo]
    if engine == "hf":
        answers = _answers_hf(model, enc, max_new_tokens, batch_size)
    elif engine == "batched":
        answers = _answers_batched(model, enc, max_new_tokens, batch_size)
    else:
        answers = _answers_specfast(model, enc, max_new_tokens)
    with out_path.open("a", encoding="utf-8") as f:
        for i, ((ids, p), answer) in enumerate(zip(enc, answers, strict=False)):
            n_new += len(answer)
            rec = {"name": p.name, "kind": p.kind, "prompt_ids": ids, "answer_ids": answer}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done.append(rec)
            dt = time.perf_counter() - t0
            print(
                f"answers: {i + 1}/{len(enc)} prompts, {n_new} new tokens, {n_new / dt:.0f} tok/s",
                file=log,
                flush=True,
            )
    return done


def _answers_specfast(model, enc, max_new_tokens: int):
    for ids, _ in enc:
        room = min(max_new_tokens, model.max_context - len(ids))
        yield generate(model, ids, max_new_tokens=room, drafter="ngram").token_ids


def batched_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_ids=()):
    """Greedy continuations of several prompts at once on a specfast Model -> one list of new
    tokens per prompt (stopping after an EOS id). Each prompt is prefilled on its own; then
    every step runs all B sequences through the weights together, one row each at its own
    position, over one (B, Hkv, S, hd) cache a layer with a mask per row: batch-1 decoding is
    bound by reading the weights on a CPU and by kernel launches on a GPU, so B rows cost little
    more than one. Finished rows go on being computed (their output ignored) rather than
    gathered out. Row order and padding can flip a near-tie against plain generate(); this
    makes training text.
    """
    eos = set(eos_ids)
    c, dev = model.config, model.device
    B = len(prompts)
    S = max(map(len, prompts)) + max_new_tokens
    outs: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        shape = (c.n_layers, B, c.n_kv_heads, S, c.head_dim)
        k_all = torch.zeros(shape, device=dev, dtype=model.dtype)
        v_all = torch.zeros(shape, device=dev, dtype=model.dtype)
        for b, p in enumerate(prompts):
            dec = model.decoder(len(p))
            outs[b].append(int(dec.forward(torch.tensor(p, device=dev), last_only=True).argmax(-1)))
            k_all[:, b, :, : len(p)] = dec.cache.k
            v_all[:, b, :, : len(p)] = dec.cache.v
        pos = [len(p) for p in prompts]  # where each row's next token goes
        live = {b for b in range(B) if outs[b][-1] not in eos}
        cos_t, sin_t = model.rope(S)
        packed = model.packed_weights()
        slots = torch.arange(S, device=dev)
        batch = torch.arange(B, device=dev)
        while live := {b for b in live if len(outs[b]) < max_new_tokens}:
            ids = torch.tensor([out[-1] for out in outs], device=dev)
            at = torch.tensor(pos, device=dev)
            cos, sin = cos_t[at][:, None, :], sin_t[at][:, None, :]  # (B, 1, hd)
            seen = (slots[None, :] <= at[:, None])[:, None, None, :]  # (B, 1, 1, S)

            def attend(i, q, k, v, at=at, seen=seen):
                # q (H, B, hd), k, v (Hkv, B, hd): column b is sequence b's token, at its own
                # position; its keys are row b of the layer's cache
                k_all[i, batch, :, at] = k.transpose(0, 1)
                v_all[i, batch, :, at] = v.transpose(0, 1)
                y = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[:, :, None], k_all[i], v_all[i], attn_mask=seen,
                    enable_gqa=True,
                )  # fmt: skip
                return y[:, :, 0].transpose(0, 1)  # (H, B, hd)

            x = run_layers(model, model.embed_tokens(ids), cos, sin, attend, packed)
            top = final_logits(model, x, None, packed).argmax(dim=-1).tolist()
            for b in live:
                outs[b].append(top[b])
                pos[b] += 1
            live = {b for b in live if outs[b][-1] not in eos}
    return outs


def _answers_batched(model, enc, max_new_tokens: int, batch_size: int):
    for b in range(0, len(enc), batch_size):
        chunk = [ids for ids, _ in enc[b : b + batch_size]]
        room = min(max_new_tokens, model.max_context - max(map(len, chunk)))
        yield from batched_greedy(model, chunk, room, model.eos_token_ids)


def _answers_hf(model, enc, max_new_tokens: int, batch_size: int):
    eos = list(model.eos_token_ids) or [0]
    hf = hf_twin(model)
    # Similar lengths together, so little padding is computed; answers come back in order.
    order = sorted(range(len(enc)), key=lambda i: len(enc[i][0]))
    got: dict[int, list[int]] = {}
    nxt = 0
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            rows = order[b : b + batch_size]
            width = max(len(enc[i][0]) for i in rows)
            input_ids = torch.full((len(rows), width), eos[0], dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids = enc[i][0]
                input_ids[r, width - len(ids) :] = torch.tensor(ids)
                mask[r, width - len(ids) :] = 1
            out = hf.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
            )  # fmt: skip
            for r, i in enumerate(rows):
                answer = out[r, width:].tolist()
                for j, t in enumerate(answer):
                    if t in eos:
                        answer = answer[: j + 1]
                        break
                got[i] = answer
            while nxt in got:
                yield got.pop(nxt)
                nxt += 1
    while nxt in got:
        yield got.pop(nxt)
        nxt += 1


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut off by an interrupted write: redo from there
    return out
