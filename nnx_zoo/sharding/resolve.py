"""THE resolver: logical axis names -> PartitionSpec.

Semantics are exactly those of ``flax.linen.logical_to_mesh_axes``: rules are visited in order; a rule for a
name in the array applies when that dimension is still unassigned and none of the rule's mesh axes is already
bound to another dimension of the array (otherwise the next rule for that name is tried). Then, with a mesh,
mesh axes of size 1 (or absent from the mesh) are removed, and, with a shape, each sharded dimension is checked
to divide evenly.

Strict divisibility is the default: a dimension that its rule's mesh axes do not divide is an error naming the
variable. With ``allow_partial=True`` (what the sharding report and the memory plan use, and what
``create_sharded(..., allow_partial=True)`` opts into) a rule whose mesh axes do not divide the dimension is
placed on the **longest prefix** of its (size > 1) mesh axes that does divide it; the dropped axes stay free for
the array's later rules (so ``exp -> (expert, fsdp)`` falling back to ``expert`` lets ``embed_no_exp`` take
``fsdp``). A rule whose every prefix fails binds nothing, and the next rule for that name is tried. Every such
placement is returned as a ``Fallback`` by ``resolve`` (the report lists them with the bytes they replicate);
when every dimension divides, the result equals the strict one. Unknown logical names stay an error either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypedDict, Unpack

from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from nnx_zoo.sharding.axes import MESH_AXES, STACK_AXES, is_known
from nnx_zoo.sharding.rules import MeshAxes, Rules, expand_rules, get_rules


class ShardingError(ValueError):
    """A logical name, rule set, mesh or shape that cannot be resolved; the message says how to fix it."""


_UNASSIGNED = object()


def axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
    """One entry of a ``PartitionSpec`` (a mesh axis, a tuple of them, or None) as a tuple of mesh axes.

    >>> axes_tuple("fsdp"), axes_tuple(("fsdp", "expert")), axes_tuple(None)
    (('fsdp',), ('fsdp', 'expert'), ())
    """
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
        unknown = [n for n in names if n is not None and not is_known(n) and all(n != r for r, _ in rules)]
        if unknown:
            raise ShardingError(
                f"{_where(path)}unknown logical axis name {unknown[0]!r} in {tuple(names)}: it is neither in the "
                "shared vocabulary (nnx_zoo/sharding/axes.py), nor declared by a model family "
                "(nnx_zoo.sharding.declare_axis), nor mentioned by the rule set. Fix the spelling, declare it in "
                "your family's folder with declare_axis(name, like=<shared name>, doc=...), add a rule for it, or "
                "pass strict=False to replicate unknown names."
            )


def _linen_resolve(
    names: Sequence[str | None], rules: Rules, partial: tuple[Sequence[int], dict[str, int]] | None = None
) -> list[MeshAxes]:
    """Flax Linen's first-match-wins resolution, with already-bound mesh axes skipping a rule.

    ``partial = (shape, mesh sizes)`` turns on the divisibility fallback of the module docstring.
    """
    result: list[object] = [_UNASSIGNED if isinstance(n, str) else None for n in names]
    taken: set[str] = set()
    for logical, axes in rules:
        if logical not in names:
            continue
        pos = list(names).index(logical)
        wanted = set(axes_tuple(axes))
        if result[pos] is not _UNASSIGNED or wanted & taken:
            continue
        if partial is not None:
            shape, sizes = partial
            real = tuple(a for a in axes_tuple(axes) if sizes.get(a, 1) > 1)
            placed = _dividing_prefix(shape[pos], real, sizes)
            if placed != real:
                if not placed:
                    continue  # nothing of this rule divides: try the next rule for the name
                wanted -= set(real) - set(placed)  # the dropped axes stay free for later rules
                axes = placed
        result[pos] = axes
        taken |= wanted
    return [None if r is _UNASSIGNED else r for r in result]  # type: ignore[misc]


def _dividing_prefix(size: int, axes: tuple[str, ...], sizes: dict[str, int]) -> tuple[str, ...]:
    """The longest prefix of ``axes`` whose sizes multiply to a divisor of ``size``."""
    parts, n = 1, 0
    for axis in axes:
        if size % (parts * sizes[axis]):
            break
        parts *= sizes[axis]
        n += 1
    return axes[:n]


def _drop_trivial_axes(axes: MeshAxes, sizes: dict[str, int]) -> MeshAxes:
    kept = tuple(a for a in axes_tuple(axes) if sizes.get(a, 1) > 1)
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
    named = sorted({axis for _, axes in get_rules(rules) for axis in axes_tuple(axes)})
    if devices <= 1 or any(sizes.get(axis, 1) > 1 for axis in named):
        return None
    which = f"rule set {rules!r}" if isinstance(rules, str) else "the given rule set"
    mesh_axes = {name: size for name, size in sizes.items() if size > 1}
    return (
        f"{which} places nothing on this mesh: its rules name the mesh axes {named}, and none of them has size > 1 "
        f"in the mesh {mesh_axes}, so every tensor is replicated on all {devices} devices. Rules can only name "
        f"the axes {MESH_AXES}: build the mesh with nnx_zoo.sharding.make_mesh, or give your mesh's axes those names."
    )


class ResolveOptions(TypedDict, total=False):
    """The keyword options of ``resolve`` (and of every function that passes them on to it)."""

    strict: bool
    shape: Sequence[int] | None
    path: str | None
    allow_partial: bool


@dataclasses.dataclass(frozen=True)
class Fallback:
    """One dimension that its rule's mesh axes do not divide, placed on a dividing prefix instead.

    ``wanted``: the mesh axes strict resolution gives the dimension (size > 1 only); ``placed``: the axes it got.
    The array is then replicated ``shards_lost`` times more over the axes it lost, unless a later dimension of the
    same array took them (the report compares per-device bytes with the ideal).
    """

    path: str | None
    dim: int
    name: str
    size: int
    wanted: tuple[str, ...]
    placed: tuple[str, ...]
    wanted_shards: int
    placed_shards: int

    def __str__(self) -> str:
        return (f"{_where(self.path)}dimension {self.dim} (logical {self.name!r}, size {self.size}) does not divide "
                f"over {self.wanted} ({self.wanted_shards} shards); placed on {self.placed or 'no axis'} "
                f"({self.placed_shards} shards)")


@dataclasses.dataclass(frozen=True)
class Resolution:
    """``resolve``'s answer: the spec and the dimensions that fell back (empty when everything divides)."""

    spec: PartitionSpec
    fallbacks: tuple[Fallback, ...] = ()
    wanted_shards: int = 1  # how many pieces strict resolution would cut the array into (shape given)


