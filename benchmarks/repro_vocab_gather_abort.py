"""Minimal reproduction (not a benchmark, not run by the tests): XLA:CPU's SPMD partitioner aborts the process on a
gather from a table split over two mesh axes inside a ``shard_map`` over a third, when the rows are laid out over
one of them.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/repro_vocab_gather_abort.py

jax / jaxlib 0.10.2 (2026-11-27): ``F... spmd_partitioner_util.cc:497] Check failed:
partition_group_list.num_replica_groups() * partition_group_list.num_devices_per_group() ==
device_groups.num_devices_per_group()`` in ``ExpandDeviceGroupsWithIota`` (from ``PartitionGather`` ->
``PartitionGatherTrivialSlicedOperandDimensions`` -> ``Reshard``). Pass ``--no-constraint`` (the rows left to the
partitioner) and it compiles. This is the embedding lookup of DeepSeek-V3's MTP tokens inside the 1F1B /
interleaved pipeline (table ``vocab -> tensor``, ``embed -> fsdp``, rows ``batch -> fsdp``); under Explicit axes the
model's train step aborted in the same check on the lookup's transpose (a scatter). ``nnx_zoo.layers.embed`` works
around it inside any manual region by looking rows up per vocab shard (``_vocab_parallel_rows``).
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((2, 2, 2), ("stage", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
constrain = "--no-constraint" not in sys.argv


def per_stage(table: jax.Array, ids: jax.Array) -> jax.Array:
    rows = table.at[ids].get(mode="clip")
    if constrain:
        rows = jax.lax.with_sharding_constraint(rows, P("fsdp"))
    return jax.lax.psum(jnp.sum(rows), "stage")


def f(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jax.shard_map(per_stage, in_specs=(P(), P()), out_specs=P(), axis_names={"stage"})(table, ids)


with jax.set_mesh(mesh):
    table = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("tensor", "fsdp")))
    jax.jit(f).lower(table, jnp.zeros((4, 6), jnp.int32)).compile()
    print("compiled")
