"""make_mesh / make_abstract_mesh / shard_mode_of, and XLA:CPU's collective workers."""

from __future__ import annotations

import os
import warnings

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh

from nnx_zoo.sharding import (
    MESH_AXES,
    make_abstract_mesh,
    make_mesh,
    parse_mesh,
    reserve_cpu_workers,
    shard_mode_of,
    xla_cpu_workers,
)
from nnx_zoo.sharding.mesh import warn_if_few_cpu_workers

ORDER = ("stage", "data", "fsdp", "fsdp_transpose", "context", "tensor", "tensor_transpose", "expert")


def _sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def test_axis_order_is_the_design_order():
    assert MESH_AXES == ORDER
    mesh = make_mesh({"expert": 2, "fsdp": 4})
    assert isinstance(mesh, Mesh)
    assert tuple(mesh.axis_names) == ORDER
    assert _sizes(mesh) == {"stage": 1, "data": 1, "fsdp": 4, "fsdp_transpose": 1, "context": 1, "tensor": 1,
                            "tensor_transpose": 1, "expert": 2}
    assert mesh.devices.size == 8 and {d.id for d in mesh.devices.flat} == {d.id for d in jax.devices()}


@pytest.mark.parametrize(
    "sizes, expected",
    [
        ({"fsdp": -1}, {"fsdp": 8}),
        ({"fsdp": -1, "tensor": 2}, {"fsdp": 4, "tensor": 2}),
        ({"data": 2, "expert": -1, "context": 2}, {"data": 2, "context": 2, "expert": 2}),
        ({"tensor_transpose": -1, "fsdp": 8}, {"fsdp": 8, "tensor_transpose": 1}),
    ],
)
def test_minus_one_fills_the_rest(sizes, expected):
    got = _sizes(make_mesh(sizes))
    assert {k: v for k, v in got.items() if v > 1} == {k: v for k, v in expected.items() if v > 1}
    for name, size in expected.items():
        assert got[name] == size


def test_devices_argument():
    devices = jax.devices()[:4]
    mesh = make_mesh({"fsdp": -1}, devices=devices)
    assert _sizes(mesh)["fsdp"] == 4
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}


def test_sizes_must_multiply_to_the_device_count():
    with pytest.raises(ValueError) as info:
        make_mesh({"fsdp": 4})
    msg = str(info.value)
    assert "4 positions" in msg and "8 devices" in msg and "-1" in msg
    with pytest.raises(ValueError, match="multiply to 8"):
        make_mesh({"fsdp": 4, "tensor": 4})
    with pytest.raises(ValueError, match="multiply to 3, which does not divide the 8 devices"):
        make_mesh({"fsdp": -1, "tensor": 3})


def test_unknown_axis_name():
    with pytest.raises(ValueError) as info:
        make_mesh({"fsdp": 4, "model": 2})
    msg = str(info.value)
    assert "unknown mesh axis 'model'" in msg and "'tensor'" in msg  # names the bad one and lists the good ones


def test_only_one_minus_one():
    with pytest.raises(ValueError, match=r"only one mesh axis may be -1.*\['fsdp', 'tensor'\]"):
        make_mesh({"fsdp": -1, "tensor": -1})


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2"])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="mesh axis sizes must be positive integers"):
        make_mesh({"fsdp": bad, "tensor": 2})


def test_bad_shard_mode():
    with pytest.raises(ValueError, match="shard_mode must be 'auto' or 'explicit', got 'manual'"):
        make_mesh({"fsdp": 8}, shard_mode="manual")
    with pytest.raises(ValueError, match="shard_mode must be"):
        make_abstract_mesh({"fsdp": 8}, shard_mode="Explicit")


@pytest.mark.parametrize("mode, axis_type", [("auto", AxisType.Auto), ("explicit", AxisType.Explicit)])
def test_shard_mode_sets_every_axis_type_and_reads_back(mode, axis_type):
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode=mode)
    assert tuple(mesh.axis_types) == (axis_type,) * len(ORDER)
    assert shard_mode_of(mesh) == mode
    assert shard_mode_of(mesh.abstract_mesh) == mode
    abstract = make_abstract_mesh({"fsdp": 4, "expert": 2}, shard_mode=mode)
    assert tuple(abstract.axis_types) == (axis_type,) * len(ORDER)
    assert shard_mode_of(abstract) == mode


