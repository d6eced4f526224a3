"""The resolver: Linen-exact rule semantics, size-1 removal, divisibility, vocabulary, rule-set validation."""

from __future__ import annotations

import flax.core.spmd as core_spmd
import flax.linen as nn
import jax.numpy as jnp
import pytest
from flax import nnx
from flax.nnx import spmd as nnx_spmd
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from nnx_zoo.sharding import (
    LOGICAL_AXES,
    MESH_AXES,
    RULE_SETS,
    ShardingError,
    context_axes,
    get_rules,
    logical_to_mesh_axes,
    make_abstract_mesh,
    named_sharding,
    validate_rules,
)

FAST = settings(max_examples=200, deadline=None, derandomize=True, database=None)

# Logical names the random rule sets and name tuples draw from: vocabulary names and names nobody declared.
POOL = ("embed", "mlp", "heads", "vocab", "exp", "kv", "activation_batch", "activation_length", "foo", "bar")


def _mesh_axes_value():
    return st.one_of(
        st.none(),
        st.sampled_from(MESH_AXES),
        st.lists(st.sampled_from(MESH_AXES), min_size=0, max_size=4, unique=True).map(tuple),
    )


rule_sets = st.lists(st.tuples(st.sampled_from(POOL), _mesh_axes_value()), max_size=14).map(tuple)


@st.composite
def name_tuples(draw):
    distinct = draw(st.lists(st.sampled_from(POOL), max_size=5, unique=True))
    slots = draw(st.lists(st.booleans(), min_size=len(distinct), max_size=len(distinct)))
    names: list[str | None] = []
    for name, none_before in zip(distinct, slots, strict=True):
        if none_before:
            names.append(None)
        names.append(name)
    if draw(st.booleans()):
        names.append(None)
    return tuple(names)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


# ---------------------------------------------------------------------------------------------------------------
# 1. Linen equivalence
# ---------------------------------------------------------------------------------------------------------------


@FAST
@given(rules=rule_sets, names=name_tuples())
def test_matches_flax_linen_without_mesh(rules, names):
    ours = logical_to_mesh_axes(names, rules, strict=False)
    theirs = nn.logical_to_mesh_axes(names, rules)
    assert ours == theirs
    assert tuple(ours) == tuple(theirs)  # also the exact entries (P(('a',)) == P('a') for PartitionSpec)


def _takes_a_fallback(rules, names) -> bool:
    """Some dimension got a later rule for its name than the first one (its first rule's axes were taken)."""
    spec = logical_to_mesh_axes(names, rules, strict=False)
    for name, entry in zip(names, spec, strict=True):
        first = next((axes for rule_name, axes in rules if rule_name == name), "no rule")
        if first != "no rule" and _axes(first) and _axes(entry) != _axes(first):
            return True
    return False


def test_the_random_inputs_reach_fallbacks_and_conflicts():
    """The property above is only worth something if its inputs exercise fallbacks: hypothesis finds one."""
    rules, names = find(
        st.tuples(rule_sets, name_tuples()),
        lambda rn: _takes_a_fallback(*rn),
        settings=settings(max_examples=2000, database=None, derandomize=True, phases=[Phase.generate]),
    )
    assert logical_to_mesh_axes(names, rules, strict=False) == nn.logical_to_mesh_axes(names, rules)
    # and a hand-written one
    rules = (("embed", ("fsdp", "tensor")), ("mlp", "tensor"), ("embed", "fsdp"), ("mlp", None), ("foo", ()))
    assert tuple(logical_to_mesh_axes(("mlp", "embed"), rules)) == (None, ("fsdp", "tensor"))
    assert tuple(logical_to_mesh_axes(("mlp",), rules)) == ("tensor",)


# ---------------------------------------------------------------------------------------------------------------
# 2. Seed 002: fallbacks, one mesh axis per array, and why Flax's dict-based rules are not used
# ---------------------------------------------------------------------------------------------------------------

SEED_002_RULES = (
    ("mlp", "fsdp_transpose"),
    ("embed", ("fsdp", "fsdp_transpose")),
    ("embed", "fsdp"),
)


def test_fallback_rule_taken_when_first_rule_axis_is_used():
    spec = logical_to_mesh_axes(("embed", "mlp"), SEED_002_RULES)
    assert tuple(spec) == ("fsdp", "fsdp_transpose")
    # Without the conflicting dimension the first embed rule applies.
    assert tuple(logical_to_mesh_axes(("embed", "vocab"), SEED_002_RULES)) == (("fsdp", "fsdp_transpose"), None)


