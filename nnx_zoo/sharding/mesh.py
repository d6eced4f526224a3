"""Building meshes from a mapping of axis sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from nnx_zoo.sharding.axes import MESH_AXES

ShardMode = Literal["auto", "explicit"]
_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def _axis_type(shard_mode: str) -> AxisType:
    try:
        return _AXIS_TYPES[shard_mode]
    except KeyError:
        raise ValueError(f"shard_mode must be 'auto' or 'explicit', got {shard_mode!r}") from None


def resolve_sizes(sizes: Mapping[str, int], num_devices: int | None) -> tuple[int, ...]:
    """Sizes of all mesh axes, in ``MESH_AXES`` order, with the one ``-1`` filled in from ``num_devices``."""
    unknown = [name for name in sizes if name not in MESH_AXES]
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown[0]!r} in {dict(sizes)}; mesh axes are {MESH_AXES}")
    bad = {n: s for n, s in sizes.items() if not isinstance(s, (int, np.integer)) or (s < 1 and s != -1)}
    if bad:
        raise ValueError(f"mesh axis sizes must be positive integers (or one -1 for 'the rest'), got {bad}")
    fill = [n for n, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"only one mesh axis may be -1 ('the rest'); got -1 for {fill}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices is None:
            raise ValueError(f"axis {fill[0]!r} is -1 but the device count is unknown; give every size explicitly")
        if num_devices % known:
            raise ValueError(
                f"mesh {dict(sizes)}: the other axes multiply to {known}, which does not divide the {num_devices} "
                f"devices, so {fill[0]!r} cannot take 'the rest'"
            )
        sizes = {**sizes, fill[0]: num_devices // known}
    total = math.prod(sizes.values())
    if num_devices is not None and total != num_devices:
        raise ValueError(
            f"mesh {dict(sizes)} has {total} positions but there are {num_devices} devices; make the sizes "
            f"multiply to {num_devices} (or set one axis to -1 to take the rest)"
        )
    return tuple(int(sizes.get(name, 1)) for name in MESH_AXES)


def make_mesh(
    sizes: Mapping[str, int], *, shard_mode: ShardMode = "auto", devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A mesh over all of ``MESH_AXES`` (unnamed axes have size 1), every axis of one type.

    >>> mesh = make_mesh({"fsdp": -1}, shard_mode="explicit")  # all devices on fsdp
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_sizes(sizes, len(devices))
    axis_type = _axis_type(shard_mode)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(axis_type,) * len(MESH_AXES), devices=devices)


def make_abstract_mesh(sizes: Mapping[str, int], *, shard_mode: ShardMode = "auto") -> AbstractMesh:
    """A device-less mesh of any size, for planning (sharding reports of models larger than this machine)."""
    shape = resolve_sizes(sizes, None)
    axis_type = _axis_type(shard_mode)
    return AbstractMesh(shape, MESH_AXES, axis_types=(axis_type,) * len(MESH_AXES))


def shard_mode_of(mesh: Mesh | AbstractMesh) -> ShardMode:
    """'explicit' or 'auto', read from the mesh's axis types (a mix of Auto and Explicit is an error).

    Manual axes (those a ``shard_map`` has taken over) are ignored: the mode is that of the axes still free to
    shard over. With none free (or no axes) it is 'auto', since then array types carry no sharding.
    """
    types = {t for t in mesh.axis_types if t != AxisType.Manual}
    if types == {AxisType.Explicit}:
        return "explicit"
    if types <= {AxisType.Auto}:
        return "auto"
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    raise ValueError(
        f"mesh axis types {kinds} mix kinds; nnx_zoo needs all axes Auto or all Explicit (build the mesh with "
        "nnx_zoo.sharding.make_mesh)"
    )


def parse_mesh(text: str) -> dict[str, int]:
    """The recipes' ``--mesh`` syntax: ``'fsdp=4,expert=2'`` -> ``{'fsdp': 4, 'expert': 2}``.

    An axis given twice is an error: silently keeping one of the sizes would train on a mesh the user did not ask
    for. Axis names and sizes are checked later, by ``make_mesh``.
    """
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = (s.strip() for s in part.partition("="))
        try:
            size = int(value)
        except ValueError:
            size = None
        if not sep or not name or size is None:
            raise ValueError(f"mesh entry {part!r} must look like axis=size, e.g. fsdp=4")
        if name in sizes:
            raise ValueError(
                f"mesh axis {name!r} is given twice in {text!r} ({name}={sizes[name]} and {name}={size}); give each "
                "axis once, e.g. fsdp=8"
            )
        sizes[name] = size
    return sizes
