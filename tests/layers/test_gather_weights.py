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
    assert tuple(gathered.sharding.spec) + (None,) * (3 - len(gathered.sharding.spec)) == ("expert", None, None)


def test_without_a_mesh_the_weight_is_returned_as_is():
    w = jnp.ones((4, 16, 8))
    assert gather_weight_fsdp_axes(w, NAMES) is w
