"""The target seam holds: outside specfast/targets/ (and specfast/model/, the torch model
itself), no code asks what kind of model it holds.

A model enters through `specfast.targets.as_target` (or `try_target`) and is a Target from then
on. So, outside targets/, the package has no isinstance/issubclass against a class defined in
targets/, no call to targets' type tests (is_hf_model, is_llama, is_target), and no
getattr/hasattr probe for a member of the Target or Decoder protocol or of specfast's Model.
Each rule has a planted violation that the same check must find (the negative control)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specfast.model import Model
from specfast.targets.base import Decoder, Target
from specfast.targets.torch import ModelTarget

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "specfast"
TARGETS = PACKAGE / "targets"
MODEL = PACKAGE / "model"
TYPE_TESTS = {"is_hf_model", "is_llama", "is_target", "is_model"}


def target_classes() -> set[str]:
    """Every class defined under targets/ and model/."""
    names = set()
    for path in [*TARGETS.rglob("*.py"), *MODEL.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
    return names


def members(cls) -> set[str]:
    names = set(getattr(cls, "__annotations__", {}))
    return names | {n for n in vars(cls) if not n.startswith("_")}


def probed_names() -> set[str]:
    """Attribute names whose probe would ask what a model is or can do."""
    model = {n for n in [*vars(Model), *vars(ModelTarget)] if not n.startswith("_")}
    # what Model.__init__ sets, and transformers' config objects
    model |= {"compiled_step", "kv_dtype", "config", "generation_config", "prepack"}
    return members(Target) | members(Decoder) | model


def name_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def violations(source: str, classes: set[str], probed: set[str]) -> list[str]:
    """What in `source` tests a model's type or probes its attributes, as readable lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = name_of(node.func)
        if func in TYPE_TESTS:
            found.append(f"line {node.lineno}: {func}()")
        elif func in ("isinstance", "issubclass") and len(node.args) == 2:
            kinds = node.args[1]
            parts = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
            hit = [name_of(p) for p in parts if name_of(p) in classes]
            if hit:
                found.append(f"line {node.lineno}: {func}(..., {hit})")
        elif func in ("getattr", "hasattr") and len(node.args) >= 2:
            attr = node.args[1]
            if isinstance(attr, ast.Constant) and attr.value in probed:
                found.append(f"line {node.lineno}: {func}(..., {attr.value!r})")
    return found


def outside_targets() -> list[Path]:
    inside = (TARGETS, MODEL)
    return [p for p in sorted(PACKAGE.rglob("*.py")) if not set(inside) & set(p.parents)]


def test_nothing_outside_targets_asks_what_a_model_is():
    classes, probed = target_classes(), probed_names()
    assert {"Model", "ModelDecoder", "ModelTarget", "HFDecoder", "LlamaDecoder"} <= classes
    assert {"chat_template", "torch_threads", "cold_passes", "tokenizer", "weights"} <= probed
    files = outside_targets()
    assert len(files) > 30  # the walk found the package
    bad = {
        str(p.relative_to(PACKAGE)): v
        for p in files
        if (v := violations(p.read_text(), classes, probed))
    }
    assert not bad, bad


@pytest.mark.parametrize(
    "planted",
    [
        "isinstance(model, Model)",
        "isinstance(decoder, (int, HFDecoder))",
        "targets.hf.is_hf_model(model)",
        "is_llama(model)",
        'getattr(model, "chat_template", None)',
        'hasattr(decoder, "cold_passes")',
        'getattr(decoder, "torch_threads", None) or 2',
        'getattr(model, "weights", "float")',
        'getattr(model, "compiled_step", None)',
    ],
)
def test_control_a_planted_type_test_or_probe_is_found(planted):
    source = (
        PACKAGE / "generate.py"
    ).read_text() + f"\n\ndef planted(model, decoder):\n    {planted}\n"
    found = violations(source, target_classes(), probed_names())
    assert len(found) == 1 and "line" in found[0], found
