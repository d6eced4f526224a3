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


# ---------------------------------------------------------------------- the options other checkpoints' layers need
def test_offset_and_unscaled_norms_match_gemmas():
    """``RMSNorm(offset=1.0, scale_in_float32=True)`` is Gemma 3's ``(1 + w)`` norm, ``use_scale=False`` Gemma 4's
    unweighted one (its value norm), and plain ``scale_in_float32=True`` Gemma 4's weighted one."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    x = 3 * np.random.default_rng(2).normal(size=(2, 5, 24)).astype(np.float32)
    w = 0.3 * np.random.default_rng(3).normal(size=(24,)).astype(np.float32)
    cases = [(Gemma3RMSNorm(24, eps=1e-6), RMSNorm(24, offset=1.0, scale_in_float32=True), True),
             (Gemma4RMSNorm(24, eps=1e-6), RMSNorm(24, scale_in_float32=True), True),
             (Gemma4RMSNorm(24, eps=1e-6, with_scale=False), RMSNorm(24, use_scale=False), False)]
    for ref, ours, weighted in cases:
        if weighted:
            with torch.no_grad():
                ref.weight.copy_(torch.as_tensor(w))
            ours.scale[...] = jnp.asarray(w)
        with torch.no_grad():
            want = ref(torch.as_tensor(x)).numpy()
        assert rel_err(ours(jnp.asarray(x)), want) < 1e-6, type(ref).__name__
    assert float(RMSNorm(8, offset=1.0).scale[...].max()) == 0.0  # a fresh (1 + w) norm scales by 1


def test_gelu_tanh_glu_matches_gemma3_mlp():
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP

    torch.manual_seed(0)
    ref = Gemma3MLP(Gemma3TextConfig(hidden_size=32, intermediate_size=80)).eval()
    ours = SwiGLU(32, 80, activation="gelu_tanh", rngs=nnx.Rngs(0))
    for name in ("gate", "up", "down"):
        getattr(ours, name).kernel[...] = jnp.asarray(getattr(ref, f"{name}_proj").weight.detach().numpy().T)
    x = np.random.default_rng(0).normal(size=(2, 5, 32)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.as_tensor(x)).numpy()
    assert rel_err(ours(jnp.asarray(x)), want) < 1e-6
    with pytest.raises(ValueError, match="unknown gate activation 'gelu_exact'"):
        SwiGLU(32, 80, activation="gelu_exact", rngs=nnx.Rngs(0))


def test_scaled_embedding_rounds_its_factor_in_bfloat16_as_torch_does():
    """sqrt(3072) = 55.43 is 55.5 in bfloat16: the rows are scaled by the rounded factor, as Gemma's scaled
    embedding (a buffer of the weights' dtype) does; the tied head (``attend``) is not scaled."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from nnx_zoo.layers import Embed

    table = np.random.default_rng(0).normal(size=(50, 16)).astype(np.float32)
    ids = np.array([[3, 7, 49], [0, 1, 2]])
    ref = Gemma3TextScaledWordEmbedding(50, 16, padding_idx=0, embed_scale=3072**0.5).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(torch.as_tensor(table))
        want = ref(torch.as_tensor(ids)).float().numpy()
    ours = Embed(50, 16, scale=3072**0.5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ours.embedding[...] = jnp.asarray(table, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(ours(jnp.asarray(ids)), np.float32), want)
    np.testing.assert_array_equal(np.asarray(ours(jnp.asarray(ids))[0, 0], np.float32),
                                  np.asarray(jnp.asarray(table[3], jnp.bfloat16) * jnp.bfloat16(55.5), np.float32))
    hidden = jnp.ones((1, 1, 16), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(ours.attend(hidden), np.float32),
                                  np.asarray(hidden @ ours.embedding[...].T, np.float32))


def test_soft_cap():
    from nnx_zoo.layers.softcap import soft_cap

    x = jnp.array([-1e4, -3.0, 0.0, 0.5, 1e4])
    np.testing.assert_allclose(np.asarray(soft_cap(x, 30.0)), 30.0 * np.tanh(np.asarray(x) / 30.0), rtol=1e-6)
    assert soft_cap(x, None) is x


def test_rmsnorm_offset_and_unweighted():
    """``offset=1``: the stored weight ``w`` scales as ``1 + w`` (a fresh norm stores 0, scaling by 1);
    ``use_scale=False``: no weight at all (the plain normalization)."""
    from nnx_zoo.layers.norm import L2Norm, RMSNorm

    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32))
    centred = RMSNorm(8, offset=1.0, scale_in_float32=True)
    assert float(jnp.abs(centred.scale[...]).max()) == 0.0
    plain = RMSNorm(8)
    np.testing.assert_allclose(centred(x), plain(x), rtol=1e-6)
    centred.scale[...] = jnp.full((8,), 0.5)
    np.testing.assert_allclose(centred(x), 1.5 * plain(x), rtol=1e-6)
    np.testing.assert_allclose(RMSNorm(8, use_scale=False)(x), L2Norm()(x), rtol=1e-6)
