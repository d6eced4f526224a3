"""Routed SwiGLU experts with three compute paths: ``dense``, ``gmm`` (grouped matmul) and ``ep`` (experts split
over devices).

Routing (who picks which experts with what weight) is the model family's business; this module takes the
routing decision ``(expert_idx [T, k], weights [T, k])`` for flat tokens ``x [T, embed]`` and returns
``sum_k weights[t, k] * expert_{idx[t, k]}(x[t])``.

- ``dense`` runs every expert on every token and weights the results (zero for experts not chosen). It is the
  simple reference and fast for few experts on small inputs.
- ``gmm`` sorts the ``T * k`` (token, expert) pairs by expert, runs a grouped matmul over the contiguous groups
  (``nnx_zoo.layers.grouped_matmul``: a tiled portable path, ``jax.lax.ragged_dot``, or a tokamax / Pallas-Triton
  kernel, picked by ``grouped_matmul_impl``) and scatters the results back. Under a mesh it runs inside
  ``jax.shard_map`` over the token axes, each shard sorting its own tokens against all-gathered expert weights
  (FSDP-style; expert parallelism is a separate path), because sorting and grouped matmuls do not partition
  automatically under Explicit axes.
- ``ep`` (expert parallelism) runs inside ``jax.shard_map`` over the mesh axes that the active rule set maps the
  logical name ``exp`` to (no mesh axis is named here). Each shard holds ``E / n_ep`` whole experts. XLA:CPU has
  no ``ragged_all_to_all``, so the dispatch is an all-gather of the tokens and their routing over the EP axes;
  each shard runs its own experts on the tokens routed to them (dense over local experts when dropless, or
  sorted into ``[local experts, capacity]`` slots and one batched einsum when ``capacity_factor`` is set:
  at most ``ceil(capacity_factor * tokens * k / E)`` tokens per expert, ``tokens`` being those the EP group
  sees, first come first served), and ``psum_scatter`` combines the partial sums back onto the token shards.
  Without a mesh, or when ``exp`` resolves to no mesh axis of size > 1, it falls back to the backend's dropless
  path (``default_moe_impl``) or to the same capacity computation on the local tokens.
  ``ep`` also takes unflattened ``x [batch, seq, embed]``: when the sequence is split over mesh axes (e.g.
  ``ep-as-cp``), flattening to tokens would move data (an all-to-all), so each shard gathers its block over the EP
  axes on the batch and sequence dims and flattens locally (always when dropless; under a capacity only when the
  group's tokens then come in the same order as the flattened path's, else it flattens first).
- ``auto`` picks ``dense`` or ``gmm`` for the backend by measurement (``default_moe_impl``).

Experts may carry biases (``use_bias``), ``b_gate``/``b_up [E, moe_mlp]`` added to each expert's gate
and up projections and ``b_down [E, embed]`` to its output before the routing weight: every path adds the biases
of the expert a row runs on (the local experts' own under ``ep``).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.grouped_matmul import choose_grouped_matmul_impl, grouped_matmul
from nnx_zoo.layers.linear import DEFAULT_INIT
from nnx_zoo.layers.mlp import PLAIN, Glu
from nnx_zoo.layers.spec import (
    ambient_mesh_or_none,
    explicit_spec,
    gather_fsdp_axes,
    resolve_activation,
    weight_einsum,
    weight_einsum_to_spec,
    without_reduced,
)
from nnx_zoo.sharding import axes_tuple, current_rules, logical_to_mesh_axes, shard
from nnx_zoo.sharding.constrain import shard_to_spec

MOE_IMPLS = ("auto", "dense", "gmm", "ep")  # RoutedExperts' paths ('auto': default_moe_impl)

MoeImpl = Literal["auto", "dense", "gmm", "ep"]
_TOKENS = ("activation_tokens", "activation_embed")
_TOKENS_TOPK = ("activation_tokens", "activation_topk")
_BL = ("activation_batch", "activation_length")
_WI_NAMES = ("exp", "embed_no_exp", "moe_mlp")
_WO_NAMES = ("exp", "moe_mlp", "embed_no_exp")
_B_IN_NAMES = ("exp", "moe_mlp")
_B_OUT_NAMES = ("exp", "embed_no_exp")


class RoutedExperts(nnx.Module):
    """``num_experts`` SwiGLU experts, stacked: ``wi_gate``/``wi_up [E, embed, moe_mlp]``, ``wo [E, moe_mlp, embed]``.

    ``grouped_matmul_impl`` picks the grouped matmul of the ``gmm`` path (``grouped_matmul``'s ``impl``). The gated
    activation is ``Glu(limit, alpha, up_offset, activation)`` (plain ``silu(gate) * up`` by default; ``activation
    ="gelu_tanh"`` makes GeGLU experts). ``use_bias`` adds per-expert biases ``wi_gate_bias``/``wi_up_bias [E,
    moe_mlp]`` and ``wo_bias [E, embed]`` (initialized to 0): ``expert_e(x) = down(act(x W_gate + b_gate, x W_up +
    b_up)) + b_down``.

    >>> experts = RoutedExperts(8, 64, 32, rngs=nnx.Rngs(0))
    >>> idx, w = jnp.zeros((10, 2), jnp.int32), jnp.full((10, 2), 0.5)
    >>> experts(jnp.ones((10, 64)), idx, w, impl="gmm").shape
    (10, 64)
    """

    def __init__(
        self,
        num_experts: int,
        features: int,
        hidden: int,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: nnx.initializers.Initializer = DEFAULT_INIT,
        grouped_matmul_impl: str = "auto",
        limit: float | None = None,
        alpha: float = 1.0,
        up_offset: float = 0.0,
        use_bias: bool = False,
        activation: str = "silu",
        rngs: nnx.Rngs,
    ):
        self.num_experts = num_experts
        self.dtype = dtype
        self.grouped_matmul_impl = grouped_matmul_impl
        # act(gate) * up: silu (or ``activation``, e.g. gelu_tanh) by default; clamped pre-activations, a sigmoid
        # gain and a shifted up projection as set
        self.act = Glu(limit, alpha, up_offset, activation)

        def param(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
            return nnx.Param(kernel_init(rngs.params(), shape, param_dtype), out_sharding=names, eager_sharding=False)

        self.wi_gate = param((num_experts, features, hidden), _WI_NAMES)
        self.wi_up = param((num_experts, features, hidden), _WI_NAMES)
        self.wo = param((num_experts, hidden, features), _WO_NAMES)

        def bias(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param | None:
            return nnx.Param(jnp.zeros(shape, param_dtype), out_sharding=names, eager_sharding=False) if use_bias \
                else None

        self.wi_gate_bias = bias((num_experts, hidden), _B_IN_NAMES)
        self.wi_up_bias = bias((num_experts, hidden), _B_IN_NAMES)
        self.wo_bias = bias((num_experts, features), _B_OUT_NAMES)

    def __call__(
        self,
        x: jax.Array,
        expert_idx: jax.Array,
        weights: jax.Array,
        *,
        impl: MoeImpl = "dense",
        capacity_factor: float | None = None,
        return_dropped: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``out [T, embed]``, or ``(out, dropped)`` with ``return_dropped``: ``dropped`` (int32 scalar) counts
        the (token, expert) pairs over capacity (always 0 when dropless). ``capacity_factor`` applies to ``ep``.
        ``x`` may also be ``[batch, seq, embed]`` (``expert_idx``/``weights [batch, seq, k]``; ``out`` then has
        ``x``'s shape): ``ep`` keeps it unflattened where the sequence is split (see the module docstring), the
        other paths flatten it."""
        if impl == "auto":
            impl = default_moe_impl()
        if x.ndim == 3 and impl != "ep":
            out = self(*_flatten_tokens(x, expert_idx, weights), impl=impl, capacity_factor=capacity_factor,
                       return_dropped=True)
            out = (_unflatten_tokens(out[0], x.shape), out[1])
            return out if return_dropped else out[0]
        if impl == "dense":
            out, dropped = self._dense(x, expert_idx, weights), jnp.zeros((), jnp.int32)
        elif impl == "gmm":
            out, dropped = self._gmm(x, expert_idx, weights), jnp.zeros((), jnp.int32)
        elif impl == "ep":
            out, dropped = self._ep(x, expert_idx, weights, capacity_factor)
        else:
            raise ValueError(f"unknown MoE implementation {impl!r}; choose one of {MOE_IMPLS}")
        if capacity_factor is not None and impl != "ep":
            raise ValueError(f"capacity_factor is only used by impl='ep', got impl={impl!r}")
        return (out, dropped) if return_dropped else out

    def cast_once_names(self, impl: MoeImpl, capacity_factor: float | None = None) -> tuple[str, ...]:
        """The Params that ``self(..., impl=impl, capacity_factor=capacity_factor)`` casts whole to the compute
        dtype, for a layer scan to cast once for all its layers (``nnx_zoo.layers.scan.run_stack``), outside the
        rematerialized body: under remat the cast would run again in the backward's recomputation (a read of the
        float32 weights and a write of their bfloat16 copy per layer). The same values; the bfloat16 copy of a
        stack's expert weights then lives through the step (the memory plan counts it). None when the compute
        dtype is the parameters' own, and none where the path reads the stored weights (``gmm`` with no mesh on
        the ``tiled`` kernel, which casts a chunk at a time and accumulates the weight gradient in float32).

        >>> RoutedExperts(8, 64, 32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).cast_once_names("dense")
        ('wi_gate', 'wi_up', 'wo')
        """
        if jnp.dtype(self.dtype) == self.wi_gate.get_value().dtype:
            return ()
        mesh = ambient_mesh_or_none()
        if impl == "auto" or (impl == "ep" and mesh is None and capacity_factor is None):
            impl = default_moe_impl()  # what those paths run
        if impl == "gmm" and mesh is None and choose_grouped_matmul_impl(self.grouped_matmul_impl) == "tiled":
            return ()
        names = ("wi_gate", "wi_up", "wo")
        return names + ("wi_gate_bias", "wi_up_bias", "wo_bias") if self.wo_bias is not None else names

    def _weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(w[...].astype(self.dtype) for w in (self.wi_gate, self.wi_up, self.wo))

    def _biases(self) -> tuple[jax.Array, ...]:
        """``(b_gate, b_up, b_down)`` in the compute dtype, or ``()`` without biases."""
        if self.wo_bias is None:
            return ()
        return tuple(b[...].astype(self.dtype) for b in (self.wi_gate_bias, self.wi_up_bias, self.wo_bias))

    def _dense(self, x: jax.Array, expert_idx: jax.Array, weights: jax.Array) -> jax.Array:
        wi_gate, wi_up, wo = self._weights()
        biases = self._biases()
        # [T, E] combine weights: zero for experts a token did not choose.
        combine = jnp.sum(jax.nn.one_hot(expert_idx, self.num_experts, dtype=weights.dtype) * weights[..., None], -2)
        h_names = ("activation_tokens", "activation_exp", "activation_moe_mlp")
        x = x.astype(self.dtype)
        # Under Auto meshes the expert weights are first gathered over their FSDP axes only (gather_fsdp_axes).
        wi_gate, wi_up = (gather_fsdp_axes("th,ehi->tei", x, w, _WI_NAMES, h_names) for w in (wi_gate, wi_up))
        gate = _expert_in_proj(x, wi_gate, h_names)
        up = _expert_in_proj(x, wi_up, h_names)
        if biases:  # each expert's own, laid out like the activations' (experts, width) dims: resolved alone, the
            # expert dim would take a mesh axis that the tokens already hold (GPT-OSS under Explicit with EP)
            laid_out = (*resolve_activation(h_names, gate.shape), None, None, None)[1:3]
            gate = gate + shard_to_spec(biases[0], PartitionSpec(*laid_out))
            up = up + shard_to_spec(biases[1], PartitionSpec(*laid_out))
        h = shard(self.act(gate, up) * combine[:, :, None].astype(self.dtype), h_names)
        out = shard(weight_einsum("tei,eih->th", h, wo, _TOKENS, weight_names=_WO_NAMES), _TOKENS)
        if biases:  # sum_k w_k b_down[e_k]: the combine weights times the output biases
            out = out + shard(weight_einsum("te,eh->th", combine.astype(self.dtype), biases[2], _TOKENS,
                                            weight_names=_B_OUT_NAMES), _TOKENS)
        return out

    def _gmm(self, x: jax.Array, expert_idx: jax.Array, weights: jax.Array) -> jax.Array:
        local = _grouped_swiglu(self.num_experts, self.grouped_matmul_impl, self.act)
        mesh = ambient_mesh_or_none()
        if mesh is None:
            # The stored weights as they are: grouped_matmul computes in x's dtype, and its tiled path casts one
            # chunk of expert weights at a time: no whole bf16 copy of f32 weights and no bf16 round trip of their
            # gradient (one DeepSeek-V2-Lite MoE layer's grad at 1 x 2048 tokens, bf16: 3.46 -> 0.81 GiB temp).
            stored = (w[...] for w in (self.wi_gate, self.wi_up, self.wo))
            return local(x.astype(self.dtype), expert_idx, weights, *stored, *self._biases())
        wi_gate, wi_up, wo = self._weights()  # cast before the gather below: half the bytes in bf16
        biases = tuple(_replicate(b) for b in self._biases())
        tokens = resolve_activation(_TOKENS[:1] + (None,), x.shape)
        x = shard(x.astype(self.dtype), _TOKENS[:1] + (None,))
        expert_idx = shard(expert_idx, _TOKENS_TOPK)
        weights = shard(weights, _TOKENS_TOPK)
        # Expert weights are gathered whole onto every shard (FSDP-style); EP is a separate path.
        wi_gate, wi_up, wo = (_replicate(w) for w in (wi_gate, wi_up, wo))
        replicated = PartitionSpec()
        out = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(tokens, tokens, tokens, replicated, replicated, replicated) + (replicated,) * len(biases),
            out_specs=tokens,
        )(x, expert_idx, weights, wi_gate, wi_up, wo, *biases)
        return shard(out, _TOKENS)

    def _ep(
        self, x: jax.Array, expert_idx: jax.Array, weights: jax.Array, capacity_factor: float | None
    ) -> tuple[jax.Array, jax.Array]:
        """Expert parallelism: ``(out [T, embed] or [batch, seq, embed] like x, dropped)``; see the module docstring."""
        wi_gate, wi_up, wo = self._weights()
        biases = self._biases()
        mesh = ambient_mesh_or_none()
        ep_axes = _ep_axes(mesh)
        if mesh is not None and self.num_experts % math.prod(mesh.shape[a] for a in ep_axes):
            raise ValueError(
                f"expert parallelism: {self.num_experts} experts cannot be split over mesh axes {ep_axes} "
                f"({math.prod(mesh.shape[a] for a in ep_axes)} shards)"
            )
        if x.ndim == 3 and (mesh is None or not _per_sequence_dispatch(x.shape, ep_axes, capacity_factor)):
            out, dropped = self._ep(*_flatten_tokens(x, expert_idx, weights), capacity_factor)
            return _unflatten_tokens(out, x.shape), dropped
        if x.ndim == 3:
            return self._ep_per_sequence(x, expert_idx, weights, capacity_factor, mesh, ep_axes)
        if not ep_axes and capacity_factor is None:
            # No EP axes: the backend's own dropless path.
            local_path = self._dense if default_moe_impl() == "dense" else self._gmm
            return local_path(x, expert_idx, weights), jnp.zeros((), jnp.int32)
        local = _ep_shard(self.num_experts, capacity_factor, ep_axes, (), (), dropless=self._ep_dropless(),
                          act=self.act)
        if mesh is None:
            out, dropped = local(x.astype(self.dtype), expert_idx, weights, wi_gate, wi_up, wo, *biases)
            return out, dropped
        tokens = resolve_activation(_TOKENS[:1] + (None,), x.shape)
        token_axes = axes_tuple(tokens[0])
        # EP axes that split the tokens, in the tokens' layout order: gathered over them, the group's tokens come
        # in token order (first come first served under a capacity), e.g. exp -> (expert, fsdp) with tokens
        # split (fsdp, expert) gathers over (fsdp, expert).
        gather_axes = tuple(a for a in token_axes if a in ep_axes)
        sum_axes = tuple(a for a in ep_axes if a not in token_axes)  # EP axes the tokens are replicated over
        local = _ep_shard(self.num_experts, capacity_factor, ep_axes, gather_axes, sum_axes,
                          count_axes=tuple(dict.fromkeys(token_axes + ep_axes)), dropless=self._ep_dropless(),
                          act=self.act)
        x = shard(x.astype(self.dtype), _TOKENS[:1] + (None,))
        expert_idx = shard(expert_idx, _TOKENS_TOPK)
        weights = shard(weights, _TOKENS_TOPK)
        experts = tuple(shard(w, ("exp",) + (None,) * (w.ndim - 1)) for w in (wi_gate, wi_up, wo, *biases))
        out, dropped = _on_mesh(local, mesh, ep_axes, tokens, tokens, x, expert_idx, weights, experts)
        return shard(out, _TOKENS), dropped

    def _ep_dropless(self):
        """EP's dropless computation on a shard's own experts, the platform's dropless path (``default_moe_impl``):
        every local expert on every gathered token (``dense``), or the tokens sorted by local expert through the
        grouped matmul (``gmm``: pairs routed to other shards' experts sort last, past every local group, and are
        not computed)."""
        if default_moe_impl() == "dense":
            return functools.partial(_dense_local, act=self.act)
        return _grouped_local(self.grouped_matmul_impl, self.act)

    def _ep_per_sequence(self, x, expert_idx, weights, capacity_factor, mesh, ep_axes):
        """``_ep`` on ``x [batch, seq, embed]`` laid out as activations: each shard gathers its block over the EP
        axes of the batch and sequence dims (the sequence first), flattens it locally, and scatters the partial
        sums back the same way: no all-to-all to reach a flat token layout."""
        experts = tuple(shard(w, ("exp",) + (None,) * (w.ndim - 1)) for w in (*self._weights(), *self._biases()))
        spec = resolve_activation(_BL + (None,), x.shape)
        batch_axes, length_axes = axes_tuple(spec[0]), axes_tuple(spec[1])
        dims = ((1, tuple(a for a in length_axes if a in ep_axes)), (0, tuple(a for a in batch_axes if a in ep_axes)))
        split = batch_axes + length_axes
        local = _ep_shard(self.num_experts, capacity_factor, ep_axes, (), tuple(a for a in ep_axes if a not in split),
                          count_axes=tuple(dict.fromkeys(split + ep_axes)), gather_dims=dims,
                          dropless=self._ep_dropless(), act=self.act)
        x = shard(x.astype(self.dtype), _BL + (None,))
        expert_idx, weights = (shard(a, _BL + ("activation_topk",)) for a in (expert_idx, weights))
        routing = resolve_activation(_BL + ("activation_topk",), expert_idx.shape)
        out, dropped = _on_mesh(local, mesh, ep_axes, spec, routing, x, expert_idx, weights, experts)
        return shard(out, _BL + ("activation_embed",)), dropped


