"""The short causal depthwise convolution (``nnx_zoo.layers.short_conv``) against ``torch.nn.Conv1d`` (depthwise,
left-padded by ``K - 1``, as transformers' linear-attention layers run it), float32; documents and padding never
leak into each other's taps; a prompt then tokens one at a time through the tail equal the whole sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
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


@pytest.mark.parametrize(("sizes", "mode"), [({"fsdp": 2, "expert": 2}, "explicit"),
                                             ({"fsdp": 2, "context": 2, "expert": 2}, "auto")])
def test_per_head_channels_and_a_split_sequence_equal_one_device(sizes, mode):
    """Channels ``[heads, d]`` with a ``[heads, d, K]`` filter equal the flat convolution; with the sequence split
    over 2 and 4 devices (ep-as-cp: each device reads the K - 1 inputs before its block from the device before),
    documents crossing and starting on block edges, left padding and a tail: outputs, the tail after the sequence
    and the gradients equal one device's."""
    import math

    import jax

    from nnx_zoo.sharding import make_mesh, named_sharding, use_rules

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 16, 2, 3)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(2, 3, 4)).astype(np.float32))
    tail = jnp.asarray(rng.normal(size=(4, 3, 2, 3)).astype(np.float32))
    seg = np.zeros((4, 16), np.int32)
    seg[0, 4:], seg[1, 8:], seg[2, 11:] = 1, 1, 1
    mask = np.ones((4, 16), bool)
    mask[3, :5] = False
    seg, mask = jnp.asarray(seg), jnp.asarray(mask)

    def fn(x, w, tail, seg, mask):
        return causal_conv1d(x, w, tail=tail, segment_ids=seg, token_mask=mask)

    def values_and_grads(*args):
        y, new_tail = jax.jit(fn)(*args)
        loss = lambda *a: jnp.sum(fn(*a)[0] ** 2) + jnp.sum(fn(*a)[1] ** 2)  # noqa: E731
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
        return [np.asarray(a) for a in (y, new_tail, *grads)]

    want = values_and_grads(x, w, tail, seg, mask)
    flat, _ = causal_conv1d(x.reshape(4, 16, 6), w.reshape(6, 4), tail=tail.reshape(4, 3, 6), segment_ids=seg,
                            token_mask=mask)
    np.testing.assert_allclose(want[0].reshape(4, 16, 6), flat, rtol=1e-6, atol=1e-6)
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:math.prod(sizes.values())])
    with jax.set_mesh(mesh), use_rules("ep-as-cp"):
        tokens = named_sharding(("activation_batch", "activation_length", None, None), "ep-as-cp", mesh)
        side = named_sharding(("activation_batch", "activation_length"), "ep-as-cp", mesh)
        assert tokens.spec[1] is not None
        got = values_and_grads(jax.device_put(x, tokens), w, tail, jax.device_put(seg, side),
                               jax.device_put(mask, side))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
