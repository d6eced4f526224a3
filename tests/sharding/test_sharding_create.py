"""create_sharded: every named rule set x several 8-device meshes x both shard modes, born on the resolved
shardings, with the values of the model created without a mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding

from nnx_zoo.sharding import (
    RULE_SETS,
    ShardingError,
    abstract_module,
    create_sharded,
    iter_variables,
    logical_names,
    logical_to_mesh_axes,
    make_mesh,
    state_shardings,
)
from tests.sharding.sharding_toy_model import EXPECTED, LAYERS, RandomToyModel, ToyModel

MESHES = {
    "fsdp8": {"fsdp": 8},
    "fsdp4-tp2": {"fsdp": 4, "tensor": 2},
    "fsdp4-tpT2": {"fsdp": 4, "tensor_transpose": 2},
    "fsdp4-ep2": {"fsdp": 4, "expert": 2},
    "dp2-fsdp2-ep2": {"data": 2, "fsdp": 2, "expert": 2},
    "fsdp2-cp2-ep2": {"fsdp": 2, "context": 2, "expert": 2},
}


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    """The model created with no mesh at all (Flax eager sharding off, or the eager Variable would need one)."""
    with nnx.use_eager_sharding(False):
        model = ToyModel(seed=3)
    return {path: np.asarray(var.get_value()) for path, var in iter_variables(model)}


def test_toy_model_annotations_survive_vmap(reference):
    model = abstract_module(lambda: ToyModel(seed=3))
    got = {path: (tuple(var.shape), logical_names(var)) for path, var in iter_variables(model)}
    assert got == EXPECTED
    assert {p: v.shape for p, v in reference.items()} == {p: s for p, (s, _) in EXPECTED.items()}
    # the stacked layers really differ (the vmapped axis is not a broadcast)
    assert not np.allclose(reference["layers.wi"][0], reference["layers.wi"][1])
    assert reference["layers.wi"].shape[0] == LAYERS


@pytest.mark.parametrize("mode", ["explicit", "auto"])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_born_with_the_resolved_shardings(rules, mesh_name, mode, reference):
    mesh = make_mesh(MESHES[mesh_name], shard_mode=mode)
    model = create_sharded(lambda: ToyModel(seed=3), mesh, rules)

    seen = set()
    sharded = 0
    for path, var in iter_variables(model):
        seen.add(path)
        shape, names = EXPECTED[path]
        arr = var.get_value()
        assert isinstance(arr, jax.Array) and arr.shape == shape
        expected = logical_to_mesh_axes(names, rules, mesh, shape=shape, path=path)
        assert isinstance(arr.sharding, NamedSharding)
        assert arr.sharding.mesh.shape == mesh.shape
        assert arr.sharding.spec == expected, (path, arr.sharding.spec, expected)
        assert tuple(arr.sharding.spec) == tuple(expected)
        if mode == "explicit":
            assert jax.typeof(arr).sharding.spec == expected, path
            assert set(jax.typeof(arr).sharding.mesh.axis_types) == {AxisType.Explicit}
        # each device holds exactly its block
        shard_shape = arr.sharding.shard_shape(shape)
        assert {s.data.shape for s in arr.addressable_shards} == {shard_shape}
        sharded += shard_shape != shape
        # same values as the model created without a mesh
        np.testing.assert_allclose(np.asarray(arr), reference[path], rtol=1e-6, atol=1e-7, err_msg=path)
    assert seen == set(EXPECTED)
    assert sharded >= 3  # not vacuous: the big weights are split on every mesh


def test_eager_default_variable_is_placed_by_our_resolver_not_flax():
    """ToyModel.embedding keeps Flax's default eager_sharding; created under a mesh by Flax alone it is
    sharded by its raw logical names (which are not mesh axes) and fails, create_sharded resolves it."""
    mesh = make_mesh({"fsdp": 4, "tensor": 2}, shard_mode="explicit")
    assert nnx.using_eager_sharding()  # Flax's default is on
    with jax.set_mesh(mesh), pytest.raises(Exception, match="vocab"):
        ToyModel(seed=0)
    model = create_sharded(lambda: ToyModel(seed=0), mesh, "default")
    assert tuple(model.embedding.get_value().sharding.spec) == ("tensor", "fsdp")
    assert nnx.using_eager_sharding()  # and the global switch is left as it was


def test_same_seed_same_values_with_rngs():
    """nnx.Rngs-initialized weights (split over an nnx.vmap stack) come out of create_sharded exactly as an
    unsharded eager construction with the same seed makes them. (One shard mode: threefry is slow to compile on
    CPU; the parametrized test above covers both modes with seed-determined values.)"""
    with nnx.use_eager_sharding(False):
        ref = dict(iter_variables(RandomToyModel(nnx.Rngs(7))))
        other = dict(iter_variables(RandomToyModel(nnx.Rngs(8))))
    mesh = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2}, shard_mode="explicit")
    model = create_sharded(lambda: RandomToyModel(nnx.Rngs(7)), mesh, "default")
    got = dict(iter_variables(model))
    assert set(got) == set(ref)
    assert sorted(p for p, v in got.items() if isinstance(v, nnx.Param)) == ["embedding", "layers.wi"]
    for path, var in got.items():
        np.testing.assert_allclose(np.asarray(var.get_value()), np.asarray(ref[path].get_value()), rtol=1e-6,
                                   atol=1e-8, err_msg=path)
    # the comparison is not trivially true: another seed differs, and so do the stacked layers
    assert not np.allclose(np.asarray(other["embedding"].get_value()), np.asarray(ref["embedding"].get_value()))
    wi = np.asarray(got["layers.wi"].get_value())
    assert not np.allclose(wi[0], wi[1])
    assert tuple(model.layers.wi.get_value().sharding.spec) == (None, "expert", "fsdp", "tensor")
    assert tuple(model.embedding.get_value().sharding.spec) == ("tensor", ("fsdp", "expert"))


def test_make_closing_over_outer_rngs_gets_a_clear_error():
    rngs = nnx.Rngs(0)
    mesh = make_mesh({"fsdp": 8})
    with pytest.raises(ShardingError, match=r"must create its own Rngs"):
        create_sharded(lambda: RandomToyModel(rngs), mesh)


def test_state_shardings_follow_leaf_order():
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    _, state = nnx.split(abstract_module(lambda: ToyModel()))
    shardings = state_shardings(state, mesh, "default")
    leaves = jax.tree.leaves(state)
    paths = [p for p, _ in iter_variables(state)]
    assert len(shardings) == len(leaves) == len(paths) == len(EXPECTED)
    for path, leaf, sharding in zip(paths, leaves, shardings, strict=True):
        assert leaf.shape == EXPECTED[path][0]
        assert sharding.spec == logical_to_mesh_axes(EXPECTED[path][1], "default", mesh)


def test_divisibility_error_names_the_variable():
    mesh = make_mesh({"fsdp": 8})

    class Odd(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.numpy.zeros((12, 8)), out_sharding=("embed", "mlp"), eager_sharding=False)

    with pytest.raises(ShardingError, match=r"w: dimension 0 \(logical 'embed', size 12\)"):
        create_sharded(Odd, mesh, "default")


def test_rank_mismatch_and_unknown_names_error_with_the_path():
    mesh = make_mesh({"fsdp": 8})

    class BadRank(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.numpy.zeros((8, 8)), out_sharding=("embed",), eager_sharding=False)

    with pytest.raises(ShardingError, match=r"w: 1 logical names \('embed',\) for a 2-d value"):
        create_sharded(BadRank, mesh)

    class Typo(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.numpy.zeros((8, 8)), out_sharding=("embedd", "mlp"), eager_sharding=False)

    with pytest.raises(ShardingError, match=r"w: unknown logical axis name 'embedd'"):
        create_sharded(Typo, mesh)
    model = create_sharded(Typo, mesh, strict=False)
    assert tuple(model.w.get_value().sharding.spec) == (None, None)


def test_unannotated_variables_are_replicated():
    mesh = make_mesh({"fsdp": 8}, shard_mode="explicit")

    class Plain(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.numpy.ones((8, 8)))
            self.count = nnx.Variable(jax.numpy.zeros((), jax.numpy.int32))

    model = create_sharded(Plain, mesh)
    assert model.w.get_value().sharding.spec == jax.sharding.PartitionSpec()
    assert model.w.get_value().sharding.is_fully_replicated
    assert model.count.get_value().sharding.is_fully_replicated


def test_rules_that_place_nothing_on_a_users_mesh_warn():
    # A user's own mesh whose axis names no rule of "default" mentions: everything would silently be replicated.
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    with pytest.warns(UserWarning, match=r"rule set 'default' places nothing on this mesh.*\{'x': 2, 'y': 4\}.*"
                      r"replicated on all 8 devices.*make_mesh"):
        model = create_sharded(lambda: ToyModel(seed=0), mesh, "default")
    assert all(v.get_value().sharding.is_fully_replicated for _, v in iter_variables(model))


def test_rules_that_place_something_do_not_warn():
    import warnings

    own = jax.make_mesh((2, 4), ("x", "fsdp"), axis_types=(AxisType.Auto,) * 2)  # not make_mesh's, but with `fsdp`
    one = make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    pure_dp = make_mesh({"data": 8})  # parameters replicated on purpose; the batch is split over `data`
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = create_sharded(lambda: ToyModel(seed=0), own, "pure-fsdp")
        create_sharded(lambda: ToyModel(seed=0), one, "default")
        create_sharded(lambda: ToyModel(seed=0), pure_dp, "default")
    assert not model.embedding.get_value().sharding.is_fully_replicated
