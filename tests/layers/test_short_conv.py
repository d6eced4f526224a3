"""The short causal depthwise convolution (``nnx_zoo.layers.short_conv``) against ``torch.nn.Conv1d`` (depthwise,
left-padded by ``K - 1``, as transformers' linear-attention layers run it), float32; documents and padding never
leak into each other's taps; a prompt then tokens one at a time through the tail equal the whole sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from nnx_zoo.layers.short_conv import causal_conv1d


def _torch(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    conv = torch.nn.Conv1d(w.shape[0], w.shape[0], w.shape[1], groups=w.shape[0], bias=False,
                           padding=w.shape[1] - 1)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(w[:, None, :]))
        y = conv(torch.from_numpy(x).transpose(1, 2))[..., :x.shape[1]]
        return torch.nn.functional.silu(y).transpose(1, 2).numpy()


def test_equals_torch_documents_padding_and_decoding():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 11, 6)).astype(np.float32)
    w = rng.normal(size=(6, 4)).astype(np.float32)
    y, tail = causal_conv1d(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(y, _torch(x, w), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(tail, x[:, -3:])
    # Row 0: documents [0, 5) and [5, 11); row 1: 3 padding tokens, then one document.
    seg = np.zeros((2, 11), np.int32)
    seg[0, 5:] = 1
    mask = np.ones((2, 11), bool)
    mask[1, :3] = False
    y, _ = causal_conv1d(jnp.asarray(x), jnp.asarray(w), segment_ids=jnp.asarray(seg), token_mask=jnp.asarray(mask))
    np.testing.assert_allclose(y[0, :5], _torch(x[:1, :5], w)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[0, 5:], _torch(x[:1, 5:], w)[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[1, 3:], _torch(x[1:, 3:], w)[0], rtol=1e-5, atol=1e-6)
    # A 6-token prompt, then one token at a time through the tail.
    y, tail = causal_conv1d(jnp.asarray(x[:, :6]), jnp.asarray(w))
    steps = [y]
    for t in range(6, 11):
        y, tail = causal_conv1d(jnp.asarray(x[:, t:t + 1]), jnp.asarray(w), tail=tail)
        steps.append(y)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), _torch(x, w), rtol=1e-5, atol=1e-6)
