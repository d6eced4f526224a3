"""The gated delta rule (Gated DeltaNet's scalar decay per head; KDA's per-channel decay): a linear-attention layer
whose state, not a cache of keys, carries the past.

Per value head, the state ``S [d_k, d_v]`` maps keys to values. Token ``t`` with key ``k``, value ``v``, query ``q``
(already scaled), write strength ``beta`` and log-decay ``g`` (``<= 0``; a scalar per head, or one per key channel)
does, in order::

    S  <- exp(g) * S                       (per channel: diag(exp(g)) S)
    S  <- S + k (beta * (v - k^T S))^T     (the delta rule: move k's read-out toward v)
    o   = q^T S

``gated_delta_rule`` computes it two ways, picked by ``impl`` (``DELTA_RULE_IMPLS``) as attention's dispatcher
picks a kernel:

- ``chunked`` (training, long prompts): the sequence in chunks of ``chunk_size``; inside a chunk, matrix products
  (the chunk's writes ``delta`` solve one unit lower-triangular system, ``(I + M) delta = beta (v - K~ S0)``); across
  chunks, a scan carrying the state. Memory linear in the sequence: each chunk's body is rematerialized in the
  backward pass, so only the state at chunk boundaries is kept.
- ``recurrent`` (decoding): token by token, the formula above.

Documents: ``segment_ids`` reset the state where a new document starts (the first token of each segment sees an
empty state), and ``token_mask`` makes padding a no-op (no decay, no write; its output is 0). ``initial_state``
continues a cached state (decoding after a prompt). Under context parallelism a device's chunks start from the
state the devices before it hand over (``nnx_zoo.layers.delta_rule.sequence_parallel``).

Letters in the einsums: b batch, h value head, c chunk position i, j another chunk position, k key channel, v
value channel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from nnx_zoo.layers.attention import activation_spec, ambient_mesh, vary_over
from nnx_zoo.layers.blockwise_attention import varying_axes
from nnx_zoo.layers.spec import explicit_spec
from nnx_zoo.sharding import axes_tuple
from nnx_zoo.sharding.constrain import shard_to_spec

DELTA_RULE_IMPLS = ("auto", "chunked", "recurrent")
DEFAULT_CHUNK = 64
_BSHD = ("activation_batch", "activation_length", "activation_heads", None)


def delta_rule_problems(chunk_size: object) -> list[str]:
    """What is wrong with a config's ``delta_rule_chunk_size`` (one line; empty: fine), the check every hybrid
    family's config runs (``delta_rule_impl``'s name is checked with the other kernel settings,
    ``nnx_zoo.layers.kernel_choices.KERNEL_SETTINGS``).

    >>> delta_rule_problems(0)
    ['delta_rule_chunk_size must be a positive integer (tokens per chunk of the chunked scan, e.g. 64), got 0']
    """
    if isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 1:
        return []
    return ["delta_rule_chunk_size must be a positive integer (tokens per chunk of the chunked scan, e.g. "
            f"{DEFAULT_CHUNK}), got {chunk_size!r}"]


def choose_delta_rule_impl(impl: str, seq_len: int, chunk_size: int) -> str:
    """The path ``impl`` takes for ``seq_len`` tokens: ``auto`` runs ``recurrent`` for at most ``chunk_size`` tokens
    (decoding), ``chunked`` beyond; the others as named.

    >>> choose_delta_rule_impl("auto", 4096, 64)
    'chunked'
    """
    if impl not in DELTA_RULE_IMPLS:
        raise ValueError(f"unknown delta-rule impl {impl!r}; choose one of {DELTA_RULE_IMPLS}")
    if impl != "auto":
        return impl
    return "recurrent" if seq_len <= chunk_size else "chunked"


def _grouped(x: jax.Array, heads: int) -> jax.Array:
    """``[b, s, hk, d]`` -> ``[b, s, heads, d]``: value head ``i`` reads key/query head ``i // (heads // hk)``."""
    hk = x.shape[2]
    if heads % hk:
        raise ValueError(f"query/key heads ({hk}) must divide the value heads ({heads})")
    if hk == heads:
        return x
    shape = (*x.shape[:2], heads, x.shape[3])  # key head i's copies stay on its devices when heads are split
    return jnp.repeat(x, heads // hk, axis=2, out_sharding=explicit_spec(_BSHD, shape))


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    token_mask: jax.Array | None = None,
    impl: str = "auto",
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """``(out [b, s, h, d_v], final state [b, h, d_k, d_v])`` of the gated delta rule (module docstring).

    ``q``, ``k [b, s, hk, d_k]`` (``hk`` divides the ``h`` value heads), ``v [b, s, h, d_v]``, ``g`` the
    log-decay ``[b, s, h]`` (scalar per head) or ``[b, s, h, d_k]`` (per key channel), ``beta [b, s, h]``.
    ``scale`` multiplies the queries. ``segment_ids [b, s]``: the state resets where the id changes;
    ``token_mask [b, s]`` (1 = token): padding neither decays nor writes the state. ``impl``: ``chunked``,
    ``recurrent``, or ``auto`` (recurrent for at most ``chunk_size`` tokens, i.e. decoding; chunked beyond).
    Everything is computed in float32; the output comes back in ``v``'s dtype.

    >>> out, state = gated_delta_rule(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, chunk_size=64)
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    b, s, h, dv = v.shape
    dk = k.shape[-1]
    if g.shape not in ((b, s, h), (b, s, h, dk)) or beta.shape != (b, s, h):
        raise ValueError(f"g {g.shape} must be [b, s, h] or [b, s, h, d_k] and beta {beta.shape} [b, s, h] for "
                         f"values {v.shape} and keys {k.shape}")
    f32, out_dtype = jnp.float32, v.dtype
    q, k = _grouped(q, h).astype(f32) * f32(scale), _grouped(k, h).astype(f32)
    v, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)
    if token_mask is not None:  # padding: no decay, no write
        real = token_mask.astype(bool)[:, :, None]
        beta = jnp.where(real, beta, 0.0)
        g = jnp.where(real[..., None] if g.ndim == 4 else real, g, 0.0)
    state = jnp.zeros((b, h, dk, dv), f32) if initial_state is None else initial_state.astype(f32)
    segments = jnp.zeros((b, s), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    impl = choose_delta_rule_impl(impl, s, chunk_size)
    run = _recurrent if impl == "recurrent" else functools.partial(_chunked, chunk_size=chunk_size)
    out, state = _per_device(run, q, k, v, g, beta, segments, state)
    if token_mask is not None:
        out = jnp.where(token_mask.astype(bool)[:, :, None, None], out, 0.0)
    return out.astype(out_dtype), state


# ---------------------------------------------------------------------------------------------- under a mesh


def _per_device(run, q, k, v, g, beta, segments, state):
    """``run`` on each device's block inside ``shard_map`` when a mesh is ambient (batch and heads split as the
    rules say; without a mesh, once). With the sequence split too (context parallelism) each device runs its
    tokens from an empty state, as an affine map of the state it will be handed; the devices exchange those maps
    (``[d_k, d_k + d_v]`` per head, all-gathered over the sequence axes), each composes its predecessors' to get the
    state it starts from, and adds that state's part to its outputs."""
    mesh = ambient_mesh()
    if mesh is None:
        return run(q, k, v, g, beta, segments, state)
    spec = activation_spec(_BSHD, q.shape)
    token_spec = PartitionSpec(*spec[:3]) if g.ndim == 3 else spec
    state_spec = PartitionSpec(spec[0], spec[2], None, None)  # batch and heads as the tokens have them
    specs = (spec, spec, spec, token_spec, PartitionSpec(*spec[:3]), PartitionSpec(*spec[:2]), state_spec)
    args = [shard_to_spec(a, p) for a, p in zip((q, k, v, g, beta, segments, state), specs)]
    # Inside an enclosing shard_map (a pipeline's over 'stage': the tokens vary over its axes) the run goes on
    # the stage's arrays laid out so, partitioned by XLA over the other axes: jax 0.10.2 gives a nested checked
    # shard_map's residuals the outer axes too, which Shardy's verifier rejects in the backward.
    outer = tuple(sorted({axis for a in args[:5] for axis in varying_axes(a)}))
    if outer:  # (a fresh state varies as the tokens do: the scans' carries match)
        return run(*args[:6], vary_over(args[6], outer))
    length_axes = axes_tuple(spec[1])
    every_axis = tuple(dict.fromkeys(a for p in specs for e in p for a in axes_tuple(e)))

    def local(*xs):
        xs = [vary_over(x, every_axis) for x in xs]
        if not length_axes:
            return run(*xs)
        return _handed_over(run, *xs, length_axes=length_axes, every_axis=every_axis)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(spec, state_spec))(*args)


