"""Grammar-constrained replies (`response_format`), exact under speculation.

A reply's grammar runs in one llguidance matcher (the grammar engine of llama.cpp and vLLM) that
has consumed exactly the committed tokens. At each position the grammar masks the target: every
token it refuses gets logit -inf before temperature, top-k, top-p and min-p, so greedy takes the
masked argmax and sampling draws from the masked, renormalised p. Where the grammar forces what
comes next (llguidance's fast-forward tokens), the mask allows only the first forced token: the
canonical tokenization of forced text, with or without speculation.

Why a round stays exact. The verify pass has rows for [last, d1..dk]; row i is masked with the
grammar's state after the committed tokens and d1..di (the matcher walks the draft, then rolls
back). So each row is the distribution plain constrained decoding would use at that position,
given the drafts before it, and the acceptance rule is applied to it unchanged.

- A draft its row refuses is never accepted (greedy: the masked argmax is an allowed token;
  sampling: p = 0), so the draft is cut before it and the pass spends no row on it. A draft
  drawn from a q (a draft model's or an EAGLE head's, when sampling) is the exception: the
  position's token must then come from the residual max(0, p - q), not from p, so a refused
  draw stays as the last draft, the ratio test rejects it (p = 0) and the residual is drawn
  from the masked p.
- Forced tokens are free drafts: after the draft, while the grammar forces the next token, it
  is appended. Its row allows only it, so it is accepted by construction (the masked argmax; a
  one-hot p), and it rides in the verify pass, so its keys and values enter the cache as every
  accepted token's do. A q gets a one-hot row for it: it was chosen for certain.
- When the grammar is complete only EOS is allowed, so the reply ends there ("eos").
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

FORMATS = (
    '{"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {...}}}, '
    '{"type": "regex", "regex": "..."} or {"type": "grammar", "grammar": "<lark grammar>"}'
)
# The keys each type takes; an unknown key (a typo, a schema put at the top) is refused.
KEYS = {
    "json_object": {"type"},
    "json_schema": {"type", "json_schema"},
    "regex": {"type", "regex"},
    "grammar": {"type", "grammar"},
}
SCHEMA_KEYS = {"name", "description", "schema", "strict"}
_TOKENIZERS: dict[tuple, tuple[Any, Any]] = {}  # (id, vocab, eos) -> (tokenizer, LLTokenizer)


@dataclass(frozen=True)
class Grammar:
    """A checked response_format: llguidance's grammar and the tokenizer it runs over."""

    text: str  # llguidance's grammar (JSON), from the schema, regex or lark grammar
    tokenizer: Any  # llguidance.LLTokenizer over the target's vocabulary, EOS = the reply's
    vocab_size: int
    eos_ids: frozenset[int]


def check_response_format(
    response_format: Any, tokenizer: Any, vocab_size: int, eos_ids: set[int]
) -> Grammar | None:
    """The grammar a response_format asks for, or None; ValueError/TypeError say what is
    allowed, and a grammar llguidance refuses raises ValueError with its message."""
    if response_format is None:
        return None
    ll = _llguidance()
    text = grammar_text(response_format)
    if not eos_ids:
        raise ValueError(
            "response_format ends the reply on EOS once the grammar is complete; it cannot be "
            "used with ignore_eos=True or an empty eos_token_id"
        )
    ll_tokenizer = _ll_tokenizer(ll, tokenizer, vocab_size, eos_ids)
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(text, ll_tokenizer)
    if is_error:
        raise ValueError(f"response_format: llguidance refuses it: {messages[0]}")
    return Grammar(text, ll_tokenizer, vocab_size, frozenset(eos_ids))


