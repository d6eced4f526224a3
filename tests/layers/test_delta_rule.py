"""The gated delta rule (``nnx_zoo.layers.delta_rule``) against a plain step-by-step recurrence written here (a
Python loop over tokens, the formula of the module docstring), CPU, float32: values and gradients (q, k, v, the
decay, beta, the initial state) at 1e-5 relative, for the scalar (Gated DeltaNet) and per-channel (KDA) decays,
grouped value heads, several chunk sizes and lengths that are not chunk multiples; padding and packed documents
(each document equals itself run alone); decoding token by token after a chunked prompt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.layers.delta_rule import gated_delta_rule

SCALE = 0.3


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def reference(q, k, v, g, beta, state):
    """The recurrence, one token at a time: ``S <- exp(g) S; S <- S + k (beta (v - k^T S))^T; o = (scale q)^T S``,
    value head ``i`` reading key/query head ``i // (h / hk)``."""
    group = v.shape[2] // k.shape[2]
    q, k = jnp.repeat(q, group, axis=2) * SCALE, jnp.repeat(k, group, axis=2)

    def step(state, token):  # one token, as the formula says
        q_t, k_t, v_t, g_t, beta_t = token
        decay = jnp.exp(g_t)  # [b, h] or [b, h, dk]
        state = state * (decay[..., None] if g_t.ndim == 3 else decay[..., None, None])
        read = jnp.einsum("bhk,bhkv->bhv", k_t, state)
        state = state + k_t[..., None] * (beta_t[..., None] * (v_t - read))[:, :, None, :]
        return state, jnp.einsum("bhk,bhkv->bhv", q_t, state)

    state, outs = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(outs, 0, 1), state


def inputs(seq: int, *, channel_decay: bool, heads=(2, 4), dk=6, dv=5, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    hk, h = heads
    q = rng.normal(size=(batch, seq, hk, dk))
    k = rng.normal(size=(batch, seq, hk, dk))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # the families L2-normalize keys: a stable recurrence
    v = rng.normal(size=(batch, seq, h, dv))
    g = -rng.uniform(0.01, 0.5, size=(batch, seq, h, dk) if channel_decay else (batch, seq, h))
    beta = rng.uniform(0.1, 0.9, size=(batch, seq, h))
    state = rng.normal(size=(batch, h, dk, dv)) * 0.5
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, state))


def _values_and_grads(fn, args):
    """``fn``'s outputs and the gradients of a loss of them with respect to its first six arguments (any more are
    masks, passed through)."""
    weight = jax.random.normal(jax.random.key(3), jax.eval_shape(fn, *args)[0].shape)

    def loss(*a):
        out, state = fn(*a)
        return jnp.sum(out * weight) + jnp.sum(jnp.sin(state))

    return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=tuple(range(6)))(*a)))(*args)


def _assert_close(got, want, tol=1e-5):
    (out, state), grads = got
    (ref_out, ref_state), ref_grads = want
    assert rel_err(out, ref_out) < tol and rel_err(state, ref_state) < tol
    for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), grads, ref_grads):
        assert rel_err(a, b) < tol, name


CASES = [(13, 4, False), (23, 5, True), (23, 16, False), (9, 64, True)]  # (seq, chunk, per-channel decay)


@pytest.mark.parametrize(("seq", "chunk", "channel"), CASES)
def test_chunked_and_recurrent_equal_the_recurrence(seq, chunk, channel):
    args = inputs(seq, channel_decay=channel)
    want = _values_and_grads(reference, args)
    for impl in ("chunked", "recurrent"):
        def ours(q, k, v, g, beta, state, impl=impl):
            return gated_delta_rule(q, k, v, g, beta, scale=SCALE, initial_state=state, impl=impl, chunk_size=chunk)
        _assert_close(_values_and_grads(ours, args), want)


@pytest.mark.parametrize("channel", [False, True])
def test_padding_and_documents_each_equal_the_document_alone(channel):
    """Row 0: three packed documents (5, 8 and 10 tokens; a boundary inside a chunk and one on a chunk's edge);
    row 1: 6 left-padding tokens then one document. Chunks of 4. Every real token's output equals the recurrence
    over its document alone from an empty state; the final state is the last document's."""
    seq = 23
    q, k, v, g, beta, _ = inputs(seq, channel_decay=channel, seed=1)
    segments = np.zeros((2, seq), np.int32)
    segments[0, 5:] = 1
    segments[0, 13:] = 2
    mask = np.ones((2, seq), bool)
    mask[1, :6] = False
    out, state = jax.jit(lambda *a: gated_delta_rule(*a, scale=SCALE, segment_ids=jnp.asarray(segments),
                                                     token_mask=jnp.asarray(mask), impl="chunked", chunk_size=4)
                         )(q, k, v, g, beta)
    empty = jnp.zeros((1, *state.shape[1:]))
    for row, (lo, hi) in [(0, (0, 5)), (0, (5, 13)), (0, (13, 23)), (1, (6, 23))]:
        part = [a[row:row + 1, lo:hi] for a in (q, k, v, g, beta)]
        ref_out, ref_state = reference(*part, empty)
        assert rel_err(out[row:row + 1, lo:hi], ref_out) < 1e-5, (row, lo)
        if hi == seq:
            assert rel_err(state[row:row + 1], ref_state) < 1e-5, row
    assert not np.asarray(out[1, :6]).any()  # padding outputs nothing


