"""Routers: router logits -> each token's experts and their weights, plus the Switch load-balancing loss.

A router is a family's choice (DeepSeek-V3's sigmoid + bias lives with DeepSeek); this module holds the
family-agnostic softmax top-k router and the Switch-Transformer auxiliary loss over any number of MoE layers.

``softmax_top_k``, in HF's order: ``p = softmax(logits)`` in float32 over all experts, ``top_k(p)``, then, with
``renormalize``, the ``k`` chosen weights divided by their sum (without: the raw probabilities).

The Switch loss (Switch Transformer eq. 4-6, as transformers' ``load_balancing_loss_func`` computes it over the
MoE layers' router logits concatenated): with ``f_e`` = (token, expert) pairs routed to expert ``e`` and
``P_e`` = summed router probability of ``e``, each over every MoE layer's real tokens and divided by the number
``R`` of (layer, real token) rows, ``loss = E * sum_e f_e * P_e`` (``f`` sums to ``k``; a uniform router gives
``k``). Because ``f`` and ``P`` are pooled over layers before the product, each layer hands over its sums
(``BalanceSums``) and ``switch_balance_loss`` combines them.

>>> logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
>>> routing = softmax_top_k(logits, 2, renormalize=True)
>>> routing.expert_indices, routing.weights.sum(-1)
(Array([[0, 1]], dtype=int32), Array([1.], dtype=float32))
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """A router's decision for tokens ``[..., E]``: ``expert_indices [..., k]`` int32, ``weights [..., k]``
    float32 (what each chosen expert's output is multiplied by), ``probs [..., E]`` float32 (the router's
    probabilities over all experts, what a balance loss reads)."""

    expert_indices: jax.Array
    weights: jax.Array
    probs: jax.Array


def softmax_top_k(logits: jax.Array, k: int, *, renormalize: bool) -> Routing:
    """Softmax (float32) over the experts of ``logits [..., E]``, the ``k`` most probable experts, their
    probabilities as weights, divided by their sum when ``renormalize``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(idx.astype(jnp.int32), weights, probs)


class BalanceSums(NamedTuple):
    """One MoE layer's share of the Switch loss (or several layers' summed): ``counts [E]`` (token, expert)
    pairs routed to each expert over real tokens (no gradient), ``probs [E]`` the router probabilities summed
    over real tokens, ``rows`` (scalar) the real tokens. All float32."""

    counts: jax.Array
    probs: jax.Array
    rows: jax.Array


def balance_sums(routing: Routing, token_mask: jax.Array | None = None) -> BalanceSums:
    """``BalanceSums`` of one layer's ``routing`` (any leading token dims ``[..., E]``); ``token_mask`` (same
    leading dims, or broadcastable to them; True / 1 = real token) leaves padding out."""
    num_experts = routing.probs.shape[-1]
    lead = routing.probs.shape[:-1]
    mask = jnp.ones(lead, jnp.float32) if token_mask is None else jnp.broadcast_to(token_mask, lead).astype(
        jnp.float32)
    # [..., k, E] one-hot of the chosen experts, weighted by the token's mask, summed over tokens and k.
    chosen = jax.nn.one_hot(routing.expert_indices, num_experts, dtype=jnp.float32) * mask[..., None, None]
    token_dims = tuple(range(len(lead)))
    counts = jax.lax.stop_gradient(jnp.sum(chosen, axis=(*token_dims, len(lead))))
    probs = jnp.sum(routing.probs * mask[..., None], axis=token_dims)
    return BalanceSums(counts, probs, jnp.sum(mask))


def switch_balance_loss(sums: BalanceSums) -> jax.Array:
    """The Switch load-balancing loss of ``sums`` pooled over all MoE layers (their ``BalanceSums`` added):
    ``E * sum_e (counts_e / rows) * (probs_e / rows)``, unweighted (a model multiplies by its coefficient)."""
    rows = jnp.maximum(sums.rows, 1.0)  # no real token: 0, not NaN
    return sums.counts.shape[-1] * jnp.sum((sums.counts / rows) * (sums.probs / rows))
