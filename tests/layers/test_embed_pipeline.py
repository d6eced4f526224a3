"""``Embed`` inside a pipeline's ``shard_map`` over ``stage`` with its table split over ``tensor`` (vocab) and
``fsdp`` (width): the lookup runs per vocab shard (XLA:CPU's partitioner aborts on the gather there), and its rows
and the table's gradient equal the plain lookup's, out-of-range ids clipped as the gather's ``mode="clip"``.

Cost: two small compiles (Auto and Explicit), about a second each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_zoo.layers import Embed
from nnx_zoo.sharding import make_mesh, use_rules

VOCAB, WIDTH = 16, 8


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_vocab_sharded_lookup_inside_a_stage_shard_map_matches_the_plain_lookup(mode):
    mesh = make_mesh({"stage": 2, "tensor": 2, "fsdp": 2}, shard_mode=mode)
    rng = np.random.default_rng(0)
    table = rng.normal(size=(VOCAB, WIDTH)).astype(np.float32)
    ids = rng.integers(0, VOCAB, (4, 6)).astype(np.int32)
    ids[0, :3] = [-3, VOCAB, VOCAB + 7]  # clipped to 0 and VOCAB - 1
    ids[1, :] = 5  # a row looked up six times: its gradient sums them
    weight = rng.normal(size=(4, 6, WIDTH)).astype(np.float32)  # a loss that weighs every element differently
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Embed(VOCAB, WIDTH, rngs=nnx.Rngs(0))))

    def loss(table, ids, weight):  # per stage: its own rows (the stage index scales them) and a scalar loss
        def per_stage(table, ids, weight):
            scale = 1.0 + jax.lax.axis_index("stage").astype(jnp.float32)
            rows = nnx.merge(graphdef, nnx.State({"embedding": nnx.Param(table)}))(ids)
            return jax.lax.psum(jnp.sum(rows * weight * scale), "stage"), rows

        return jax.shard_map(per_stage, in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec()),
                             out_specs=(PartitionSpec(), PartitionSpec("stage")), axis_names={"stage"})(
            table, ids, weight)

    with jax.set_mesh(mesh), use_rules("default"):
        placed = jax.device_put(table, NamedSharding(mesh, PartitionSpec("tensor", "fsdp")))
        (value, rows), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(placed, jnp.asarray(ids),
                                                                            jnp.asarray(weight))
    clipped = np.clip(ids, 0, VOCAB - 1)
    want_rows = table[clipped]
    np.testing.assert_allclose(np.asarray(rows), np.concatenate([want_rows, want_rows]), rtol=1e-6)
    np.testing.assert_allclose(float(value), 3 * np.sum(want_rows * weight), rtol=1e-5)
    want_grad = np.zeros_like(table)
    np.add.at(want_grad, clipped, 3 * weight)  # stage 0 weighs 1, stage 1 weighs 2
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
