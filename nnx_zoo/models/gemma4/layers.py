"""Gemma 4's layer: attention (own, storing or shared K/V; value norm; unit scale), the GeGLU MLP with its optional
MoE block, the per-layer input gate, the layer scalar.

``Gemma4DecoderLayer.__call__`` returns ``(hidden, kv, routing)``: ``kv`` the layer's keys and values (for a
storing layer, what the shared layers of its type reuse), ``routing`` the MoE block's choice (None without it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.attention import Attention, AttentionMask
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.mlp import GATE_ACTIVATIONS, SwiGLU
from nnx_zoo.layers.moe import RoutedExperts
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import apply_rope
from nnx_zoo.layers.routers import Routing, route
from nnx_zoo.models.causal_lm import _dtypes
from nnx_zoo.models.gemma4.config import Gemma4Config, Gemma4LayerKind
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_BLND = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
_BKND = ("activation_batch", "activation_kv_length", "activation_kv_heads", "activation_kv")
_BL_EXPERTS = ("activation_batch", "activation_length", None)


def gemma4_norm(dim: int, c: Gemma4Config, *, use_scale: bool = True) -> RMSNorm:
    """Gemma 4's RMSNorm: the weight applied as stored (``w``, initialized to 1), multiplied in float32."""
    return RMSNorm(dim, eps=c.rms_norm_eps, scale_in_float32=True, use_scale=use_scale, **_dtypes(c))


class LayerScalar(nnx.Variable):
    """A layer's output multiplier (HF ``layer_scalar``, a buffer): read from checkpoints, never trained (not an
    ``nnx.Param``, so optimizers built with ``wrt=nnx.Param`` leave it alone, as torch leaves buffers)."""


class SharedKV(NamedTuple):
    """The keys and values a storing layer attended to, for the shared layers of its type: ``k``, ``v`` ``[batch,
    keys, kv_heads, head_dim]`` and, when decoding, the mask over them (``Attention.cached_keys``'s)."""

    k: jax.Array
    v: jax.Array
    mask: AttentionMask | None = None


