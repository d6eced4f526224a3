"""Routers: router logits -> each token's experts and their weights, plus the Switch load-balancing loss.

A router is a family's choice; this module holds the family-agnostic ones (``ROUTERS``, picked by name in
``route``), the selection bias Variable and its aux-loss-free balancing step, and the Switch-Transformer
auxiliary loss over any number of MoE layers.

``softmax_top_k``, in HF's order: ``p = softmax(logits)`` in float32 over all experts, ``top_k(p)``, then, with
``renormalize``, the ``k`` chosen weights divided by their sum (without: the raw probabilities), times ``scale``
(1 unless a model sets it). With ``group_top=1`` (router ``"softmax_group_limited"``, HF DeepSeek-V2's
``group_limited_greedy``) the top-k is taken only within the ``topk_group`` of ``n_group`` contiguous groups
holding the best single probabilities; with ``group_top=2`` (router ``"softmax_group_top2"``) a group scores as the sum
of its two best probabilities.

``sigmoid_bias_top_k`` (HF ``topk_method='noaux_tc'``): ``s = sigmoid(logits)`` in float32; experts
are *selected* on ``s + bias`` within the ``topk_group`` best of ``n_group`` contiguous expert groups (a group's
score is the sum of its two best biased scores); the chosen experts are *weighted* by the unbiased ``s``, divided
by their sum (+1e-20) when ``renormalize``, and always multiplied by ``scale``. ``group_limited_top_k`` is that
selection on any scores (softmax routers use it too). The bias (``RouterBias``) is not trained by gradients:
``balance_routing_bias`` moves it after each optimizer step, ``bias += rate * sign(mean load - load)``.

``sigmoid_top_k`` (Llama 4): the ``k`` largest logits, each weighted by its ``sigmoid`` (float32); no bias, no
group limit, not renormalised unless asked. Selection is on the logits themselves (the same order as the sigmoid's,
without float32 ties where the sigmoid saturates).

``sqrtsoftplus_bias_top_k`` (DeepSeek-V4): the same with ``s = sqrt(softplus(logits))`` and no group limit; the
weights are always divided by their sum (+1e-20). ``chosen_weights`` weights experts chosen elsewhere (DeepSeek-V4's
hash-routed layers pick them from a frozen token-id table; the router's scores still weight them).

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
from flax import nnx


class RouterBias(nnx.Variable):
    """A router's selection bias (HF ``e_score_correction_bias``). Not an ``nnx.Param``: gradient-based
    optimizers built with ``wrt=nnx.Param`` leave it alone; ``balance_routing_bias`` updates it."""


class Routing(NamedTuple):
    """A router's decision for tokens ``[..., E]``: ``expert_indices [..., k]`` int32, ``weights [..., k]``
    float32 (what each chosen expert's output is multiplied by), ``probs [..., E]`` float32 (the router's
    probabilities over all experts, what a balance loss reads)."""

    expert_indices: jax.Array
    weights: jax.Array
    probs: jax.Array


def softmax_top_k(logits: jax.Array, k: int, *, renormalize: bool, n_group: int = 1, topk_group: int = 1,
                  group_top: int = 0, scale: float = 1.0) -> Routing:
    """Softmax (float32) over the experts of ``logits [..., E]``, the ``k`` most probable experts (``group_top``
    > 0: within the ``topk_group`` best of ``n_group`` groups, see ``group_limited_top_k``), their probabilities
    as weights, divided by their sum when ``renormalize``, times ``scale``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if group_top:
        idx, weights = group_limited_top_k(probs, k, n_group=n_group, topk_group=topk_group, group_top=group_top)
    else:
        weights, idx = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if scale != 1.0:  # a Python constant: the default traces nothing
        weights = weights * scale
    return Routing(idx.astype(jnp.int32), weights, probs)