def test_default_rules_fall_back_for_the_maxtext_base_yaml_case():
    """MaxText's base rules: mlp -> (fsdp_transpose, tensor, ...), embed -> (fsdp, fsdp_transpose, ...)."""
    mesh = make_abstract_mesh({"fsdp": 2, "fsdp_transpose": 2, "tensor": 2})
    spec = logical_to_mesh_axes(("embed", "mlp"), "default", mesh)
    assert tuple(spec) == ("fsdp", ("fsdp_transpose", "tensor"))
    spec = logical_to_mesh_axes(("mlp", "embed"), "default", mesh)
    assert tuple(spec) == (("fsdp_transpose", "tensor"), "fsdp")


@FAST
@given(rules=rule_sets, names=name_tuples(), with_mesh=st.booleans())
def test_a_mesh_axis_is_never_bound_twice(rules, names, with_mesh):
    mesh = make_abstract_mesh({"data": 2, "fsdp": 2, "tensor": 2, "expert": 2}) if with_mesh else None
    spec = logical_to_mesh_axes(names, rules, mesh, strict=False)
    used = [a for entry in spec for a in _axes(entry)]
    assert len(used) == len(set(used)), (rules, names, spec)
    assert len(spec) == len(names)


@FAST
@given(rules=rule_sets, names=name_tuples())
def test_with_mesh_is_linen_minus_size_one_axes(rules, names):
    sizes = {"data": 2, "fsdp": 4, "expert": 1}  # expert present at size 1; every other axis at size 1 too
    mesh = make_abstract_mesh(sizes)
    ours = logical_to_mesh_axes(names, rules, mesh, strict=False)
    for entry, linen_entry in zip(ours, nn.logical_to_mesh_axes(names, rules), strict=False):
        kept = tuple(a for a in _axes(linen_entry) if sizes.get(a, 1) > 1)
        expected = None if not kept else kept[0] if len(kept) == 1 else kept
        assert entry == expected
        assert not isinstance(entry, tuple) or len(entry) > 1  # single-element tuples collapse


def test_flax_dict_rules_differ_which_is_why_we_do_not_use_them():
    """Flax's ``from_sharding_rules`` (behind nnx eager sharding and ``get_var_pspec``) builds a dict: the last
    rule for a name wins, fallbacks are never tried, and nothing stops two dimensions sharing a mesh axis."""
    rules = (("embed", ("fsdp", "fsdp_transpose")), ("embed", "fsdp"), ("mlp", "fsdp_transpose"))
    names = ("embed", "mlp")
    ours = logical_to_mesh_axes(names, rules)
    assert tuple(ours) == (("fsdp", "fsdp_transpose"), None) == tuple(nn.logical_to_mesh_axes(names, rules))
    assert core_spmd.from_sharding_rules(names, rules) == ("fsdp", "fsdp_transpose")  # last 'embed' rule won

    clash = (("embed", "fsdp"), ("mlp", "fsdp"))
    assert core_spmd.from_sharding_rules(names, clash) == ("fsdp", "fsdp")  # an invalid spec
    assert tuple(logical_to_mesh_axes(names, clash)) == ("fsdp", None)

    # The same through an NNX Variable's own metadata.
    var = nnx.Param(jnp.zeros((4, 4)), out_sharding=names, sharding_rules=rules, eager_sharding=False)
    assert tuple(nnx_spmd.get_var_pspec(var)) == ("fsdp", "fsdp_transpose")

    # An unmapped name is passed through as if it were a mesh axis; ours replicates it.
    assert core_spmd.from_sharding_rules(("vocab",), rules) == ("vocab",)
    assert tuple(logical_to_mesh_axes(("vocab",), rules)) == (None,)


# ---------------------------------------------------------------------------------------------------------------
# 3. Size-1 removal, divisibility, vocabulary, validation
# ---------------------------------------------------------------------------------------------------------------

FSDP8 = make_abstract_mesh({"fsdp": 8})


def test_size_one_axes_are_removed():
    rules = (("activation_batch", ("data", "fsdp", "expert")),)
    spec = logical_to_mesh_axes(("activation_batch", None), rules, FSDP8)
    assert tuple(spec) == ("fsdp", None)
    assert isinstance(spec[0], str)
    # Without a mesh nothing is removed.
    assert tuple(logical_to_mesh_axes(("activation_batch",), rules)) == (("data", "fsdp", "expert"),)


def test_rule_naming_only_size_one_axes_replicates():
    rules = (("activation_batch", ("data", "expert")), ("embed", "tensor"))
    assert tuple(logical_to_mesh_axes(("activation_batch", "embed"), rules, FSDP8)) == (None, None)


