"""RoutedExperts' fused-layout expert projection and the platform default MoE path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.layers import RoutedExperts, default_moe_impl
from nnx_zoo.layers.moe import _expert_in_proj
from nnx_zoo.sharding import create_sharded, logical_to_mesh_axes, make_mesh, use_rules


def test_fused_expert_projection_equals_the_einsum_and_its_gradients():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (12, 8))
    w = jax.random.normal(kw, (4, 8, 6))

    def loss(f, x, w):
        return jnp.sum(jnp.sin(f(x, w)))

    fused = jax.value_and_grad(lambda x, w: loss(_expert_in_proj, x, w), argnums=(0, 1))(x, w)
    plain = jax.value_and_grad(lambda x, w: loss(lambda a, b: jnp.einsum("th,ehi->tei", a, b), x, w),
                               argnums=(0, 1))(x, w)
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("sizes", "rules"), [
    ({"fsdp": 8}, "default"),  # experts split on nothing, tokens on fsdp
    ({"fsdp": 4, "tensor": 2}, "default"),  # the expert width is split: the 3-D einsum
    ({"fsdp": 4, "expert": 2}, "shard-exp-on-fsdp"),  # the fused axis carries (expert, fsdp)
])
def test_dense_path_under_explicit_meshes_matches_single_device(sizes, rules):
    """The fused (expert, width) axis merges the resolved shardings of both dims, or keeps the 3-D einsum when
    the width is split (tensor); either way the numbers are the single-device ones."""
    experts = RoutedExperts(8, 16, 8, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))
    idx = jax.random.randint(jax.random.key(2), (32, 2), 0, 8)
    weights = jax.random.uniform(jax.random.key(3), (32, 2))
    want = experts(x, idx, weights, impl="dense")
    mesh = make_mesh(sizes, shard_mode="explicit")
    sharded = create_sharded(lambda: RoutedExperts(8, 16, 8, rngs=nnx.Rngs(0)), mesh, rules)
    assert any(jax.typeof(v).sharding.spec != jax.sharding.PartitionSpec() for v in jax.tree.leaves(nnx.state(sharded)))
    with jax.set_mesh(mesh), use_rules(rules):
        tokens = jax.sharding.reshard(x, shard_spec := logical_to_mesh_axes(("activation_tokens", None), rules, mesh))
        assert shard_spec != jax.sharding.PartitionSpec()
        got = jax.jit(lambda x, i, w: sharded(x, i, w, impl="dense"))(tokens, idx, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_auto_picks_the_measured_path_per_platform():
    assert default_moe_impl("cpu") == "dense"  # ragged_dot is a G-times masked dense dot on XLA:CPU
    assert default_moe_impl("gpu") == "gmm"
    assert default_moe_impl("tpu") == "gmm"
    experts = RoutedExperts(4, 8, 8, rngs=nnx.Rngs(0))
    x = jnp.ones((6, 8))
    idx, w = jnp.zeros((6, 2), jnp.int32).at[:, 1].set(3), jnp.full((6, 2), 0.5)
    np.testing.assert_array_equal(experts(x, idx, w, impl="auto"), experts(x, idx, w, impl=default_moe_impl()))
