"""The layers of docs/ARCHITECTURE.md: imports point down only, and the scheduler's side
imports no torch. Every import counts, deferred and type-only ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import infer

ROOT = Path(infer.__file__).parent
# Top to bottom; a module may import its own layer and the ones after it.
LAYERS = [
    "server",
    "engine",
    "distributed",
    "spec_decode",
    "runner",
    "structured",
    "model",
    "kv_cache",
    "core",
]
NO_TORCH = ["core", "kv_cache", "engine/scheduler.py", "spec_decode/ngram.py"]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def test_imports_point_down_only():
    upward = []
    for layer_index, layer in enumerate(LAYERS):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] != "infer" or len(parts) < 2 or parts[1] not in LAYERS:
                    continue
                if LAYERS.index(parts[1]) < layer_index:
                    upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert upward == []


def test_the_scheduler_side_imports_no_torch():
    found = []
    for entry in NO_TORCH:
        target = ROOT / entry
        for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            found += [
                f"{path.relative_to(ROOT)}: {n}"
                for n in _imports(path)
                if n.split(".")[0] == "torch"
            ]
    assert found == []
