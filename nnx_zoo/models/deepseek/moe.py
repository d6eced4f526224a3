"""DeepSeek's MoE block: a float32 router (V3's or V2's, by ``topk_method``), routed experts, shared experts.

V3 routing (``topk_method='noaux_tc'``, HF ``DeepseekV3TopkRouter``): ``s = sigmoid(x W)`` in float32; experts
are *selected* on ``s + e_score_correction_bias`` within the ``topk_group`` best groups (a group's score is the
sum of its two best biased scores); the chosen experts are *weighted* by the unbiased ``s``, normalized to sum 1
when ``norm_topk_prob``, and always multiplied by ``routed_scaling_factor``.
V2 routing (``'greedy'`` / ``'group_limited_greedy'``, HF ``DeepseekV2TopkRouter``): ``s = softmax(x W)`` in
float32, no bias; the top-k of ``s`` (group-limited: within the ``topk_group`` groups holding the best single
scores), weighted by ``s`` times ``routed_scaling_factor``, never renormalized.
The selection (``group_limited_top_k``) and the bias Variable (``RouterBias``) are the shared ones of
``nnx_zoo.layers.routers``. The shared experts (one SwiGLU of width ``moe_intermediate_size *
n_shared_experts``) are added unscaled.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.moe import RoutedExperts
from nnx_zoo.layers.routers import RouterBias, group_limited_top_k
from nnx_zoo.layers.spec import explicit_spec, weight_einsum
from nnx_zoo.models.deepseek.config import DeepSeekV3Config
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_BLE = ("activation_batch", "activation_length", "activation_embed")
_TE = ("activation_tokens", "activation_embed")
_T_EXPERTS = ("activation_tokens", None)  # every token sees all router scores: top-k needs the whole row
_BL_EXPERTS = ("activation_batch", "activation_length", None)


def router_scores(logits: jax.Array, config: DeepSeekV3Config) -> jax.Array:
    """The router's scores for ``logits [..., E]``: sigmoid (V3) or softmax over the experts (V2), in float32."""
    logits = logits.astype(jnp.float32)
    return jax.nn.sigmoid(logits) if config.router.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)


def route(
    logits: jax.Array, bias: jax.Array | None, config: DeepSeekV3Config
) -> tuple[jax.Array, jax.Array]:
    """Top-k experts and their weights for router ``logits [..., E]`` (float32, e.g. ``[T, E]`` or ``[B, S, E]``):
    ``(idx [..., k], weights [..., k])``. ``bias``: the selection bias when ``config.router`` has one, else None."""
    c = config
    return group_limited_top_k(router_scores(logits, c), c.num_experts_per_tok, bias=bias, n_group=c.n_group,
                               topk_group=c.topk_group, group_top=c.router.group_top, renormalize=c.norm_topk_prob,
                               scale=c.routed_scaling_factor)