def test_single_element_tuple_collapses_to_the_axis_name():
    rules = (("embed", ("fsdp",)),)
    spec = logical_to_mesh_axes(("embed",), rules, FSDP8)
    assert tuple(spec) == ("fsdp",) and isinstance(spec[0], str)
    # Without a mesh the entry is Linen's; PartitionSpec itself normalizes ('fsdp',) to 'fsdp'.
    linen = tuple(nn.logical_to_mesh_axes(("embed",), rules))
    assert tuple(logical_to_mesh_axes(("embed",), rules)) == ("fsdp",) == linen


def test_axes_absent_from_the_mesh_are_removed():
    from jax.sharding import AbstractMesh

    small = AbstractMesh((4,), ("fsdp",))  # a user mesh that lacks most of our axes
    assert tuple(logical_to_mesh_axes(("embed",), "default", small)) == ("fsdp",)


def test_divisibility_error_names_everything():
    mesh = make_abstract_mesh({"fsdp": 8})
    with pytest.raises(ShardingError) as info:
        logical_to_mesh_axes(("vocab", "embed"), "default", mesh, shape=(64, 12), path="model.embed.table")
    msg = str(info.value)
    for part in ("model.embed.table", "dimension 1", "'embed'", "size 12", "('fsdp',)", "8 shards", "Change the mesh"):
        assert part in msg, (part, msg)
    # Divisible shapes pass, and a replicated dimension of any size is fine.
    assert tuple(logical_to_mesh_axes(("vocab", "embed"), "default", mesh, shape=(63, 16))) == (None, "fsdp")


def test_shape_rank_mismatch_and_shape_without_mesh_error():
    with pytest.raises(ShardingError, match="one name per dimension"):
        logical_to_mesh_axes(("embed",), "default", FSDP8, shape=(8, 8))
    with pytest.raises(ShardingError, match="needs the mesh"):
        logical_to_mesh_axes(("embed",), "default", shape=(8,))


def test_unknown_name_is_an_error_in_strict_mode_and_replicated_otherwise():
    with pytest.raises(ShardingError) as info:
        logical_to_mesh_axes(("embedd", "mlp"), "default", path="decoder.mlp.wi")
    msg = str(info.value)
    assert "decoder.mlp.wi" in msg and "'embedd'" in msg and "strict=False" in msg
    spec = logical_to_mesh_axes(("embedd", "mlp"), "default", strict=False)
    assert tuple(spec) == (None, ("fsdp_transpose", "tensor"))


def test_a_name_the_rule_set_mentions_is_known_even_outside_the_vocabulary():
    assert "my_dim" not in LOGICAL_AXES
    assert tuple(logical_to_mesh_axes(("my_dim",), (("my_dim", "tensor"),))) == ("tensor",)


def test_known_vocabulary_name_absent_from_the_rules_is_replicated():
    rules = (("embed", "fsdp"),)
    assert "cache_batch" in LOGICAL_AXES
    assert tuple(logical_to_mesh_axes(("cache_batch", "embed"), rules, FSDP8)) == (None, "fsdp")
    # pure-fsdp does not mention activation_length: replicated, no error.
    assert tuple(logical_to_mesh_axes(("activation_length",), "pure-fsdp", FSDP8)) == (None,)


def test_repeated_names_in_one_array_error():
    with pytest.raises(ShardingError, match=r"\['embed'\] occur more than once"):
        logical_to_mesh_axes(("embed", "mlp", "embed"), "default", path="w")
    # None may repeat.
    assert tuple(logical_to_mesh_axes((None, "embed", None), (("embed", "fsdp"),))) == (None, "fsdp", None)


def test_non_string_names_error():
    with pytest.raises(ShardingError, match="strings or None"):
        logical_to_mesh_axes(("embed", 3), "default")


