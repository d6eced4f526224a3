"""Token cross-entropy with a hand-written, one-pass backward, and the output head + cross-entropy in chunks.

Autodiff of ``logsumexp(logits) - logits[target]`` builds the ``[batch, seq, vocab]`` logits gradient from two
cotangents (the log-sum-exp's softmax and the target pick's one-hot), each materialized and then added in a
separate pass: extra full passes over the largest tensor of a train step. Here the backward writes
``(softmax - onehot) * g * mask`` in one elementwise pass.

``chunked_head_cross_entropy`` goes one step further back: it takes the head's input (the final hidden states)
and the head, and computes the logits one chunk of positions at a time, recomputing each chunk's logits in the
backward, so no float32 ``[tokens, vocab]`` array of the whole batch exists (Llama 3's 128k vocabulary: 4.2 GB
for 8,192 tokens, plus its gradient and low-precision copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from nnx_zoo.layers.spec import ambient_mesh_or_none, resolve_activation
from nnx_zoo.sharding import axes_tuple, restore_sharding, shard, shard_mode_of, sharding_of

# The default chunk: at most this many bytes of float32 logits per device. A batch whose logits fit is one chunk,
# computed exactly as without chunking (no recompute); a larger one pays one more head matmul (the forward's,
# recomputed in the backward) for holding one chunk's logits instead of all of them. 512 MiB: Llama 3's vocab at
# 1,024 tokens a chunk, a head matmul still large enough to run at full speed on an accelerator.
DEFAULT_CHUNK_BYTES = 512 * 2**20
# The head's input, outside any pipeline: its batch split over 'stage' too (activation_batch's axes without one).
_HIDDEN = ("activation_embed_and_logits_batch", "activation_length", "activation_embed")


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


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk whose float32 logits take ``DEFAULT_CHUNK_BYTES`` (``chunked_head_cross_entropy``'s
    default): 1,046 at Llama 3's 128,256-token vocabulary, 4,194 at 32,000."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * vocab))


def chunked_head_cross_entropy(
    hidden: jax.Array, head: Callable[[jax.Array], jax.Array], targets: jax.Array, mask: jax.Array, *,
    chunk_tokens: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``token_cross_entropy(head(hidden), targets, mask)`` for each leading index, without the whole batch's
    logits: the summed cross-entropy and the mask's sum, each of ``hidden``'s leading shape.

    ``hidden [..., batch, seq, embed]``: the head's input (leading dims, e.g. the main model and its MTP depths
    stacked, go through ``head`` together, one matmul per chunk); ``head``: ``[..., batch, seq, embed] -> [...,
    batch, seq, vocab]`` (a model's ``output_head()``, its weight gathered once outside); ``targets``, ``mask``
    ``[..., batch, seq]``. ``chunk_tokens``: about how many tokens' logits one chunk computes per device (all
    leading entries counted); None: ``default_chunk_tokens(vocab)``, except under an Auto mesh that splits the
    tokens over devices, where it is one chunk (below); 0: never chunk.

    The chunks run along the sequence in a ``lax.scan`` whose body is rematerialized (``jax.checkpoint``): the
    forward keeps only each chunk's loss, the backward recomputes the chunk's logits and writes its hidden-state
    gradient and its share of the head's. When the whole batch fits one chunk, the head runs once on all of it,
    the program of ``token_cross_entropy(head(hidden), ...)``. Under a mesh each chunk takes the same slice of
    every device's part of the sequence (context parallelism splits it), so a chunk is laid out like the whole
    batch and nothing moves between devices; the head is applied inside the loop to what ``head`` closes over,
    so its weight is gathered (and its gradient reduced) once, not once per chunk. Call it inside the model's
    ``sharding_scope()``, where the model's rules say how the tokens are split under Auto meshes. A sequence
    that does not divide over its devices (Auto meshes pad uneven shards) is one chunk.

    Auto meshes: XLA reduces the head's weight gradient over the token axes inside the chunk loop, once per chunk
    (measured: FSDP 4 x TP 2 and FSDP 4 x EP-as-CP 2), where an Explicit mesh types the gathered weight reduced
    and reduces the sum of all chunks once. So by default an Auto mesh whose tokens are split over devices runs
    one chunk (the whole logits, as before); an explicit ``chunk_tokens`` chunks there too, trading those
    reductions for memory. Without a mesh, on one device, or under Explicit meshes the default chunks.

    >>> hidden = model.forward(ids, with_logits=False).final_hidden
    >>> with model.sharding_scope():
    ...     total, count = chunked_head_cross_entropy(hidden, model.output_head(), targets, mask, chunk_tokens=1024)
    >>> loss = total / count
    """
    if hidden.ndim < 3 or hidden.shape[:-1] != targets.shape or targets.shape != mask.shape:
        raise ValueError(f"chunked_head_cross_entropy needs hidden [..., batch, seq, embed] with targets and mask of "
                         f"its leading shape; got hidden {hidden.shape}, targets {targets.shape}, mask {mask.shape}")
    lead_shape = hidden.shape[:-3]
    # The targets and mask laid out like the hidden states' tokens (the batch over 'stage' too, as the head's).
    token_names = (None,) * len(lead_shape) + _HIDDEN[:2]
    targets, mask = shard(targets, token_names), shard(mask.astype(jnp.float32), token_names)
    counts = jnp.sum(mask, axis=(-2, -1))
    vocab = jax.eval_shape(head, hidden).shape[-1]
    batch_shards, seq_shards = _token_shards(hidden)
    if chunk_tokens is None:
        mesh = ambient_mesh_or_none()
        auto_split = mesh is not None and shard_mode_of(mesh) != "explicit" and batch_shards * seq_shards > 1
        chunk_tokens = 0 if auto_split else default_chunk_tokens(vocab)  # see "Auto meshes" above
    lead, (batch, seq) = math.prod(lead_shape), hidden.shape[-3:-1]
    local_seq = seq // seq_shards
    # Positions per chunk of each device's part of the sequence.
    positions = max(1, chunk_tokens // max(1, lead * (batch // batch_shards)))
    if chunk_tokens <= 0 or positions >= local_seq or seq % seq_shards:
        return _per_lead_cross_entropy(head(hidden), targets, mask, lead_shape), counts
    chunks = -(-local_seq // positions)
    positions = -(-local_seq // chunks)  # as even as the sequence allows; the last chunk is padded (mask 0)

    def to_chunks(x: jax.Array) -> jax.Array:
        """``[lead, batch, seq, ...]`` -> ``[chunks, lead, batch, seq_shards, positions, ...]``: chunk ``i`` holds
        positions ``i * positions ...`` of every device's part of the sequence (split over ``seq_shards``)."""
        rest = x.shape[3:]
        x = x.reshape(lead, batch, seq_shards, local_seq, *rest)
        pad = chunks * positions - local_seq
        if pad:
            x = jnp.pad(x, [(0, 0)] * 3 + [(0, pad)] + [(0, 0)] * len(rest))
        return jnp.moveaxis(x.reshape(lead, batch, seq_shards, chunks, positions, *rest), 3, 0)

    def flat(x: jax.Array) -> jax.Array:
        return x.reshape(lead, batch, seq, *x.shape[len(lead_shape) + 2:])

    xs = (to_chunks(flat(hidden)), to_chunks(flat(targets)), to_chunks(flat(mask)))

    @jax.checkpoint  # keep only the chunk's inputs; its logits are recomputed in the backward
    def chunk_loss(h: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        def join(x: jax.Array) -> jax.Array:  # [lead, batch, seq_shards, positions, ...] -> [lead, batch, tokens, ...]
            return x.reshape(lead, batch, seq_shards * positions, *x.shape[4:])

        h = shard(join(h), (None, *_HIDDEN))
        return _per_lead_cross_entropy(head(h), join(t), join(m), (lead,))

    def body(total: jax.Array, x: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return total + chunk_loss(*x), None

    total, _ = jax.lax.scan(body, jnp.zeros((lead,), jnp.float32), xs)
    return total.reshape(lead_shape), counts


def _per_lead_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array,
                            lead_shape: tuple[int, ...]) -> jax.Array:
    """The summed cross-entropy of each leading index of ``logits [..., batch, seq, vocab]`` (``lead_shape``)."""
    if not lead_shape:
        return _summed_cross_entropy(logits.astype(jnp.float32), targets, mask)
    lead = math.prod(lead_shape)
    logits = logits.reshape(lead, *logits.shape[-3:])
    targets, mask = targets.reshape(lead, *targets.shape[-2:]), mask.reshape(lead, *mask.shape[-2:])
    sums = [_summed_cross_entropy(logits[k].astype(jnp.float32), targets[k], mask[k]) for k in range(lead)]
    return jnp.stack(sums).reshape(lead_shape)


def _token_shards(hidden: jax.Array) -> tuple[int, int]:
    """How many devices split ``hidden [..., batch, seq, embed]``'s batch dim and its sequence dim: from its type
    under an Explicit mesh, from the rules in force under an Auto one; (1, 1) without a mesh."""
    mesh = ambient_mesh_or_none()
    if mesh is None or mesh.size == 1:
        return 1, 1
    if shard_mode_of(mesh) == "explicit":
        spec = tuple(jax.typeof(hidden).sharding.spec)
    else:
        names = (None,) * (hidden.ndim - 3) + _HIDDEN
        spec = tuple(resolve_activation(names, hidden.shape))
    spec = spec + (None,) * (hidden.ndim - len(spec))
    sizes = dict(mesh.shape)

    def shards(entry: object) -> int:
        return math.prod(sizes[a] for a in axes_tuple(entry))

    return shards(spec[-3]), shards(spec[-2])