def sequence_balance_loss(
    logits: jax.Array, idx: jax.Array, token_mask: jax.Array, config: DeepSeekV3Config
) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss (paper eq. 17-20), one value per sequence.

    For router ``logits [B*S, E]`` and the chosen experts ``idx [B*S, k]`` of ``B`` sequences of ``S`` tokens
    (or ``[B, S, E]`` and ``[B, S, k]``):
    ``f_i = E / (k T) * #{t : t chose i}``, ``P_i = 1/T * sum_t s'_{i,t}`` with ``s' = s / sum_j s_j`` the router's
    scores (``router_scores``: sigmoid, or V2's softmax) normalized over all experts, and
    ``L = alpha * sum_i f_i P_i`` -> ``[B]`` float32. ``T`` counts the sequence's real tokens: ``token_mask
    [B or 1, S]`` (False = padding) leaves the others out; a sequence with none gets 0. ``f`` counts the experts
    actually chosen (selection includes any routing bias) and carries no gradient; the gradient flows through
    ``P`` into the router.
    """
    num_experts, k = logits.shape[-1], idx.shape[-1]
    seq = token_mask.shape[-1]
    batch = logits.shape[0] // seq if logits.ndim == 2 else logits.shape[0]
    per_sequence = (batch, seq, num_experts)

    def split_sequences(a: jax.Array) -> jax.Array:  # [B*S, E] -> [B, S, E], laid out like [B, S, E] activations
        if a.ndim == 3:
            return shard(a, _BL_EXPERTS)
        return shard(jnp.reshape(a, per_sequence, out_sharding=explicit_spec(_BL_EXPERTS, per_sequence)),
                     _BL_EXPERTS)

    valid = jnp.broadcast_to(token_mask, (batch, seq)).astype(jnp.float32)[..., None]  # [B, S, 1]
    valid = shard(valid, _BL_EXPERTS)
    scores = router_scores(logits, config)
    normalized = split_sequences(scores / jnp.sum(scores, axis=-1, keepdims=True)) * valid
    chosen = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32), axis=-2)  # [B*S, E]: 1 where chosen
    chosen = jax.lax.stop_gradient(split_sequences(chosen) * valid)
    tokens = jnp.maximum(jnp.sum(valid, axis=(1, 2)), 1.0)[:, None]  # T of each sequence, [B, 1]
    f = num_experts / (k * tokens) * jnp.sum(chosen, axis=1)  # [B, E]
    p = jnp.sum(normalized, axis=1) / tokens  # [B, E]
    return config.seq_aux_loss_alpha * jnp.sum(f * p, axis=-1)


class MoEOutput(NamedTuple):
    """What ``DeepSeekMoE`` returns, always these four: ``output [batch, seq, embed]``; ``expert_indices [batch,
    seq, k]`` int32, each token's chosen experts; ``dropped_tokens`` int32 scalar, (token, expert) pairs dropped
    over capacity (``moe_impl='ep'`` with ``moe_capacity_factor``; else 0); ``balance_loss [batch]`` float32,
    each sequence's ``sequence_balance_loss`` (None when ``seq_aux_loss_alpha`` is 0)."""

    output: jax.Array
    expert_indices: jax.Array
    dropped_tokens: jax.Array
    balance_loss: jax.Array | None


class DeepSeekMoE(nnx.Module):
    """The MoE feed-forward block: ``moe(x [batch, seq, embed]) -> MoEOutput``.

    >>> moe = DeepSeekMoE(DeepSeekV3Config.preset("deepseek3-mini"), rngs=nnx.Rngs(0))
    >>> out = moe(jnp.ones((2, 8, 128)))
    >>> out.output.shape, out.expert_indices.shape, out.balance_loss
    ((2, 8, 128), (2, 8, 2), None)
    """

    def __init__(self, config: DeepSeekV3Config, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype),
                  kernel_init=nnx.initializers.normal(c.initializer_range), rngs=rngs)
        init = nnx.initializers.normal(c.initializer_range)
        self.router = nnx.Param(
            init(rngs.params(), (c.hidden_size, c.n_routed_experts), jnp.dtype(c.param_dtype)),
            out_sharding=("embed", "exp_router"),
            eager_sharding=False,
        )
        if c.router.selection_bias:  # V2's routers have none: no Variable, no HF key
            self.e_score_correction_bias = RouterBias(
                jnp.zeros((c.n_routed_experts,), jnp.float32), out_sharding=("exp_router",), eager_sharding=False
            )
        else:
            self.e_score_correction_bias = None
        self.experts = RoutedExperts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size,
                                     grouped_matmul_impl=c.grouped_matmul_impl, **kw)
        if c.n_shared_experts:
            self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, **kw)
        else:
            self.shared_experts = None

    def __call__(self, x: jax.Array, *, token_mask: jax.Array | None = None) -> MoEOutput:
        """``MoEOutput`` for ``x [batch, seq, embed]``. ``token_mask [batch or 1, seq]`` (True = real token; default
        all real) says which tokens the balance loss counts."""
        c = self.config
        in_sharding = sharding_of(x)
        batch, seq, hidden = x.shape
        router = self.router[...].astype(jnp.float32)
        if c.moe_impl == "ep":
            # Routed per sequence: with the sequence split (ep-as-cp) a flat token layout costs an all-to-all; the
            # ep path gathers [batch, seq] blocks itself.
            tokens = shard(x, _BLE)
            logits = shard(weight_einsum("bsh,he->bse", tokens.astype(jnp.float32), router, _BL_EXPERTS),
                           _BL_EXPERTS)
        else:
            tokens = jnp.reshape(x, (batch * seq, hidden), out_sharding=explicit_spec(_TE, (batch * seq, hidden)))
            tokens = shard(tokens, _TE)
            logits = shard(weight_einsum("th,he->te", tokens.astype(jnp.float32), router, _T_EXPERTS), _T_EXPERTS)
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        idx, weights = route(logits, bias, c)

        out, dropped = self.experts(tokens, idx, weights, impl=c.moe_impl, capacity_factor=c.moe_capacity_factor,
                                    return_dropped=True)
        out = jnp.reshape(out, x.shape, out_sharding=explicit_spec(_BLE, x.shape))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        out = restore_sharding(shard(out, _BLE), in_sharding)
        balance = None
        if c.seq_aux_loss_alpha > 0:  # off: nothing to trace
            token_mask = jnp.ones((1, seq), bool) if token_mask is None else token_mask
            balance = sequence_balance_loss(logits, idx, token_mask, c)
        return MoEOutput(out, idx.reshape(batch, seq, c.num_experts_per_tok), dropped, balance)
