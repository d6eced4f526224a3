"""Building meshes from a mapping of axis sizes."""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from nnx_zoo.sharding.axes import MESH_AXES

ShardMode = Literal["auto", "explicit"]
_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


# XLA:CPU (jaxlib 0.10.2, measured) runs every local device's collectives on one worker pool of max(PJRT_NPROC, or
# NPROC, or the cores; the local devices) threads, and a collective holds its worker until its whole group arrives.
# When each device has several independent collectives ready at once (a pipeline tick's FSDP gathers, its forward
# and backward stage permutes), waiters can fill the pool while a collective they wait for sits queued with no
# worker to run it: after 40 s the rendezvous aborts the process ("Termination timeout ... Exiting"). With one
# worker per device (the default on a small machine with fake devices) the 1F1B cases of stage 2 x fsdp 4 and stage
# 2 x tensor 2 x fsdp 2 aborted in 7 of 24 runs; with four, in none of 24, nor in two runs of the whole pipeline
# full matrix (273 cases each).
CPU_WORKERS_PER_DEVICE = 4


def xla_cpu_workers(devices: int) -> int:
    """The number of worker threads XLA:CPU gives ``devices`` local devices, read from the environment as XLA does
    (``PJRT_NPROC``, else ``NPROC``, else the cores this process may run on; never fewer than ``devices``)."""
    for name in ("PJRT_NPROC", "NPROC"):
        try:
            return max(int(os.environ.get(name, "")), devices)
        except ValueError:
            continue
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(cores, devices)


def _forced_cpu_devices() -> int:
    """How many CPU devices this process will have: ``jax_num_cpu_devices``, else XLA_FLAGS' last
    ``--xla_force_host_platform_device_count``, else 1."""
    if jax.config.jax_num_cpu_devices > 0:
        return jax.config.jax_num_cpu_devices
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(counts[-1]) if counts else 1


def reserve_cpu_workers() -> int:
    """Give XLA:CPU ``CPU_WORKERS_PER_DEVICE`` workers per device (``PJRT_NPROC``) when this process will have
    several CPU devices and neither ``PJRT_NPROC`` nor ``NPROC`` is set; returns the pool size it will have.

    Call it before JAX first touches a device (XLA reads the variable when it creates the CPU client): the recipes
    and the test suite do. A process that already set either variable keeps it.

    >>> os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    >>> reserve_cpu_workers()  # sets PJRT_NPROC=32
    32
    """
    devices = _forced_cpu_devices()
    if devices > 1 and not any(os.environ.get(name, "").strip() for name in ("PJRT_NPROC", "NPROC")):
        os.environ["PJRT_NPROC"] = str(CPU_WORKERS_PER_DEVICE * devices)
    return xla_cpu_workers(devices)


def warn_if_few_cpu_workers(what: str) -> None:
    """Warn, on the CPU backend with several local devices, when XLA:CPU's worker pool has fewer than
    ``CPU_WORKERS_PER_DEVICE`` workers per device, before ``what`` (a program whose devices hold several
    collectives at once) can abort the process in a rendezvous timeout."""
    devices = jax.local_device_count()
    if jax.default_backend() != "cpu" or devices == 1:
        return
    workers = xla_cpu_workers(devices)
    if workers < CPU_WORKERS_PER_DEVICE * devices:
        warnings.warn(
            f"{what} on XLA:CPU: {devices} devices share {workers} collective workers, and a device waiting in "
            "several collectives at once can leave none to run the one they wait for (the process aborts after a "
            f"40 s rendezvous timeout); set PJRT_NPROC={CPU_WORKERS_PER_DEVICE * devices} in the environment "
            "before JAX starts (nnx_zoo.sharding.reserve_cpu_workers() does it; the recipes call it)",
            RuntimeWarning, stacklevel=3)


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
