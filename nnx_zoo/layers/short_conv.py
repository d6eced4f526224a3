"""The short causal depthwise convolution that linear-attention layers (Gated DeltaNet, KDA) run over their q/k/v
projections before the recurrence: ``y_t = act(sum_j w[:, j] * x_{t - (K-1) + j})`` per channel, kernel ``K`` (4).

Within documents only: a tap that would reach into another document (packed ``segment_ids``) or into padding
(``token_mask``, as transformers zeroes padding positions before its convolution) reads 0. Decoding carries the
last ``K - 1`` inputs (``tail``) in the cache.

Channels may be one dim or several (``[b, s, heads, d]`` with a ``[heads, d, K]`` filter: a layer whose heads are
split over devices keeps them split). Under a mesh whose rules split the sequence (context parallelism) each
device convolves its own block, reading the ``K - 1`` inputs before it from the device before (an all-gather of
every device's last ``K - 1`` rows, a few values per channel); ``channel_names`` lay the channel dims out.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.attention import activation_spec, ambient_mesh, vary_over
from nnx_zoo.sharding import axes_tuple, restore_sharding, shard, sharding_of
from nnx_zoo.sharding.constrain import shard_to_spec

ACTIVATIONS = {"silu": jax.nn.silu, "identity": lambda x: x}


def causal_conv1d(x: jax.Array, weight: jax.Array, *, activation: str = "silu", tail: jax.Array | None = None,
                  segment_ids: jax.Array | None = None, token_mask: jax.Array | None = None,
                  channel_names: Sequence[str | None] | None = None) -> tuple[jax.Array, jax.Array]:
    """``(y [b, s, *c], new tail [b, K-1, *c])`` for ``x [b, s, *c]`` and a depthwise ``weight [*c, K]``.

    ``tail [b, K-1, *c]``: the inputs before ``x`` (a decoding cache's; None: zeros, the start of a sequence).
    ``segment_ids [b, s]``: a tap never reads another document (the tail counts as the first token's document);
    ``token_mask [b, s]``: padding inputs read as 0. ``channel_names``: the logical names of the channel dims
    (default: whole), for the layout under a mesh that splits the sequence.

    >>> y, tail = causal_conv1d(x, w)                       # a prompt
    >>> y1, tail = causal_conv1d(x_next, w, tail=tail)      # one more token
    """
    b, s = x.shape[:2]
    channels = x.shape[2:]
    taps = weight.shape[-1]
    if weight.shape[:-1] != channels:
        raise ValueError(f"weight {weight.shape} must be [*channels={channels}, kernel]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
    if token_mask is not None:
        x = jnp.where(_expand(token_mask.astype(bool), x.ndim), x, 0)
    before = jnp.zeros((b, taps - 1, *channels), x.dtype) if tail is None else tail.astype(x.dtype)
    names = tuple(channel_names) if channel_names is not None else (None,) * len(channels)
    mesh = ambient_mesh()
    spec = None if mesh is None else activation_spec(("activation_batch", "activation_length", *names), x.shape)
    if spec is None or not axes_tuple(spec[1]):
        before = _laid_out_like(before, x)
        y = _conv(x, weight, before, segment_ids, None, activation)
        return y, _last_inputs(before, x, taps)
    return _split_sequence(x, weight, before, segment_ids, activation, spec)


def _expand(a: jax.Array, ndim: int) -> jax.Array:
    """``[b, s]`` -> ``[b, s, 1, ...]`` against an array of ``ndim`` dims."""
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _laid_out_like(before: jax.Array, x: jax.Array) -> jax.Array:
    """``before`` split over batch and channels as ``x`` is (whole over its K - 1 rows), so the two concatenate
    under an Explicit mesh (a zero tail arrives replicated, heads split over devices do not)."""
    sharding = sharding_of(x)
    spec = PartitionSpec(*[None if i == 1 else e for i, e in enumerate(sharding.spec)])
    return restore_sharding(before, sharding.update(spec=spec))


def _last_inputs(before: jax.Array, x: jax.Array, taps: int) -> jax.Array:
    """The last ``K - 1`` inputs of ``before`` followed by ``x``: the tail after ``x``."""
    if taps == 1:
        return x[:, :0]
    padded = jnp.concatenate([before, x], axis=1)
    return jax.lax.slice_in_dim(padded, x.shape[1], x.shape[1] + taps - 1, axis=1)


def _conv(x: jax.Array, weight: jax.Array, before: jax.Array, segment_ids: jax.Array | None,
          before_segments: jax.Array | None, activation: str) -> jax.Array:
    """The convolution of ``x`` with the ``K - 1`` inputs ``before`` it; ``before_segments [b, K-1]`` their
    documents (None: the first token's)."""
    s, taps = x.shape[1], weight.shape[-1]
    padded = jnp.concatenate([before.astype(x.dtype), x], axis=1)  # [b, K-1+s, *c]
    seg = None
    if segment_ids is not None:
        if before_segments is None:  # the tail belongs to the first token's document
            before_segments = jnp.repeat(segment_ids[:, :1], taps - 1, axis=1)
        seg = jnp.concatenate([before_segments, segment_ids], axis=1)
    y = jnp.zeros(x.shape, jnp.float32)
    for j in range(taps):  # tap j reads the input K-1-j steps back
        window = jax.lax.slice_in_dim(padded, j, j + s, axis=1).astype(jnp.float32)
        if seg is not None:
            same = jax.lax.slice_in_dim(seg, j, j + s, axis=1) == segment_ids
            window = jnp.where(_expand(same, x.ndim), window, 0.0)
        y = y + window * weight[..., j].astype(jnp.float32)
    return ACTIVATIONS[activation](y).astype(x.dtype)


def _split_sequence(x: jax.Array, weight: jax.Array, before: jax.Array, segment_ids: jax.Array | None,
                    activation: str, spec: PartitionSpec) -> tuple[jax.Array, jax.Array]:
    """The convolution with the sequence split over devices (``spec[1]``): each device's block, the ``K - 1``
    inputs before it gathered from the device before (device 0: ``before``)."""
    mesh = ambient_mesh()
    taps = weight.shape[-1]
    length_axes = axes_tuple(spec[1])
    weight_spec = PartitionSpec(*spec[2:], None)
    tail_spec = PartitionSpec(spec[0], None, *spec[2:])
    side = PartitionSpec(*spec[:2])
    segments = jnp.zeros(x.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    specs = (spec, weight_spec, tail_spec, side)
    args = [shard_to_spec(a, p) for a, p in zip((x, weight, before, segments), specs)]
    every_axis = tuple(dict.fromkeys(a for p in specs for e in p for a in axes_tuple(e)))

    def local(x, weight, before, segments):
        x, weight, before, segments = (vary_over(a, every_axis) for a in (x, weight, before, segments))
        if x.shape[1] < taps - 1:
            raise ValueError(f"a sequence split into blocks of {x.shape[1]} tokens is shorter than the "
                             f"convolution's reach ({taps - 1} tokens before each): split it over fewer devices")
        me = jax.lax.axis_index(length_axes)
        halo = jax.lax.all_gather(x[:, x.shape[1] - (taps - 1):], length_axes)  # [devices, b, K-1, *c]
        halo_segments = jax.lax.all_gather(segments[:, segments.shape[1] - (taps - 1):], length_axes)
        previous = jnp.maximum(me - 1, 0)
        mine = jnp.where(me == 0, before, halo[previous])
        mine_segments = jnp.where(me == 0, jnp.repeat(segments[:, :1], taps - 1, axis=1), halo_segments[previous])
        y = _conv(x, weight, mine, segments if segment_ids is not None else None,
                  mine_segments if segment_ids is not None else None, activation)
        # The tail after the whole sequence: the last device's last K - 1 inputs, typed whole over the sequence.
        count = halo.shape[0]
        tail = jax.lax.psum(jnp.where(me == count - 1, halo[count - 1], 0.0).astype(x.dtype), length_axes)
        return y, tail

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(spec, tail_spec))(*args)


class ShortConv(nnx.Module):
    """A depthwise causal convolution over ``channels`` (an int, or a tuple of channel dims) with kernel
    ``kernel`` and no bias (``causal_conv1d``).

    ``weight [*channels, kernel]`` carries the logical names ``names`` (HF stores it ``[channels, 1, kernel]``);
    ``channel_names`` name the activations' channel dims (default: whole).

    >>> conv = ShortConv(96, 4, rngs=nnx.Rngs(0))
    >>> y, tail = conv(jnp.ones((2, 10, 96)))
    >>> y.shape, tail.shape
    ((2, 10, 96), (2, 3, 96))
    >>> ShortConv((4, 24), 4, rngs=nnx.Rngs(0))(jnp.ones((2, 10, 4, 24)))[0].shape    # per-head channels
    (2, 10, 4, 24)
    """

    def __init__(self, channels: int | tuple[int, ...], kernel: int = 4, *, activation: str = "silu",
                 names: tuple[str | None, ...] | None = None,
                 channel_names: tuple[str | None, ...] | None = None, dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
        channels = (channels,) if isinstance(channels, int) else tuple(channels)
        names = (None,) * (len(channels) + 1) if names is None else tuple(names)
        if len(names) != len(channels) + 1:
            raise ValueError(f"weight [{', '.join(map(str, channels))}, {kernel}] needs {len(channels) + 1} "
                             f"logical names, got {names}")
        bound = 1.0 / kernel**0.5  # PyTorch's Conv1d default (fan_in = kernel for a depthwise filter)
        init = jax.random.uniform(rngs.params(), (*channels, kernel), param_dtype, -bound, bound)
        self.weight = nnx.Param(init, out_sharding=names, eager_sharding=False)
        self.activation, self.dtype, self.names = activation, dtype, names
        self.channel_names = (None,) * len(channels) if channel_names is None else tuple(channel_names)

    def __call__(self, x: jax.Array, *, tail: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        y, tail = causal_conv1d(x.astype(self.dtype), self.weight[...].astype(self.dtype),
                                activation=self.activation, tail=tail, segment_ids=segment_ids,
                                token_mask=token_mask, channel_names=self.channel_names)
        return shard(y, ("activation_batch", "activation_length", *self.channel_names)), tail