def test_default_shard_mode_is_auto():
    assert shard_mode_of(make_mesh({"fsdp": 8})) == "auto"


def test_shard_mode_of_a_mixed_mesh_errors():
    mixed = AbstractMesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto, AxisType.Explicit))
    with pytest.raises(ValueError, match="mix kinds"):
        shard_mode_of(mixed)


def test_shard_mode_of_ignores_manual_axes():
    """Inside shard_map the mapped axes turn Manual; the mode is that of the axes still free."""
    m = AbstractMesh((2, 4), ("expert", "fsdp"), axis_types=(AxisType.Manual, AxisType.Explicit))
    assert shard_mode_of(m) == "explicit"
    m = AbstractMesh((2, 4), ("expert", "fsdp"), axis_types=(AxisType.Manual, AxisType.Auto))
    assert shard_mode_of(m) == "auto"


def test_abstract_mesh_for_512_devices():
    mesh = make_abstract_mesh({"data": 2, "fsdp": 32, "expert": 8}, shard_mode="explicit")
    assert isinstance(mesh, AbstractMesh)
    assert tuple(mesh.axis_names) == ORDER
    assert mesh.size == 512
    assert _sizes(mesh) == {"stage": 1, "data": 2, "fsdp": 32, "fsdp_transpose": 1, "context": 1, "tensor": 1,
                            "tensor_transpose": 1, "expert": 8}
    assert shard_mode_of(mesh) == "explicit"


def test_abstract_mesh_cannot_fill_minus_one():
    with pytest.raises(ValueError, match="device count is unknown"):
        make_abstract_mesh({"fsdp": -1})


def test_parse_mesh():
    assert parse_mesh("fsdp=4, expert=2") == {"fsdp": 4, "expert": 2}
    assert parse_mesh("fsdp=-1") == {"fsdp": -1}
    with pytest.raises(ValueError, match=r"mesh axis 'fsdp' is given twice in 'fsdp=2,fsdp=8' \(fsdp=2 and fsdp=8\)"):
        parse_mesh("fsdp=2,fsdp=8")
    for bad in ("fsdp", "fsdp=four", "=4"):
        with pytest.raises(ValueError, match=r"must look like axis=size"):
            parse_mesh(bad)


def test_xla_cpu_workers_reads_the_environment_as_xla_does(monkeypatch):
    """The rule mirrors XLA's own: this process (conftest's reserve_cpu_workers: PJRT_NPROC=32 for its 8 devices)
    runs that many XLA:CPU worker threads (Linux names them), and the variables override in XLA's order."""
    assert xla_cpu_workers(8) == 32
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    assert names.count("tf_XLAEigen") == 32, names
    monkeypatch.setenv("PJRT_NPROC", "3")
    assert xla_cpu_workers(8) == 8 and xla_cpu_workers(2) == 3  # never fewer workers than devices
    monkeypatch.delenv("PJRT_NPROC")
    monkeypatch.setenv("NPROC", "12")
    assert xla_cpu_workers(8) == 12
    monkeypatch.setenv("NPROC", "")  # unset-like: the cores
    assert xla_cpu_workers(1) == len(os.sched_getaffinity(0))


def test_reserve_cpu_workers_sets_four_per_device_unless_set(monkeypatch):
    for name in ("PJRT_NPROC", "NPROC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_force_host_platform_device_count=6")
    assert reserve_cpu_workers() == 24 and os.environ["PJRT_NPROC"] == "24"  # the last flag wins, as in XLA
    monkeypatch.setenv("PJRT_NPROC", "10")
    assert reserve_cpu_workers() == 10 and os.environ["PJRT_NPROC"] == "10"  # the user's choice is kept
    monkeypatch.delenv("PJRT_NPROC")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert reserve_cpu_workers() >= 1 and "PJRT_NPROC" not in os.environ  # one device: nothing to reserve


def test_few_cpu_workers_warn_with_the_fix(monkeypatch):
    monkeypatch.setenv("PJRT_NPROC", "8")
    with pytest.warns(RuntimeWarning, match=r"8 devices share 8 collective workers.*PJRT_NPROC=32"):
        warn_if_few_cpu_workers("a pipelined 1F1B step")
    monkeypatch.setenv("PJRT_NPROC", "32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_few_cpu_workers("a pipelined 1F1B step")
