"""DeepSeek's MoE block: a float32 router (V3's or V2's, by ``topk_method``), routed experts, shared experts.

V3 routing (``topk_method='noaux_tc'``, HF ``DeepseekV3TopkRouter``): ``s = sigmoid(x W)`` in float32; experts
are *selected* on ``s + e_score_correction_bias`` within the ``topk_group`` best groups (a group's score is the
sum of its two best biased scores); the chosen experts are *weighted* by the unbiased ``s``, normalized to sum 1
when ``norm_topk_prob``, and always multiplied by ``routed_scaling_factor``.
V2 routing (``'greedy'`` / ``'group_limited_greedy'``, HF ``DeepseekV2TopkRouter``): ``s = softmax(x W)`` in
float32, no bias; the top-k of ``s`` (group-limited: within the ``topk_group`` groups holding the best single
scores), weighted by ``s`` times ``routed_scaling_factor``, never renormalized.
The block is the shared ``nnx_zoo.layers.sparse_moe.SparseMoE`` (token layout, float32 router, every
``moe_impl`` path, the input's sharding restored), its router the shared one ``topk_method`` names
(``SHARED_ROUTERS``); DeepSeek adds the sequence-wise balance loss. The shared experts (one SwiGLU of width
``moe_intermediate_size * n_shared_experts``) are added unscaled.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.routers import RouterBias
from nnx_zoo.layers.routers import route as shared_route
from nnx_zoo.layers.sparse_moe import SparseMoE
from nnx_zoo.layers.spec import explicit_spec
from nnx_zoo.models.deepseek.config import DeepSeekV3Config, Router
from nnx_zoo.sharding import shard

__all__ = ["SHARED_ROUTERS", "DeepSeekMoE", "MoEOutput", "RouterBias", "route", "router_scores",
           "sequence_balance_loss"]

_BL_EXPERTS = ("activation_batch", "activation_length", None)


# DeepSeek's routers (config.ROUTERS rows, or a config's own ``router``) as the shared ones
# (nnx_zoo.layers.routers.ROUTERS), by (scoring, group_top, selection_bias): V3's noaux_tc, V2's greedy and
# group_limited_greedy, and softmax scores limited to the groups whose two best scores sum highest.
SHARED_ROUTERS: dict[tuple[str, int, bool], str] = {
    ("sigmoid", 2, True): "sigmoid_bias",
    ("softmax", 0, False): "softmax",
    ("softmax", 1, False): "softmax_group_limited",
    ("softmax", 2, False): "softmax_group_top2",
}


def _shared_router(router: Router) -> str:
    key = (router.scoring, router.group_top, router.selection_bias)
    if key not in SHARED_ROUTERS:
        raise ValueError(f"no shared router routes as {router} does")
    return SHARED_ROUTERS[key]


def router_scores(logits: jax.Array, config: DeepSeekV3Config) -> jax.Array:
    """The router's scores for ``logits [..., E]``: sigmoid (V3) or softmax over the experts (V2), in float32."""
    logits = logits.astype(jnp.float32)
    return jax.nn.sigmoid(logits) if config.router.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)


def route(
    logits: jax.Array, bias: jax.Array | None, config: DeepSeekV3Config
) -> tuple[jax.Array, jax.Array]:
    """Top-k experts and their weights for router ``logits [..., E]`` (float32, e.g. ``[T, E]`` or ``[B, S, E]``):
    ``(idx [..., k], weights [..., k])``, as ``DeepSeekMoE`` routes (the shared router ``config.router`` maps to).
    ``bias``: the selection bias when ``config.router`` has one, else None."""
    c = config
    routing = shared_route(_shared_router(c.router), logits, c.num_experts_per_tok, renormalize=c.norm_topk_prob,
                           bias=bias, n_group=c.n_group or 1, topk_group=c.topk_group or 1,
                           scale=c.routed_scaling_factor)
    return routing.expert_indices, routing.weights


