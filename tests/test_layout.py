"""The package layout of issue 11: every import points down the layer list, nothing in engine/
imports server, and no module in engine/ is over 500 lines.

Layers, low to high (a module may import its own layer or lower ones):
    engine.errors
    engine.formats                              GGUF container, config, quant tables, metadata
    engine.text | engine.reference | engine.gpu   tokenizers/chat, the CPU oracle, the GPU engine
    engine.loader | engine.session | engine.generate
    engine.tools                                bench, greedy32, synth, slice, relabel, fetch, fuzz
    engine.cli, engine.__main__
engine.gpu and engine.reference never import each other (the oracle stays independent of what
it checks); engine.text and the backends neither. One edge goes up on purpose: the fuzzer
(engine.tools.fuzz) drives the CLI's own entry point in-process, so it sits above engine.cli. `server` sits above the whole engine; the
CLI reaches it only through an import inside the `serve` hand-off function.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RANK = {"errors": 0, "formats": 1, "text": 2, "reference": 2, "gpu": 2, "loader": 3, "session": 3,
        "scheduler": 3,
        "generate": 3, "tools": 4, "cli": 5, "__main__": 5, "__init__": 0}


HARNESS_EDGES = {("engine.tools.fuzz", "engine.cli")}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path):
    """(imported module, at module level?) for every import of engine/server in a file."""
    tree = ast.parse(path.read_text("utf-8"))
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for n in names:
            if n.split(".")[0] in ("engine", "server"):
                yield n, id(node) in top


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_engine_imports_point_down():
    bad = []
    for path in (ROOT / "engine").rglob("*.py"):
        me = _module_name(path)
        mine = _layer(me)
        for imp, at_top in _imports(path):
            if imp.startswith("server"):
                if not (me == "engine.cli" and not at_top):
                    bad.append(f"{me} imports {imp}")
                continue
            if imp == "engine" or any(me == a and imp.startswith(b) for a, b in HARNESS_EDGES):
                continue
            theirs = _layer(imp)
            if theirs not in RANK:      # `from engine import x` of a name, not a subpackage
                continue
            if RANK[theirs] > RANK[mine] or (RANK[theirs] == RANK[mine] == 2 and theirs != mine):
                bad.append(f"{me} ({mine}) imports {imp} ({theirs})")
    assert not bad, "\n".join(bad)


def test_no_engine_module_over_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / "engine").rglob("*.py")
            if (n := len(p.read_text("utf-8").splitlines())) > 500]
    assert not long, long


def test_every_engine_layer_is_known():
    layers = {_layer(_module_name(p)) for p in (ROOT / "engine").rglob("*.py")}
    assert layers <= set(RANK), layers - set(RANK)
