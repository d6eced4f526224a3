"""Family-declared logical names (``declare_axis``): placed like their ``like`` name by every rule set without
edits to any rule set, overridden by a rule set that names them, typos still rejected, conflicting declarations
refused. A toy family declares its names in this module, as a family's ``axes.py`` would."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

import nnx_zoo  # noqa: F401  (imports every family, so their declarations exist)
from nnx_zoo.sharding import (
    LOGICAL_AXES,
    RULE_SETS,
    STACK_AXES,
    ShardingError,
    declare_axis,
    declared_axes,
    describe,
    expand_rules,
    get_rules,
    logical_to_mesh_axes,
    make_abstract_mesh,
)
from nnx_zoo.sharding.axes import like_chain, placed_like

TOY_LATENT = declare_axis("toy_latent", like="embed", doc="toy family's attention latent width")
TOY_SUB = declare_axis("toy_sub", like=TOY_LATENT, doc="toy family's narrower latent (a chain of likes)")
TOY_BLOCKS = declare_axis("toy_blocks", like="layers", doc="toy family's stack of blocks")
TOY_WHOLE = declare_axis("toy_whole", like=None, doc="toy family's dim that no rule set splits")
_DECLARED_AT = __file__

# Every mesh axis of size 2 (128 abstract devices): each rule's every axis is live.
ALL2 = make_abstract_mesh({a: 2 for a in ("data", "fsdp", "fsdp_transpose", "context", "tensor",
                                          "tensor_transpose", "expert")})
MOE_MESH = make_abstract_mesh({"fsdp": 2, "tensor": 2, "expert": 2})


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
@pytest.mark.parametrize("other", [(), ("heads", "kv"), ("mlp",), ("vocab",), ("exp", "moe_mlp")])
def test_declared_name_is_placed_like_its_like_under_every_named_set(rules, other):
    """In an array without its ``like``, a declared name gets exactly the ``like``'s placement (chains too)."""
    for mesh in (ALL2, MOE_MESH):
        want = logical_to_mesh_axes(("embed", *other), rules, mesh)
        assert logical_to_mesh_axes((TOY_LATENT, *other), rules, mesh) == want
        assert logical_to_mesh_axes((TOY_SUB, *other), rules, mesh) == want


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_like_picks_first_when_both_are_in_one_array(rules):
    """[embed, toy_latent]: embed keeps its own placement; the declared name gets only what embed left."""
    for mesh in (ALL2, MOE_MESH):
        embed_alone = logical_to_mesh_axes(("embed", None), rules, mesh)
        both = logical_to_mesh_axes(("embed", TOY_LATENT), rules, mesh)
        assert both[0] == embed_alone[0]
        used = set(both[0] if isinstance(both[0], tuple) else (both[0],))
        rest = set(both[1] if isinstance(both[1], tuple) else (both[1],)) - {None}
        assert not rest & used


def test_concrete_placements_on_a_small_moe_mesh():
    # default on fsdp=2, tensor=2, expert=2: embed -> (fsdp, expert), mlp -> tensor, heads -> tensor.
    assert logical_to_mesh_axes((TOY_LATENT, "mlp"), "default", MOE_MESH) == P(("fsdp", "expert"), "tensor")
    assert logical_to_mesh_axes((TOY_LATENT, "heads", "kv"), "default", MOE_MESH) == P(
        ("fsdp", "expert"), "tensor", None)
    assert logical_to_mesh_axes(("embed", TOY_LATENT), "default", MOE_MESH) == P(("fsdp", "expert"), None)
    assert logical_to_mesh_axes((TOY_BLOCKS, "embed", "mlp"), "default", MOE_MESH) == P(
        None, ("fsdp", "expert"), "tensor")
    assert logical_to_mesh_axes((TOY_LATENT,), "pure-fsdp", make_abstract_mesh({"fsdp": 8})) == P("fsdp")


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_like_none_is_replicated_everywhere(rules):
    assert logical_to_mesh_axes((TOY_WHOLE, "embed"), rules, ALL2)[0] is None


def test_a_rule_set_that_names_the_declared_name_wins():
    own = (("embed", "fsdp"), (TOY_LATENT, "tensor"))
    assert logical_to_mesh_axes((TOY_LATENT,), own) == P("tensor")
    # ... and the chain below it follows the mentioned name, not the root.
    assert logical_to_mesh_axes((TOY_SUB,), own) == P("tensor")
    assert logical_to_mesh_axes((TOY_WHOLE,), ((TOY_WHOLE, "expert"),)) == P("expert")


