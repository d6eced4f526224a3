"""token_cross_entropy's hand-written backward against independent references: torch's cross_entropy (value and
logits gradient) and jax.grad of a plain log_softmax implementation (logits and mask gradients), on one device and
with vocab-sharded logits on an Explicit mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from nnx_zoo.sharding import make_mesh
from nnx_zoo.train.loss import token_cross_entropy

B, S, V = 2, 5, 48


def _case():
    rng = np.random.default_rng(0)
    logits = (3 * rng.normal(size=(B, S, V))).astype(np.float32)
    targets = rng.integers(0, V, size=(B, S)).astype(np.int32)
    mask = np.ones((B, S), np.float32)
    mask[0, -2:] = 0.0
    mask[1, 1] = 0.5  # a weight, not just 0/1
    targets[0, -1] = -100  # an ignore index where the mask is 0 (HF's convention) must not matter
    return logits, targets, mask


def _plain_sum(logits, targets, mask):
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1]), axis=-1)
    return -jnp.sum(picked * mask)


def _ours(logits, targets, mask):
    return token_cross_entropy(logits, targets, mask)[0]


def test_value_and_logits_gradient_match_torch():
    logits, targets, mask = _case()
    value, grad = jax.value_and_grad(_ours)(logits, targets, mask)
    t_logits = torch.tensor(logits, requires_grad=True)
    per_token = torch.nn.functional.cross_entropy(
        t_logits.reshape(-1, V), torch.tensor(np.clip(targets, 0, None), dtype=torch.long).reshape(-1),
        reduction="none")
    t_total = (per_token * torch.tensor(mask).reshape(-1)).sum()
    t_total.backward()
    np.testing.assert_allclose(value, t_total.item(), rtol=1e-6)
    np.testing.assert_allclose(grad, t_logits.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[0, -2:] == 0.0)  # masked positions get no gradient
    _, count = token_cross_entropy(logits, targets, mask)
    assert float(count) == mask.sum()


def test_gradients_match_autodiff_of_a_plain_implementation_under_jit_and_scaling():
    logits, targets, mask = _case()
    targets = np.clip(targets, 0, None)

    def scaled(fn):
        return jax.jit(jax.grad(lambda lg, m: 0.37 * fn(lg, targets, m), argnums=(0, 1)))

    got, want = scaled(_ours)(logits, mask), scaled(_plain_sum)(logits, mask)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_vocab_sharded_logits_on_an_explicit_mesh():
    logits, targets, mask = _case()
    targets = np.clip(targets, 0, None)
    want_value, want_grad = jax.value_and_grad(_plain_sum)(logits, targets, mask)
    mesh = make_mesh({"data": 2, "tensor": 4}, shard_mode="explicit")
    with jax.set_mesh(mesh):
        sharded = jax.device_put(logits, jax.P("data", None, "tensor"))
        t, m = jax.device_put(targets, jax.P("data")), jax.device_put(mask, jax.P("data"))
        value, grad = jax.jit(jax.value_and_grad(_ours))(sharded, t, m)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert jax.typeof(grad).sharding.spec == jax.P("data", None, "tensor")


def test_mismatched_shapes_say_what_is_expected():
    with pytest.raises(ValueError, match="targets and mask of its leading shape"):
        token_cross_entropy(jnp.zeros((2, 3, 8)), jnp.zeros((2, 4), jnp.int32), jnp.ones((2, 4)))