@pytest.mark.parametrize("channel", [False, True])
def test_decode_after_a_chunked_prompt(channel):
    """A 10-token prompt through the chunked form (chunks of 4), then 5 tokens one at a time from its final state
    (the recurrent form): the outputs equal the recurrence over all 15 tokens."""
    q, k, v, g, beta, state = inputs(15, channel_decay=channel, seed=2)
    want_out, want_state = reference(q, k, v, g, beta, state)
    out, carried = gated_delta_rule(*(a[:, :10] for a in (q, k, v, g, beta)), scale=SCALE, initial_state=state,
                                    impl="chunked", chunk_size=4)
    outs = [out]
    for t in range(10, 15):
        step, carried = gated_delta_rule(*(a[:, t:t + 1] for a in (q, k, v, g, beta)), scale=SCALE,
                                         initial_state=carried)  # auto: one token is the recurrent form
        outs.append(step)
    assert rel_err(jnp.concatenate(outs, axis=1), want_out) < 1e-5
    assert rel_err(carried, want_state) < 1e-5


def test_refuses_what_it_cannot_run():
    q, k, v, g, beta, _ = inputs(4, channel_decay=False)
    with pytest.raises(ValueError, match="unknown delta-rule impl"):
        gated_delta_rule(q, k, v, g, beta, scale=1.0, impl="pallas")
    with pytest.raises(ValueError, match="must divide the value heads"):
        gated_delta_rule(q[:, :, :1].repeat(3, axis=2), k[:, :, :1].repeat(3, axis=2), v, g, beta, scale=1.0)
    with pytest.raises(ValueError, match="g .* must be"):
        gated_delta_rule(q, k, v, g[..., :1], beta, scale=1.0)


MESHES = [({"fsdp": 2, "tensor": 2}, "default", "explicit"), ({"fsdp": 2, "expert": 2}, "ep-as-cp", "explicit"),
          ({"fsdp": 2, "context": 2, "expert": 2}, "ep-as-cp", "auto")]


@pytest.mark.parametrize(("sizes", "rules", "mode"), MESHES, ids=lambda v: str(v).replace(" ", ""))
def test_under_a_mesh_equals_one_device(sizes, rules, mode):
    """Batch and heads split (FSDP x TP), and the sequence split over 2 and 4 devices (ep-as-cp), with a document
    boundary inside a device's block, one on a block edge and one document spanning blocks, left padding and an
    initial state: values and gradients equal one device's."""
    import math

    from nnx_zoo.sharding import make_mesh, named_sharding, use_rules

    q, k, v, g, beta, state = inputs(16, channel_decay=False, heads=(2, 4), batch=4, seed=4)
    segments = np.zeros((4, 16), np.int32)
    segments[0, 4:], segments[1, 7:], segments[2, 11:] = 1, 1, 1
    mask = np.ones((4, 16), bool)
    mask[3, :5] = False
    segments, mask = jnp.asarray(segments), jnp.asarray(mask)

    def fn(q, k, v, g, beta, state, segments, mask):
        return gated_delta_rule(q, k, v, g, beta, scale=SCALE, initial_state=state, segment_ids=segments,
                                token_mask=mask, impl="chunked", chunk_size=2)

    want = _values_and_grads(fn, (q, k, v, g, beta, state, segments, mask))
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:math.prod(sizes.values())])
    with jax.set_mesh(mesh), use_rules(rules):
        tokens = named_sharding(("activation_batch", "activation_length", None, None), rules, mesh)
        side = named_sharding(("activation_batch", "activation_length"), rules, mesh)
        assert (tokens.spec[1] is not None) == (rules == "ep-as-cp")
        got = _values_and_grads(fn, (jax.device_put(q, tokens), jax.device_put(k, tokens), jax.device_put(v, tokens),
                                     g, beta, state, jax.device_put(segments, side), jax.device_put(mask, side)))
    _assert_close(got, want)
