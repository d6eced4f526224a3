"""sharding_report: per-Variable rows, totals, table, JSON, and planning on an AbstractMesh without memory."""

from __future__ import annotations

import json
import math
import time

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from nnx_zoo.sharding import (
    ShardingError,
    create_sharded,
    iter_variables,
    logical_to_mesh_axes,
    make_abstract_mesh,
    make_mesh,
    sharding_report,
)
from tests.sharding.sharding_toy_model import EXPECTED, ToyModel

MESH = {"fsdp": 4, "tensor": 2}


@pytest.fixture(scope="module")
def sharded_model():
    return create_sharded(lambda: ToyModel(seed=1), make_mesh(MESH, shard_mode="explicit"), "default")


@pytest.mark.parametrize("source", ["constructor", "real model"])
def test_rows_match_the_arrays_on_a_real_mesh(source, sharded_model):
    mesh = make_mesh(MESH, shard_mode="explicit")
    model = (lambda: ToyModel(seed=1)) if source == "constructor" else sharded_model
    report = sharding_report(model, mesh, "default")
    arrays = {path: var.get_value() for path, var in iter_variables(sharded_model)}
    assert [r.path for r in report.rows] == sorted(EXPECTED)  # every Variable, stable order
    assert report.mesh_shape == dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    for row in report.rows:
        shape, names = EXPECTED[row.path]
        arr = arrays[row.path]
        assert row.kind == "Param" and row.is_param
        assert row.shape == shape
        assert row.names == names
        assert row.dtype == "float32"
        assert row.spec == tuple(logical_to_mesh_axes(names, "default", mesh))
        assert row.spec == tuple(arr.sharding.spec)
        # per-device numbers agree with what the devices really hold
        assert row.per_device_shape == arr.sharding.shard_shape(shape)
        assert row.per_device_shape == arr.addressable_shards[0].data.shape
        assert row.bytes == arr.nbytes == math.prod(shape) * 4
        assert row.bytes_per_device == arr.addressable_shards[0].data.nbytes
        assert row.sharded == (row.per_device_shape != shape)
    spec = {r.path: r.spec for r in report.rows}
    assert spec["mlp_in"] == ("fsdp", "tensor")
    assert spec["layers.wi"] == (None, None, "fsdp", "tensor")
    assert spec["final_norm"] == (None,)


def test_totals(sharded_model):
    report = sharding_report(sharded_model, make_mesh(MESH), "default")
    arrays = [var.get_value() for _, var in iter_variables(sharded_model)]
    n_params = sum(a.size for a in arrays)
    per_device = sum(a.addressable_shards[0].data.nbytes for a in arrays)
    assert report.num_parameters == n_params
    assert report.param_bytes == 4 * n_params
    assert report.param_bytes_per_device == per_device
    assert report.adamw_bytes_per_device == 2 * per_device
    assert report.bytes_per_device == per_device  # only Params in this model
    totals = report.totals()
    assert totals["params_plus_adamw_bytes_per_device"] == 3 * per_device
    assert totals["annotated_fraction"] == 1.0
    replicated = sum(a.nbytes for a in arrays if a.sharding.is_fully_replicated)
    assert totals["sharded_fraction"] == pytest.approx(1 - replicated / report.param_bytes)
    assert 0 < totals["sharded_fraction"] < 1  # the norms are replicated, the matrices are not


def test_table_and_json(tmp_path, sharded_model):
    report = sharding_report(sharded_model, make_mesh(MESH), "default")
    table = report.table()
    for path in EXPECTED:
        assert path in table
    assert "fsdp=4 x tensor=2" in table
    assert f"parameters: {report.num_parameters:,}" in table
    assert "P(fsdp, tensor)" in table  # mlp_in's spec
    out = tmp_path / "report.json"
    report.save_json(out)
    with open(out) as f:
        loaded = json.load(f)
    assert loaded == json.loads(json.dumps(report.to_dict()))
    assert loaded["mesh"] == report.mesh_shape
    assert loaded["totals"]["num_parameters"] == report.num_parameters
    rows = {v["path"]: v for v in loaded["variables"]}
    assert set(rows) == set(EXPECTED)
    assert rows["layers.wi"]["spec"] == [None, None, "fsdp", "tensor"]
    assert rows["embedding"]["names"] == ["vocab", "embed"]
    assert rows["embedding"]["bytes_per_device"] == report.rows[0].bytes_per_device


