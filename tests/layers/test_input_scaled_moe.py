"""The sigmoid top-k router and input-scaled experts (``SparseMoE(router="sigmoid", scale_inputs=True)``): each chosen
expert runs on its token times the routing weight, outputs added unweighted, against a loop written out in numpy,
on every ``moe_impl`` and under an Explicit FSDP 4 x EP 2 mesh (``ep-as-cp``) with the output in its input's
sharding; and the weightless ``L2Norm``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.layers.norm import L2Norm
from nnx_zoo.layers.routers import route
from nnx_zoo.layers.sparse_moe import SparseMoE
from nnx_zoo.sharding import create_sharded, logical_to_mesh_axes, make_mesh, use_rules


def _moe(impl: str) -> SparseMoE:
    return SparseMoE(16, num_experts=8, experts_per_token=2, expert_hidden=8, renormalize=False, router="sigmoid",
                     scale_inputs=True, shared_hidden=8, moe_impl=impl, rngs=nnx.Rngs(0))


def _reference(moe: SparseMoE, x: np.ndarray) -> np.ndarray:
    """``shared(x) + sum_k expert_{i_k}(sigmoid(l_{i_k}) * x)`` over the ``k`` largest router logits ``l``."""
    def silu(a):
        return a / (1 + np.exp(-a))

    gate, up, down = (np.asarray(w[...], np.float64) for w in (moe.experts.wi_gate, moe.experts.wi_up, moe.experts.wo))
    tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = tokens @ np.asarray(moe.router[...], np.float64)
    out = np.zeros_like(tokens)
    for t, row in enumerate(logits):
        for e in np.argsort(-row)[:2]:
            h = tokens[t] / (1 + np.exp(-row[e]))
            out[t] += (silu(h @ gate[e]) * (h @ up[e])) @ down[e]
    s = moe.shared_experts
    shared = silu(tokens @ np.asarray(s.gate.kernel[...])) * (tokens @ np.asarray(s.up.kernel[...]))
    return (out + shared @ np.asarray(s.down.kernel[...])).reshape(x.shape)


@pytest.mark.parametrize("impl", ["dense", "gmm", "ep"])
def test_input_scaled_sigmoid_experts_equal_the_loop(impl):
    x = jax.random.normal(jax.random.key(1), (4, 8, 16))
    moe = _moe(impl)
    out = moe(x)
    np.testing.assert_allclose(np.asarray(out.output), _reference(moe, np.asarray(x)), rtol=1e-5, atol=1e-6)
    routing = route("sigmoid", jnp.asarray([[0.0, 3.0, -1.0, 2.0]]), 2, renormalize=False)
    np.testing.assert_array_equal(np.asarray(routing.expert_indices), [[1, 3]])
    np.testing.assert_allclose(np.asarray(routing.weights), 1 / (1 + np.exp(-np.array([[3.0, 2.0]]))), rtol=1e-6)


def test_input_scaled_experts_under_an_explicit_mesh_equal_one_device():
    x = jax.random.normal(jax.random.key(2), (8, 8, 16))
    want = _moe("ep")(x).output
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode="explicit")
    sharded = create_sharded(lambda: _moe("ep"), mesh, "ep-as-cp")
    with jax.set_mesh(mesh), use_rules("ep-as-cp"):
        spec = logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"), "ep-as-cp", mesh)
        xs = jax.sharding.reshard(x, spec)
        got = jax.jit(lambda m, x: m(x).output)(sharded, xs)
        assert jax.typeof(got).sharding == jax.typeof(xs).sharding
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_l2_norm_has_no_weight_and_unit_rms():
    x = np.random.default_rng(0).normal(size=(3, 5, 8)).astype(np.float32) * 4
    norm = L2Norm(eps=1e-6)
    assert not nnx.state(norm, nnx.Param)
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-6)
    assert norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16
