"""nnx_zoo/hf is shared by every family: it may import nnx_zoo.sharding and nnx_zoo.layers, never a model family
(or the trainer), so a family can depend on it without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import nnx_zoo.hf

ALLOWED = ("nnx_zoo.hf", "nnx_zoo.sharding", "nnx_zoo.layers")


def _nnx_zoo_imports(file: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n == "nnx_zoo" or n.startswith("nnx_zoo.")]


def test_hf_imports_only_sharding_and_layers():
    files = sorted(Path(nnx_zoo.hf.__file__).parent.glob("*.py"))
    imports = {f.name: _nnx_zoo_imports(f) for f in files}
    assert "nnx_zoo.sharding" in imports["walker.py"]  # the scan sees the imports it checks
    bad = {name: [m for m in mods if not m.startswith(ALLOWED)] for name, mods in imports.items()}
    assert not any(bad.values()), f"nnx_zoo/hf must not import these: {bad}"