def _handed_over(run, q, k, v, g, beta, segments, state, *, length_axes, every_axis):
    """One device's block of a sequence split over ``length_axes``: its run from an empty state with the identity
    beside its values (so the outputs and final state come back as affine maps of the state it starts from), the
    maps of every device gathered and composed in order."""
    b, _, h, dv = v.shape
    dk = k.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=v.dtype), (b, h, dk, dk))
    # Value columns [v | 0] with the state [0 | I]: outputs [o(0) | O], final state [U | T]; from a state S the
    # block's outputs are o(0) + O S and its final state U + T S (every step is linear in the state, per column).
    wide_v = jnp.concatenate([v, jnp.zeros((*v.shape[:3], dk), v.dtype)], axis=-1)
    start = jnp.concatenate([jnp.zeros((b, h, dk, dv), v.dtype), eye], axis=-1)
    out, final = run(q, k, wide_v, g, beta, segments, vary_over(start, every_axis))
    # The segment the block starts in continues the previous block's last one only if the ids match.
    first, last = segments[:, 0], segments[:, -1]
    maps = [jax.lax.all_gather(x, length_axes) for x in (final, first, last)]  # each [devices, ...]
    me = jax.lax.axis_index(length_axes)

    def hand_over(S, device):
        U, T = maps[0][device][..., :dv], maps[0][device][..., dv:]
        starts = jnp.where(device == 0, state, S)
        # The block's first segment continues the state only if the previous block ended in it.
        joined = (device == 0) | (maps[1][device] == maps[2][jnp.maximum(device - 1, 0)])
        starts = jnp.where(joined[:, None, None, None], starts, 0.0)
        return U + jnp.einsum("bhkj,bhjv->bhkv", T, starts), starts

    count = maps[0].shape[0]
    final, starts = jax.lax.scan(hand_over, jnp.zeros_like(state), jnp.arange(count))
    mine = starts[me]
    outputs = out[..., :dv] + jnp.einsum("bshk,bhkv->bshv", out[..., dv:], mine)
    # Every device composed the same final state; the last one's, summed over the sequence axes, is typed whole.
    return outputs, jax.lax.psum(jnp.where(me == count - 1, final, 0.0), length_axes)


