"""Token cross-entropy with a hand-written, one-pass backward.

Autodiff of ``logsumexp(logits) - logits[target]`` builds the ``[batch, seq, vocab]`` logits gradient from two
cotangents (the log-sum-exp's softmax and the target pick's one-hot), each materialized and then added in a
separate pass: extra full passes over the largest tensor of a train step. Here the backward writes
``(softmax - onehot) * g * mask`` in one elementwise pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnx_zoo.layers.spec import ambient_mesh_or_none
from nnx_zoo.sharding import restore_sharding, sharding_of


def token_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over the positions where ``mask`` is nonzero (weighted by it), and the
    mask's sum.

    ``logits [..., vocab]`` (any float dtype; computed in float32), ``targets [...]`` int token ids, ``mask [...]``
    weights. A target outside ``[0, vocab)`` is allowed where the mask is 0. Gradients flow to ``logits`` and
    ``mask`` (each position's loss), not to ``targets``.

    >>> logits = jnp.zeros((1, 3, 8))
    >>> total, count = token_cross_entropy(logits, jnp.array([[1, 2, 3]]), jnp.array([[1.0, 1.0, 0.0]]))
    >>> round(float(total / count), 4)  # log(8)
    2.0794
    """
    if logits.shape[:-1] != targets.shape or targets.shape != mask.shape:
        raise ValueError(f"token_cross_entropy needs logits [..., vocab] with targets and mask of its leading shape; "
                         f"got logits {logits.shape}, targets {targets.shape}, mask {mask.shape}")
    mask = mask.astype(jnp.float32)
    return _summed_cross_entropy(logits.astype(jnp.float32), targets, mask), jnp.sum(mask)


def _target_logit(logits: jax.Array, targets: jax.Array) -> jax.Array:
    mesh = ambient_mesh_or_none()
    if mesh is None or mesh.size == 1:
        # One device: a gather of one logit per token, not a select over [tokens, vocab] and a reduction.
        return jnp.take_along_axis(logits, targets[..., None], axis=-1, mode="clip")[..., 0]
    # Under a mesh the vocab dim may be sharded (Explicit axes cannot gather across it): compare with an iota,
    # which XLA fuses with the reduction.
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)


@jax.custom_vjp
def _summed_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    return _summed_cross_entropy_fwd(logits, targets, mask)[0]


def _summed_cross_entropy_fwd(logits, targets, mask):
    log_z = jax.nn.logsumexp(logits, axis=-1)
    per_token = log_z - _target_logit(logits, targets)
    return jnp.sum(per_token * mask), (logits, log_z, per_token, targets, mask)


def _summed_cross_entropy_bwd(residuals, g):
    logits, log_z, per_token, targets, mask = residuals
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    onehot = jnp.where(vocab_ids == targets[..., None], 1.0, 0.0)
    d_logits = (jnp.exp(logits - log_z[..., None]) - onehot) * (g * mask)[..., None]
    # The mask's cotangent comes out laid out like the logits (sequence split under context parallelism); under an
    # Explicit mesh it must carry the mask's own sharding.
    return d_logits, None, restore_sharding(g * per_token, sharding_of(mask))


_summed_cross_entropy.defvjp(_summed_cross_entropy_fwd, _summed_cross_entropy_bwd)