def _on_mesh(local, mesh, ep_axes, x_spec, routing_spec, x, expert_idx, weights, experts):
    """Run a per-shard EP function (``_ep_shard``) over ``mesh``: ``x`` laid out as ``x_spec``, its routing
    (``expert_idx``, ``weights``) as ``routing_spec``, the stacked expert weights (and biases) split over
    ``ep_axes``; returns ``(out laid out like x, dropped count)``."""
    # what shard(w, ("exp", None, ...)) gave them
    expert_specs = tuple(PartitionSpec(ep_axes or None, *(None,) * (w.ndim - 1)) for w in experts)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(x_spec, routing_spec, routing_spec, *expert_specs),
        out_specs=(x_spec, PartitionSpec()),
    )(x, expert_idx, weights, *experts)


def _flatten_tokens(x: jax.Array, expert_idx: jax.Array, weights: jax.Array) -> tuple[jax.Array, ...]:
    """``[batch, seq, ...]`` -> ``[batch*seq, ...]`` for ``x``, ``expert_idx`` and ``weights``, laid out as tokens."""
    def flat(a, names):
        shape = (a.shape[0] * a.shape[1], a.shape[2])
        return shard(jnp.reshape(a, shape, out_sharding=explicit_spec(names, shape)), names)

    return flat(x, _TOKENS), flat(expert_idx, _TOKENS_TOPK), flat(weights, _TOKENS_TOPK)