def sequence_balance_loss(
    scores: jax.Array, idx: jax.Array, token_mask: jax.Array, alpha: float
) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss (paper eq. 17-20), one value per sequence.

    For the router's float32 ``scores [B*S, E]`` (``router_scores``: sigmoid, V2's softmax, V4's sqrt(softplus))
    and the chosen experts ``idx [B*S, k]`` of ``B`` sequences of ``S`` tokens (or ``[B, S, E]`` and ``[B, S,
    k]``):
    ``f_i = E / (k T) * #{t : t chose i}``, ``P_i = 1/T * sum_t s'_{i,t}`` with ``s' = s / sum_j s_j`` the router's
    scores (``router_scores``: sigmoid, or V2's softmax) normalized over all experts, and
    ``L = alpha * sum_i f_i P_i`` -> ``[B]`` float32. ``T`` counts the sequence's real tokens: ``token_mask
    [B or 1, S]`` (False = padding) leaves the others out; a sequence with none gets 0. ``f`` counts the experts
    actually chosen (selection includes any routing bias) and carries no gradient; the gradient flows through
    ``P`` into the router.
    """
    num_experts, k = scores.shape[-1], idx.shape[-1]
    seq = token_mask.shape[-1]
    batch = scores.shape[0] // seq if scores.ndim == 2 else scores.shape[0]
    per_sequence = (batch, seq, num_experts)

    def split_sequences(a: jax.Array) -> jax.Array:  # [B*S, E] -> [B, S, E], laid out like [B, S, E] activations
        if a.ndim == 3:
            return shard(a, _BL_EXPERTS)
        return shard(jnp.reshape(a, per_sequence, out_sharding=explicit_spec(_BL_EXPERTS, per_sequence)),
                     _BL_EXPERTS)

    valid = jnp.broadcast_to(token_mask, (batch, seq)).astype(jnp.float32)[..., None]  # [B, S, 1]
    valid = shard(valid, _BL_EXPERTS)
    normalized = split_sequences(scores / jnp.sum(scores, axis=-1, keepdims=True)) * valid
    chosen = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32), axis=-2)  # [B*S, E]: 1 where chosen
    chosen = jax.lax.stop_gradient(split_sequences(chosen) * valid)
    tokens = jnp.maximum(jnp.sum(valid, axis=(1, 2)), 1.0)[:, None]  # T of each sequence, [B, 1]
    f = num_experts / (k * tokens) * jnp.sum(chosen, axis=1)  # [B, E]
    p = jnp.sum(normalized, axis=1) / tokens  # [B, E]
    return alpha * jnp.sum(f * p, axis=-1)


class MoEOutput(NamedTuple):
    """What ``DeepSeekMoE`` returns, always these four: ``output [batch, seq, embed]``; ``expert_indices [batch,
    seq, k]`` int32, each token's chosen experts; ``dropped_tokens`` int32 scalar, (token, expert) pairs dropped
    over capacity (``moe_impl='ep'`` with ``moe_capacity_factor``; else 0); ``balance_loss [batch]`` float32,
    each sequence's ``sequence_balance_loss`` (None when ``seq_aux_loss_alpha`` is 0)."""

    output: jax.Array
    expert_indices: jax.Array
    dropped_tokens: jax.Array
    balance_loss: jax.Array | None


class DeepSeekMoE(SparseMoE):
    """The MoE feed-forward block: ``moe(x [batch, seq, embed]) -> MoEOutput``. A ``SparseMoE`` configured from
    ``config`` (its Variables ``router``, ``e_score_correction_bias`` (V3 only), ``experts``, ``shared_experts``)
    with DeepSeek's output and sequence-wise balance loss.

    >>> moe = DeepSeekMoE(DeepSeekV3Config.preset("deepseek3-mini"), rngs=nnx.Rngs(0))
    >>> out = moe(jnp.ones((2, 8, 128)))
    >>> out.output.shape, out.expert_indices.shape, out.balance_loss
    ((2, 8, 128), (2, 8, 2), None)
    """

    def __init__(self, config: DeepSeekV3Config, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        super().__init__(
            c.hidden_size, num_experts=c.num_routed_experts, experts_per_token=c.num_experts_per_tok,
            expert_hidden=c.expert_intermediate_size, renormalize=c.norm_topk_prob,
            shared_hidden=c.shared_expert_intermediate_size, router=_shared_router(c.router),
            n_group=c.n_group or 1, topk_group=c.topk_group or 1, routed_scaling_factor=c.routed_scaling_factor,
            moe_impl=c.moe_impl, grouped_matmul_impl=c.grouped_matmul_impl, capacity_factor=c.moe_capacity_factor,
            dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype),
            kernel_init=nnx.initializers.normal(c.initializer_range), rngs=rngs)

    def __call__(self, x: jax.Array, *, token_mask: jax.Array | None = None) -> MoEOutput:  # type: ignore[override]
        """``MoEOutput`` for ``x [batch, seq, embed]``. ``token_mask [batch or 1, seq]`` (True = real token; default
        all real) says which tokens the balance loss counts."""
        c = self.config
        batch, seq, _ = x.shape
        out, routing, logits, dropped = self.routed(x)
        idx = routing.expert_indices
        balance = None
        if c.seq_aux_loss_alpha > 0:  # off: nothing to trace
            token_mask = jnp.ones((1, seq), bool) if token_mask is None else token_mask
            balance = sequence_balance_loss(router_scores(logits, c), idx, token_mask, c.seq_aux_loss_alpha)
        return MoEOutput(out, idx.reshape(batch, seq, c.num_experts_per_tok), dropped, balance)
