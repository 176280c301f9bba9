"""The import rules (docs/architecture.md §7): a module imports only from its own layer or below,
and the module graph has no cycle; a target kind (targets/torch/, targets/llama_cpp/,
targets/hf.py) is imported only by itself and by targets/__init__.py, the one place that knows
the kinds. Every import counts, in functions and TYPE_CHECKING too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "specfast"
LAYERS = {"_core": 1, "sampling": 1, "autok": 1, "hardware": 1, "corpus": 1, "targets.base": 1}
LAYERS |= {"stats": 1, "chat": 1, "streaming": 1, "constraints": 1, "model": 2, "targets": 3}
LAYERS |= {"logprobs": 1, "settings": 3}
LAYERS |= {"formats": 3, "drafters": 4, "generate": 5, "session": 5, "": 5}
LAYERS |= {"cli": 6, "serve": 6, "bench": 6, "train": 6, "__main__": 6, "vllm": 6}
FILES = {p: p.relative_to(PACKAGE.parent).with_suffix("").parts for p in PACKAGE.rglob("*.py")}
SOURCES = {".".join(n[:-1] if n[-1] == "__init__" else n): p.read_text() for p, n in FILES.items()}


def layer(module: str) -> int:
    path = module.partition(".")[2]  # "": specfast/__init__, the public names up to Session
    while path not in LAYERS and "." in path:
        path = path.rpartition(".")[0]
    return LAYERS[path]  # KeyError: a module of no layer


def problems(sources: dict[str, str]) -> list[str]:
    """Relative imports, upward imports and cycles among `sources` ({module name: source})."""
    known, edges, out = {*sources, "specfast._core"}, {m: set() for m in sources}, []
    for mod, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom):
                out += [f"{mod}: relative import"] if node.level else []
                names = {f"{node.module}.{a.name}" for a in node.names}
                edges[mod] |= {n if n in known else node.module for n in names}
            elif isinstance(node, ast.Import):
                edges[mod] |= {a.name for a in node.names}
    edges = {m: {t for t in ts if t in known and t != m} for m, ts in edges.items()}
    for m, ts in sorted(edges.items()):
        out += [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})" for t in sorted(ts)
                if layer(t) > layer(m)]  # fmt: skip
    while sinks := [m for m, ts in edges.items() if not ts & edges.keys()]:
        edges = {m: ts for m, ts in edges.items() if m not in sinks}
    return out + ([f"import cycle through {sorted(edges)}"] if edges else [])  # what is left


KINDS = ("specfast.targets.torch", "specfast.targets.llama_cpp", "specfast.targets.hf")


def imported(src: str) -> set[str]:
    """Every module name `src` imports from (absolute imports)."""
    out = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def kind_leaks(sources: dict[str, str]) -> list[str]:
    """Imports of a target kind's modules from outside that kind and targets/__init__."""
    out = []
    for mod, src in sources.items():
        for kind in KINDS:
            if mod == "specfast.targets" or mod == kind or mod.startswith(kind + "."):
                continue
            hits = sorted(n for n in imported(src) if n == kind or n.startswith(kind + "."))
            out += [f"{mod} imports {hits[0]}"] if hits else []
    return out


def test_imports_point_down_the_layers_without_cycles():
    assert len(SOURCES) > 30 and all(layer(m) for m in SOURCES)  # every module has a layer
    assert problems(SOURCES) == []


def test_negative_controls_an_upward_import_and_a_cycle_are_reported():
    up = {"specfast.targets.x": "def f():\n    from specfast.generate import generate\n"}
    want = "specfast.targets.x (layer 3) imports specfast.generate (layer 5)"
    assert problems({**SOURCES, **up}) == [want]
    a, b = "specfast.drafters.a", "specfast.drafters.b"
    cycle = {a: f"import {b}", b: "from specfast.drafters import a"}
    assert problems({**SOURCES, **cycle}) == [f"import cycle through {[a, b]}"]


def test_a_target_kind_is_imported_only_through_targets():
    assert any(m.startswith("specfast.targets.llama_cpp.") for m in SOURCES)  # kinds were found
    assert kind_leaks(SOURCES) == []


def test_negative_control_a_kind_imported_from_outside_targets_is_reported():
    planted = {
        "specfast.formats.x": "from specfast.targets.llama_cpp.state import llama_state\n",
        "specfast.generate": SOURCES["specfast.generate"] + "\nimport specfast.targets.torch\n",
        "specfast.cli.x": "def f():\n    from specfast.targets.hf import HFTarget\n",
    }
    assert sorted(kind_leaks({**SOURCES, **planted})) == [
        "specfast.cli.x imports specfast.targets.hf",
        "specfast.formats.x imports specfast.targets.llama_cpp.state",
        "specfast.generate imports specfast.targets.torch",
    ]
