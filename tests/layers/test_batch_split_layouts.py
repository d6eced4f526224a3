"""``batch_split`` hands back its input's exact sharding for input layouts other than the rule set's standard one,
under an all-Explicit mesh: the batch on a different mesh axis, the sequence sharded, the embedding sharded,
nothing sharded. The function it splits relays its output out to the standard layout (as every layer does), so
only the restore can bring the input's layout back. Values equal the unsplit call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.layers import batch_split
from nnx_zoo.models.deepseek.model import DecoderLayer
from nnx_zoo.sharding import logical_to_mesh_axes, make_mesh, shard, use_rules
from tests.models.deepseek.small import small_config

BATCH, SEQ, EMBED, FACTOR = 8, 8, 16, 2
BLE = ("activation_batch", "activation_length", "activation_embed")
SIZES = {"data": 2, "fsdp": 2, "context": 2}
LAYOUTS = {
    "batch-on-data-only": P("data"),
    "batch-on-fsdp-only": P("fsdp"),
    "batch-on-context": P("context"),
    "sequence-only": P(None, "context"),
    "sequence-on-two-axes": P(None, ("context", "data")),
    "batch-and-sequence-swapped": P("context", "fsdp"),
    "embed-sharded": P(None, None, "data"),
    "replicated": P(),
}


@functools.cache
def _mesh():
    return make_mesh(SIZES, shard_mode="explicit")


def test_the_layouts_are_not_the_standard_one():
    standard = logical_to_mesh_axes(BLE, "default", _mesh())
    assert standard == P(("data", "fsdp"), "context", None)
    assert all(tuple(spec) + (None,) * (3 - len(spec)) != tuple(standard) for spec in LAYOUTS.values())


def _layer_like(h, rows):
    """Like a decoder layer: output relaid out to the standard layout, a per-row aux and a scalar aux."""
    y = shard(jnp.tanh(h) * 2.0 + rows[:, None, None], BLE)
    return y, (jnp.sum(h, axis=(1, 2)), jnp.sum(h))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batch_split_restores_any_input_layout(layout):
    mesh = _mesh()
    x = np.random.default_rng(0).normal(size=(BATCH, SEQ, EMBED)).astype(np.float32)
    rows = np.arange(BATCH, dtype=np.float32)

    @jax.jit
    def run(x, rows):
        with use_rules("default"):
            return batch_split(_layer_like, x, rows, factor=FACTOR), _layer_like(x, rows)

    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, LAYOUTS[layout]))
        rows = jax.device_put(rows, NamedSharding(mesh, P()))
        (y, (per_row, total)), (want, (want_per_row, want_total)) = run(x, rows)
    assert jax.typeof(y).sharding == jax.typeof(x).sharding
    assert y.sharding.is_equivalent_to(x.sharding, 3)  # the concrete arrays too
    # Split and unsplit are two programs (a decoder layer each) whose float32 results round apart: under the suite's
    # -O0 codegen (conftest.py) one value of 1,024 differed by 2.4e-7 (1.07e-6 relative). The sums below keep 1e-5.
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(per_row), np.asarray(want_per_row), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(total), float(want_total), rtol=1e-5)


@functools.cache
def _decoder_layer():
    config = small_config(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0, moe_impl="dense")
    return config, DecoderLayer(config, moe=True, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("layout", ["batch-on-data-only", "sequence-only"])
def test_decoder_layer_batch_split_restores_the_input_layout(layout):
    config, layer = _decoder_layer()
    mesh = _mesh()
    graphdef, state = nnx.split(layer)
    cos = sin = jnp.ones((1, SEQ, config.qk_rope_head_dim // 2)) * jnp.arange(SEQ)[None, :, None] / SEQ

    @jax.jit
    def run(state, x):
        layer = nnx.merge(graphdef, state)
        with use_rules("default"):
            return layer.batch_split(x, cos, sin, None, FACTOR)[0], layer(x, cos, sin, None)[0]

    x = np.random.default_rng(1).normal(size=(BATCH, SEQ, config.hidden_size)).astype(np.float32)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, LAYOUTS[layout]))
        state = jax.device_put(state, NamedSharding(mesh, P()))
        y, want = run(state, x)
    assert jax.typeof(y).sharding == jax.typeof(x).sharding
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