# ------------------------------------------------------------------------------------------------- recurrent
def _recurrent(q, k, v, g, beta, segments, state):
    """Token by token (a scan over the sequence); the first token's segment continues the given state."""
    first = segments[:, :1]
    previous = jnp.concatenate([first, segments[:, :-1]], axis=1)

    def step(S, xs):
        q_t, k_t, v_t, g_t, beta_t, fresh = xs  # [b, h, d], ..., [b, h] or [b, h, dk], [b, h], [b]
        decay = jnp.exp(g_t)[..., None] if g_t.ndim == 3 else jnp.exp(g_t)[..., None, None]
        S = jnp.where(fresh[:, None, None, None], 0.0, S) * decay
        read = jnp.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, beta_t[..., None] * (v_t - read))
        return S, jnp.einsum("bhk,bhkv->bhv", q_t, S)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, segments != previous))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


# --------------------------------------------------------------------------------------------------- chunked
def _chunked(q, k, v, g, beta, segments, state, *, chunk_size):
    b, s, h, dk = k.shape
    c = min(chunk_size, s)
    pad = -s % c
    if pad:  # no-ops at the end (no decay, no write) in the last token's segment: the final state is kept
        widths = lambda a: [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)  # noqa: E731
        q, k, v, g, beta = (jnp.pad(a, widths(a)) for a in (q, k, v, g, beta))
        segments = jnp.pad(segments, ((0, 0), (0, pad)), mode="edge")
    n = (s + pad) // c

    def chunks(a):  # [b, n*c, ...] -> [n, b, h, c, ...] (sequence-major for the scan; heads before positions)
        a = a.reshape(b, n, c, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2) if a.ndim > 3 else jnp.moveaxis(a, 1, 0)

    xs = (chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta), chunks(segments))
    carry = (state, segments[:, 0])  # the first chunk continues the given state in its first segment
    (state, _), out = jax.lax.scan(jax.checkpoint(_chunk), carry, xs)
    out = jnp.moveaxis(out, 0, 1)  # [b, n, h, c, dv]
    out = jnp.moveaxis(out, 2, 3).reshape(b, n * c, h, -1)
    return out[:, :s], state


