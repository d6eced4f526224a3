"""The shared SwiGLU MLP and RMSNorm against transformers' LlamaMLP / LlamaRMSNorm / Qwen3RMSNorm (float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from nnx_zoo.layers import RMSNorm, SwiGLU


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_swiglu_matches_llama_mlp():
    config = LlamaConfig(hidden_size=32, intermediate_size=80)
    torch.manual_seed(0)
    ref = LlamaMLP(config).eval()
    ours = SwiGLU(32, 80, rngs=nnx.Rngs(0))
    for name in ("gate", "up", "down"):
        getattr(ours, name).kernel[...] = jnp.asarray(getattr(ref, f"{name}_proj").weight.detach().numpy().T)
    x = np.random.default_rng(0).normal(size=(2, 5, 32)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.as_tensor(x)).numpy()
    assert rel_err(ours(jnp.asarray(x)), want) < 1e-6


@pytest.mark.parametrize("norm_cls", [LlamaRMSNorm, Qwen3RMSNorm])
def test_rms_norm_matches_transformers(norm_cls):
    ref = norm_cls(24, eps=1e-5)
    with torch.no_grad():
        ref.weight.normal_()
    ours = RMSNorm(24, eps=1e-5)
    ours.scale[...] = jnp.asarray(ref.weight.detach().numpy())
    x = 3 * np.random.default_rng(1).normal(size=(2, 5, 4, 24)).astype(np.float32)  # normed over the last dim
    with torch.no_grad():
        want = ref(torch.as_tensor(x)).numpy()
    assert rel_err(ours(jnp.asarray(x)), want) < 1e-6


def test_rms_norm_over_two_trailing_dims_is_the_norm_of_the_flattened_projection():
    """``axes=2`` on ``[..., heads, head_dim]``: transformers' norm of the whole ``heads * head_dim`` projection
    (MiniMax-M2's q/k norm), its flat scale viewed per head; not each head's own norm."""
    ref = LlamaRMSNorm(4 * 6, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    ours = RMSNorm(4 * 6, eps=1e-6, axes=2)
    ours.scale[...] = jnp.asarray(ref.weight.detach().numpy())
    x = np.random.default_rng(2).normal(size=(2, 5, 4, 6)).astype(np.float32) * np.arange(1, 5)[:, None]
    with torch.no_grad():
        want = ref(torch.as_tensor(x.reshape(2, 5, 24))).numpy().reshape(x.shape)
    assert rel_err(ours(jnp.asarray(x)), want) < 1e-6
    per_head = RMSNorm(6, eps=1e-6)(jnp.asarray(x)) * ours.scale[...].reshape(4, 6)
    assert rel_err(per_head, want) > 1e-2


@pytest.mark.parametrize("jit", [False, True])
def test_rms_norm_of_rows_whose_square_overflows_is_finite_with_finite_gradient(jit):
    """A diverged run's final norm saw a residual stream of |x| ~ 4e26: x * x overflows float32, so the mean square
    was inf, rsqrt(inf) = 0 zeroed the output, and the backward's sum(grad * x) (cotangents ~1e12) overflowed too:
    0 * inf = NaN gradients although the norm, which is scale-invariant, is finite. Such rows must norm like
    their rescaled selves, and their gradient must be the rescaled one."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    row_scale = np.array([[1.0], [4e26], [1e37]], np.float32)  # row 0 as usual; rows 1 and 2: x * x overflows
    big = x * row_scale
    assert np.isinf(np.mean(big.astype(np.float32) ** 2, axis=-1))[1:].all()
    norm = RMSNorm(64)
    norm.scale[...] = jnp.asarray(rng.normal(size=64).astype(np.float32))
    cotangent = jnp.asarray((1e12 * rng.normal(size=(3, 64))).astype(np.float32))

    def loss(v):
        return jnp.sum(norm(v) * cotangent)

    forward = jax.jit(norm) if jit else norm
    grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    np.testing.assert_allclose(forward(jnp.asarray(big)), forward(jnp.asarray(x)), rtol=2e-6, atol=1e-6)
    g_big = np.asarray(grad(jnp.asarray(big)))
    assert np.isfinite(g_big).all()
    # f(s x) = f(x) row-wise, so the gradient at s x is the gradient at x divided by s
    assert rel_err(g_big * row_scale, grad(jnp.asarray(x))) < 1e-5
