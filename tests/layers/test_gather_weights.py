"""gather_weight_fsdp_axes: a weight loses its FSDP axes (the mesh axes of activation_tokens) and keeps the rest,
experts staying on their EP axes; the values are untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nnx_zoo.layers.spec import gather_weight_fsdp_axes
from nnx_zoo.sharding import logical_to_mesh_axes, make_mesh, use_rules

NAMES = ("exp", "embed_no_exp", "moe_mlp")


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_expert_weight_keeps_expert_and_drops_fsdp(mode):
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode=mode)
    w = np.arange(4 * 16 * 8, dtype=np.float32).reshape(4, 16, 8)
    stored = logical_to_mesh_axes(NAMES, "default", mesh, shape=w.shape)
    assert stored == PartitionSpec("expert", "fsdp", None), stored  # the layout this test starts from
    with jax.set_mesh(mesh), use_rules("default"):
        placed = jax.device_put(w, NamedSharding(mesh, stored))
        gathered = jax.jit(lambda a: gather_weight_fsdp_axes(a, NAMES))(placed)
    np.testing.assert_array_equal(np.asarray(gathered), w)
    parts = tuple(gathered.sharding.spec.partitions)
    assert parts + (None,) * (3 - len(parts)) == ("expert", None, None)
    # Explicit: marked reduced over the gathered token axis, so every use's gradient is summed before one
    # reduction (tests/sharding/test_no_involuntary_remat.py counts them).
    assert gathered.sharding.spec.reduced == (frozenset({"fsdp"}) if mode == "explicit" else frozenset())


def test_without_a_mesh_the_weight_is_returned_as_is():
    w = jnp.ones((4, 16, 8))
    assert gather_weight_fsdp_axes(w, NAMES) is w


@pytest.mark.parametrize(("start", "end", "most_kib"), [
    # tensor_transpose moves from the input dim to the output dim, fsdp leaves: move, then gather. The least a
    # device can receive is its [128, 192] block minus the 16 x 192 it holds: 84 KiB. Gathering both axes first
    # and slicing (the old way) received 168 KiB.
    ((("fsdp", "tensor_transpose"), None), (None, "tensor_transpose"), 84),
    # A pure move is one all-to-all: half of what a device holds, 48 KiB (was: gathered whole, 96 KiB).
    ((None, "tensor_transpose", None), (None, None, "tensor_transpose"), 48),
])
def test_reshard_in_steps_moves_before_it_gathers(start, end, most_kib):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import compiled_programs as cp

    from nnx_zoo.layers.spec import reshard_in_steps

    mesh = make_mesh({"fsdp": 4, "tensor_transpose": 2}, shard_mode="explicit")
    shape = (128, 384) if len(start) == 2 else (2, 128, 192)
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    with jax.set_mesh(mesh):
        placed = jax.device_put(w, NamedSharding(mesh, PartitionSpec(*start)))
        move = jax.jit(lambda a: reshard_in_steps(a, PartitionSpec(*end)))
        with cp.captured_stderr() as err:
            hlo = move.lower(placed).compile().as_text()
        moved = move(placed)
    np.testing.assert_array_equal(np.asarray(moved), w)
    assert moved.sharding.spec == PartitionSpec(*end)
    assert not cp.remat_warnings(err[0])
    assert sum(cp.collective_bytes(hlo, 8).values()) / 1024 <= most_kib
