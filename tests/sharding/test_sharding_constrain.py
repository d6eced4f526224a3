"""shard / restore_sharding / use_rules: activations under Explicit, Auto and no mesh (seed 000)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.sharding import (
    RULE_SETS,
    ShardingError,
    current_rules,
    get_rules,
    make_mesh,
    restore_sharding,
    shard,
    sharding_of,
    use_rules,
)

BATCH_AXES = ("data", "fsdp", "expert")
# A custom rule set like MaxText's: the logits batch is laid out over the data axes *and* context (size 1 here).
SEED_000_RULES = (
    ("activation_embed_and_logits_batch", ("data", "fsdp", "expert", "context")),
    ("activation_vocab", "tensor"),
)


@pytest.fixture(scope="module")
def explicit_mesh():
    return make_mesh({"data": 2, "fsdp": 2, "expert": 2}, shard_mode="explicit")


@pytest.fixture(scope="module")
def auto_mesh():
    return make_mesh({"data": 2, "fsdp": 2, "expert": 2}, shard_mode="auto")


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


# ---------------------------------------------------------------------------------------------------------------
# Seed 000
# ---------------------------------------------------------------------------------------------------------------


def test_seed_000_raw_constraint_asserts_under_explicit(explicit_mesh):
    """The failure we design against: the spec with the size-1 'context' axis left in does not match."""
    x = _put(jnp.ones((16, 8)), explicit_mesh, P(BATCH_AXES, None))
    with jax.set_mesh(explicit_mesh):
        f = jax.jit(lambda x: jax.lax.with_sharding_constraint(x, P(BATCH_AXES + ("context",), None)))
        with pytest.raises(AssertionError, match="acts as an assert"):
            f(x)


def test_seed_000_shard_under_explicit_works(explicit_mesh):
    x = _put(jnp.arange(128.0).reshape(16, 8), explicit_mesh, P(BATCH_AXES, None))
    names = ("activation_embed_and_logits_batch", None)
    seen = {}

    @jax.jit
    def f(x):
        y = shard(x * 2, names, rules=SEED_000_RULES)
        seen["inside"] = jax.typeof(y).sharding.spec
        return y

    with jax.set_mesh(explicit_mesh):
        out = f(x)
    assert seen["inside"] == P(BATCH_AXES, None)
    assert tuple(out.sharding.spec) == (BATCH_AXES, None)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(128.0).reshape(16, 8))

    # also with the rules in force through use_rules (how the models pass them), entered inside the traced code
    def g(x):
        with use_rules(SEED_000_RULES):
            return shard(x, names)

    with jax.set_mesh(explicit_mesh):
        assert tuple(jax.jit(g)(x).sharding.spec) == (BATCH_AXES, None)


def test_shard_under_explicit_reshards(explicit_mesh):
    """From a different layout, shard moves the data (jax.reshard) rather than asserting."""
    x = _put(jnp.arange(128.0).reshape(16, 8), explicit_mesh, P(None, "fsdp"))
    with jax.set_mesh(explicit_mesh):
        out = jax.jit(lambda x: shard(x, ("activation_batch", "activation_embed"), rules="default"))(x)
        eager = shard(x, ("activation_batch", "activation_embed"), rules="ep-as-cp")  # outside jit too
    # default: activation_batch -> (data, fsdp, fsdp_transpose, expert), minus size-1 fsdp_transpose
    assert tuple(out.sharding.spec) == (BATCH_AXES, None)
    assert tuple(jax.typeof(out).sharding.spec) == (BATCH_AXES, None)
    assert tuple(eager.sharding.spec) == (("data", "fsdp"), None)  # ep-as-cp: expert is not a batch axis
    np.testing.assert_array_equal(np.asarray(out), np.arange(128.0).reshape(16, 8))


def test_shard_under_explicit_checks_divisibility(explicit_mesh):
    x = _put(jnp.ones((6, 8)), explicit_mesh, P())
    with jax.set_mesh(explicit_mesh), pytest.raises(ShardingError, match=r"activation: dimension 0 .*size 6"):
        jax.jit(lambda x: shard(x, ("activation_batch", None)))(x)


def test_shard_under_auto_applies_the_constraint(auto_mesh):
    x = _put(jnp.arange(128.0).reshape(16, 8), auto_mesh, P())
    names = ("activation_embed_and_logits_batch", None)
    f = jax.jit(lambda x: shard(x * 2, names, rules=SEED_000_RULES))
    with jax.set_mesh(auto_mesh):
        compiled = f.lower(x).compile()
        out = f(x)
    want = NamedSharding(auto_mesh, P(BATCH_AXES, None))
    assert compiled.output_shardings.is_equivalent_to(want, 2)  # (XLA reports it without the trailing None)
    assert out.sharding.is_equivalent_to(want, 2)
    assert {s.data.shape for s in out.addressable_shards} == {(2, 8)}
    np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(128.0).reshape(16, 8))
    # the same function without the constraint leaves the output replicated: the constraint did the work
    with jax.set_mesh(auto_mesh):
        plain = jax.jit(lambda x: x * 2).lower(x).compile()
    assert plain.output_shardings.is_fully_replicated


def test_shard_without_a_mesh_is_the_identity():
    x = jnp.ones((6, 5))  # not divisible by anything: no checks either
    assert jax.sharding.get_abstract_mesh().empty
    assert shard(x, ("activation_batch", "activation_embed")) is x
    seen = {}

    def f(x):
        y = shard(x, ("activation_batch", "activation_embed"))
        seen["same"] = y is x
        return y

    jax.jit(f)(x)
    assert seen["same"]


def test_shard_inside_a_full_shard_map_is_the_identity(explicit_mesh):
    """With every mesh axis Manual there is nothing left to shard over."""
    x = _put(jnp.arange(128.0).reshape(16, 8), explicit_mesh, P(BATCH_AXES, None))
    seen = {}

    def body(block):
        y = shard(block, ("activation_batch", None), rules="default")
        seen["same"] = y is block
        return y

    with jax.set_mesh(explicit_mesh):
        out = jax.jit(jax.shard_map(body, in_specs=P(BATCH_AXES), out_specs=P(BATCH_AXES)))(x)
    assert seen["same"]
    np.testing.assert_array_equal(np.asarray(out), np.arange(128.0).reshape(16, 8))


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_shard_inside_shard_map_leaves_out_the_manual_axes(mode, explicit_mesh, auto_mesh):
    """In a shard_map over 'expert' (the EP path) the spec may only name the other axes."""
    mesh = explicit_mesh if mode == "explicit" else auto_mesh
    x = _put(jnp.arange(128.0).reshape(16, 8), mesh, P(BATCH_AXES, None))
    seen = {}

    def body(block):
        y = shard(block * 2, ("activation_batch", None), rules="default")
        seen["spec"] = tuple(jax.typeof(y).sharding.spec)
        return y

    with jax.set_mesh(mesh):
        f = jax.jit(jax.shard_map(body, in_specs=P("expert"), out_specs=P("expert"), axis_names={"expert"}))
        out = f(x)
    if mode == "explicit":
        assert seen["spec"] == (("data", "fsdp"), None)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.arange(128.0).reshape(16, 8))


# ---------------------------------------------------------------------------------------------------------------
# restore_sharding
# ---------------------------------------------------------------------------------------------------------------


def test_restore_sharding_under_explicit(explicit_mesh):
    x = _put(jnp.arange(128.0).reshape(16, 8), explicit_mesh, P(BATCH_AXES, None))
    seen = {}

    @jax.jit
    def module(x):
        entry = sharding_of(x)
        h = jax.reshard(x * 3, P(None, "fsdp"))  # internal relayout
        seen["internal"] = jax.typeof(h).sharding.spec
        out = restore_sharding(h, entry)
        seen["out"] = jax.typeof(out).sharding
        seen["entry"] = entry
        return out

    with jax.set_mesh(explicit_mesh):
        out = module(x)
    assert seen["internal"] == P(None, "fsdp") != seen["entry"].spec
    assert seen["out"] == seen["entry"]
    assert out.sharding.spec == x.sharding.spec == P(BATCH_AXES, None)
    assert jax.typeof(out).sharding.spec == jax.typeof(x).sharding.spec
    np.testing.assert_array_equal(np.asarray(out), 3 * np.arange(128.0).reshape(16, 8))


def test_restore_sharding_maps_over_pytrees_and_works_outside_jit(explicit_mesh):
    x = _put(jnp.ones((16, 8)), explicit_mesh, P(BATCH_AXES, None))
    moved = _put(jnp.ones((16, 8)), explicit_mesh, P(None, ("fsdp", "expert")))
    # concrete arrays, no jax.set_mesh: the sharding (with its mesh) is passed on, not just its spec
    a, b = restore_sharding((moved, moved * 2), sharding_of(x))
    assert a.sharding.spec == b.sharding.spec == P(BATCH_AXES, None)
    np.testing.assert_array_equal(np.asarray(b), 2 * np.ones((16, 8)))


def test_restore_sharding_under_auto_is_a_no_op(auto_mesh):
    x = _put(jnp.ones((16, 8)), auto_mesh, P(BATCH_AXES, None))
    seen = {}

    def module(x):
        entry = sharding_of(x)
        h = jax.lax.with_sharding_constraint(x * 2, P(None, "fsdp"))
        out = restore_sharding(h, entry)
        seen["same"] = out is h
        return out

    with jax.set_mesh(auto_mesh):
        jax.jit(module)(x)
    assert seen["same"]
    y = jnp.zeros(3)
    assert restore_sharding(y, sharding_of(x)) is y


# ---------------------------------------------------------------------------------------------------------------
# use_rules / current_rules
# ---------------------------------------------------------------------------------------------------------------


def test_use_rules_scoping():
    assert current_rules() is RULE_SETS["default"]
    with use_rules("pure-fsdp") as rules:
        assert rules is current_rules() is RULE_SETS["pure-fsdp"]
        with use_rules(SEED_000_RULES):
            assert current_rules() == get_rules(SEED_000_RULES)
        assert current_rules() is RULE_SETS["pure-fsdp"]
    assert current_rules() is RULE_SETS["default"]
    with pytest.raises(RuntimeError), use_rules("ep-as-cp"):
        raise RuntimeError("boom")
    assert current_rules() is RULE_SETS["default"]
    with pytest.raises(ValueError, match="unknown rule set"), use_rules("nope"):
        pass
    assert current_rules() is RULE_SETS["default"]


def test_shard_reads_the_rules_in_force(explicit_mesh):
    x = _put(jnp.ones((16, 8)), explicit_mesh, P())
    names = ("activation_batch", None)
    with jax.set_mesh(explicit_mesh):
        default = shard(x, names)
        with use_rules("ep-as-cp"):
            ep_as_cp = shard(x, names)
        with use_rules("pure-fsdp"):
            explicit_arg = shard(x, names, rules="default")  # an explicit argument beats the context
    assert tuple(default.sharding.spec) == (BATCH_AXES, None)
    assert tuple(ep_as_cp.sharding.spec) == (("data", "fsdp"), None)
    assert tuple(explicit_arg.sharding.spec) == (BATCH_AXES, None)