def _unflatten_tokens(out: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    names = _BL + ("activation_embed",)
    return shard(jnp.reshape(out, shape, out_sharding=explicit_spec(names, shape)), names)


def _per_sequence_dispatch(shape: tuple[int, ...], ep_axes: tuple[str, ...], capacity_factor: float | None) -> bool:
    """Whether ``_ep`` keeps ``x [batch, seq, embed]`` unflattened: only where the sequence is split (else the
    flat layout costs nothing), and under a capacity only where each EP group then sees its tokens in the flat
    path's order (first come first served must drop the same pairs): the sequence's axes are all EP axes and the
    batch's EP axes are its innermost ones, so a group holds whole consecutive sequences either way."""
    spec = resolve_activation(_BL + (None,), shape)
    batch_axes, length_axes = axes_tuple(spec[0]), axes_tuple(spec[1])
    if not length_axes or not ep_axes:
        return False
    if capacity_factor is None:
        return True
    flat = axes_tuple(resolve_activation(_TOKENS[:1], (shape[0] * shape[1],))[0])
    batch_ep = [a for a in batch_axes if a in ep_axes]
    return (flat == batch_axes + length_axes and set(length_axes) <= set(ep_axes)
            and list(batch_axes[len(batch_axes) - len(batch_ep):]) == batch_ep)


def default_moe_impl(platform: str | None = None) -> MoeImpl:
    """The MoE path ``impl="auto"`` runs on ``platform`` (default: JAX's default backend), chosen by measurement
    (benchmarks/README.md): GPUs and TPUs run ``gmm`` on a grouped-matmul kernel (tokamax, Pallas-Triton, XLA:TPU's
    ragged dot; ``grouped_matmul``). CPU runs ``dense``, the small-scale reference: ``gmm`` there uses the tiled
    grouped matmul, which measured 1.07-1.22x faster train steps on deepseek3-tiny/-mini (a loaded box, 3 rounds;
    not a clear enough win to change the CPU default), and never ``ragged_dot`` (XLA:CPU expands it G times)."""
    platform = platform or jax.default_backend()
    return "dense" if platform == "cpu" else "gmm"


def _expert_in_proj(x: jax.Array, w: jax.Array, out_names: tuple[str, ...] | None = None) -> jax.Array:
    """``x [T, H]`` through every expert's ``w [E, H, F]``: ``[T, E, F]``, computed as one row-major
    ``[T, H] @ [H, E*F]`` matmul.

    Why not ``einsum("th,ehi->tei")``: for that form XLA:CPU writes the ``[T, E, F]`` cotangent transposed
    (strided stores) to compute the weight gradient, which alone cost about half of the MoE block; the fused form
    keeps every matmul and gradient row-major (about 2x faster forward+backward, benchmarks/README.md) and the
    transpose moves onto the much smaller weight. When the rules split ``F`` over devices the fused axis would not
    be a block split of ``(E, F)``, so that case keeps the 3-D einsum.
    """
    num_tokens = x.shape[0]
    experts, hidden, width = w.shape
    spec = None if out_names is None else explicit_spec(out_names, (num_tokens, experts, width))
    laid_out = None if out_names is None else resolve_activation(out_names, (num_tokens, experts, width))
    if laid_out is not None and axes_tuple((list(laid_out) + [None] * 3)[2]):
        return weight_einsum("th,ehi->tei", x, w, out_names, weight_names=_WI_NAMES)
    fused = jnp.transpose(without_reduced(w), (1, 0, 2)).reshape(hidden, experts * width)
    fused_spec = None if spec is None else PartitionSpec(*(list(spec) + [None] * 2)[:2])
    out = weight_einsum_to_spec("th,hx->tx", x, fused, fused_spec)
    return jnp.reshape(out, (num_tokens, experts, width), out_sharding=spec)


def _replicate(w: jax.Array) -> jax.Array:
    return shard(w, (None,) * w.ndim)


def _grouped_swiglu(num_experts: int, impl: str = "auto", act: Glu = PLAIN):
    """The per-shard grouped-matmul expert computation (no collectives); ``impl``: ``grouped_matmul``'s, ``act``
    the gated activation; ``biases`` (optional ``b_gate, b_up, b_down``) are taken per row by its expert (none for
    an expert index past the table: another shard's)."""

    def run(x, expert_idx, weights, wi_gate, wi_up, wo, *biases):
        num_tokens, k = expert_idx.shape
        flat_expert = expert_idx.reshape(-1)
        # (token, slot) pairs grouped by expert: the sorted experts and the permutation (`order`) in one sort,
        # and its inverse (each pair's place in the sorted rows) by a second sort, so that routing and its
        # gradient move rows by gathers only (a scatter is slow on GPUs).
        pairs = jnp.arange(flat_expert.shape[0], dtype=jnp.int32)
        row_expert, order = jax.lax.sort((flat_expert, pairs), num_keys=1, is_stable=True)
        inverse = jax.lax.sort((order, pairs), num_keys=1)[1]
        rows = _dispatch_rows(x, order, inverse, k)
        group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
        gate = grouped_matmul(rows, wi_gate, group_sizes, impl=impl)
        up = grouped_matmul(rows, wi_up, group_sizes, impl=impl)
        if biases:
            gate = gate + _rows_of(biases[0], row_expert, gate.dtype)
            up = up + _rows_of(biases[1], row_expert, up.dtype)
        out_sorted = grouped_matmul(act(gate, up), wo, group_sizes, impl=impl)
        if biases:
            out_sorted = out_sorted + _rows_of(biases[2], row_expert, out_sorted.dtype)
        row_weight = _permute_rows(weights.reshape(-1), order, inverse)
        out_sorted = out_sorted * row_weight[:, None].astype(out_sorted.dtype)
        return _permute_rows(out_sorted, inverse, order).reshape(num_tokens, k, -1).sum(axis=1)

    return run


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch_rows(x: jax.Array, order: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    """``x [T, h]``'s row of each sorted (token, slot) pair, ``x[order // k]`` (``[T * k, h]``). Its gradient
    gathers each pair's row back by ``inverse`` (``order``'s inverse) and sums a token's ``k`` slots, where
    autodiff of the gather would scatter-add."""
    return x[order // k]


def _dispatch_rows_fwd(x, order, inverse, k):
    return x[order // k], (order, inverse)


def _dispatch_rows_bwd(k, residuals, d_rows):
    order, inverse = residuals
    d_x = d_rows[inverse].reshape(-1, k, d_rows.shape[-1]).sum(axis=1)
    return d_x, _no_grad(order), _no_grad(inverse)


_dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


@jax.custom_vjp
def _permute_rows(a: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """``a[perm]`` for a permutation ``perm`` of ``a``'s rows; the gradient is the gather by ``inverse``
    (``perm``'s inverse), where autodiff of the gather would scatter."""
    return a[perm]


def _permute_rows_fwd(a, perm, inverse):
    return a[perm], (perm, inverse)


def _permute_rows_bwd(residuals, d_out):
    perm, inverse = residuals
    return d_out[inverse], _no_grad(perm), _no_grad(inverse)


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _no_grad(index: jax.Array) -> jax.Array:
    """The cotangent of an integer input of a custom_vjp: float0 zeros."""
    return np.zeros(index.shape, jax.dtypes.float0)


def _rows_of(bias: jax.Array, expert: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``bias [E, n]`` row of each ``expert`` index (zeros for an index outside ``[0, E)``), in ``dtype``."""
    return jnp.take(bias, expert, axis=0, mode="fill", fill_value=0).astype(dtype)


def _ep_axes(mesh: jax.sharding.AbstractMesh | None) -> tuple[str, ...]:
    """The mesh axes the active rule set shards the expert dim (logical ``exp``) over, size-1 axes dropped."""
    if mesh is None:
        return ()
    return axes_tuple(logical_to_mesh_axes(("exp",), current_rules(), mesh)[0])


def _ep_shard(
    num_experts: int,
    capacity_factor: float | None,
    ep_axes: tuple[str, ...],
    gather_axes: tuple[str, ...],
    sum_axes: tuple[str, ...],
    count_axes: tuple[str, ...] = (),
    gather_dims: tuple[tuple[int, tuple[str, ...]], ...] = (),
    dropless=None,
    act: Glu = PLAIN,
):
    """The per-shard expert-parallel computation (run inside ``shard_map``, or alone without a mesh).

    Tokens and their routing are all-gathered over ``gather_axes``; this shard's ``E / n_ep`` experts run on the
    tokens routed to them; the partial sums go back to the token shards with ``psum_scatter`` (and ``psum`` over
    EP axes that do not split the tokens). Returns ``(out, dropped)``: ``dropped`` counts (token, expert) pairs
    over capacity, summed over ``count_axes`` (every shard then holds the total). ``gather_dims`` ((dim, axes),
    ...) is the same for a ``[batch, seq, ...]`` block: gathered over each dim's axes in turn, flattened to tokens
    here, the output scattered back in reverse order. ``dropless`` computes the local experts without a capacity
    (``_dense_local`` by default, or ``_grouped_local(impl)``); ``act`` is the gated activation.
    """
    dropless = dropless or functools.partial(_dense_local, act=act)

    def run(x, expert_idx, weights, wi_gate, wi_up, wo, *biases):
        local_experts = wi_gate.shape[0]
        if gather_axes:
            x, expert_idx, weights = (
                jax.lax.all_gather(a, gather_axes, axis=0, tiled=True) for a in (x, expert_idx, weights)
            )
        block = None
        if gather_dims:
            for dim, axes in gather_dims:
                if axes:
                    x, expert_idx, weights = (
                        jax.lax.all_gather(a, axes, axis=dim, tiled=True) for a in (x, expert_idx, weights))
            block = x.shape
            x, expert_idx, weights = (a.reshape(block[0] * block[1], a.shape[-1]) for a in (x, expert_idx, weights))
        first = jax.lax.axis_index(ep_axes) * local_experts if ep_axes else 0
        local_idx = expert_idx - first  # outside [0, local_experts): another shard's expert
        if capacity_factor is None:
            out, dropped = dropless(x, local_idx, weights, wi_gate, wi_up, wo, *biases), jnp.zeros((), jnp.int32)
        else:
            capacity = math.ceil(capacity_factor * x.shape[0] * expert_idx.shape[1] / num_experts)
            capacity = max(1, min(capacity, x.shape[0]))  # a token picks an expert at most once
            out, dropped = _capacity_local(x, local_idx, weights, wi_gate, wi_up, wo, capacity, act, biases)
        if gather_axes:
            out = jax.lax.psum_scatter(out, gather_axes, scatter_dimension=0, tiled=True)
        if block is not None:
            out = out.reshape(block)
            for dim, axes in reversed(gather_dims):
                if axes:
                    out = jax.lax.psum_scatter(out, axes, scatter_dimension=dim, tiled=True)
        if sum_axes:
            out = jax.lax.psum(out, sum_axes)
        if count_axes:
            dropped = jax.lax.psum(dropped, count_axes)
        return out, dropped

    return run


def _grouped_local(impl: str, act: Glu = PLAIN):
    """Dropless over the local experts by grouped matmul (``_grouped_swiglu``): ``local_idx`` outside
    ``[0, local experts)`` (another shard's expert) becomes one trailing group that ``group_sizes`` leaves out, so
    those pairs sort past every local group and the grouped matmul gives them zero rows."""

    def run(x, local_idx, weights, wi_gate, wi_up, wo, *biases):
        local_experts = wi_gate.shape[0]
        is_local = (local_idx >= 0) & (local_idx < local_experts)
        idx = jnp.where(is_local, local_idx, local_experts)
        return _grouped_swiglu(local_experts, impl, act)(x, idx, weights, wi_gate, wi_up, wo, *biases)

    return run


def _dense_local(x, local_idx, weights, wi_gate, wi_up, wo, *biases, act: Glu = PLAIN):
    """Dropless: every local expert on every token, weighted by the combine weights (zero where not routed)."""
    combine = jnp.sum(jax.nn.one_hot(local_idx, wi_gate.shape[0], dtype=weights.dtype) * weights[..., None], -2)
    gate = _expert_in_proj(x, wi_gate)
    up = _expert_in_proj(x, wi_up)
    if biases:
        gate, up = gate + biases[0].astype(gate.dtype), up + biases[1].astype(up.dtype)
    h = act(gate, up) * combine[:, :, None].astype(x.dtype)
    out = jnp.einsum("tei,eih->th", h, wo)
    return out + jnp.einsum("te,eh->th", combine.astype(out.dtype), biases[2].astype(out.dtype)) if biases else out


def _capacity_local(x, local_idx, weights, wi_gate, wi_up, wo, capacity, act: Glu = PLAIN, biases=()):
    """At most ``capacity`` tokens per local expert (first come, in token order), as one batched einsum over
    ``[local_experts, capacity]`` slots. Returns ``(out, number of local (token, expert) pairs dropped)``."""
    local_experts = wi_gate.shape[0]
    num_tokens, k = local_idx.shape
    flat = local_idx.reshape(-1)
    is_local = (flat >= 0) & (flat < local_experts)
    onehot = jax.nn.one_hot(jnp.where(is_local, flat, local_experts), local_experts, dtype=jnp.int32)
    position = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1) - 1  # rank among the expert's pairs
    keep = is_local & (position < capacity)
    dropped = jnp.sum(is_local & ~keep, dtype=jnp.int32)
    slot = jnp.where(keep, flat * capacity + position, local_experts * capacity)  # out of range: not dispatched
    rows = x[jnp.arange(num_tokens * k) // k]
    buffer = jnp.zeros((local_experts * capacity, x.shape[-1]), x.dtype).at[slot].set(rows, mode="drop")
    buffer = buffer.reshape(local_experts, capacity, -1)
    gate = jnp.einsum("ech,ehi->eci", buffer, wi_gate)
    up = jnp.einsum("ech,ehi->eci", buffer, wi_up)
    if biases:  # each slot row's expert's own (empty slots compute too, and are never read)
        gate, up = gate + biases[0][:, None].astype(gate.dtype), up + biases[1][:, None].astype(up.dtype)
    out = jnp.einsum("eci,eih->ech", act(gate, up), wo)
    if biases:
        out = out + biases[2][:, None].astype(out.dtype)
    out = out.reshape(local_experts * capacity, -1)
    pairs = out.at[slot].get(mode="fill", fill_value=0)
    pairs = pairs * (weights.reshape(-1) * keep).astype(pairs.dtype)[:, None]
    return pairs.reshape(num_tokens, k, -1).sum(axis=1), dropped