def is_special(text: str, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> bool:
    """True when `text` is one token that llguidance holds special (a chat format's tag, as
    Qwen's <tool_call>): a regex over free text never matches it, so a grammar whose free text
    ends at it must name it <text>, not "text"."""
    ll = _llguidance()
    ll_tokenizer = _ll_tokenizer(ll, tokenizer, vocab_size, eos_ids)
    ids = ll_tokenizer.tokenize_str(text)
    return len(ids) == 1 and ll_tokenizer.is_special_token(ids[0])


def _llguidance() -> ModuleType:
    try:
        import llguidance
    except ImportError as e:  # imported only here, so a reply without a grammar never needs it
        raise ValueError(
            f"response_format needs llguidance: pip install 'llguidance>=1.9,<2' ({e})"
        ) from None
    return llguidance


def grammar_text(response_format: Any) -> str:
    """llguidance's grammar for a response_format (checked here; the grammar itself is
    checked against the tokenizer by check_response_format)."""
    ll = _llguidance()
    if not isinstance(response_format, Mapping):
        raise TypeError(f"response_format must be a dict: {FORMATS}; got {response_format!r}")
    kind = response_format.get("type")
    if kind not in KEYS:
        raise ValueError(
            f"response_format['type'] must be one of {sorted(KEYS)}, got {kind!r} (a JSON schema "
            'goes in {"type": "json_schema", "json_schema": {"schema": ...}})'
        )
    unknown = sorted(set(response_format) - KEYS[kind])
    if unknown:
        raise ValueError(
            f"response_format of type {kind!r} takes {sorted(KEYS[kind])}, not {unknown}"
        )
    if kind == "json_object":
        return ll.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ValueError(
                "response_format['json_schema'] must be a dict whose 'schema' is a JSON schema "
                f"(a dict), got {spec!r}"
            )
        unknown = sorted(set(spec) - SCHEMA_KEYS)
        if unknown:
            raise ValueError(
                f"response_format['json_schema'] takes {sorted(SCHEMA_KEYS)}, not {unknown}"
            )
        if not isinstance(spec.get("strict", True), bool):
            raise TypeError("response_format['json_schema']['strict'] must be a bool")
        try:  # strict or not, the schema is enforced: there is no looser mode to fall back on
            return ll.LLMatcher.grammar_from_json_schema(json.dumps(spec["schema"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"response_format: the schema is not valid JSON: {e}") from None
    source = response_format.get(kind)
    if not isinstance(source, str) or not source:
        raise ValueError(f"response_format[{kind!r}] must be a non-empty str, got {source!r}")
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(source)
    return ll.LLMatcher.grammar_from_lark(source)


def _ll_tokenizer(ll: ModuleType, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> Any:
    """llguidance's tokenizer over the target's vocabulary, built once per tokenizer (0.1-1 s)."""
    # llguidance reads a tokenizers.Tokenizer's JSON (`to_str`); a transformers fast tokenizer
    # wraps one.
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not callable(getattr(backend, "to_str", None)):
        raise ValueError(
            "response_format needs the model's tokenizer as a tokenizers.Tokenizer (or a "
            f"transformers fast tokenizer), got {type(tokenizer).__name__}"
        )
    key = (id(backend), vocab_size, tuple(sorted(eos_ids)))
    if key not in _TOKENIZERS:
        try:
            plain = copy.copy(backend)  # llguidance must not pad or truncate what it tokenizes
            plain.no_padding()
            plain.no_truncation()
            built = ll.LLTokenizer(plain.to_str(), n_vocab=vocab_size, eos_token=list(key[2]))
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(
                f"response_format: llguidance cannot read the tokenizer: {e}"
            ) from None
        if len(_TOKENIZERS) >= 8:
            del _TOKENIZERS[next(iter(_TOKENIZERS))]
        _TOKENIZERS[key] = (backend, built)  # holding `backend` keeps its id from being reused
    return _TOKENIZERS[key][1]


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> Any:
    """llguidance's tokenizer over the target's vocabulary (built once), or ValueError. Its
    decode_bytes gives a token's exact bytes (serve's logprobs)."""
    return _ll_tokenizer(_llguidance(), tokenizer, vocab_size, eos_ids)


@dataclass
class Plan:
    """One round under the grammar: the draft to verify and every verify row's mask."""

    tokens: list[int]  # the drafter's tokens the grammar allows, then the forced ones
    q: torch.Tensor | None  # the drafts' q, when they were drawn from one (forced rows one-hot)
    allowed: torch.Tensor  # (len(tokens) + 1, V) bool: row i, the state after tokens[:i]
    proposed: int  # how many of `tokens` are the drafter's
    forced: int  # how many are forced

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (rows, V) with every refused token at -inf, before any sampling transform."""
        return torch.where(self.allowed.to(logits.device, non_blocking=True), logits, -torch.inf)


class Constraint:
    """One reply's grammar: a matcher that has consumed exactly the committed tokens."""

    def __init__(self, grammar: Grammar):
        ll = _llguidance()
        self.matcher = ll.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        self.vocab_size, self.eos_ids = grammar.vocab_size, grammar.eos_ids

    def plan(self, draft: list[int], q: torch.Tensor | None, budget: int) -> Plan:
        """Cuts `draft` at the first token the grammar refuses, appends the tokens it then
        forces (up to `budget` tokens in all) and gives each verify row its mask; the matcher
        is back at the committed state on return. `q`: the drafts' q (k, V), when sampling."""
        tokens: list[int] = []
        row, forced = self._state()
        rows, consumed, refused = [row], 0, None
        for t in draft[:budget]:
            if not row[t]:
                refused = t
                break
            tokens.append(t)
            if t in self.eos_ids:
                # The reply ends here: the row after it is never read, and the matcher is never
                # fed EOS (llguidance's rollback over an EOS taken when complete undoes one token
                # too many).
                rows.append(self._anything())
                forced = None
                break
            self._consume(t)
            consumed += 1
            row, forced = self._state()
            rows.append(row)
        proposed = len(tokens)
        if q is not None and refused is not None:
            # Kept: the ratio test rejects it (p = 0) and draws the residual with its q. The row
            # after it is never read (it is never accepted).
            tokens.append(refused)
            rows.append(self._anything())
            proposed, forced = proposed + 1, None
        while forced is not None and len(tokens) < budget:
            self._consume(forced)
            consumed += 1
            tokens.append(forced)
            row, forced = self._state()
            rows.append(row)
        self.matcher.rollback(consumed)
        n_forced = len(tokens) - proposed
        if q is not None:
            q = q[:proposed]
            if n_forced:
                one_hot = q.new_zeros(n_forced, q.shape[1])
                idx = torch.tensor(tokens[proposed:], device=q.device)
                q = torch.cat([q, one_hot.scatter_(1, idx[:, None], 1.0)])
        allowed = torch.from_numpy(np.stack(rows))
        return Plan(tokens, q, allowed, proposed, n_forced)

    def commit(self, tokens: list[int]) -> None:
        """The tokens the round committed; each one its row allowed, so the grammar takes it.
        EOS ends the reply, so the matcher never needs it."""
        for t in tokens:
            if t in self.eos_ids:
                break
            self._consume(t)

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} broke the grammar: {self.matcher.get_error()}")

    def _state(self) -> tuple[np.ndarray, int | None]:
        """(the tokens the grammar allows next, (V,) bool; the token it forces, or None)."""
        forced = self.matcher.compute_ff_tokens()
        if forced and forced[0] not in self.eos_ids:
            row = np.zeros(self.vocab_size, dtype=bool)
            row[forced[0]] = True
            return row, forced[0]
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        row = np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(np.bool_)
        if not row.any():
            raise RuntimeError(f"the grammar allows no token here: {self.matcher.get_error()}")
        return row, None

    def _anything(self) -> np.ndarray:
        """The mask of a row that is never read: all allowed, so its probabilities are finite."""
        return np.ones(self.vocab_size, dtype=bool)
