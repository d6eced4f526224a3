"""The sequence-wise balance loss of a model with two MoE layers: the sum over the MoE layers of DeepSeek-V3's
per-sequence loss (paper eq. 17-20), averaged over the sequences holding a real token, against a float64 numpy
computation from each layer's router input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3
from nnx_zoo.layers.attention import causal_mask
from tests.models.deepseek.small import small_config

ALPHA = 0.02
BATCH, SEQ = 4, 12


def numpy_sequence_loss(router_input, router, chosen, real):
    """``alpha * sum_i f_i P_i`` for one sequence: ``router_input [S, H]``, ``router [H, E]``, ``chosen [S, k]``,
    ``real [S]`` bool. ``f_i = E / (k T) * (tokens choosing i)``, ``P_i`` = mean over tokens of the sigmoid scores
    normalised over all experts; ``T`` = real tokens."""
    num_experts, k = router.shape[1], chosen.shape[-1]
    tokens = np.flatnonzero(real)
    if not len(tokens):
        return 0.0
    scores = 1.0 / (1.0 + np.exp(-(router_input[tokens].astype(np.float64) @ router.astype(np.float64))))
    p = (scores / scores.sum(-1, keepdims=True)).mean(0)
    f = num_experts / (k * len(tokens)) * np.bincount(chosen[tokens].ravel(), minlength=num_experts)
    return ALPHA * float(np.sum(f * p))


def _router_inputs(model, ids, attention_mask, hidden_states):
    """Each MoE layer's router input (its post-attention norm), rebuilt from the previous layer's output
    (``hidden_states[i]`` is layer ``i - 1``'s output)."""
    graphdef, state = nnx.split(model.moe_layers)
    cos, sin = model._rope(jnp.arange(SEQ)[None, :])
    mask = causal_mask(SEQ, attention_mask)
    inputs, routers = [], []
    first = model.config.num_dense_layers
    for layer_index in range(model.config.num_moe_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=layer_index: a[i], state))
        x = hidden_states[first + layer_index]
        h = x + layer.attn(layer.input_norm(x), cos, sin, mask)
        inputs.append(np.asarray(layer.post_attn_norm(h)))
        routers.append(np.asarray(layer.mlp.router[...]))
    return inputs, routers


@pytest.mark.parametrize("batch_split_factor", [1, 2])
def test_balance_loss_is_summed_over_moe_layers(batch_split_factor):
    config = small_config(num_hidden_layers=3, seq_aux_loss_alpha=ALPHA, num_nextn_predict_layers=0,
                          batch_split_factor=batch_split_factor)
    assert (config.num_dense_layers, config.num_moe_layers) == (1, 2)
    model = DeepSeekV3(config, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(4), (BATCH, SEQ), 0, config.vocab_size)
    attention_mask = jnp.ones((BATCH, SEQ), jnp.int32).at[1, :5].set(0).at[2].set(0)  # left padding; empty row

    @nnx.jit
    def both(model, ids, attention_mask):  # the trainer's call and the one with every output, compiled together
        return (model.forward(ids, attention_mask=attention_mask),
                model.forward(ids, attention_mask=attention_mask, with_hidden_states=True, with_routing=True))

    plain, aux = both(model, ids, attention_mask)
    inputs, routers = _router_inputs(model, ids, attention_mask, aux.hidden_states)
    real = np.asarray(attention_mask, bool)
    chosen = np.asarray(aux.expert_indices)  # [moe layers, batch, seq, k]
    per_layer = np.array([[numpy_sequence_loss(inputs[layer][b], routers[layer], chosen[layer, b], real[b])
                           for b in range(BATCH)] for layer in range(2)])  # [layers, batch]
    has_tokens = real.any(-1)
    expected = per_layer.sum(0)[has_tokens].mean()
    # Both layers contribute: the sum is far from one layer's loss or from their mean.
    layer_means = per_layer[:, has_tokens].mean(-1)
    assert layer_means.min() > 0.2 * layer_means.max()
    assert abs(expected - layer_means.mean()) > 0.3 * expected

    np.testing.assert_allclose(float(plain.aux_loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(aux.aux_loss), expected, rtol=1e-5)