def _chunk(carry, xs):
    """One chunk: ``(state, the segment it belongs to) -> (state after the chunk, ...), outputs [b, h, c, dv]``."""
    S, seg_before = carry
    q, k, v, g, beta, seg = xs  # [b, h, c, dk|dv], g [b, h, c] or [b, h, c, dk], beta [b, h, c], seg [b, c]
    c = q.shape[2]
    G = jnp.cumsum(g, axis=2)  # log of the decay from the chunk's start through each token
    i, j = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    same = seg[:, :, None] == seg[:, None, :]  # [b, c, c]
    causal = (j <= i)[None] & same  # j reaches i's state undecayed by any reset
    strict = (j < i)[None] & same
    continues = (seg == seg_before[:, None])[:, None, :]  # [b, 1, c]: the token still sees the state before
    if g.ndim == 3:  # a scalar decay per head: [b, h, c, c]
        log_decay = G[..., :, None] - G[..., None, :]
        decay = jnp.where(causal[:, None], jnp.exp(jnp.where(causal[:, None], log_decay, 0.0)), 0.0)
        qk = jnp.einsum("bhik,bhjk->bhij", q, k) * decay
        kk = jnp.einsum("bhik,bhjk->bhij", k, k) * jnp.where(strict[:, None], decay, 0.0)
        from_start = jnp.where(continues, jnp.exp(G), 0.0)[..., None]  # [b, h, c, 1]
    else:  # one decay per key channel: the pairwise decays are [b, h, c, c, dk]
        log_decay = G[..., :, None, :] - G[..., None, :, :]
        decay = jnp.where(causal[:, None, ..., None], jnp.exp(jnp.where(causal[:, None, ..., None], log_decay, 0.0)),
                          0.0)
        qk = jnp.einsum("bhik,bhjk,bhijk->bhij", q, k, decay)
        kk = jnp.einsum("bhik,bhjk,bhijk->bhij", k, k, decay * strict[:, None, ..., None])
        from_start = jnp.where(continues[..., None], jnp.exp(G), 0.0)  # [b, h, c, dk]
    # The writes: delta_i = beta_i (v_i - (k_i A_i)^T S0 - sum_{j<i} decay_ij (k_i . k_j) delta_j).
    rhs = beta[..., None] * (v - jnp.einsum("bhik,bhkv->bhiv", k * from_start, S))
    system = jnp.eye(c, dtype=q.dtype) + beta[..., None] * kk
    delta = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    out = jnp.einsum("bhik,bhkv->bhiv", q * from_start, S) + jnp.einsum("bhij,bhjv->bhiv", qk, delta)
    # The state after the last token: the old one decayed (if its segment goes on), plus the writes of the last
    # token's segment decayed to the chunk's end.
    last = seg[:, -1]
    in_last = (seg == last[:, None])[:, None, :]  # [b, 1, c]
    if g.ndim == 3:
        to_end = jnp.where(in_last, jnp.exp(G[..., -1:] - G), 0.0)[..., None]  # [b, h, c, 1]
        keep = jnp.where((last == seg_before)[:, None, None, None], jnp.exp(G[..., -1])[..., None, None], 0.0)
    else:
        to_end = jnp.where(in_last[..., None], jnp.exp(G[..., -1:, :] - G), 0.0)  # [b, h, c, dk]
        keep = jnp.where((last == seg_before)[:, None, None, None], jnp.exp(G[..., -1, :])[..., None], 0.0)
    S = keep * S + jnp.einsum("bhik,bhiv->bhkv", k * to_end, delta)
    return (S, last), out
