"""The softmax top-k router (transformers' order: float32 softmax, top-k, optional renormalisation) and the
SparseMoE block under an Explicit FSDP 4 x EP 2 mesh: named rule sets and each ``moe_impl`` give the
single-device output and balance sums, with the output in exactly its input's sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from nnx_zoo.layers.routers import balance_sums, softmax_top_k
from nnx_zoo.layers.sparse_moe import SparseMoE
from nnx_zoo.sharding import RULE_SETS, create_sharded, logical_to_mesh_axes, make_mesh, use_rules


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_top_k_follows_transformers_order(renormalize):
    logits = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    probs = torch.softmax(torch.as_tensor(logits), dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, 3, dim=-1)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    routing = softmax_top_k(jnp.asarray(logits), 3, renormalize=renormalize)
    np.testing.assert_array_equal(np.asarray(routing.expert_indices), idx.numpy())
    np.testing.assert_allclose(np.asarray(routing.weights), top.numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(routing.probs), probs.numpy(), rtol=1e-6)
    mask = np.arange(20) % 3 != 0
    sums = balance_sums(routing, jnp.asarray(mask))
    assert float(sums.rows) == mask.sum() and float(jnp.sum(sums.counts)) == 3 * mask.sum()


def _moe(impl: str) -> SparseMoE:
    return SparseMoE(16, num_experts=8, experts_per_token=2, expert_hidden=8, renormalize=True, moe_impl=impl,
                     shared_hidden=8, rngs=nnx.Rngs(0))


# ep under the rule sets that move the expert or sequence dims; gmm and dense (no expert split) once each.
CASES = [("ep", "ep-as-cp"), ("ep", "shard-exp-on-fsdp"), ("gmm", "default"), ("dense", "pure-fsdp")]


@pytest.mark.parametrize(("impl", "rules"), CASES)
def test_rule_sets_and_paths_keep_the_input_sharding_and_the_numbers(impl, rules):
    assert rules in RULE_SETS
    x = jax.random.normal(jax.random.key(1), (8, 8, 16))
    mask = jnp.ones((8, 8), bool).at[0, :3].set(False)
    want = _moe(impl)(x, token_mask=mask, with_balance=True)
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode="explicit")
    sharded = create_sharded(lambda: _moe(impl), mesh, rules)
    with jax.set_mesh(mesh), use_rules(rules):
        spec = logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"), rules, mesh)
        xs = jax.sharding.reshard(x, spec)
        got = jax.jit(lambda m, x, t: m(x, token_mask=t, with_balance=True))(sharded, xs, mask)
        assert jax.typeof(got.output).sharding == jax.typeof(xs).sharding
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
