"""Kimi Delta Attention (KDA), Kimi Linear's linear-attention token mixer: the gated delta rule with a decay per
key channel. It takes ``(x, cos, sin, mask)`` and decodes as ``decode(x, cos, sin, tail, state, start, mask)``
(``DeltaRuleMixer``), so a decoder layer holds it as its ``attn`` beside MLA in the full layers.

Letters in the shapes: b batch, s sequence, h heads, d their width (queries, keys and values alike), C = h * d.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.delta_rule import DEFAULT_CHUNK
from nnx_zoo.layers.linear import DEFAULT_INIT, Linear
from nnx_zoo.layers.norm import GatedRMSNorm, l2_normalize
from nnx_zoo.layers.short_conv import ShortConv
from nnx_zoo.models.qwen3_next.mixers import DeltaRuleMixer
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_BLH = ("activation_batch", "activation_length", "activation_heads")
_BL_ = ("activation_batch", "activation_length", None)


class KimiDeltaAttention(DeltaRuleMixer):
    """KDA: ``q_proj``, ``k_proj``, ``v_proj [embed, h, d]``, each through its own causal convolution (``q_conv``,
    ``k_conv``, ``v_conv``: ``ShortConv`` per head, SiLU); queries and keys L2-normalized per
    head; the gated delta rule with write strength ``beta = sigmoid(b_proj(x))`` per head and log-decay
    ``g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`` per key channel (a low-rank projection, ``dt_bias [h,
    d]``, ``A_log [h]``); the output RMSNorm per head gated by ``sigmoid(g_b(g_a(x)))`` (another low-rank
    projection); ``o_proj``. The decoding cache's conv tail is the three convolutions' last inputs side by side
    (per head its queries, keys, values: ``[b, K - 1, h, 3 d]``).

    >>> kda = KimiDeltaAttention(64, heads=2, head_dim=16, conv_kernel=4, rngs=nnx.Rngs(0))
    >>> kda(jnp.ones((2, 10, 64)), None, None, causal_mask(10)).shape
    (2, 10, 64)
    """

    def __init__(self, features: int, *, heads: int, head_dim: int, conv_kernel: int, norm_eps: float = 1e-5,
                 chunk_size: int = DEFAULT_CHUNK, delta_rule_impl: str = "auto", dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32,
                 kernel_init: nnx.initializers.Initializer = DEFAULT_INIT, rngs: nnx.Rngs):
        h, d = heads, head_dim
        self.heads, self.head_dim, self.dtype = h, d, dtype
        self.chunk_size, self.delta_rule_impl = chunk_size, delta_rule_impl
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.q_proj = Linear(features, (h, d), kernel_names=("embed", "heads", "kv"), **kw)
        self.k_proj = Linear(features, (h, d), kernel_names=("embed", "heads", "kv"), **kw)
        self.v_proj = Linear(features, (h, d), kernel_names=("embed", "heads", "kv"), **kw)
        # Per head ([h, d, K]; the checkpoints' [C, 1, K]), so tensor parallelism splits filters and tails by heads.
        conv = dict(names=("heads", None, None), channel_names=("activation_heads", None), dtype=dtype,
                    param_dtype=param_dtype, rngs=rngs)
        self.q_conv = ShortConv((h, d), conv_kernel, **conv)
        self.k_conv = ShortConv((h, d), conv_kernel, **conv)
        self.v_conv = ShortConv((h, d), conv_kernel, **conv)
        self.f_a_proj = Linear(features, d, kernel_names=("embed", None), **kw)
        self.f_b_proj = Linear(d, (h, d), kernel_names=(None, "heads", "kv"), **kw)
        # transformers' init: dt = exp(U[ln 1e-3, ln 1e-1)) stored as softplus^-1(dt); A in [1, 16).
        dt = jnp.exp(jax.random.uniform(rngs.params(), (h, d), jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
        self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(param_dtype), out_sharding=("heads", "kv"),
                                 eager_sharding=False)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (h,), param_dtype, 1.0, 16.0)),
                               out_sharding=("heads",), eager_sharding=False)
        self.b_proj = Linear(features, h, kernel_names=("embed", "heads"), **kw)
        self.g_a_proj = Linear(features, d, kernel_names=("embed", None), **kw)
        self.g_b_proj = Linear(d, (h, d), kernel_names=(None, "heads", "kv"), **kw)
        self.o_norm = GatedRMSNorm(d, eps=norm_eps, activation="sigmoid", dtype=dtype, param_dtype=param_dtype)
        self.o_proj = Linear((h, d), features, kernel_names=("heads", "kv", "embed"), **kw)

    def decay(self, x: jax.Array) -> jax.Array:
        """The log-decay ``g [b, s, h, d]`` (float32, ``<= 0``) of each key channel."""
        a = self.f_b_proj(self.f_a_proj(x, _BL_), _BLHD).astype(jnp.float32)
        rate = jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]  # [h, 1]: one rate per head
        return -rate * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))

    def _mix(self, x: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None, tail: jax.Array | None,
             state: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(out [b, s, embed], conv tail [b, K - 1, h, 3 d], delta-rule state [b, h, d, d])`` continuing ``tail``
        / ``state`` (None: empty)."""
        in_sharding = sharding_of(x)
        d = self.head_dim
        x = jnp.where(token_mask[:, :, None], x, 0).astype(x.dtype)  # padding reads as 0, as transformers zeroes it
        tails = [None] * 3 if tail is None else jnp.split(tail, 3, axis=-1)
        mixed, new_tails = [], []
        for proj, conv, before in zip((self.q_proj, self.k_proj, self.v_proj), (self.q_conv, self.k_conv,
                                                                                 self.v_conv), tails):
            y, after = conv(proj(x, _BLHD), tail=before, segment_ids=segment_ids, token_mask=token_mask)
            mixed.append(y)
            new_tails.append(after)
        q, k, v = mixed
        tail = jnp.concatenate(new_tails, axis=-1)
        beta = jax.nn.sigmoid(self.b_proj(x, _BLH).astype(jnp.float32))
        out, state = self._delta_rule(l2_normalize(q, 1e-6), l2_normalize(k, 1e-6), v, self.decay(x), beta,
                                      scale=d**-0.5, initial_state=state, segment_ids=segment_ids,
                                      token_mask=token_mask)
        out = self.o_norm(out, self.g_b_proj(self.g_a_proj(x, _BL_), _BLHD))  # [b, s, h, d]
        return restore_sharding(self.o_proj(shard(out.astype(self.dtype), _BLHD), _BLE), in_sharding), tail, state
