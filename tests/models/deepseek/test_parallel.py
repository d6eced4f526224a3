"""Expert parallelism (``moe_impl='ep'``) and the batch-split schedule under meshes.

EP equals the dense reference (logits and gradients) on several meshes and rule sets, in both shard modes; the
capacity factor drops (and reports) tokens; batch splitting leaves loss and gradients unchanged; MLA, the MoE
block and the batch-split layer hand back exactly their input's sharding under every named rule set.
Compiled functions are shared (one value-and-grad function, keyed by model graph and mesh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zoo import DeepSeekV3
from nnx_zoo.layers import batch_split
from nnx_zoo.models.deepseek import MLA, DeepSeekMoE
from nnx_zoo.models.deepseek.model import DecoderLayer
from nnx_zoo.sharding import (
    RULE_SETS,
    get_rules,
    logical_to_mesh_axes,
    make_mesh,
    shard,
    state_shardings,
    use_rules,
)
from nnx_zoo.sharding.rules import DEFAULT
from tests.models.deepseek.small import small_config

BATCH, SEQ = 16, 8
_BLE = ("activation_batch", "activation_length", "activation_embed")

# (mesh sizes, rule sets that make sense there). ep-as-dp splits experts over expert (data parallel outside the MoE).
MESHES = [
    ({"fsdp": 4, "expert": 2}, ("default", "shard-exp-on-fsdp")),
    ({"data": 2, "fsdp": 2, "expert": 2}, ("default", "ep-as-dp")),
    ({"fsdp": 2, "context": 2, "expert": 2}, ("cp-as-ep", "ep-as-cp")),
]
# Every case under Explicit axes; under Auto, one rule set per mesh (the Auto compiles are what this file spends
# its time on, and Auto adds no sharding logic of its own to the EP path).
CASES = [(sizes, rules, "explicit") for sizes, names in MESHES for rules in names]
CASES += [(sizes, names[-1], "auto") for sizes, names in MESHES]


def _config(**overrides):
    """One MoE layer (no dense layer, no MTP head): the smallest model that runs the whole EP path."""
    return small_config(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0, **overrides)


@functools.cache
def _state():
    """The one set of parameter values every test uses (created once)."""
    return nnx.state(DeepSeekV3(_config(), rngs=nnx.Rngs(0)))


@functools.cache
def _graphdef(rules: str = "default", **overrides):
    return nnx.graphdef(nnx.eval_shape(lambda: DeepSeekV3(_config(**overrides), rngs=nnx.Rngs(0), rules=rules)))


@functools.cache
def _inputs():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 256, (BATCH, SEQ)), jnp.int32)
    mask = jnp.ones((BATCH, SEQ), jnp.int32).at[0, :3].set(0)
    probe = jnp.asarray(rng.normal(size=(BATCH, SEQ, 256)), jnp.float32)
    return ids, mask, probe


def _loss(state, graphdef, ids, mask, probe):
    out = nnx.merge(graphdef, state).forward(ids, mask, with_expert_load=True)
    return jnp.mean(out.logits * probe), (out.logits, out.dropped_tokens)


_value_and_grad = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=1)


def _place(state, mesh, rules):
    shardings = state_shardings(state, mesh, get_rules(rules))
    leaves = [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(state), shardings)]
    return jax.tree.unflatten(jax.tree.structure(state), leaves)


def _run(graphdef, sizes=None, rules="default", mode="explicit"):
    """(loss, logits, dropped per MoE layer, grads) as numpy, on a mesh when ``sizes`` is given."""
    state, (ids, mask, probe) = _state(), _inputs()
    if sizes is None:
        (loss, (logits, dropped)), grads = _value_and_grad(state, graphdef, ids, mask, probe)
    else:
        mesh = make_mesh(sizes, shard_mode=mode)
        with jax.set_mesh(mesh):
            (loss, (logits, dropped)), grads = _value_and_grad(_place(state, mesh, rules), graphdef, ids, mask,
                                                               probe)
    return jax.device_get((loss, logits, dropped, grads))


@functools.cache
def _reference():
    return _run(_graphdef(moe_impl="dense"))


def _assert_same(got, want):
    loss, logits, _, grads = got
    np.testing.assert_allclose(loss, want[0], rtol=1e-5)
    np.testing.assert_allclose(logits, want[1], rtol=1e-5, atol=1e-6 * np.abs(want[1]).max())
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want[3])):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * max(np.abs(r).max(), 1e-12),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("sizes,rules,mode", CASES, ids=[f"{r}-{m}-{'x'.join(map(str, s.values()))}"
                                                         for s, r, m in CASES])
def test_ep_equals_dense(sizes, rules, mode):
    got = _run(_graphdef(rules, moe_impl="ep"), sizes, rules, mode)
    _assert_same(got, _reference())
    assert np.all(got[2] == 0)  # dropless


def test_ep_axes_follow_the_rules():
    mesh = make_mesh({"fsdp": 2, "context": 2, "expert": 2})
    resolve = {name: logical_to_mesh_axes(("exp",), RULE_SETS[name], mesh)[0] for name in RULE_SETS}
    assert resolve["default"] == "expert" and resolve["ep-as-cp"] == "expert"
    assert resolve["cp-as-ep"] == ("context", "expert")  # MaxText's order
    assert resolve["shard-exp-on-fsdp"] == ("expert", "fsdp")
    assert resolve["ep-as-dp"] == "expert" and resolve["pure-fsdp"] is None


def test_capacity_factor_drops_and_reports_tokens():
    sizes = {"fsdp": 4, "expert": 2}
    tight = _run(_graphdef(moe_impl="ep", moe_capacity_factor=0.5), sizes)
    assert tight[2].shape == (1,) and tight[2][0] > 0  # one MoE layer; pairs over capacity were dropped
    assert tight[2][0] < BATCH * SEQ * 2  # fewer than all (token, expert) pairs
    assert not np.allclose(tight[1], _reference()[1], rtol=1e-3)
    huge = _run(_graphdef(moe_impl="ep", moe_capacity_factor=1e3), sizes)
    assert np.all(huge[2] == 0)
    _assert_same(huge, _reference())


def test_capacity_factor_without_ep_axes_is_local():
    # pure-fsdp: 'exp' maps to no mesh axis, so the capacity applies per token shard (and without a mesh, to all).
    config = _config(moe_impl="ep", moe_capacity_factor=0.5)
    moe = DeepSeekMoE(config, rngs=nnx.Rngs(1))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(BATCH, SEQ, config.hidden_size)), jnp.float32)
    graphdef, state = nnx.split(moe)

    @jax.jit
    def dropped(state, x):
        with use_rules("pure-fsdp"):
            return nnx.merge(graphdef, state)(x).dropped_tokens

    assert dropped(state, x) > 0
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode="explicit")
    with jax.set_mesh(mesh):
        assert dropped(_place(state, mesh, "pure-fsdp"), x) > 0


def test_batch_split_equals_unsplit():
    split = _run(_graphdef(moe_impl="ep", batch_split_factor=2), {"fsdp": 4, "expert": 2}, "default", "explicit")
    _assert_same(split, _reference())


def test_batch_split_without_mesh_and_its_errors():
    _assert_same(_run(_graphdef(moe_impl="dense", batch_split_factor=2)), _reference())
    with pytest.raises(ValueError, match="must divide the batch size"):
        batch_split(lambda x: (x, None), jnp.ones((6, 2)), factor=4)
    mesh = make_mesh({"fsdp": 8}, shard_mode="explicit")
    x = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, jax.P("fsdp")))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="cannot be split over the 8 devices"):
        jax.jit(lambda x: batch_split(lambda x: (x, None), x, factor=2))(x)
    with pytest.raises(ValueError, match="batch_split_factor"):
        _config(batch_split_factor=0)
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        _config(moe_capacity_factor=1.0)  # dense is dropless


@functools.cache
def _layers():
    config = _config(moe_impl="ep")
    return MLA(config, rngs=nnx.Rngs(0)), DeepSeekMoE(config, rngs=nnx.Rngs(1)), DecoderLayer(config, moe=True,
                                                                                             rngs=nnx.Rngs(2))


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_blocks_return_their_input_sharding(rules):
    mla, moe, layer = _layers()
    config = _config()
    mesh = make_mesh({"fsdp": 2, "context": 2, "expert": 2}, shard_mode="explicit")
    positions = jnp.arange(SEQ)[None]
    cos = sin = jnp.ones((1, SEQ, config.qk_rope_head_dim // 2)) * positions[..., None] / SEQ
    graphdefs, states = zip(*(nnx.split(m) for m in (mla, moe, layer)))

    @jax.jit
    def run(states, x):
        mla, moe, layer = (nnx.merge(g, s) for g, s in zip(graphdefs, states))
        with use_rules(rules):
            return mla(x, cos, sin, None), moe(x)[0], layer.batch_split(x, cos, sin, None, 2)[0]

    with jax.set_mesh(mesh):
        spec = logical_to_mesh_axes(_BLE, rules, mesh)
        x = jax.device_put(jnp.ones((BATCH, SEQ, config.hidden_size)), NamedSharding(mesh, spec))
        states = _place(states, mesh, rules)
        # Under an all-Explicit mesh the sharding is part of the traced type: tracing the blocks (no compile) gives
        # the sharding the compiled program returns.
        for out in jax.eval_shape(run, states, x):
            assert out.sharding == jax.typeof(x).sharding, rules


def test_seed000_batch_split_then_shard_with_size_one_context():
    # Seed 000: the batch-split scan dropped the size-1 context axis from its output; a later constraint to names
    # whose rule lists context then asserted under an Explicit mesh.
    rules = (("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert", "context")),
             *((n, a) for n, a in DEFAULT if n != "activation_batch"))
    _, _, layer = _layers()
    config = _config()
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode="explicit")  # context has size 1
    cos = sin = jnp.zeros((1, SEQ, config.qk_rope_head_dim // 2))
    graphdef, state = nnx.split(layer)

    @jax.jit
    def run(state, x):
        with use_rules(rules):
            h = nnx.merge(graphdef, state).batch_split(x, cos, sin, None, 2).hidden
            return shard(h * 2.0, _BLE)

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((BATCH, SEQ, config.hidden_size)), NamedSharding(mesh, jax.P(("fsdp", "expert"))))
        out = run(_place(state, mesh, rules), x)
    assert jax.typeof(out).sharding == jax.typeof(x).sharding
