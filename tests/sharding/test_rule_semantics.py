"""Each named rule set means what the MaxText rule file of the same name means (docs/rule_sets.md has the table):
where routed experts, non-expert weights, the router, MLA latents, the embedding and the activations go."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

import nnx_zoo  # noqa: F401  (declares DeepSeek's q_lora / kv_lora)
from nnx_zoo.sharding import RULE_SETS, ShardingError, logical_to_mesh_axes, make_abstract_mesh

EXPERTS = ("exp", "embed_no_exp", "moe_mlp")  # routed expert wi [E, embed, moe_mlp]
DENSE = ("embed", "mlp")  # dense MLP / shared expert wi
ATTN_Q = ("embed", "heads", "kv")
EMBEDDING = ("vocab", "embed")
ROUTER = ("embed", "exp_router")
LATENT_UP = ("q_lora", "heads", "kv")  # MLA wq_b
HIDDEN = ("activation_batch", "activation_length", "activation_embed")


def axes(names, rules, mesh):
    """Per dimension, the set of mesh axes it is split over."""
    spec = logical_to_mesh_axes(names, rules, make_abstract_mesh(mesh))
    return [set() if a is None else {a} if isinstance(a, str) else set(a) for a in spec]


def test_default():
    mesh = {"fsdp": 2, "context": 2, "tensor": 2, "expert": 2}
    exp, width, hidden = axes(EXPERTS, "default", mesh)
    assert exp == {"expert"} and width == {"fsdp", "context"} and hidden == {"tensor"}
    assert axes(DENSE, "default", mesh) == [{"fsdp", "context", "expert"}, {"tensor"}]  # expert is FSDP here
    assert axes(ROUTER, "default", mesh)[1] == set()  # top-k needs every expert's score
    assert axes(LATENT_UP, "default", mesh)[:2] == [{"fsdp", "context", "expert"}, {"tensor"}]
    assert axes(EMBEDDING, "default", mesh) == [{"tensor"}, {"fsdp", "context", "expert"}]
    assert axes(HIDDEN, "default", mesh) == [{"fsdp", "expert"}, {"context"}, set()]


def test_pure_fsdp_uses_only_data_and_fsdp():
    mesh = {"data": 2, "fsdp": 4, "context": 2, "tensor": 2, "expert": 2}
    for names in (EXPERTS, DENSE, ATTN_Q, EMBEDDING, ROUTER, LATENT_UP, HIDDEN):
        used = set().union(*axes(names, "pure-fsdp", mesh))
        assert used <= {"data", "fsdp"}, (names, used)
    assert axes(EXPERTS, "pure-fsdp", mesh)[:2] == [set(), {"fsdp"}]  # experts whole, width FSDP
    assert axes(HIDDEN, "pure-fsdp", mesh)[0] == {"data", "fsdp"}


def test_ep_as_cp_expert_splits_the_sequence_outside_the_moe_and_experts_inside():
    mesh = {"fsdp": 2, "expert": 4}
    assert axes(HIDDEN, "ep-as-cp", mesh) == [{"fsdp"}, {"expert"}, set()]
    assert axes(EXPERTS, "ep-as-cp", mesh)[:2] == [{"expert"}, {"fsdp"}]
    assert axes(DENSE, "ep-as-cp", mesh)[0] == {"fsdp", "expert"}  # MaxText: embed -> [fsdp, expert]
    assert axes(EMBEDDING, "ep-as-cp", mesh) == [set(), {"fsdp", "expert"}]
    assert axes(LATENT_UP, "ep-as-cp", mesh)[0] == {"fsdp"}  # MaxText: q_lora -> [fsdp]
    # The MoE core's tokens are split over expert too (the dispatch exchanges them over it).
    assert axes(("activation_tokens", "activation_embed"), "ep-as-cp", mesh)[0] == {"fsdp", "expert"}


def test_cp_as_ep_context_splits_the_sequence_outside_the_moe_and_experts_inside():
    mesh = {"fsdp": 2, "context": 2, "expert": 2}
    assert axes(HIDDEN, "cp-as-ep", mesh) == [{"fsdp", "expert"}, {"context"}, set()]
    assert axes(EXPERTS, "cp-as-ep", mesh)[:2] == [{"context", "expert"}, {"fsdp"}]  # MaxText: embed_moe -> fsdp
    assert axes(("activation_tokens", "activation_exp"), "cp-as-ep", mesh)[1] == set()  # tokens took them first
    assert axes(("activation_exp",), "cp-as-ep", mesh)[0] == {"context", "expert"}
    assert axes(DENSE, "cp-as-ep", mesh)[0] == {"fsdp", "context", "expert"}
    assert axes(LATENT_UP, "cp-as-ep", mesh)[0] == {"fsdp", "context", "expert"}


def test_ep_as_dp_expert_is_data_parallel_outside_the_moe_and_splits_experts_inside():
    mesh = {"fsdp": 4, "expert": 2}
    assert axes(EXPERTS, "ep-as-dp", mesh)[:2] == [{"expert"}, {"fsdp"}]  # experts split, not one more FSDP
    assert axes(("activation_exp",), "ep-as-dp", mesh) == [{"expert"}]
    assert axes(HIDDEN, "ep-as-dp", mesh)[0] == {"fsdp", "expert"}  # batch split over expert: data parallel
    # ... and, as data parallelism, non-expert weights are replicated over expert (FSDP over fsdp only).
    for names in (DENSE, ATTN_Q, EMBEDDING, ROUTER, LATENT_UP):
        assert "expert" not in set().union(*axes(names, "ep-as-dp", mesh)), names
    assert axes(DENSE, "ep-as-dp", mesh)[0] == {"fsdp"}
    mesh2 = {"fsdp": 2, "fsdp_transpose": 2, "expert": 2}
    assert axes(ATTN_Q, "ep-as-dp", mesh2)[0] == {"fsdp", "fsdp_transpose"}  # MaxText: embed -> [fsdp, fsdp_t]
    assert axes(DENSE, "ep-as-dp", mesh2) == [{"fsdp"}, {"fsdp_transpose"}]


def test_shard_exp_on_fsdp_splits_the_expert_dim_over_expert_and_fsdp():
    mesh = {"fsdp": 4, "expert": 2}
    assert axes(EXPERTS, "shard-exp-on-fsdp", mesh) == [{"expert", "fsdp"}, set(), set()]  # whole matrices
    assert axes(DENSE, "shard-exp-on-fsdp", mesh)[0] == {"fsdp", "expert"}
    assert axes(HIDDEN, "shard-exp-on-fsdp", mesh)[0] == {"fsdp", "expert"}
    # MaxText: embed_moe -> context (the axis fsdp leaves free).
    assert axes(EXPERTS, "shard-exp-on-fsdp", {"fsdp": 2, "context": 2, "expert": 2})[:2] == [
        {"expert", "fsdp"}, {"context"}]



def test_pipeline_large_moe_as_maxtext_file():
    """MaxText's pipeline-large-moe.yml: stacks on stage, the batch on (data, fsdp, expert), experts on expert, the
    width on (fsdp, expert), expert widths and latents on fsdp, tensor for heads, MLP, vocab and activation width;
    fsdp_transpose and tensor_transpose (not in its mesh) are used by nothing."""
    mesh = {"stage": 2, "data": 2, "fsdp": 2, "fsdp_transpose": 2, "context": 2, "tensor": 2, "tensor_transpose": 2,
            "expert": 2}
    rules = "pipeline-large-moe"
    assert axes(("layers", *EXPERTS), rules, mesh) == [{"stage"}, {"expert"}, {"fsdp"}, {"tensor"}]
    assert axes(("layers", *DENSE), rules, mesh) == [{"stage"}, {"fsdp", "expert"}, {"tensor"}]
    assert axes(EMBEDDING, rules, mesh) == [{"tensor"}, {"fsdp", "expert"}]
    assert axes(LATENT_UP, rules, mesh) == [{"fsdp"}, {"tensor"}, set()]
    assert axes(HIDDEN, rules, mesh) == [{"data", "fsdp", "expert"}, {"context"}, {"tensor"}]
    for names in (EXPERTS, DENSE, ATTN_Q, EMBEDDING, ROUTER, LATENT_UP, HIDDEN):
        assert not set().union(*axes(names, rules, mesh)) & {"fsdp_transpose", "tensor_transpose", "stage"}, names

# MaxText's q_lora/kv_lora rules per file (e591f30), on a mesh with every axis its file can name: the latent of
# an up-projection [latent, heads, kv] is FSDP-sharded like the width, but on fewer axes in three sets.
LATENT_MESH = {"fsdp": 2, "fsdp_transpose": 2, "context": 2, "expert": 2}
LATENT_PLACEMENT = {
    "default": {"fsdp", "fsdp_transpose", "context", "expert"},  # = embed
    "cp-as-ep": {"fsdp", "fsdp_transpose", "context", "expert"},  # = embed
    "pure-fsdp": {"fsdp"},  # = embed
    "ep-as-cp": {"fsdp", "fsdp_transpose", "context"},  # embed's without expert (MaxText's mesh: fsdp only)
    "ep-as-dp": {"fsdp", "context"},  # embed's without fsdp_transpose (MaxText's mesh: fsdp only)
    "shard-exp-on-fsdp": {"fsdp", "fsdp_transpose", "expert"},  # embed's without context (= MaxText)
    "pipeline-large-moe": {"fsdp"},  # MaxText: q_lora/kv_lora -> [fsdp]
}


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
@pytest.mark.parametrize("latent", ["latent", "q_lora", "kv_lora"])
def test_latent_of_an_up_projection(rules, latent):
    assert axes((latent, "heads", "kv"), rules, LATENT_MESH)[0] == LATENT_PLACEMENT[rules]
    # The down-projection [embed, latent]: embed picks first; the latent gets nothing (MaxText *_lora_up_proj: []).
    embed_alone = axes(("embed", None), rules, LATENT_MESH)[0]
    assert axes(("embed", latent), rules, LATENT_MESH) == [embed_alone, set()]


def test_latents_divide_at_scale_where_maxtext_keeps_them_off_expert():
    """deepseek3-671b's 512-wide kv latent on fsdp=256 x expert=8 (2,048 devices): strict resolution places it
    under ep-as-cp and ep-as-dp (fsdp only), while the sets whose latent rule has expert cannot split it."""
    mesh = make_abstract_mesh({"fsdp": 256, "expert": 8})
    kv_b = (("kv_lora", "heads", "kv"), (512, 128, 256))
    for rules in ("ep-as-cp", "ep-as-dp"):
        assert logical_to_mesh_axes(kv_b[0], rules, mesh, shape=kv_b[1]) == P("fsdp", None, None)
    with pytest.raises(ShardingError, match="kv_lora"):
        logical_to_mesh_axes(kv_b[0], "default", mesh, shape=kv_b[1])


def test_every_named_set_is_checked_here():
    assert set(RULE_SETS) == {"default", "pure-fsdp", "ep-as-cp", "cp-as-ep", "ep-as-dp", "shard-exp-on-fsdp",
                              "pipeline-large-moe"}


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_router_expert_dim_is_whole_everywhere(rules):
    mesh = {"fsdp": 2, "context": 2, "tensor": 2, "expert": 2}
    assert axes(ROUTER, rules, mesh)[1] == set()


def _ordered(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_tokens_are_the_batch_axes_then_the_sequence_axes(rules):
    """``activation_tokens`` is ``[batch, seq]`` flattened (the MoE block, the losses), so its mesh axes are the
    batch's followed by the sequence's, in order: flattening is then a reshape that moves nothing. Listing the
    sequence's ``context`` before the batch's ``expert`` (as these sets did) laid the MoE input out again: the dense
    MoE step on fsdp 2 x context 2 x expert 2 moved 10.07 MiB per device (Explicit) where it moves 9.82 now."""
    mesh = make_abstract_mesh({"data": 2, "fsdp": 2, "fsdp_transpose": 2, "context": 2, "expert": 2})
    batch, length = (_ordered(e) for e in logical_to_mesh_axes(("activation_batch", "activation_length"),
                                                                  rules, mesh))
    tokens = _ordered(logical_to_mesh_axes(("activation_tokens",), rules, mesh)[0])
    assert tokens == batch + length


def test_cp_as_ep_orders_the_expert_group_as_maxtext():
    """MaxText's cp-as-ep: ``exp`` and ``activation_exp`` on ``['context', 'expert']`` (in that order)."""
    mesh = make_abstract_mesh({"fsdp": 2, "context": 2, "expert": 2})
    for name in ("exp", "activation_exp"):
        assert _ordered(logical_to_mesh_axes((name,), "cp-as-ep", mesh)[0]) == ("context", "expert")
