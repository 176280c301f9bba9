"""How many drafts a head would have accepted on held-out documents, greedily, as generate()
replays its rounds: the figure a training run is judged by."""

from __future__ import annotations

import torch

from specfast.bench import workloads
from specfast.drafters.eagle.head import EagleHead
from specfast.generate import generate
from specfast.train.data import target_features
from specfast.train.ttt import ttt_step

# ---------------------------------------------------------------------------- greedy acceptance


def chain_drafts(head: EagleHead, features, tokens, embed, steps: int) -> torch.Tensor:
    """What greedy chain drafting proposes from every position at once -> (steps, T) target
    ids, T = N - 1: row s, column t is the (s+1)-th draft of a round whose step 0 reads the
    target's features of position t with token t+1. Later steps feed the head's own drafts, as
    drafting does (the same attention as training-time test, own tokens instead of the text's)."""
    tokens = tokens.long().to(features.device)
    T = tokens.shape[0] - 1
    pos = torch.arange(T, device=features.device)
    dtype = head.fc.weight.dtype
    head.bind_embedding(embed)
    with torch.no_grad():
        hidden = head.fc(features[:T].to(dtype))
        keys: list = []
        values: list = []
        tok, out = tokens[1:], []
        for s in range(steps):
            hidden = ttt_step(head, tok, hidden, pos + s, keys, values)
            tok = head.target_ids[head.logits(hidden).argmax(dim=-1)]
            out.append(tok)
    return torch.stack(out)


def greedy_acceptance(drafts: torch.Tensor, tokens, start: int, k: int) -> list[int]:
    """Rounds of greedy chain drafting over `tokens` (the target's own greedy text) from the
    round whose first draft is token `start` -> tokens emitted per round (accepted + 1).
    A round at t (step 0 reads position t) drafts tokens t+2..; the next round starts one past
    the target's own token."""
    tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    d = drafts.tolist()
    rounds, t, N = [], start - 2, len(tokens)
    while t + 2 < N:
        a = 0
        while a < min(k, len(d)) and t + 2 + a < N and d[a][t] == tokens[t + 2 + a]:
            a += 1
        emitted = min(a + 1, N - (t + 2))
        rounds.append(emitted)
        t += emitted
    return rounds


def held_out_acceptance(
    target,
    heads: dict,
    kinds=("open", "complete"),
    k_values=(1, 2, 3, 4, 5, 6),
    max_new_tokens: int = 128,
    per_kind: int = 16,
) -> dict:
    """Mean acceptance length of greedy chain drafting at each k, for each head of `heads`
    ({name: EagleHead}), on the benchmark's own prompts (specfast.bench.workloads, none trained on).

    The target generates each answer once, plainly (EOS ignored, as the benchmark does); one
    forward reads its features; then every round is replayed per head (chain_drafts,
    greedy_acceptance). Greedy output does not depend on the drafter, so this is the
    mean_acceptance_length generate() reports at that k, up to float noise at near-ties.
    -> {name: {kind: {k: tau}}}."""
    first = next(iter(heads.values()))
    aux = first.config.aux_layers
    embed = target.embed.weight.detach().float()
    rounds: dict = {n: {kind: {k: [] for k in k_values} for kind in kinds} for n in heads}
    for kind in kinds:
        for w in workloads.build_workloads([kind], per_kind):
            prompt = target.tokenizer.encode(w.render(target.chat_template)).ids
            out = generate(target, prompt, max_new_tokens, drafter=None, ignore_eos=True)
            ids = torch.tensor(prompt + out.token_ids, device=target.device)
            feats = target_features(target, ids, aux)[0].float()
            for name, head in heads.items():
                drafts = chain_drafts(head, feats, ids, embed, max(k_values))
                for k in k_values:
                    rounds[name][kind][k] += greedy_acceptance(drafts, ids, len(prompt) + 1, k)
    return {
        n: {kind: {k: round(sum(r) / len(r), 3) for k, r in ks.items()} for kind, ks in kd.items()}
        for n, kd in rounds.items()
    }
