"""Model behaviour beyond HF parity: training-facing pieces (remat policies, what an optimizer trains), the
output contract, and the stacked parameter layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3
from nnx_zoo.models.deepseek import RouterBias
from nnx_zoo.sharding import abstract_module, iter_variables, logical_names
from tests.models.deepseek.small import small_config


def _loss(model: DeepSeekV3, ids: jax.Array) -> jax.Array:
    """Next-token loss, plus the MTP head's next-next-token loss when the model has one."""
    mtp = model.mtp_layers is not None
    out = model.forward(ids, with_mtp=mtp)
    logp = jax.nn.log_softmax(out.logits[:, :-1])
    loss = -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()
    if mtp:
        mtp_logp = jax.nn.log_softmax(out.mtp_logits[0, :, :-2])
        loss += 0.1 * -jnp.take_along_axis(mtp_logp, ids[:, 2:, None], -1).mean()
    return loss


def test_remat_policies_give_the_same_gradients():
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    grads = {}
    for policy in ("none", "full", "dots_saveable"):
        config = small_config(remat_policy=policy, moe_impl="gmm", num_nextn_predict_layers=0)
        model = DeepSeekV3.create(config, seed=0)
        loss, g = nnx.jit(nnx.value_and_grad(_loss))(model, ids)
        grads[policy] = (float(loss), jax.tree.leaves(g))
    ref_loss, ref = grads["none"]
    for policy in ("full", "dots_saveable"):
        loss, g = grads[policy]
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for a, b in zip(g, ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_optimizer_trains_params_but_not_the_router_bias():
    model = DeepSeekV3.create(small_config(moe_impl="dense"), seed=0)
    bias_paths = [p for p, v in iter_variables(model) if isinstance(v, RouterBias)]
    assert bias_paths == ["moe_layers.mlp.e_score_correction_bias", "mtp_layers.layer.mlp.e_score_correction_bias"]
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    before = {p: np.asarray(v[...]) for p, v in iter_variables(model)}

    @nnx.jit
    def step(model, optimizer, ids):
        grads = nnx.grad(_loss, argnums=nnx.DiffState(0, nnx.Param))(model, ids)
        optimizer.update(model, grads)

    step(model, optimizer, ids)
    after = {p: np.asarray(v[...]) for p, v in iter_variables(model)}
    for p in before:
        changed = not np.array_equal(before[p], after[p])
        assert changed == (p not in bias_paths), p


def test_stacked_layout_and_names():
    model = abstract_module(lambda: DeepSeekV3(small_config(num_hidden_layers=3), rngs=nnx.Rngs(0)))
    variables = dict(iter_variables(model))
    wi = variables["moe_layers.mlp.experts.wi_gate"]
    assert wi.shape == (2, 8, 128, 64)
    assert logical_names(wi) == ("moe_layers", "exp", "embed_no_exp", "moe_mlp")
    assert logical_names(variables["dense_layers.attn.q_b_proj.kernel"]) == ("dense_layers", "q_lora", "heads", "kv")
    assert logical_names(variables["mtp_layers.eh_proj.kernel"]) == ("mtp_layers", "mtp_embed", "embed")
    assert variables["dense_layers.attn.q_b_proj.kernel"].shape == (1, 64, 4, 48)
    assert all(v.get_metadata().get("eager_sharding") is False for v in variables.values())


def test_output_contract():
    config = small_config(num_hidden_layers=3, num_nextn_predict_layers=0, dtype="bfloat16", param_dtype="bfloat16")
    ids, mask = jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5), jnp.int32)

    def shapes_of(config, **forward_kwargs):  # build and run abstractly: shapes and dtypes only, nothing compiled
        def run():
            model = DeepSeekV3(config, rngs=nnx.Rngs(0))
            return model.forward(ids, mask, **forward_kwargs) if forward_kwargs else model(ids, mask)
        return jax.eval_shape(run)

    logits = shapes_of(config)
    assert logits.shape == (2, 5, 256) and logits.dtype == jnp.bfloat16
    out = shapes_of(config, with_hidden_states=True, with_routing=True, with_expert_load=True)
    assert out.hidden_states.shape == (4, 2, 5, 128) and out.expert_indices.shape == (2, 2, 5, 2)
    assert out.expert_load.shape == (2, 8) and out.dropped_tokens.shape == (2,)
    assert out.mtp_logits is None and out.aux_loss is None
    model = abstract_module(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0)))
    assert model.moe_layers.mlp.e_score_correction_bias.dtype == jnp.float32  # the router stays float32
    with pytest.raises(ValueError, match="no MTP heads"):
        shapes_of(config, with_mtp=True)
    assert shapes_of(small_config(), with_mtp=True).mtp_logits.shape == (1, 2, 5, 256)


def _count_ops(jaxpr, name: str, *shapes: tuple[int, ...]) -> int:
    """``name`` equations (nested jaxprs included) with an operand or result of one of ``shapes``."""
    count = 0
    for eqn in jaxpr.eqns:
        seen = {getattr(v.aval, "shape", None) for v in (*eqn.invars, *eqn.outvars)}
        count += eqn.primitive.name == name and bool(seen & set(shapes))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _count_ops(inner, name, *shapes)
    return count


@pytest.mark.parametrize("depth", [1, 2])
def test_main_model_and_mtp_depths_share_one_lookup_and_one_head_matmul(depth):
    """The main model's tokens and every MTP depth's shifted ones are looked up together, and the main and MTP
    hidden states go through the output head in one matmul: the table's gradient is one scatter-add and the
    head's one dot, each reduced over the devices once per step, not once per depth (benchmarks/README.md 4.1)."""
    vocab, hidden = 320, 128  # a vocab no other dim shares
    config = small_config(vocab_size=vocab, num_nextn_predict_layers=depth, moe_impl="dense")
    model = DeepSeekV3.create(config, seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (2, 12)), jnp.int32)
    jaxpr = jax.make_jaxpr(nnx.grad(_loss))(model, ids).jaxpr
    assert _count_ops(jaxpr, "gather", (vocab, hidden)) == 1
    assert _count_ops(jaxpr, "scatter-add", (vocab, hidden)) == 1
    # the head (or its transposed copy): one forward dot, its input gradient and its weight gradient
    assert _count_ops(jaxpr, "dot_general", (hidden, vocab), (vocab, hidden)) == 3