def group_limited_top_k(scores: jax.Array, k: int, *, bias: jax.Array | None = None, n_group: int = 1,
                        topk_group: int = 1, group_top: int = 0, renormalize: bool = False,
                        scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``(idx [..., k], weights [..., k])`` for router ``scores [..., E]`` (float32): the top-``k`` of
    ``scores + bias`` (``bias`` None: of ``scores``), only among the ``topk_group`` of ``n_group`` contiguous
    groups whose best ``group_top`` chooser scores sum highest (``group_top=0``: no group limit); weighted by the
    unbiased ``scores``, divided by their sum when ``renormalize``, times ``scale``."""
    *lead, num_experts = scores.shape
    chooser = scores if bias is None else scores + bias
    if group_top:
        per_group = num_experts // n_group
        grouped = chooser.reshape(*lead, n_group, per_group)  # [..., groups, experts of the group]
        group_scores = jax.lax.top_k(grouped, group_top)[0].sum(-1)
        _, best_groups = jax.lax.top_k(group_scores, topk_group)
        group_kept = jax.nn.one_hot(best_groups, n_group, dtype=jnp.int32).sum(-2) > 0
        chooser = jnp.where(jnp.repeat(group_kept, per_group, axis=-1), chooser, -jnp.inf)
    _, idx = jax.lax.top_k(chooser, k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)  # from the unbiased scores
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return idx, weights * scale


def sigmoid_bias_top_k(logits: jax.Array, k: int, *, bias: jax.Array, renormalize: bool, n_group: int = 1,
                       topk_group: int = 1, scale: float = 1.0) -> Routing:
    """Sigmoid scores (float32) of ``logits [..., E]``, experts selected on ``scores + bias`` within the
    ``topk_group`` best groups (group score: the sum of its top two), weighted by the unbiased scores (see the
    module docstring). ``probs`` are the sigmoid scores."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    idx, weights = group_limited_top_k(scores, k, bias=bias, n_group=n_group, topk_group=topk_group, group_top=2,
                                       renormalize=renormalize, scale=scale)
    return Routing(idx.astype(jnp.int32), weights, scores)


def sigmoid_top_k(logits: jax.Array, k: int, *, renormalize: bool = False, scale: float = 1.0) -> Routing:
    """The ``k`` largest ``logits [..., E]``, weighted by their sigmoid (float32), divided by their sum when
    ``renormalize``, times ``scale``; ``probs`` are the sigmoid scores of every expert.

    >>> sigmoid_top_k(jnp.array([[0.0, 2.0, -1.0]]), 1).weights
    Array([[0.8808]], dtype=float32)
    """
    logits = logits.astype(jnp.float32)
    top, idx = jax.lax.top_k(logits, k)
    weights = jax.nn.sigmoid(top)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(idx.astype(jnp.int32), weights * scale, jax.nn.sigmoid(logits))


def sqrt_softplus(logits: jax.Array) -> jax.Array:
    """DeepSeek-V4's router scores ``sqrt(softplus(logits))`` in float32 (positive, unbounded)."""
    return jnp.sqrt(jax.nn.softplus(logits.astype(jnp.float32)))


def sqrtsoftplus_bias_top_k(logits: jax.Array, k: int, *, bias: jax.Array, renormalize: bool,
                            scale: float = 1.0) -> Routing:
    """``sqrt_softplus`` scores of ``logits [..., E]``, experts selected on ``scores + bias`` (no group limit),
    weighted by the unbiased scores, divided by their sum (+1e-20) when ``renormalize``, times ``scale``
    (DeepSeek-V4's top-k layers). ``probs`` are the scores."""
    scores = sqrt_softplus(logits)
    idx, weights = group_limited_top_k(scores, k, bias=bias, renormalize=renormalize, scale=scale)
    return Routing(idx.astype(jnp.int32), weights, scores)


def chosen_weights(scores: jax.Array, idx: jax.Array, *, renormalize: bool, scale: float = 1.0) -> jax.Array:
    """The weights of experts ``idx [..., k]`` chosen by other means (a hash table): their ``scores [..., E]``,
    divided by their sum (+1e-20) when ``renormalize``, times ``scale``."""
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale


# Router scores by name, for routers whose choice is made elsewhere (``chosen_weights``).
SCORES = {"sigmoid": lambda logits: jax.nn.sigmoid(logits.astype(jnp.float32)),
          "softmax": lambda logits: jax.nn.softmax(logits.astype(jnp.float32), axis=-1),
          "sqrtsoftplus": sqrt_softplus}

# The routers a model picks by name (a config value): does the router carry a selection bias (RouterBias)?
# ``*_hash`` routers take their choice from a frozen token-id table (``HashTable``) and weight it by their scores.
ROUTERS: dict[str, bool] = {"softmax": False, "softmax_group_limited": False, "softmax_group_top2": False,
                            "sigmoid": False, "sigmoid_bias": True, "sqrtsoftplus_bias": True,
                            "sqrtsoftplus_hash": False}
HASH_ROUTERS: dict[str, str] = {"sqrtsoftplus_hash": "sqrtsoftplus"}  # name -> its scores (SCORES)
# The softmax routers' group score: the sum of a group's best ``group_top`` probabilities (0: no group limit).
_SOFTMAX_GROUP_TOP = {"softmax": 0, "softmax_group_limited": 1, "softmax_group_top2": 2}


class HashTable(nnx.Variable):
    """A hash router's frozen token-id -> experts table ``[vocab, k]`` int32 (HF ``tid2eid``). Not an
    ``nnx.Param``: no optimizer built with ``wrt=nnx.Param`` touches it, and nothing else moves it."""


def route(router: str, logits: jax.Array, k: int, *, renormalize: bool, bias: jax.Array | None = None,
          n_group: int = 1, topk_group: int = 1, scale: float = 1.0, chosen: jax.Array | None = None) -> Routing:
    """The ``Routing`` of ``logits [..., E]`` by the router named ``router`` (``ROUTERS``): ``"softmax"``
    (``softmax_top_k``; no bias or groups), ``"softmax_group_limited"`` (``softmax_top_k`` within the
    ``topk_group`` groups holding the best single probabilities; no bias), ``"softmax_group_top2"`` (the same
    with a group scored by the sum of its two best probabilities), ``"sigmoid"`` (``sigmoid_top_k``; no bias or
    groups), ``"sigmoid_bias"`` (``sigmoid_bias_top_k``) or
    ``"sqrtsoftplus_bias"`` (``sqrtsoftplus_bias_top_k``; no groups). A hash router (``HASH_ROUTERS``) routes to
    ``chosen [..., k]`` (the table's experts of each token), weighted by its scores."""
    if router in HASH_ROUTERS:
        if chosen is None:
            raise ValueError(f"router {router!r} routes by a token-id table: pass the chosen experts")
        scores = SCORES[HASH_ROUTERS[router]](logits)
        chosen = chosen.astype(jnp.int32)
        return Routing(chosen, chosen_weights(scores, chosen, renormalize=renormalize, scale=scale), scores)
    if router == "sigmoid":
        return sigmoid_top_k(logits, k, renormalize=renormalize, scale=scale)
    if router == "sqrtsoftplus_bias":
        return sqrtsoftplus_bias_top_k(logits, k, bias=bias, renormalize=renormalize, scale=scale)
    if router in _SOFTMAX_GROUP_TOP:
        return softmax_top_k(logits, k, renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                             group_top=_SOFTMAX_GROUP_TOP[router], scale=scale)
    if router == "sigmoid_bias":
        return sigmoid_bias_top_k(logits, k, bias=bias, renormalize=renormalize, n_group=n_group,
                                  topk_group=topk_group, scale=scale)
    raise ValueError(f"unknown router {router!r}; choose one of {tuple(ROUTERS)}")


def balance_routing_bias(bias: RouterBias, expert_load: jax.Array, rate: float) -> None:
    """Auxiliary-loss-free load balancing, after an optimizer step: ``bias [..., E]`` (e.g. ``[layers, E]``)
    moves by ``rate`` toward balance, ``bias += rate * sign(mean load - load)``, with ``expert_load`` the
    (token, expert) pairs each expert received, shaped like the bias."""
    load = expert_load.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    bias[...] = bias[...] + step.astype(bias[...].dtype)


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
