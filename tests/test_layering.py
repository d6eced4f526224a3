"""The package's rooms import downward only, and no module reaches itself through its imports.

Every ``import`` in ``nnx_zoo`` counts, at module level or inside a function (a lazy import is still a reach),
except those under ``if TYPE_CHECKING:`` (never run). The rooms, lowest first: ``sharding``; ``layers``; ``hf``;
the input checks and ``generate`` (they drive any model through its cache protocol); the models' shared core
(configs, the dense and MoE causal LMs, the dense key table); the families (each a folder; one may build on
another's parts); the registry, which knows every family; ``train`` and the package's face.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nnx_zoo

PACKAGE = Path(nnx_zoo.__file__).parent
ROOMS = [
    ("sharding",),
    ("layers",),
    ("hf",),
    ("models.inputs", "generate"),
    ("models", "models.decoder_config", "models.moe_decoder_config", "models.dense_hf", "models.causal_lm",
     "models.moe_causal_lm"),
    ("models.<family>",),
    ("models.registry",),
    ("train", "", "__main__"),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``nnx_zoo`` modules ``name`` imports (a name imported from a package counts as its submodule when it is
    one, else as the package)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
               for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name and target.startswith("nnx_zoo"):
                found.add(target)
    return found


def _room(name: str) -> int:
    parts = name.split(".")[1:]
    key = ".".join(parts[:2]) if parts[:1] == ["models"] else (parts[0] if parts else "")
    if parts[:1] == ["models"] and len(parts) >= 2 and (PACKAGE / "models" / parts[1]).is_dir():
        key = "models.<family>"
    for rank, room in enumerate(ROOMS):
        if key in room:
            return rank
    raise AssertionError(f"{name}: in no room of tests/test_layering.py; place it")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_rooms_import_downward():
    upward = [f"{a} ({ROOMS[_room(a)]}) -> {b} ({ROOMS[_room(b)]})"
              for a, targets in _graph().items() for b in targets if _room(b) > _room(a)]
    assert not upward, "imports reaching up:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_core_reaches_no_family():
    """What the issue named: the configs' core, the causal-LM core and generation never reach the registry or a
    family, even through other modules; the kernel choosers' report sits above the kernels it asks."""
    graph = _graph()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for w in graph[todo.pop()] - seen:
                seen.add(w)
                todo.append(w)
        return seen

    for core in ("nnx_zoo.models.decoder_config", "nnx_zoo.models.causal_lm", "nnx_zoo.models.moe_causal_lm",
                 "nnx_zoo.generate"):
        far = sorted(m for m in reach(core) if _room(m) >= _room("nnx_zoo.models.llama"))
        assert not far, f"{core} reaches {far}"
    assert "nnx_zoo.layers.kernel_choices" not in reach("nnx_zoo.layers.kernels")
    assert "nnx_zoo.generate" not in reach("nnx_zoo.generate")
