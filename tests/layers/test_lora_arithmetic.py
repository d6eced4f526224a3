"""LoRA arithmetic against hand computations in float64 numpy: an adapted projection adds exactly
``(alpha / rank) * (x A) B``, adapted experts run with ``W + (alpha / rank) A B``, and merging folds exactly that
into the weights. Rank 4 and alpha 6 tell ``alpha / rank`` (1.5) from ``alpha`` (6), ``alpha / sqrt(rank)`` (3)
and no scale (1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.layers import Linear, LoRAExperts, LoRALinear, RoutedExperts
from nnx_zoo.layers.lora import apply_lora, merge_lora

RANK, ALPHA = 4, 6.0
SCALE = 1.5  # alpha / rank, written out


def _randomize(variable: nnx.Variable, seed: int) -> np.ndarray:
    value = np.random.default_rng(seed).normal(size=variable.shape).astype(np.float32)
    variable[...] = jnp.asarray(value)
    return value.astype(np.float64)


def _f64(variable: nnx.Variable) -> np.ndarray:
    return np.asarray(variable[...], np.float64)


@pytest.mark.parametrize("out_names", [None, ("activation_batch", "activation_length", "activation_heads", None)])
def test_lora_linear_adds_scaled_x_a_b(out_names):
    holder = nnx.Dict(proj=Linear(6, (2, 5), kernel_names=("embed", "heads", "kv"), rngs=nnx.Rngs(0)))
    assert apply_lora(holder, pattern="proj", rank=RANK, alpha=ALPHA) == ["proj"]
    proj = holder.proj
    assert isinstance(proj, LoRALinear)
    kernel = _f64(proj.base.kernel)  # [6, 2, 5]
    a = _f64(proj.lora_a)  # [6, r]
    b = _randomize(proj.lora_b, 1)  # [r, 2, 5]: trained adapters are non-zero
    assert a.shape == (6, RANK) and b.shape == (RANK, 2, 5)
    x = np.random.default_rng(2).normal(size=(3, 4, 6))

    got = np.asarray(proj(jnp.asarray(x, jnp.float32), out_names))
    base = (x.reshape(12, 6) @ kernel.reshape(6, 10)).reshape(3, 4, 2, 5)
    delta = ((x.reshape(12, 6) @ a) @ b.reshape(RANK, 10)).reshape(3, 4, 2, 5)
    np.testing.assert_allclose(got, base + SCALE * delta, rtol=1e-5, atol=1e-5)
    assert np.abs(delta).max() > 1.0  # the adapter's term is large enough that any other scale fails

    merge_lora(holder)  # W += (alpha / r) A B, and the plain Linear is back
    assert isinstance(holder.proj, Linear)
    np.testing.assert_allclose(_f64(holder.proj.kernel), kernel + SCALE * np.einsum("ir,rhk->ihk", a, b),
                               rtol=1e-5, atol=1e-6)


def _swiglu(x, wg, wu, wo):
    gate = x @ wg
    return (gate / (1.0 + np.exp(-gate)) * (x @ wu)) @ wo


def test_lora_experts_use_w_plus_scaled_a_b():
    num_experts, features, hidden, tokens, k = 4, 6, 5, 10, 2
    holder = nnx.Dict(experts=RoutedExperts(num_experts, features, hidden,
                                            kernel_init=nnx.initializers.normal(0.3), rngs=nnx.Rngs(0)))
    apply_lora(holder, pattern="experts", rank=RANK, alpha=ALPHA)
    experts = holder.experts
    assert isinstance(experts, LoRAExperts)
    effective = {}
    for i, name in enumerate(("wi_gate", "wi_up", "wo")):
        a, b = experts.factors(name)
        a_value, b_value = _f64(a), _randomize(b, 10 + i)
        effective[name] = _f64(getattr(experts.base, name)) + SCALE * np.einsum("eir,ero->eio", a_value, b_value)

    rng = np.random.default_rng(3)
    x = rng.normal(size=(tokens, features))
    idx = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])
    weights = rng.uniform(0.2, 1.0, (tokens, k))
    want = np.zeros((tokens, features))
    for t in range(tokens):
        for j in range(k):
            e = idx[t, j]
            want[t] += weights[t, j] * _swiglu(x[t], effective["wi_gate"][e], effective["wi_up"][e],
                                                effective["wo"][e])
    got = experts(jnp.asarray(x, jnp.float32), jnp.asarray(idx, jnp.int32), jnp.asarray(weights, jnp.float32),
                  impl="dense")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())

    merge_lora(holder)
    for name in ("wi_gate", "wi_up", "wo"):
        np.testing.assert_allclose(_f64(getattr(holder.experts, name)), effective[name], rtol=1e-5, atol=1e-6)
    merged = holder.experts(jnp.asarray(x, jnp.float32), jnp.asarray(idx, jnp.int32),
                            jnp.asarray(weights, jnp.float32), impl="dense")
    np.testing.assert_allclose(np.asarray(merged), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert jax.tree.leaves(nnx.state(holder, nnx.Param))  # still a model with weights