def test_bad_user_rule_sets_error_clearly():
    with pytest.raises(ValueError, match=r"unknown mesh axes \['fsdpp'\].*mesh axes are \('stage'"):
        get_rules([("embed", "fsdpp")])
    with pytest.raises(ValueError, match=r"rule #1 .*unknown mesh axes \['model'\]"):
        get_rules([("embed", "fsdp"), ("mlp", ("tensor", "model"))])
    with pytest.raises(TypeError, match=r"rule #0 is \('embed',\); each rule must be a pair"):
        get_rules([("embed",)])
    with pytest.raises(TypeError, match="each rule must be a pair"):
        get_rules(["embed"])
    with pytest.raises(TypeError, match="rule for 'embed' maps to 3"):
        get_rules([("embed", 3)])
    with pytest.raises(TypeError, match="not a dict"):
        get_rules({"embed": "fsdp"})
    with pytest.raises(ValueError, match=r"names mesh axes \['fsdp'\] more than once"):
        get_rules([("embed", ("fsdp", "fsdp"))])
    # The resolver checks the rules it is given too: a mesh-axis typo must not silently replicate.
    with pytest.raises(ValueError, match="fsdpp"):
        logical_to_mesh_axes(("embed",), (("embed", "fsdpp"),), FSDP8)


def test_user_rules_are_normalized():
    rules = get_rules([["embed", ["fsdp", "tensor"]], ("mlp", None), ("kv", ())])
    assert rules == (("embed", ("fsdp", "tensor")), ("mlp", None), ("kv", ()))
    assert tuple(logical_to_mesh_axes(("embed",), [["embed", ["fsdp", "tensor"]]])) == (("fsdp", "tensor"),)


def test_get_rules_unknown_name_lists_the_sets():
    with pytest.raises(ValueError) as info:
        get_rules("nope")
    msg = str(info.value)
    assert "'nope'" in msg
    for name in ("default", "pure-fsdp", "ep-as-cp", "cp-as-ep", "ep-as-dp", "shard-exp-on-fsdp"):
        assert name in msg


@pytest.mark.parametrize("name", sorted(RULE_SETS))
def test_named_rule_sets_are_valid_and_use_only_the_vocabulary(name):
    rules = get_rules(name)
    assert validate_rules(rules) == rules
    undeclared = sorted({n for n, _ in rules} - LOGICAL_AXES.keys())
    assert not undeclared, f"{name} mentions names missing from axes.py: {undeclared}"


def test_named_rule_sets_are_the_seven_of_the_design():
    assert set(RULE_SETS) == {"default", "pure-fsdp", "ep-as-cp", "cp-as-ep", "ep-as-dp", "shard-exp-on-fsdp",
                              "pipeline-large-moe"}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("default", ("context",)),
        ("pure-fsdp", ()),
        ("ep-as-cp", ("context", "expert")),
        ("cp-as-ep", ("context",)),
        ("ep-as-dp", ("context",)),
        ("shard-exp-on-fsdp", ("context",)),
    ],
)
def test_context_axes(name, expected):
    assert context_axes(get_rules(name)) == expected


def test_context_axes_of_user_rules():
    assert context_axes((("activation_length", "expert"), ("activation_length", "context"))) == ("expert",)
    assert context_axes((("activation_length", None),)) == ()
    assert context_axes((("embed", "fsdp"),)) == ()


def test_strategy_switch_is_one_word():
    """The rule sets differ where the design says they do (expert weights, the sequence dim)."""
    mesh = make_abstract_mesh({"fsdp": 2, "context": 2, "expert": 2})
    wi = ("exp", "embed_no_exp", "moe_mlp")
    assert tuple(logical_to_mesh_axes(wi, "default", mesh)) == ("expert", ("fsdp", "context"), None)
    assert tuple(logical_to_mesh_axes(wi, "pure-fsdp", mesh)) == (None, "fsdp", None)
    # fsdp moves from the width to the expert dim; the width keeps only context (MaxText: embed_moe -> context)
    assert tuple(logical_to_mesh_axes(wi, "shard-exp-on-fsdp", mesh)) == (("expert", "fsdp"), "context", None)
    # experts split over expert; expert is data parallelism outside the MoE, never FSDP for the weights
    assert tuple(logical_to_mesh_axes(wi, "ep-as-dp", mesh)) == ("expert", ("fsdp", "context"), None)
    assert tuple(logical_to_mesh_axes(wi, "cp-as-ep", mesh)) == (("context", "expert"), "fsdp", None)  # MaxText's order
    act = ("activation_batch", "activation_length", "activation_embed")
    assert tuple(logical_to_mesh_axes(act, "default", mesh)) == (("fsdp", "expert"), "context", None)
    assert tuple(logical_to_mesh_axes(act, "ep-as-cp", mesh)) == ("fsdp", ("context", "expert"), None)


def test_named_sharding_wraps_the_resolved_spec():
    import jax

    mesh = jax.make_mesh((8,), ("fsdp",))
    s = named_sharding(("embed", "mlp"), (("embed", "fsdp"),), mesh, shape=(16, 3))
    assert s.mesh == mesh and s.spec == P("fsdp", None)