class Gemma4Attention(Attention):
    """Gemma 4's attention: per-head RMS-normed queries and keys (weighted) and values (unweighted), softmax scale 1,
    rope on queries and keys. On a global layer with ``attention_k_eq_v`` the values are the key projection's
    output (no ``v_proj``); a shared-K/V layer has only ``q_proj``, ``q_norm`` and ``o_proj``, and attends to the
    keys and values it is given (``SharedKV``).

    >>> config = Gemma4Config.preset("gemma4-tiny")
    >>> attn = Gemma4Attention(config, kind=config.layer_kinds()[1], rngs=nnx.Rngs(0))   # global: 64 wide, K = V
    >>> attn.v_proj is None, attn.head_dim
    (True, 64)
    """

    def __init__(self, config: Gemma4Config, *, kind: Gemma4LayerKind, rngs: nnx.Rngs):
        c = config
        head_dim, kv_heads = c.head_dims(kind)
        super().__init__(c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         use_bias=c.attention_bias, scale=1.0, attention_impl=c.attention_impl,
                         kernel_init=nnx.initializers.normal(c.initializer_range), rngs=rngs,
                         **c.attention_options(kind), **_dtypes(c))
        self.q_norm = nnx.data(gemma4_norm(head_dim, c))
        self.shared = kind.kv == "shared"
        if self.shared:  # the storing layer's keys and values: no projections of its own
            self.k_proj = self.v_proj = None
            self.k_norm = self.v_norm = None
        else:
            self.k_norm = nnx.data(gemma4_norm(head_dim, c))
            self.v_norm = gemma4_norm(head_dim, c, use_scale=False)
            if kind.attention == "full" and c.attention_k_eq_v:
                self.v_proj = None  # values: the keys' projection, before the key norm and rope

    def project_q(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        return apply_rope(self.q_norm(self.q_proj(x, _BLHD)), cos, sin, interleaved=False)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(q, k, v)``: each head normed, queries and keys roped (a shared layer: ``k``, ``v`` are None)."""
        q = self.project_q(x, cos, sin)
        if self.shared:
            return q, None, None
        k = self.k_proj(x, _BLND)
        v = k if self.v_proj is None else self.v_proj(x, _BLND)
        return q, apply_rope(self.k_norm(k), cos, sin, interleaved=False), self.v_norm(v)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,  # type: ignore[override]
                 mask: AttentionMask | None, shared_kv: SharedKV | None = None) -> tuple[jax.Array, SharedKV]:
        """``(out [b, s, embed], SharedKV(k, v))``: a shared layer attends to ``shared_kv`` (and returns it)."""
        in_sharding = sharding_of(x)
        q, k, v = self.project(x, cos, sin)
        if self.shared:
            k, v = shared_kv.k, shared_kv.v
        k, v = shard(k, _BKND), shard(v, _BKND)
        out = self.attend(q, k, v, mask)
        return restore_sharding(self.o_proj(shard(out, _BLHD), _BLE), in_sharding), SharedKV(k, v)

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array | None,  # type: ignore[override]
               v_cache: jax.Array | None, start: jax.Array, mask: AttentionMask, shared_kv: SharedKV | None = None
               ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, SharedKV]:
        """New tokens against this layer's cache (``Attention.cached_keys``), or, for a shared layer (no cache),
        against ``shared_kv``, the storing layer's keys, values and mask of this step. Returns ``(out, k_cache,
        v_cache, SharedKV)``."""
        in_sharding = sharding_of(x)
        q, k, v = self.project(x, cos, sin)
        if self.shared:
            keys, values, step_mask = shared_kv
        else:
            keys, values, step_mask, k_cache, v_cache = self.cached_keys(k, v, k_cache, v_cache, start, mask)
        out = self.attend(q, keys.astype(q.dtype), values.astype(q.dtype), step_mask)
        out = restore_sharding(self.o_proj(shard(out, _BLHD), _BLE), in_sharding)
        return out, k_cache, v_cache, SharedKV(keys, values, step_mask)


class Gemma4Router(nnx.Module):
    """Gemma 4's router: the unweighted RMS norm of the hidden state, times ``scale * hidden ** -0.5``, projected to
    ``num_experts`` logits; top-k of their softmax (float32), renormalized, times each chosen expert's
    ``per_expert_scale``."""

    def __init__(self, c: Gemma4Config, *, rngs: nnx.Rngs):
        self.k = c.top_k_experts
        self.norm = gemma4_norm(c.hidden_size, c, use_scale=False)
        self.scale = nnx.Param(jnp.ones((c.hidden_size,), jnp.dtype(c.param_dtype)), out_sharding=("norm",),
                               eager_sharding=False)
        self.root = float(c.hidden_size**-0.5)
        self.proj = Linear(c.hidden_size, c.num_experts, kernel_names=("embed", "exp_router"),
                           kernel_init=nnx.initializers.normal(c.initializer_range), rngs=rngs, **_dtypes(c))
        self.per_expert_scale = nnx.Param(jnp.ones((c.num_experts,), jnp.dtype(c.param_dtype)),
                                          out_sharding=("exp_router",), eager_sharding=False)

    def __call__(self, x: jax.Array) -> Routing:
        """Routing for ``x [batch, seq, embed]``: ``expert_indices``, ``weights [batch, seq, k]``."""
        h = self.norm(x) * self.scale[...].astype(x.dtype) * jnp.asarray(self.root, x.dtype)
        logits = shard(self.proj(h, _BL_EXPERTS), _BL_EXPERTS)
        routing = route("softmax", logits.astype(jnp.float32), self.k, renormalize=True)
        # Each chosen expert's scale picked by a one-hot product, not a gather: inside a pipeline stage (a
        # shard_map over 'stage', the other axes Explicit) JAX cannot lower that gather's nested shard_map (it
        # closes over the stage-varying micro-batch index). One term of each sum is nonzero: the same values.
        chosen = jax.nn.one_hot(routing.expert_indices, self.per_expert_scale.shape[0], dtype=jnp.float32)
        scale = jnp.sum(chosen * self.per_expert_scale[...].astype(jnp.float32), axis=-1)
        return routing._replace(weights=routing.weights * scale)


class Gemma4MLP(SwiGLU):
    """The feed-forward block: the GeGLU MLP (``gate``, ``up``, ``down``) and, with ``enable_moe_block``, beside it
    routed GeGLU experts (``router``, ``experts``) with their own norms: ``post_dense_norm(mlp(pre_normed)) +
    post_experts_norm(experts(pre_experts_norm(residual)))``, routed by the residual. Without the block, the MLP."""

    def __init__(self, c: Gemma4Config, *, kind: Gemma4LayerKind, rngs: nnx.Rngs):
        init = nnx.initializers.normal(c.initializer_range)
        super().__init__(c.hidden_size, c.mlp_width(kind), activation=c.gate_activation, kernel_init=init, rngs=rngs,
                         **_dtypes(c))
        self.moe_impl = c.moe_impl
        if kind.moe:
            self.router = Gemma4Router(c, rngs=rngs)
            self.experts = RoutedExperts(c.num_experts, c.hidden_size, c.moe_intermediate_size,
                                         activation=c.gate_activation, grouped_matmul_impl=c.grouped_matmul_impl,
                                         kernel_init=init, rngs=rngs, **_dtypes(c))
            self.post_dense_norm = gemma4_norm(c.hidden_size, c)
            self.pre_experts_norm = gemma4_norm(c.hidden_size, c)
            self.post_experts_norm = gemma4_norm(c.hidden_size, c)
        else:
            self.router = self.experts = None

    def params_cast_once(self) -> dict[tuple[str, ...], Any]:
        """``{path: dtype}`` of the expert weights a layer scan casts once for all its layers (``run_stack``)."""
        if self.experts is None:
            return {}
        return {("experts", n): self.experts.dtype for n in self.experts.cast_once_names(self.moe_impl)}

    def __call__(self, x: jax.Array, residual: jax.Array | None = None  # type: ignore[override]
                 ) -> tuple[jax.Array, Routing | None]:
        """``(out, routing)`` for the pre-normed ``x`` and (with the MoE block) the ``residual`` it came from."""
        dense = super().__call__(x)
        if self.router is None:
            return dense, None
        routing = self.router(residual)
        experts = self.experts(self.pre_experts_norm(residual), routing.expert_indices, routing.weights,
                               impl=self.moe_impl)
        return shard(self.post_dense_norm(dense) + self.post_experts_norm(experts), _BLE), routing


class Gemma4DecoderLayer(nnx.Module):
    """Gemma 4's block: ``h = x + post_attn_norm(attn(input_norm(x)))``; ``h = h + post_mlp_norm(mlp(...))``; with
    per-layer inputs ``h = h + post_per_layer_norm(per_layer_proj(act(per_layer_gate(h)) * per_layer_input))``;
    then ``h * layer_scalar``.

    >>> config = Gemma4Config.preset("gemma4-tiny")
    >>> layer = Gemma4DecoderLayer(config, kind=config.layer_kinds()[0], rngs=nnx.Rngs(0))
    >>> cos, sin = rope_cos_sin(jnp.arange(8)[None], rope_frequencies(32, 1e4)[0])
    >>> h, kv, routing = layer(jnp.ones((2, 8, 128)), cos, sin, causal_mask(8), per_layer_input=jnp.ones((2, 8, 16)))
    >>> h.shape, routing.expert_indices.shape
    ((2, 8, 128), (2, 8, 2))
    """

    def __init__(self, config: Gemma4Config, *, kind: Any = None, rngs: nnx.Rngs):
        c = config
        kind = kind if kind is not None else c.layer_kinds()[-1]
        self.input_norm = gemma4_norm(c.hidden_size, c)
        self.attn = Gemma4Attention(c, kind=kind, rngs=rngs)
        self.post_attn_norm = gemma4_norm(c.hidden_size, c)
        self.pre_mlp_norm = gemma4_norm(c.hidden_size, c)
        self.mlp = Gemma4MLP(c, kind=kind, rngs=rngs)
        self.post_mlp_norm = gemma4_norm(c.hidden_size, c)
        p = c.hidden_size_per_layer_input
        self.act = GATE_ACTIVATIONS[c.gate_activation]
        if p:
            kw = dict(kernel_init=nnx.initializers.normal(c.initializer_range), rngs=rngs, **_dtypes(c))
            self.per_layer_gate = Linear(c.hidden_size, p, kernel_names=("embed", None), **kw)
            self.per_layer_proj = Linear(p, c.hidden_size, kernel_names=(None, "embed"), **kw)
            self.post_per_layer_norm = gemma4_norm(c.hidden_size, c)
        else:
            self.per_layer_gate = self.per_layer_proj = self.post_per_layer_norm = None
        self.layer_scalar = LayerScalar(jnp.ones((1,), jnp.dtype(c.param_dtype)), out_sharding=(None,),
                                        eager_sharding=False)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | None, *,
                 per_layer_input: jax.Array | None = None, shared_kv: SharedKV | None = None
                 ) -> tuple[jax.Array, SharedKV, Routing | None]:
        """``(hidden [batch, seq, embed], this layer's SharedKV, routing)`` (see the module docstring)."""
        attn, kv = self.attn(self.input_norm(x), cos, sin, mask, shared_kv)
        h, routing = self._after_attention(x, attn, per_layer_input)
        return h, kv, routing

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array | None,
               v_cache: jax.Array | None, start: jax.Array, mask: AttentionMask, *,
               per_layer_input: jax.Array | None = None, shared_kv: SharedKV | None = None
               ) -> tuple[jax.Array, jax.Array | None, jax.Array | None, SharedKV]:
        """The layer on new tokens against its cache (a shared layer: against ``shared_kv``)."""
        attn, k_cache, v_cache, kv = self.attn.decode(self.input_norm(x), cos, sin, k_cache, v_cache, start, mask,
                                                      shared_kv)
        h, _ = self._after_attention(x, attn, per_layer_input)
        return h, k_cache, v_cache, kv

    def _after_attention(self, x: jax.Array, attn: jax.Array, per_layer_input: jax.Array | None
                         ) -> tuple[jax.Array, Routing | None]:
        h = shard(x + self.post_attn_norm(attn), _BLE)
        mlp, routing = self.mlp(self.pre_mlp_norm(h), h)
        h = shard(h + self.post_mlp_norm(mlp), _BLE)
        if self.per_layer_gate is not None:
            gated = self.act(self.per_layer_gate(h)) * per_layer_input.astype(h.dtype)
            h = shard(h + self.post_per_layer_norm(self.per_layer_proj(gated, _BLE)), _BLE)
        return h * self.layer_scalar[...].astype(h.dtype), routing
