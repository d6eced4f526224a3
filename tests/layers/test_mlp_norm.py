"""The shared SwiGLU MLP and RMSNorm against transformers' LlamaMLP / LlamaRMSNorm / Qwen3RMSNorm (float32)."""

from __future__ import annotations

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
