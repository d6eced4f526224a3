"""Aux-loss-free balancing: per-expert loads, and the bias update that moves routing toward balance."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.train.step import train_step


def _model():
    config = DeepSeekV3Config.preset("deepseek3-mini", num_hidden_layers=3, vocab_size=128)
    return config, DeepSeekV3(config, rngs=nnx.Rngs(0))


def test_expert_load_counts_the_routed_pairs():
    config, model = _model()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)))
    out = model.forward(ids, with_expert_load=True, with_routing=True)
    load, chosen = out.expert_load, out.expert_indices  # chosen: [layers, b, s, k]
    expected = np.stack([np.bincount(np.asarray(c).ravel(), minlength=config.n_routed_experts) for c in chosen])
    np.testing.assert_array_equal(np.asarray(load), expected)
    assert load.shape == (config.num_moe_layers, config.n_routed_experts)


def test_update_moves_bias_against_the_load():
    config, model = _model()
    load = jnp.asarray(np.random.default_rng(1).integers(0, 20, (config.num_moe_layers, config.n_routed_experts)),
                       jnp.float32)
    before = np.asarray(model.moe_layers.mlp.e_score_correction_bias[...])
    model.update_routing_bias(load, 0.01)
    step = np.asarray(model.moe_layers.mlp.e_score_correction_bias[...]) - before
    mean = np.asarray(load).mean(-1, keepdims=True)
    np.testing.assert_allclose(step, 0.01 * np.sign(mean - np.asarray(load)), atol=1e-7)


def test_train_step_updates_the_bias_but_the_optimizer_does_not_train_it():
    config, model = _model()
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 128, (4, 12)))
    batch = {"input_ids": ids, "targets": ids, "loss_mask": jnp.ones(ids.shape)}
    step = nnx.jit(train_step, static_argnames=("model_kwargs", "routing_bias_rate"))
    metrics = step(model, optimizer, batch, model_kwargs=(("with_expert_load", True),), routing_bias_rate=0.0)
    assert np.all(np.asarray(model.moe_layers.mlp.e_score_correction_bias[...]) == 0)  # lr 0, rate 0: unchanged
    assert float(metrics["expert_max_over_mean"]) >= 1.0
    step(model, optimizer, batch, model_kwargs=(("with_expert_load", True),), routing_bias_rate=1e-3)
    bias = np.asarray(model.moe_layers.mlp.e_score_correction_bias[...])
    assert np.all(np.isin(np.round(bias / 1e-3), [-1, 0, 1])) and np.any(bias != 0)
    assert jax.tree.leaves(metrics)
