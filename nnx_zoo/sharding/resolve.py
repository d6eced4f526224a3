"""THE resolver: logical axis names -> PartitionSpec.

Semantics are exactly those of ``flax.linen.logical_to_mesh_axes``: rules are visited in order; a rule for a
name in the array applies when that dimension is still unassigned and none of the rule's mesh axes is already
bound to another dimension of the array (otherwise the next rule for that name is tried). Then, with a mesh,
mesh axes of size 1 (or absent from the mesh) are removed, and, with a shape, each sharded dimension is checked
to divide evenly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from nnx_zoo.sharding.axes import LOGICAL_AXES, MESH_AXES
from nnx_zoo.sharding.rules import MeshAxes, Rules, get_rules


class ShardingError(ValueError):
    """A logical name, rule set, mesh or shape that cannot be resolved; the message says how to fix it."""


_UNASSIGNED = object()


def _axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _where(path: str | None) -> str:
    return f"{path}: " if path else ""


def _check_names(names: Sequence[str | None], rules: Rules, strict: bool, path: str | None) -> None:
    for name in names:
        if name is not None and not isinstance(name, str):
            raise ShardingError(f"{_where(path)}logical names must be strings or None, got {name!r} in {names!r}")
    repeated = sorted({n for n in names if n is not None and names.count(n) > 1})
    if repeated:
        raise ShardingError(
            f"{_where(path)}logical names {repeated} occur more than once in {tuple(names)}; give each dimension "
            "its own name"
        )
    if strict:
        known = LOGICAL_AXES.keys() | {rule_name for rule_name, _ in rules}
        unknown = [n for n in names if n is not None and n not in known]
        if unknown:
            raise ShardingError(
                f"{_where(path)}unknown logical axis name {unknown[0]!r} in {tuple(names)}: it is neither in the "
                "vocabulary (nnx_zoo/sharding/axes.py) nor mentioned by the rule set. Fix the spelling, declare it "
                "in axes.py, add a rule for it, or pass strict=False to replicate unknown names."
            )


def _linen_resolve(names: Sequence[str | None], rules: Rules) -> list[MeshAxes]:
    """Flax Linen's first-match-wins resolution, with already-bound mesh axes skipping a rule."""
    result: list[object] = [_UNASSIGNED if isinstance(n, str) else None for n in names]
    taken: set[str] = set()
    for logical, axes in rules:
        if logical not in names:
            continue
        pos = list(names).index(logical)
        wanted = set(_axes_tuple(axes))
        if result[pos] is _UNASSIGNED and not wanted & taken:
            result[pos] = axes
            taken |= wanted
    return [None if r is _UNASSIGNED else r for r in result]  # type: ignore[misc]


def _drop_trivial_axes(axes: MeshAxes, sizes: dict[str, int]) -> MeshAxes:
    kept = tuple(a for a in _axes_tuple(axes) if sizes.get(a, 1) > 1)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def _mesh_sizes(mesh: Mesh | AbstractMesh) -> dict[str, int]:
    """Axis sizes available for sharding. Inside ``shard_map`` the Manual axes are already split off (each
    device sees its own block), so a spec must not name them: they count as size 1 and are dropped."""
    types = getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names)
    return {
        name: 1 if kind == AxisType.Manual else size
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, types, strict=True)
    }


def unplaced_mesh_message(rules: Rules | str, mesh: Mesh | AbstractMesh) -> str | None:
    """Why ``rules`` can place nothing on ``mesh`` (None when it can, or the mesh has one device).

    A rule set shards only over the mesh axes it names; on a mesh where none of them has size > 1 (e.g. a user's
    own mesh with other axis names) every tensor resolves to replicated, which no error would otherwise reveal.
    """
    sizes = _mesh_sizes(mesh)
    devices = math.prod(sizes.values())
    named = sorted({axis for _, axes in get_rules(rules) for axis in _axes_tuple(axes)})
    if devices <= 1 or any(sizes.get(axis, 1) > 1 for axis in named):
        return None
    which = f"rule set {rules!r}" if isinstance(rules, str) else "the given rule set"
    mesh_axes = {name: size for name, size in sizes.items() if size > 1}
    return (
        f"{which} places nothing on this mesh: its rules name the mesh axes {named}, and none of them has size > 1 "
        f"in the mesh {mesh_axes}, so every tensor is replicated on all {devices} devices. Rules can only name "
        f"the axes {MESH_AXES}: build the mesh with nnx_zoo.sharding.make_mesh, or give your mesh's axes those names."
    )


def logical_to_mesh_axes(
    names: Sequence[str | None],
    rules: Rules | str,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    strict: bool = True,
    shape: Sequence[int] | None = None,
    path: str | None = None,
) -> PartitionSpec:
    """Resolve logical dimension names to a ``PartitionSpec``.

    Without ``mesh`` the result equals ``flax.linen.logical_to_mesh_axes(names, rules)``. With ``mesh``, axes of
    size 1, absent from it, or Manual (inside ``shard_map``) are removed. With ``shape`` (and ``mesh``), every
    sharded dimension must divide evenly. ``rules`` is a named set or a sequence of ``(logical_name, mesh_axes)``
    pairs (checked by ``validate_rules``). ``path`` names the variable in error messages.

    >>> logical_to_mesh_axes(("embed", "mlp"), (("mlp", "tensor"), ("embed", "fsdp")))
    PartitionSpec('fsdp', 'tensor')
    """
    rules = get_rules(rules)
    names = tuple(names)
    _check_names(names, rules, strict, path)
    resolved = _linen_resolve(names, rules)
    if mesh is None:
        if shape is not None:
            raise ShardingError("logical_to_mesh_axes: checking a shape needs the mesh; pass mesh=...")
        return PartitionSpec(*resolved)
    sizes = _mesh_sizes(mesh)
    resolved = [_drop_trivial_axes(axes, sizes) for axes in resolved]
    if shape is not None:
        if len(shape) != len(names):
            raise ShardingError(
                f"{_where(path)}shape {tuple(shape)} has {len(shape)} dims but {len(names)} logical names "
                f"{names}; give one name per dimension"
            )
        for dim, (size, name, axes) in enumerate(zip(shape, names, resolved, strict=True)):
            parts = math.prod(sizes[a] for a in _axes_tuple(axes))
            if size % parts:
                raise ShardingError(
                    f"{_where(path)}dimension {dim} (logical {name!r}, size {size}) cannot be split over mesh axes "
                    f"{_axes_tuple(axes)} ({parts} shards): {size} is not divisible by {parts}. Change the mesh "
                    "sizes, or use a rule set that maps this name to fewer devices."
                )
    return PartitionSpec(*resolved)


def named_sharding(
    names: Sequence[str | None],
    rules: Rules | str,
    mesh: Mesh,
    *,
    strict: bool = True,
    shape: Sequence[int] | None = None,
    path: str | None = None,
) -> NamedSharding:
    """``NamedSharding(mesh, logical_to_mesh_axes(names, rules, mesh, ...))``."""
    return NamedSharding(mesh, logical_to_mesh_axes(names, rules, mesh, strict=strict, shape=shape, path=path))
