"""Stacks of identical layers: created with ``nnx.vmap`` under a logical stack-axis name, applied with a scan.

``create_stack`` builds ``count`` layers at once; every Variable gains a leading dim named ``axis_name``
(``dense_layers``, ``moe_layers``, ...) so the resolver sees the stacked rank. ``run_stack`` applies them in
order, either with ``jax.lax.scan`` (one compiled layer body) or unrolled in Python (for debugging, same
numbers), with an optional rematerialization policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

M = TypeVar("M", bound=nnx.Module)

# Remat policies by name: what a layer keeps for the backward pass.
REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,  # no rematerialization: keep every intermediate
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only layer inputs, recompute the rest
    "dots_saveable": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs, recompute elementwise ops
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def create_stack(make: Callable[[nnx.Rngs], M], count: int, rngs: nnx.Rngs, axis_name: str) -> M:
    """``count`` layers built by ``make(rngs)``, stacked on a leading dim with logical name ``axis_name``.

    >>> stack = create_stack(lambda r: SwiGLU(64, 128, rngs=r), 4, nnx.Rngs(0), "dense_layers")
    """

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis_name})
    def build(layer_rngs: nnx.Rngs) -> M:
        return make(layer_rngs)

    return build(rngs)


def run_stack(
    stack: M,
    body: Callable[[M, Any, Any], tuple[Any, Any]],
    carry: Any,
    xs: Any = None,
    *,
    scan: bool = True,
    remat_policy: str = "none",
) -> tuple[Any, Any]:
    """Fold ``body(layer, carry, x) -> (carry, per_layer_output)`` over the layers of ``stack``.

    ``xs`` (optional) holds one input per layer on a leading dim; ``x`` is None without it. Returns the final
    carry and the per-layer outputs stacked on a leading dim. The layers' state is read, not written (forward
    passes here mutate nothing).
    """
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat_policy {remat_policy!r}; choose one of {sorted(REMAT_POLICIES)}")
    graphdef, state = nnx.split(stack)

    def step(carry: Any, layer_state_and_x: Any) -> tuple[Any, Any]:
        layer_state, x = layer_state_and_x
        return body(nnx.merge(graphdef, layer_state), carry, x)

    if remat_policy != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[remat_policy], prevent_cse=not scan)
    if scan:
        return jax.lax.scan(step, carry, (state, xs))
    count = jax.tree.leaves(state)[0].shape[0]
    outputs = []
    for i in range(count):
        carry, out = step(carry, jax.tree.map(lambda a, i=i: a[i], (state, xs)))
        outputs.append(out)
    return carry, jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *outputs)
