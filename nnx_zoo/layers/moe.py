"""Routed SwiGLU experts with two compute paths: ``dense`` and ``gmm`` (grouped matmul).

Routing (who picks which experts with what weight) is the model family's business; this module takes the
routing decision ``(expert_idx [T, k], weights [T, k])`` for flat tokens ``x [T, embed]`` and returns
``sum_k weights[t, k] * expert_{idx[t, k]}(x[t])``.

- ``dense`` runs every expert on every token and weights the results (zero for experts not chosen). It is the
  simple reference and fast for few experts on small inputs.
- ``gmm`` sorts the ``T * k`` (token, expert) pairs by expert, runs ``jax.lax.ragged_dot`` over the contiguous
  groups and scatters the results back. Under a mesh it runs inside ``jax.shard_map`` over the token axes, each
  shard sorting its own tokens against all-gathered expert weights (FSDP-style; expert parallelism is a separate
  path), because sorting and ``ragged_dot`` do not partition automatically under Explicit axes.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.linear import DEFAULT_INIT
from nnx_zoo.layers.spec import ambient_mesh_or_none, resolve_activation, weight_einsum
from nnx_zoo.sharding import shard

MoeImpl = Literal["dense", "gmm"]
_TOKENS = ("activation_tokens", "activation_embed")
_TOKENS_TOPK = ("activation_tokens", "activation_topk")


class RoutedExperts(nnx.Module):
    """``num_experts`` SwiGLU experts, stacked: ``wi_gate``/``wi_up [E, embed, moe_mlp]``, ``wo [E, moe_mlp, embed]``.

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
        rngs: nnx.Rngs,
    ):
        self.num_experts = num_experts
        self.dtype = dtype

        def param(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
            return nnx.Param(kernel_init(rngs.params(), shape, param_dtype), out_sharding=names, eager_sharding=False)

        self.wi_gate = param((num_experts, features, hidden), ("exp", "embed_no_exp", "moe_mlp"))
        self.wi_up = param((num_experts, features, hidden), ("exp", "embed_no_exp", "moe_mlp"))
        self.wo = param((num_experts, hidden, features), ("exp", "moe_mlp", "embed_no_exp"))

    def __call__(
        self, x: jax.Array, expert_idx: jax.Array, weights: jax.Array, *, impl: MoeImpl = "dense"
    ) -> jax.Array:
        if impl == "dense":
            return self._dense(x, expert_idx, weights)
        if impl == "gmm":
            return self._gmm(x, expert_idx, weights)
        raise ValueError(f"unknown MoE implementation {impl!r}; choose 'dense' or 'gmm'")

    def _weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(w[...].astype(self.dtype) for w in (self.wi_gate, self.wi_up, self.wo))

    def _dense(self, x: jax.Array, expert_idx: jax.Array, weights: jax.Array) -> jax.Array:
        wi_gate, wi_up, wo = self._weights()
        # [T, E] combine weights: zero for experts a token did not choose.
        combine = jnp.sum(jax.nn.one_hot(expert_idx, self.num_experts, dtype=weights.dtype) * weights[..., None], -2)
        h_names = ("activation_tokens", "activation_exp", "activation_moe_mlp")
        x = x.astype(self.dtype)
        gate = weight_einsum("th,ehi->tei", x, wi_gate, h_names)
        up = weight_einsum("th,ehi->tei", x, wi_up, h_names)
        h = shard(jax.nn.silu(gate) * up * combine[:, :, None].astype(self.dtype), h_names)
        return shard(weight_einsum("tei,eih->th", h, wo, _TOKENS), _TOKENS)

    def _gmm(self, x: jax.Array, expert_idx: jax.Array, weights: jax.Array) -> jax.Array:
        wi_gate, wi_up, wo = self._weights()
        local = _grouped_swiglu(self.num_experts)
        mesh = ambient_mesh_or_none()
        if mesh is None:
            return local(x.astype(self.dtype), expert_idx, weights, wi_gate, wi_up, wo)
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
            in_specs=(tokens, tokens, tokens, replicated, replicated, replicated),
            out_specs=tokens,
        )(x, expert_idx, weights, wi_gate, wi_up, wo)
        return shard(out, _TOKENS)


def _replicate(w: jax.Array) -> jax.Array:
    return shard(w, (None,) * w.ndim)


def _grouped_swiglu(num_experts: int):
    """The per-shard grouped-matmul expert computation (no collectives)."""

    def run(x, expert_idx, weights, wi_gate, wi_up, wo):
        num_tokens, k = expert_idx.shape
        flat_expert = expert_idx.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)  # (token, slot) pairs grouped by expert
        rows = x[order // k]
        group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
        gate = jax.lax.ragged_dot(rows, wi_gate, group_sizes)
        up = jax.lax.ragged_dot(rows, wi_up, group_sizes)
        out_sorted = jax.lax.ragged_dot(jax.nn.silu(gate) * up, wo, group_sizes)
        out_sorted = out_sorted * weights.reshape(-1)[order][:, None].astype(out_sorted.dtype)
        out = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True)
        return out.reshape(num_tokens, k, -1).sum(axis=1)

    return run