def test_a_users_own_rule_set_places_declared_names_without_edits():
    own = get_rules([("embed", ("fsdp", "expert")), ("mlp", "tensor")])
    assert logical_to_mesh_axes((TOY_LATENT, "mlp"), own) == P(("fsdp", "expert"), "tensor")
    expanded = expand_rules(own)
    copies = [name for name, axes in expanded if axes == ("fsdp", "expert")]
    assert copies[0] == "embed" and {TOY_LATENT, TOY_SUB, "q_lora", "kv_lora"} <= set(copies), copies
    # A set that mentions neither the name nor its like: known, so replicated, not an error.
    assert logical_to_mesh_axes((TOY_LATENT, "mlp"), (("mlp", "tensor"),)) == P(None, "tensor")


def test_shared_latent_is_placed_like_embed_by_a_set_that_does_not_mention_it():
    """DeepSeek's latents are declared like the shared 'latent'; a user's set written without 'latent' still
    FSDP-shards them like the width, and one that names 'latent' places them by its own rule."""
    assert like_chain("q_lora") == ("q_lora", "latent", "embed") and placed_like("kv_lora") == "embed"
    without = get_rules([("embed", ("fsdp", "expert")), ("heads", "tensor")])
    for name in ("latent", "q_lora", "kv_lora"):
        assert logical_to_mesh_axes((name, "heads"), without, MOE_MESH) == P(("fsdp", "expert"), "tensor")
    named = get_rules([("embed", ("fsdp", "expert")), ("latent", "fsdp"), ("heads", "tensor")])
    for name in ("latent", "q_lora", "kv_lora"):
        assert logical_to_mesh_axes((name, "heads"), named, MOE_MESH) == P("fsdp", "tensor")
    assert logical_to_mesh_axes(("q_lora",), (("mlp", "tensor"),)) == P(None)  # neither named: replicated


def test_a_typo_is_still_rejected_with_the_way_to_declare_it():
    with pytest.raises(ShardingError) as info:
        logical_to_mesh_axes(("toy_latnet", "mlp"), "default", path="toy.attn.w")
    msg = str(info.value)
    assert "'toy_latnet'" in msg and "toy.attn.w" in msg and "declare_axis" in msg


def test_redeclaring_with_another_meaning_names_both_places():
    assert declare_axis("toy_latent", like="embed", doc="toy family's attention latent width") == "toy_latent"
    with pytest.raises(ValueError) as info:
        declare_axis("toy_latent", like="mlp", doc="toy family's attention latent width")
    msg = str(info.value)
    first = declared_axes()["toy_latent"].where
    assert first.startswith(_DECLARED_AT + ":") and msg.count(_DECLARED_AT + ":") == 2, msg
    assert "like='embed'" in msg and "like='mlp'" in msg
    assert declared_axes()["toy_latent"].like == "embed"  # the first declaration stands


def test_declaring_bad_names_errors():
    with pytest.raises(ValueError, match="'embed' is a shared logical name"):
        declare_axis("embed", like="mlp", doc="x")
    with pytest.raises(ValueError, match="'embd' is not a known logical name"):
        declare_axis("toy_other", like="embd", doc="x")
    with pytest.raises(ValueError, match="give doc="):
        declare_axis("toy_other", like="embed", doc="")
    assert "toy_other" not in declared_axes()


def test_stack_axes_include_declared_stack_names():
    assert TOY_BLOCKS in STACK_AXES and "layers" in STACK_AXES
    assert TOY_LATENT not in STACK_AXES and "embed" not in STACK_AXES and "nonsense" not in STACK_AXES
    assert {"dense_layers", "moe_layers", "mtp_layers"} <= set(STACK_AXES)
    assert like_chain(TOY_SUB) == (TOY_SUB, TOY_LATENT, "embed") and placed_like(TOY_WHOLE) is None


def test_deepseek_names_live_in_its_folder_not_in_the_shared_vocabulary():
    deepseek = {"q_lora", "kv_lora", "mtp_embed", "activation_q_lora", "activation_kv_lora", "dense_layers",
                "moe_layers", "mtp_layers"}
    assert not deepseek & LOGICAL_AXES.keys()
    for name in deepseek:
        assert declared_axes()[name].where.split(":")[0].endswith("nnx_zoo/models/deepseek/axes.py"), name
        assert name in describe(name) or describe(name)
    for rules in RULE_SETS.values():
        assert not deepseek & {n for n, _ in rules}
