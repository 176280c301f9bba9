"""Log-probabilities of the emitted tokens (generate(..., logprobs=True, top_logprobs=N)).

Which distribution: the log-softmax of the target's logits at the position, before temperature,
top-k, top-p and min-p (vLLM's default, "raw_logprobs"); under a response_format, of the logits
the grammar masked, so it is renormalised over the tokens the grammar allows there (a forced
token gets 0.0) and refused tokens are never listed, as in vLLM, which applies the grammar's mask
before it takes logprobs. Sampling settings never change the numbers, only which token is drawn.

Where they come from: the rows of the pass that chose each token (the prompt's last row for the
first token, then the verify pass's row i for the round's i-th committed token), so they are
plain decoding's numbers with or without speculation: bit for bit where a pass's rows do not
depend on its row count (specfast's core on CPU), elsewhere as close as the runtime's batched
and one-row passes are (exactness.md §4).
"""

from __future__ import annotations

import math

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit

# (logprob of each token, per token its row's top N as (id, logprob), most likely first, or None)
Rows = tuple[list[float], list[list[tuple[int, float]]] | None]


def check_logprobs(logprobs, top_logprobs) -> int | None:
    """None when logprobs are off, else how many alternatives each token gets (0 to 20)."""
    if not isinstance(logprobs, bool):
        raise TypeError(f"logprobs must be True or False, got {logprobs!r}")
    top = top_logprobs
    if isinstance(top, bool) or not isinstance(top, int):
        raise TypeError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {top!r}")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    if top and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True")
    return top if logprobs else None


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> Rows:
    """logits (>= n, V), row i the one tokens[i] was chosen from -> Rows for the n tokens.

    Each is logit - logsumexp(row): the log-softmax without writing a (n, V) tensor. Tokens a
    grammar refused (-inf) are left out of the top N, so a row may list fewer."""
    n = len(tokens)
    x = logits[:n].float()  # (n, V)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # (n, 1)
    ids = torch.tensor(tokens, device=x.device)[:, None]  # (n, 1)
    chosen = x.gather(1, ids) - lse  # (n, 1)
    if not top_n:
        return chosen[:, 0].tolist(), None
    values, top_ids = torch.topk(x, min(top_n, x.shape[1]), dim=-1)  # (n, N), most likely first
    both = torch.cat([chosen, values - lse], dim=1).tolist()  # (n, 1 + N)
    tops = [
        [(t, v) for t, v in zip(row_ids, row[1:], strict=True) if v > -math.inf]
        for row_ids, row in zip(top_ids.tolist(), both, strict=True)
    ]
    return [row[0] for row in both], tops


def committed_logprobs(logits: torch.Tensor | None, tokens: list[int], top_n: int | None):
    """The committed tokens' Rows from the pass rows that chose them, or None when logprobs are
    off (top_n None)."""
    return None if top_n is None or logits is None else token_logprobs(logits, tokens, top_n)
