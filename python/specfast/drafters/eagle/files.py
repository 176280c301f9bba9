"""EAGLE-3 head files: SpecForge's layout (config.json + model.safetensors, head.py's tensor
names) written by `save_eagle` and read by `load_eagle`, checked against the target that will
run the head (its sizes and layers, from the target's `layer_facts()`); and where the head kept
for the default model lives in a source checkout (`DEFAULT_HEAD`: not in the wheel)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specfast.drafters.eagle.config import EagleConfig
from specfast.drafters.eagle.head import EagleHead, check_vocab_maps
from specfast.model.config import resolve_dtype
from specfast.targets import as_target
from specfast.targets.base import LayerFacts, default_aux_layers

WEIGHTS = "model.safetensors"
PICKLES = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth", "pytorch_model.pt")
DEFAULT_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct"


def save_eagle(head: EagleHead, path, dtype="bfloat16") -> Path:
    """Writes `head` as SpecForge exports it: path/config.json + path/model.safetensors.

    dtype: "bfloat16" (small, what is shipped) or "float32" for the float weights; d2t stays
    int64 and t2d bool. A shared embedding is not written (loaders use the target's)."""
    from safetensors.torch import save_file

    dtype = resolve_dtype(dtype)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in head.state_dict().items():
        t = t.detach().cpu()
        if t.dtype.is_floating_point:
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    return out


def load_eagle(path=None, target=None, dtype=None) -> EagleHead:
    """An EAGLE-3 head from SpecForge's layout (a folder with config.json + model.safetensors),
    checked against `target` (a specfast Model, or a llama_cpp.Llama) and put on its device, in its
    dtype (a Llama's: "auto" on the CPU), or in `dtype`.

    path=None is the head shipped for the default model. Pickle files (pytorch_model.bin) are
    refused: convert them first. Errors (ValueError) name what is wrong: a missing tensor, a
    wrong shape, d2t outside the vocabulary, a vocabulary or hidden size that is not the
    target's, aux layer ids the target does not have.
    """
    from safetensors import SafetensorError, safe_open

    folder = DEFAULT_HEAD if path is None else Path(path)
    if folder.is_file() and folder.name == WEIGHTS:
        folder = folder.parent
    if not folder.is_dir():
        hint = " (the shipped head for the default model is missing)" if path is None else ""
        raise FileNotFoundError(
            f"no EAGLE head at {folder}{hint}: expected a folder with config.json and {WEIGHTS}"
        )
    weights = folder / WEIGHTS
    if not weights.is_file():
        pickles = [p.name for p in folder.iterdir() if p.name in PICKLES or p.suffix == ".bin"]
        if pickles:
            raise ValueError(
                f"{folder}: found {pickles[0]}, a pickle file, which specfast never loads (it can "
                "run code). Convert it once, yourself: sd = torch.load(file, weights_only=True); "
                f"safetensors.torch.save_file(sd, '{WEIGHTS}')"
            )
        raise ValueError(f"{folder}: no {WEIGHTS}")
    try:
        config = EagleConfig.from_dict(json.loads((folder / "config.json").read_text()))
    except FileNotFoundError:
        raise ValueError(f"{folder}: no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'config.json'}: not valid JSON: {e}") from None
    except TypeError as e:
        raise ValueError(f"{folder / 'config.json'}: {e}") from None
    try:
        with safe_open(str(weights), framework="pt") as f:
            tensors = {k.removeprefix("model."): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{weights}: cannot read safetensors file: {e}") from None
    head = head_from_tensors(config, tensors, target, where=str(weights))
    facts = eagle_target(target) if target is not None else None
    if dtype is not None or facts is not None:
        dtype = resolve_dtype(dtype) if dtype is not None or facts is None else facts.dtype
        head = head.to(dtype=dtype)
        if facts is not None and head.embed_tokens is None:
            head.bind_embedding(target_embedding(facts, dtype))  # a Llama's, in its dtype
    return head.to(facts.device) if facts is not None else head


def head_from_tensors(config: EagleConfig, tensors: dict, target=None, where="") -> EagleHead:
    """The head built from SpecForge-named tensors, with every check (see load_eagle)."""
    where = f"{where}: " if where else ""
    facts = eagle_target(target) if target is not None else None
    if facts is not None:
        check_config_for_target(config, facts)
    own_embedding = "embed_tokens.weight" in tensors
    head = EagleHead(config, own_embedding)
    want = head.state_dict()
    missing = [k for k in want if k not in tensors]
    if missing:
        raise ValueError(f"{where}missing tensor {missing[0]!r} (expected {sorted(want)})")
    for k, w in want.items():
        t = tensors[k]
        if tuple(t.shape) != tuple(w.shape):
            raise ValueError(
                f"{where}tensor {k!r} has shape {tuple(t.shape)}; this config needs "
                f"{tuple(w.shape)}"
            )
        if w.dtype.is_floating_point and not t.dtype.is_floating_point:
            raise ValueError(f"{where}tensor {k!r} must be floating point, got {t.dtype}")
    check_vocab_maps(tensors["d2t"], tensors["t2d"], config)
    with torch.no_grad():
        for k, w in want.items():
            w.copy_(tensors[k].to(w.dtype))
    if facts is not None and not own_embedding:
        head.bind_embedding(target_embedding(facts, facts.dtype))
    return head.requires_grad_(False)


def eagle_target(target) -> LayerFacts:
    """What an EAGLE head needs of `target` (anything as_target takes): a specfast Model, or a
    llama_cpp.Llama whose llama.cpp returns per-layer inputs; the error says why any other
    cannot feed one."""
    return as_target(target).layer_facts()


def target_embedding(facts: LayerFacts, dtype: torch.dtype) -> torch.Tensor:
    """The target's token embedding (V, D) in `dtype`, from facts eagle_target made."""
    return facts.embedding(dtype)


def check_config_for_target(config: EagleConfig, target: LayerFacts) -> None:
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"the EAGLE head is for a vocabulary of {config.vocab_size} tokens; the target has "
            f"{target.vocab_size}"
        )
    if config.target_hidden_size != target.dim:
        raise ValueError(
            f"the EAGLE head reads target features of hidden size {config.target_hidden_size}; "
            f"the target's is {target.dim}"
        )
    if config.aux_layers is None:
        config.aux_layers = default_aux_layers(target.n_layers)
    bad = [i for i in config.aux_layers if not 0 <= i < target.n_layers]
    if bad:
        raise ValueError(
            f"the EAGLE head reads target layers {list(config.aux_layers)}; the target has "
            f"{target.n_layers} layers (ids 0..{target.n_layers - 1})"
        )
