"""The sequence-wise balance loss (DeepSeek-V3 paper eq. 17-20) against a direct numpy computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3
from nnx_zoo.layers.attention import causal_mask
from nnx_zoo.models.deepseek.moe import DeepSeekMoE
from nnx_zoo.sharding import make_mesh
from tests.models.deepseek.small import small_config

ALPHA = 0.01


def numpy_balance_loss(moe_input, router, chosen, token_mask, alpha):
    """Eq. 17-20 per sequence, float64, only over real tokens: returns one loss per sequence."""
    batch, seq, _ = moe_input.shape
    num_experts, k = router.shape[1], chosen.shape[-1]
    losses = []
    for b in range(batch):
        real = np.flatnonzero(token_mask[b])
        if not len(real):
            losses.append(0.0)
            continue
        s = 1.0 / (1.0 + np.exp(-(moe_input[b, real].astype(np.float64) @ router.astype(np.float64))))
        s_norm = s / s.sum(-1, keepdims=True)
        counts = np.zeros(num_experts)
        for t in real:
            counts[chosen[b, t]] += 1
        f = num_experts / (k * len(real)) * counts
        p = s_norm.mean(0)
        losses.append(alpha * np.sum(f * p))
    return np.asarray(losses)


def test_block_loss_matches_numpy_and_skips_padding():
    config = small_config(seq_aux_loss_alpha=ALPHA)
    moe = DeepSeekMoE(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 12, config.hidden_size))
    token_mask = np.ones((3, 12), bool)
    token_mask[1, :5] = False  # left padding
    token_mask[2] = False  # a sequence with no real token gets 0
    _, chosen, _, balance = nnx.jit(lambda m, x, t: m(x, token_mask=t))(moe, x, jnp.asarray(token_mask))
    expected = numpy_balance_loss(np.asarray(x), np.asarray(moe.router[...]), np.asarray(chosen), token_mask, ALPHA)
    np.testing.assert_allclose(np.asarray(balance), expected, rtol=1e-5)
    assert expected[0] > 0 and expected[2] == 0
    # Only P carries a gradient: d loss / d router is that of alpha * sum_i f_i P_i with f held fixed.
    grads = nnx.grad(lambda m: jnp.sum(m(x, token_mask=jnp.asarray(token_mask)).balance_loss))(moe)
    assert float(jnp.abs(grads.router[...]).sum()) > 0


def _moe_input(model, ids, attention_mask):
    """The MoE layer's input (post-attention norm), rebuilt from the model's pieces and the dense layer's output."""
    out = nnx.jit(lambda m, i, a: m.forward(i, attention_mask=a, with_hidden_states=True, with_routing=True))(
        model, ids, attention_mask)
    graphdef, state = nnx.split(model.moe_layers)
    layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    cos, sin = model._rope(jnp.arange(ids.shape[1])[None, :])
    x = out.hidden_states[1]  # the dense layer's output
    h = x + layer.attn(layer.input_norm(x), cos, sin, causal_mask(ids.shape[1], attention_mask))
    return out, layer.post_attn_norm(h), layer.mlp.router[...]


def test_model_aux_loss_is_the_mean_over_sequences_and_alpha_zero_changes_nothing():
    config = small_config(seq_aux_loss_alpha=ALPHA, num_nextn_predict_layers=0)  # 1 dense + 1 MoE layer
    model = DeepSeekV3(config, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (4, 16), 0, config.vocab_size)
    attention_mask = jnp.ones((4, 16), jnp.int32).at[1, :6].set(0).at[3].set(0)
    out, moe_input, router = _moe_input(model, ids, attention_mask)
    per_sequence = numpy_balance_loss(np.asarray(moe_input), np.asarray(router), np.asarray(out.expert_indices[0]),
                                      np.asarray(attention_mask, bool), ALPHA)
    expected = per_sequence[:3].mean()  # row 3 is all padding: left out of the mean
    np.testing.assert_allclose(float(out.aux_loss), expected, rtol=1e-5)
    plain_forward = nnx.jit(lambda m, i, a: m.forward(i, attention_mask=a))(model, ids, attention_mask)
    np.testing.assert_allclose(float(plain_forward.aux_loss), expected, rtol=1e-5)
    # The call gives logits, whatever alpha: the same ones.
    on = nnx.jit(lambda m, i, a: m(i, attention_mask=a))(model, ids, attention_mask)
    np.testing.assert_array_equal(np.asarray(on), np.asarray(plain_forward.logits))

    # alpha = 0 (the default): identical logits, and no aux loss for the trainer to add.
    off_model = DeepSeekV3(small_config(num_nextn_predict_layers=0), rngs=nnx.Rngs(0))  # the same weights
    off = nnx.jit(lambda m, i, a: m.forward(i, attention_mask=a))(off_model, ids, attention_mask)
    assert off.aux_loss is None
    np.testing.assert_array_equal(np.asarray(off.logits), np.asarray(plain_forward.logits))


@pytest.mark.parametrize(("sizes", "rules", "ids_spec"), [
    ({"fsdp": 4, "expert": 2}, "default", (("fsdp", "expert"),)),
    # context parallelism: the sequence dim of the per-sequence sums is split too
    ({"fsdp": 4, "context": 2}, "default", ("fsdp", "context")),
])
def test_aux_loss_is_the_same_on_an_explicit_sharded_mesh(sizes, rules, ids_spec):
    config = small_config(seq_aux_loss_alpha=ALPHA, num_nextn_predict_layers=0, batch_split_factor=2)
    ids = jax.random.randint(jax.random.key(3), (16, 8), 0, config.vocab_size)
    aux_loss = jax.jit(lambda m, i: m.forward(i).aux_loss)
    single = aux_loss(DeepSeekV3.create(config), ids)
    mesh = make_mesh(sizes, shard_mode="explicit")
    sharded = DeepSeekV3.create(config, mesh=mesh, rules=rules)
    with jax.set_mesh(mesh):
        ids = jax.device_put(ids, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*ids_spec)))
        value = aux_loss(sharded, ids)
    np.testing.assert_allclose(float(value), float(single), rtol=1e-5)