def test_non_param_variables_keys_and_param_subclasses():
    """RNG keys (Dropout) have an extended dtype; a LoRAParam is a Param (it gets AdamW state); counters are not."""

    class Mixed(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.w = nnx.Param(jnp.zeros((16, 8)), out_sharding=("embed", "mlp"), eager_sharding=False)
            self.lora = nnx.LoRAParam(jnp.zeros((16, 4)), out_sharding=("embed", "lora_rank"), eager_sharding=False)
            self.stat = nnx.BatchStat(jnp.zeros((8,), jnp.bfloat16))
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    report = sharding_report(lambda: Mixed(nnx.Rngs(0)), make_abstract_mesh({"fsdp": 8}), "default")
    rows = {r.path: r for r in report.rows}
    assert set(rows) == {"w", "lora", "stat", "drop.rngs.key", "drop.rngs.count"}
    assert rows["lora"].kind == "LoRAParam" and rows["lora"].is_param
    assert not rows["stat"].is_param and not rows["drop.rngs.key"].is_param
    assert rows["stat"].bytes == 16 and rows["stat"].dtype == "bfloat16"
    assert rows["drop.rngs.key"].bytes == jax.random.key(0).dtype.itemsize  # a threefry key: 2 x uint32
    assert rows["w"].bytes_per_device == 16 * 8 * 4 // 8
    assert rows["lora"].bytes_per_device == 16 * 4 * 4 // 8
    assert report.num_parameters == 16 * 8 + 16 * 4
    assert report.adamw_bytes_per_device == 2 * (16 + 8) * 4
    assert report.bytes_per_device == report.param_bytes_per_device + 16 + rows["drop.rngs.key"].bytes + 4
    assert "drop.rngs.key" in report.table()


class Huge(nnx.Module):
    """400 GB of float32 weights: only ever built abstractly."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.table = nnx.Param(init(rngs.params(), (1_000_000, 100_000)), out_sharding=("embed", "mlp"))
        self.norm = nnx.Param(jnp.ones((100_000,)), out_sharding=("norm",), eager_sharding=False)


def test_report_on_512_devices_without_allocating():
    mesh = make_abstract_mesh({"fsdp": 64, "tensor": 8})
    assert mesh.size == 512 > jax.device_count()
    start = time.perf_counter()
    report = sharding_report(lambda: Huge(nnx.Rngs(0)), mesh, "default")
    assert time.perf_counter() - start < 30  # shapes only: writing 400 GB would take far longer, or fail
    rows = {r.path: r for r in report.rows}
    assert rows["table"].spec == ("fsdp", "tensor")
    assert rows["table"].per_device_shape == (1_000_000 // 64, 100_000 // 8)
    assert rows["table"].bytes == 400_000_000_000
    assert rows["table"].bytes_per_device == 400_000_000_000 // 512
    assert rows["norm"].per_device_shape == (100_000,)
    assert report.num_parameters == 100_000_100_000
    assert report.param_bytes_per_device == 400_000_000_000 // 512 + 400_000
    assert report.adamw_bytes_per_device == 2 * report.param_bytes_per_device
    assert "GiB" in report.table()


def test_report_on_an_abstract_module_and_divisibility_errors():
    with nnx.use_eager_sharding(False):  # (eager sharding would need a mesh, and would use Flax's dict rules)
        model = nnx.eval_shape(lambda: Huge(nnx.Rngs(0)))
    assert isinstance(model.table.get_value(), jax.ShapeDtypeStruct)
    report = sharding_report(model, make_abstract_mesh({"fsdp": 16, "expert": 4, "tensor": 8}), "default")
    assert {r.path: r.spec for r in report.rows}["table"] == (("fsdp", "expert"), "tensor")
    with pytest.raises(ShardingError, match=r"table: dimension 0 \(logical 'embed', size 1000000\)"):
        sharding_report(model, make_abstract_mesh({"fsdp": 512}), "default", allow_partial=False)
    # By default the report plans instead: 512 does not divide 10**6 and neither does any prefix of (fsdp,), so
    # the table is replicated, and the footer says so with the bytes it costs each device.
    report = sharding_report(model, make_abstract_mesh({"fsdp": 512}), "default")
    table = {r.path: r for r in report.rows}["table"]
    assert table.spec == (None, None)
    assert [(f.path, f.dim, f.name, f.wanted, f.placed) for f in report.fallbacks] == [
        ("table", 0, "embed", ("fsdp",), ())]
    assert table.fallback_bytes_per_device == 400_000_000_000 - 400_000_000_000 // 512
    assert report.totals()["fallback_bytes_per_device"] == table.fallback_bytes_per_device
    assert "'embed' (size 1000000) does not divide over fsdp (512 shards): placed on no axis" in report.table()
