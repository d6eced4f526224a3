"""The design bans raw ``with_sharding_constraint`` outside nnx_zoo/sharding/ (it is a hard assert under an
all-Explicit mesh: seed 000). Activations are laid out with ``nnx_zoo.sharding.shard``."""

from __future__ import annotations

from pathlib import Path

import nnx_zoo

PACKAGE = Path(nnx_zoo.__file__).resolve().parent
BANNED = b"with_sharding_constraint"


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def test_no_with_sharding_constraint_outside_the_sharding_package():
    sharding_dir = PACKAGE / "sharding"
    others = [p for p in _files(PACKAGE) if sharding_dir not in p.parents]
    assert any(p.name == "__init__.py" for p in others)  # the walk does see the package
    offenders = [str(p.relative_to(PACKAGE)) for p in others if BANNED in p.read_bytes()]
    assert not offenders, f"use nnx_zoo.sharding.shard instead of with_sharding_constraint in: {offenders}"


def test_the_search_would_find_it():
    """The one sanctioned call site exists, so the byte search above is looking for the right thing."""
    assert BANNED in (PACKAGE / "sharding" / "constrain.py").read_bytes()