def resolve(
    names: Sequence[str | None],
    rules: Rules | str,
    mesh: Mesh | AbstractMesh | None = None,
    *,
    strict: bool = True,
    shape: Sequence[int] | None = None,
    path: str | None = None,
    allow_partial: bool = False,
) -> Resolution:
    """``logical_to_mesh_axes`` that also returns the divisibility fallbacks it took (``allow_partial=True``).

    >>> mesh = make_abstract_mesh({"fsdp": 256, "expert": 8})
    >>> r = resolve(("embed", "mlp"), "default", mesh, shape=(7168, 18432), allow_partial=True)
    >>> r.spec, r.fallbacks[0].placed
    (PartitionSpec('fsdp', None), ('fsdp',))
    """
    rules = expand_rules(get_rules(rules))
    names = tuple(names)
    _check_names(names, rules, strict, path)
    resolved = _linen_resolve(names, rules)
    if mesh is None:
        if shape is not None:
            raise ShardingError("logical_to_mesh_axes: checking a shape needs the mesh; pass mesh=...")
        return Resolution(PartitionSpec(*resolved))
    sizes = _mesh_sizes(mesh)
    resolved = [_drop_trivial_axes(axes, sizes) for axes in resolved]
    if shape is None:
        return Resolution(PartitionSpec(*resolved))
    if len(shape) != len(names):
        raise ShardingError(
            f"{_where(path)}shape {tuple(shape)} has {len(shape)} dims but {len(names)} logical names "
            f"{names}; give one name per dimension"
        )
    shards = [math.prod(sizes[a] for a in axes_tuple(axes)) for axes in resolved]
    bad = [dim for dim, (size, parts) in enumerate(zip(shape, shards, strict=True)) if size % parts]
    if not bad:
        return Resolution(PartitionSpec(*resolved), wanted_shards=math.prod(shards))
    if not allow_partial:
        dim = bad[0]
        if names[dim] in STACK_AXES and "stage" in axes_tuple(resolved[dim]):
            fits = [n for n in range(1, shape[dim] + 1) if shape[dim] % n == 0]
            raise ShardingError(
                f"{_where(path)}the {shape[dim]} layers of this stack (logical {names[dim]!r}) do not split into "
                f"{shards[dim]} pipeline stages (mesh axes {axes_tuple(resolved[dim])}): every stage holds the same "
                f"number of layers. Use a 'stage' mesh size that divides {shape[dim]} (one of {fits}), or a layer "
                f"count that is a multiple of {shards[dim]}"
                + (f", or pipeline only the model's last layers: --model.pipeline_layers with a multiple of "
                   f"{shards[dim]} (e.g. {shape[dim] - shape[dim] % shards[dim]}; the layers before them run "
                   "before the pipeline, whole on every stage)" if shape[dim] > shards[dim] else "") + "."
            )
        raise ShardingError(
            f"{_where(path)}dimension {dim} (logical {names[dim]!r}, size {shape[dim]}) cannot be split over mesh "
            f"axes {axes_tuple(resolved[dim])} ({shards[dim]} shards): {shape[dim]} is not divisible by "
            f"{shards[dim]}. Change the mesh sizes, use a rule set that maps this name to fewer devices, or pass "
            "allow_partial=True to place it on the longest prefix of those axes that divides it (the sharding "
            "report and --plan do, and list what they replicated)."
        )
    partial = [_drop_trivial_axes(a, sizes) for a in _linen_resolve(names, rules, (tuple(shape), sizes))]
    fallbacks = tuple(
        Fallback(path=path, dim=dim, name=names[dim], size=shape[dim], wanted=axes_tuple(resolved[dim]),
                 placed=axes_tuple(partial[dim]), wanted_shards=shards[dim],
                 placed_shards=math.prod(sizes[a] for a in axes_tuple(partial[dim])))
        for dim in bad
    )
    return Resolution(PartitionSpec(*partial), fallbacks, math.prod(shards))


