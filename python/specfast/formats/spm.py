"""SentencePiece tokenizers from GGUF metadata (llama.cpp's "llama" tokenizer model, as Gemma's
and Llama 2's files carry them), built with the `tokenizers` library.

llama.cpp tokenizes these the SentencePiece way: control and user-defined tokens are cut out of
the raw text first; the rest has its spaces written as "▁" (and one put in front with
`add_space_prefix`); then, starting from single characters, the adjacent pair whose joined text
is the vocabulary piece of highest score is joined, leftmost first, until no pair joins; a
character outside the vocabulary becomes its UTF-8 bytes' <0xXX> tokens. That is byte-fallback
BPE whose merges are every split of every piece into two pieces, ranked by the joined piece's
score, which is what `spm_tokenizer` builds.
"""

from __future__ import annotations

from pathlib import Path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # "▁", SentencePiece's space


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) whose join is a normal piece, both halves normal pieces too, the
    join of highest score first (on equal scores, the lower id)."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, normal[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_tokenizer(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    bos_id: int | None,
    add_bos: bool,
    add_space_prefix: bool,
    path: Path,
):
    """A `tokenizers.Tokenizer` that tokenizes as llama.cpp does a "llama" model's vocabulary
    (see the module docstring). `add_bos`: encode() puts the BOS token first, as llama.cpp does
    for these files (decoding skips it as a special token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    if not (len(tokens) == len(scores) == len(types)):
        raise ValueError(
            f"{path}: tokenizer.ggml.tokens, scores and token_type differ in length "
            f"({len(tokens)}, {len(scores)}, {len(types)})"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens holds a piece twice")
    unk = next((t for t, ty in zip(tokens, types, strict=True) if ty == UNKNOWN), None)
    try:
        model = models.BPE(
            vocab=vocab,
            merges=spm_merges(tokens, scores, types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
        tok = Tokenizer(model)
    except Exception as e:  # tokenizers raises bare Exceptions
        raise ValueError(f"{path}: cannot build the tokenizer: {e}") from None
    spaces = [normalizers.Replace(" ", SPACE)]
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE)] if add_space_prefix else []) + spaces
    )
    tail = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *tail]
    )
    # Control tokens are special (never split, skipped on decode); user-defined ones are cut
    # out of the raw text, as llama.cpp does before it escapes the spaces.
    pairs = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, ty in pairs if ty == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, ty in pairs if ty == USER_DEFINED]
    )
    if add_bos and bos_id is not None and 0 <= bos_id < len(tokens):
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    return tok
