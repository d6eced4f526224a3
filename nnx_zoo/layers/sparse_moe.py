"""A sparse mixture-of-experts feed-forward block: router projection, routing (``nnx_zoo.layers.routers``: softmax
top-k, or sigmoid scores with a selection bias and group limit), routed SwiGLU experts (``RoutedExperts``: every
``moe_impl`` path and grouped-matmul kernel), optional shared experts.

``out = sum_k w_k * expert_{i_k}(x) (+ shared(x))`` with ``(i, w) = route(router, x W_router (+ b_router))``; with
``scale_inputs`` the weight scales each chosen expert's input instead, ``out = sum_k expert_{i_k}(w_k * x)`` (Llama 4;
not the same for a SwiGLU, which is not linear). The router
weight ``[embed, exp_router]`` (and its optional bias) is applied in float32 (logits ``[tokens, E]`` whole along the
experts: top-k needs the whole row). The block returns ``SparseMoEOutput`` (always the same fields, a fixed shape),
restored to the sharding its input arrived with.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.linear import DEFAULT_INIT
from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.moe import MoeImpl, RoutedExperts
from nnx_zoo.layers.routers import (
    HASH_ROUTERS,
    ROUTERS,
    BalanceSums,
    HashTable,
    RouterBias,
    Routing,
    balance_routing_bias,
    balance_sums,
    route,
    softmax_top_k,
)
from nnx_zoo.layers.spec import explicit_spec, weight_einsum
from nnx_zoo.sharding import restore_sharding, shard, sharding_of

_BLE = ("activation_batch", "activation_length", "activation_embed")
_TE = ("activation_tokens", "activation_embed")
_T_EXPERTS = ("activation_tokens", None)  # every token sees all router logits: top-k needs the whole row
_BL_EXPERTS = ("activation_batch", "activation_length", None)


class SparseMoEOutput(NamedTuple):
    """What ``SparseMoE`` returns, always these four: ``output [batch, seq, embed]``; ``expert_indices [batch,
    seq, k]`` int32; ``dropped_tokens`` int32 scalar, (token, expert) pairs over capacity (``moe_impl='ep'``
    with a ``capacity_factor``; else 0); ``balance`` (``BalanceSums``, the layer's share of the Switch
    load-balancing loss over real tokens; None unless asked for)."""

    output: jax.Array
    expert_indices: jax.Array
    dropped_tokens: jax.Array
    balance: BalanceSums | None


class RoutedOutput(NamedTuple):
    """``SparseMoE.routed``'s result, what a family's block builds its own output from: ``output [batch, seq,
    embed]`` (in the input's sharding); ``routing`` and ``logits`` (float32) over the tokens as the block laid
    them out, ``[batch * seq, ...]`` (``[batch, seq, ...]`` for ``moe_impl='ep'``); ``dropped_tokens`` (int32
    scalar)."""

    output: jax.Array
    routing: Routing
    logits: jax.Array
    dropped_tokens: jax.Array


class SparseMoE(nnx.Module):
    """Routed SwiGLU experts (``num_experts`` of width ``expert_hidden``), plus an optional shared SwiGLU of width
    ``shared_hidden`` added unweighted.

    ``router`` names the routing (``nnx_zoo.layers.routers.ROUTERS``): ``"softmax"`` (top-k of the softmax),
    ``"softmax_group_limited"`` (that within the ``topk_group`` of ``n_group`` groups holding the best single
    probabilities) or ``"sigmoid_bias"`` (selection on sigmoid scores + ``e_score_correction_bias``, a
    ``RouterBias`` Variable moved by ``balance_bias``, within the ``topk_group`` best of ``n_group`` groups),
    ``"sqrtsoftplus_bias"`` (the same on ``sqrt(softplus)`` scores, no groups), or a hash router
    (``"sqrtsoftplus_hash"``: each token's experts are row ``input_ids`` of a frozen ``tid2eid [vocab_size, k]``
    table, a ``HashTable`` Variable; the router's scores weight them). ``swiglu_limit`` clamps the experts' and
    shared experts' pre-activations (``Glu``); ``swiglu_alpha`` and ``swiglu_up_offset`` set the routed experts'
    sigmoid gain and up-projection shift (``Glu``'s ``alpha`` / ``up_offset``). ``router_bias`` adds a learned bias
    ``router_bias [E]`` to the router logits (a ``Linear`` with bias, trained like the weight; not a selection
    bias); ``expert_bias`` gives the routed experts biases (``RoutedExperts``' ``use_bias``). ``scale_inputs``: each
    chosen expert runs on its token times the routing weight and its output is added unweighted (run as ``k`` top-1
    dispatches, so every ``moe_impl`` serves it).
    Weights are times ``routed_scaling_factor``. ``renormalize``: divide the ``k`` chosen weights by their sum.
    ``balance_softmax``: the balance sums read the softmax of the router logits and its top-k (what transformers'
    ``load_balancing_loss_func`` computes whatever the router) instead of this router's own scores and choice.
    ``moe_impl``: ``RoutedExperts``' path (``auto`` / ``dense`` / ``gmm`` / ``ep``), ``capacity_factor`` for ``ep``.
    ``routed`` is the block without its output tuple, for a family's block that builds its own.

    >>> moe = SparseMoE(64, num_experts=8, experts_per_token=2, expert_hidden=32, renormalize=True,
    ...                 rngs=nnx.Rngs(0))
    >>> out = moe(jnp.ones((2, 8, 64)), with_balance=True)
    >>> out.output.shape, out.expert_indices.shape, out.balance.counts.shape
    ((2, 8, 64), (2, 8, 2), (8,))
    """

    def __init__(self, features: int, *, num_experts: int, experts_per_token: int, expert_hidden: int,
                 renormalize: bool, shared_hidden: int = 0, router: str = "softmax", n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0, moe_impl: MoeImpl = "auto",
                 grouped_matmul_impl: str = "auto", capacity_factor: float | None = None,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.0, swiglu_up_offset: float = 0.0,
                 router_bias: bool = False, expert_bias: bool = False, vocab_size: int | None = None,
                 scale_inputs: bool = False, shared_gate: bool = False, balance_softmax: bool = False,
                 dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype = jnp.float32,
                 kernel_init: nnx.initializers.Initializer = DEFAULT_INIT, rngs: nnx.Rngs):
        self.num_experts, self.experts_per_token, self.renormalize = num_experts, experts_per_token, renormalize
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; choose one of {tuple(ROUTERS)}")
        self.moe_impl, self.capacity_factor = moe_impl, capacity_factor
        self.router_kind, self.n_group, self.topk_group = router, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.scale_inputs = scale_inputs
        self.balance_softmax = balance_softmax
        self.router = nnx.Param(kernel_init(rngs.params(), (features, num_experts), param_dtype),
                                out_sharding=("embed", "exp_router"), eager_sharding=False)
        self.router_bias = nnx.Param(jnp.zeros((num_experts,), param_dtype), out_sharding=("exp_router",),
                                     eager_sharding=False) if router_bias else None
        # float32 whatever param_dtype: a bf16 bias could not take the balancing rule's small steps.
        self.e_score_correction_bias = RouterBias(
            jnp.zeros((num_experts,), jnp.float32), out_sharding=("exp_router",), eager_sharding=False
        ) if ROUTERS[router] else None
        if router in HASH_ROUTERS and not vocab_size:
            raise ValueError(f"router {router!r} routes by a token-id table: give vocab_size")
        # Replicated: each token reads its own row (a [vocab, k] int32 table, a few MB).
        self.tid2eid = HashTable(jnp.zeros((vocab_size, experts_per_token), jnp.int32), out_sharding=(None, None),
                                 eager_sharding=False) if router in HASH_ROUTERS else None
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.experts = RoutedExperts(num_experts, features, expert_hidden, grouped_matmul_impl=grouped_matmul_impl,
                                     limit=swiglu_limit, alpha=swiglu_alpha, up_offset=swiglu_up_offset,
                                     use_bias=expert_bias, **kw)
        self.shared_experts = SwiGLU(features, shared_hidden, limit=swiglu_limit, **kw) if shared_hidden else None
        if shared_gate and not shared_hidden:
            raise ValueError("shared_gate=True gates the shared expert: give shared_hidden > 0")
        # [embed, 1]: one logit per token; its sigmoid scales the shared expert's output (Qwen2-MoE, Qwen3-Next).
        self.shared_gate = nnx.Param(kernel_init(rngs.params(), (features, 1), param_dtype),
                                     out_sharding=("embed", None), eager_sharding=False) if shared_gate else None

    def __call__(self, x: jax.Array, *, token_mask: jax.Array | None = None, with_balance: bool = False,
                 input_ids: jax.Array | None = None) -> SparseMoEOutput:
        """``SparseMoEOutput`` for ``x [batch, seq, embed]``. ``token_mask [batch or 1, seq]`` (True = real token;
        default all real): which tokens the balance sums count (``with_balance``). ``input_ids [batch, seq]``: the
        tokens, which a hash router routes by."""
        batch, seq, _ = x.shape
        out, routing, logits, dropped = self.routed(x, input_ids)
        balance = None
        if with_balance:
            mask = jnp.ones((1, seq), bool) if token_mask is None else token_mask
            mask = shard(jnp.broadcast_to(mask, (batch, seq)), _BLE[:2])
            if logits.ndim == 2:
                mask = shard(jnp.reshape(mask, (batch * seq,), out_sharding=explicit_spec(_TE[:1], (batch * seq,))),
                             _TE[:1])
            # balance_softmax: the Switch loss's own softmax top-k of the logits, not the selection made above.
            scored = softmax_top_k(logits, self.experts_per_token, renormalize=False) if self.balance_softmax else (
                routing)
            balance = balance_sums(scored, mask)
        idx = routing.expert_indices.reshape(batch, seq, self.experts_per_token)
        return SparseMoEOutput(out, idx, dropped, balance)

    def routed(self, x: jax.Array, input_ids: jax.Array | None = None) -> RoutedOutput:
        """The block on ``x [batch, seq, embed]`` (the output, restored to ``x``'s sharding) with its routing and
        router logits, for ``__call__`` or a family's own block to build its output (and losses) from.
        ``input_ids [batch, seq]``: the tokens (a hash router needs them)."""
        if self.tid2eid is not None and input_ids is None:
            raise ValueError(f"router {self.router_kind!r} routes each token by its id: pass input_ids")
        in_sharding = sharding_of(x)
        batch, seq, hidden = x.shape
        router = self.router[...].astype(jnp.float32)
        if self.moe_impl == "ep":
            # Routed per sequence: with the sequence split (ep-as-cp) a flat token layout costs an all-to-all; the
            # ep path gathers [batch, seq] blocks itself.
            tokens = shard(x, _BLE)
            logits = shard(weight_einsum("bsh,he->bse", tokens.astype(jnp.float32), router, _BL_EXPERTS),
                           _BL_EXPERTS)
        else:
            tokens = jnp.reshape(x, (batch * seq, hidden), out_sharding=explicit_spec(_TE, (batch * seq, hidden)))
            tokens = shard(tokens, _TE)
            logits = shard(weight_einsum("th,he->te", tokens.astype(jnp.float32), router, _T_EXPERTS), _T_EXPERTS)
        if self.router_bias is not None:  # whole along the experts, like the logits
            logits = logits + shard(self.router_bias[...].astype(jnp.float32), (None,))
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        chosen = None
        if self.tid2eid is not None:  # the table's rows of the tokens, laid out like the logits
            names = _BL_EXPERTS if logits.ndim == 3 else _T_EXPERTS
            ids = input_ids if logits.ndim == 3 else jnp.reshape(
                input_ids, (batch * seq,), out_sharding=explicit_spec(_TE[:1], (batch * seq,)))
            shape = (*ids.shape, self.experts_per_token)
            chosen = shard(self.tid2eid[...].at[ids].get(out_sharding=explicit_spec(names, shape)), names)
        routing = route(self.router_kind, logits, self.experts_per_token, renormalize=self.renormalize, bias=bias,
                        n_group=self.n_group, topk_group=self.topk_group, scale=self.routed_scaling_factor,
                        chosen=chosen)
        if self.scale_inputs:
            out, dropped = self._input_scaled(tokens, routing)
        else:
            out, dropped = self.experts(tokens, routing.expert_indices, routing.weights, impl=self.moe_impl,
                                        capacity_factor=self.capacity_factor, return_dropped=True)
        out = jnp.reshape(out, x.shape, out_sharding=explicit_spec(_BLE, x.shape))
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                gate = weight_einsum("bsh,ho->bso", x, self.shared_gate[...].astype(x.dtype), _BL_EXPERTS)
                shared = jax.nn.sigmoid(gate) * shared
            out = out + shared
        out = restore_sharding(shard(out.astype(x.dtype), _BLE), in_sharding)
        return RoutedOutput(out, routing, logits, dropped)

    def params_cast_once(self) -> dict[tuple[str, ...], jnp.dtype]:
        """``{path: dtype}`` of the Params this block casts whole to its compute dtype (its experts':
        ``RoutedExperts.cast_once_names``), which a layer scan casts once for all its layers (``run_stack``)."""
        names = self.experts.cast_once_names(self.moe_impl, self.capacity_factor)
        return {("experts", name): self.experts.dtype for name in names}

    def _input_scaled(self, tokens: jax.Array, routing: Routing) -> tuple[jax.Array, jax.Array]:
        """``sum_j expert_{i_j}(w_j * x)`` over the ``k`` choices, one top-1 dispatch each (outputs unweighted), and
        the dropped (token, expert) pairs summed."""
        out, dropped = None, jnp.zeros((), jnp.int32)
        for j in range(self.experts_per_token):
            idx = routing.expert_indices[..., j:j + 1]
            weight = routing.weights[..., j:j + 1]
            part, lost = self.experts(tokens * weight.astype(tokens.dtype), idx, jnp.ones_like(weight),
                                      impl=self.moe_impl, capacity_factor=self.capacity_factor, return_dropped=True)
            out, dropped = part if out is None else out + part, dropped + lost
        return out, dropped

    def balance_bias(self, expert_load: jax.Array, rate: float) -> None:
        """Move the selection bias toward balance after an optimizer step (``balance_routing_bias``);
        ``expert_load`` is shaped like the bias (``[E]``, or ``[layers, E]`` for a stacked block). A router
        without a bias has nothing to move: a no-op."""
        if self.e_score_correction_bias is not None:
            balance_routing_bias(self.e_score_correction_bias, expert_load, rate)