def logical_to_mesh_axes(
    names: Sequence[str | None],
    rules: Rules | str,
    mesh: Mesh | AbstractMesh | None = None,
    **options: Unpack[ResolveOptions],
) -> PartitionSpec:
    """Resolve logical dimension names to a ``PartitionSpec`` (``resolve``'s spec; same keyword options).

    Without ``mesh`` the result equals ``flax.linen.logical_to_mesh_axes(names, rules)`` (family-declared names
    placed by ``expand_rules``). With ``mesh``, axes of size 1, absent from it, or Manual (inside ``shard_map``)
    are removed. With ``shape`` (and ``mesh``), every sharded dimension must divide evenly (a ``ShardingError``
    otherwise), or, with ``allow_partial=True``, a dimension that does not is placed on the longest dividing
    prefix of its rule's axes (module docstring; ``resolve`` also returns what fell back). ``rules`` is a named
    set or a sequence of ``(logical_name, mesh_axes)`` pairs (checked by ``validate_rules``). ``path`` names the
    variable in error messages; ``strict=False`` replicates unknown names instead of rejecting them.

    >>> logical_to_mesh_axes(("embed", "mlp"), (("mlp", "tensor"), ("embed", "fsdp")))
    PartitionSpec('fsdp', 'tensor')
    """
    return resolve(names, rules, mesh, **options).spec


def named_sharding(
    names: Sequence[str | None], rules: Rules | str, mesh: Mesh, **options: Unpack[ResolveOptions]
) -> NamedSharding:
    """``NamedSharding(mesh, logical_to_mesh_axes(names, rules, mesh, **options))``."""
    return NamedSharding(mesh, logical_to_mesh_axes(names, rules, mesh, **options))
