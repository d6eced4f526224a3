"""Output shardings for ops that cannot infer them under an all-Explicit mesh.

Under Explicit axes a dot whose contraction dim is sharded, or a gather from a sharded table, needs the caller to
say how its output is laid out (``out_sharding=``). ``explicit_spec`` resolves logical activation names to that
spec with the ambient mesh and rules, and returns None elsewhere (no mesh, or Auto axes, where XLA decides), so a
call site can pass its result straight through: ``jnp.einsum(..., out_sharding=explicit_spec(names, shape))``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from nnx_zoo.sharding import current_rules, logical_to_mesh_axes, shard_mode_of


def explicit_spec(names: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec | None:
    """The spec ``names`` resolve to on the ambient mesh when its axes are Explicit, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or shard_mode_of(mesh) != "explicit":
        return None
    return logical_to_mesh_axes(names, current_rules(), mesh, shape=tuple(shape), path="activation")


def ambient_mesh_or_none() -> jax.sharding.AbstractMesh | None:
    """The mesh set with ``jax.set_mesh`` (abstract), or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def resolve_activation(names: Sequence[str | None], shape: Sequence[int] | None = None) -> PartitionSpec:
    """The spec ``names`` resolve to on the ambient mesh (any axis type); ``P()`` without a mesh."""
    mesh = ambient_mesh_or_none()
    if mesh is None:
        return PartitionSpec()
    checked = tuple(shape) if shape is not None and shard_mode_of(mesh) == "explicit" else None
    return logical_to_mesh_axes(names, current_rules(), mesh, shape=checked, path="activation")


def _spec_entries(spec: PartitionSpec, ndim: int) -> list:
    entries = list(spec) + [None] * (ndim - len(spec))
    return [(e,) if isinstance(e, str) else tuple(e or ()) for e in entries]


def weight_einsum(equation: str, x: jax.Array, weight: jax.Array, out_names: Sequence[str | None]) -> jax.Array:
    """``jnp.einsum(equation, x, weight)`` for an activation ``x`` and a weight, output laid out as ``out_names``.

    Under an Explicit mesh the weight is first resharded so each of its dims is split like the activation's dim
    it contracts with, or like the output dim it produces (a mesh axis used twice keeps its first, contracting
    use): the FSDP "gather the weight, compute locally" pattern. Handing XLA a weight sharded on the axes that
    the activation's batch dim also uses made it miscompile some dots silently (a (data, fsdp)-batch activation
    against an fsdp-sharded kernel with heads on tensor_transpose returned wrong numbers on CPU, jax 0.10.2).
    """
    inputs, out_letters = equation.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    out_shape = tuple(
        x.shape[x_letters.index(c)] if c in x_letters else weight.shape[w_letters.index(c)] for c in out_letters
    )
    return weight_einsum_to_spec(equation, x, weight, explicit_spec(out_names, out_shape))


def weight_einsum_to_spec(
    equation: str, x: jax.Array, weight: jax.Array, out_spec: PartitionSpec | None
) -> jax.Array:
    """`weight_einsum` with the output's spec given directly (None: no Explicit mesh, XLA decides)."""
    if out_spec is None:
        return jnp.einsum(equation, x, weight)
    inputs, out_letters = equation.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    x_axes = dict(zip(x_letters, _spec_entries(jax.typeof(x).sharding.spec, x.ndim)))
    out_axes = dict(zip(out_letters, _spec_entries(out_spec, len(out_letters))))
    used: set[str] = set()
    weight_spec = [()] * weight.ndim
    # Contracting (and batch) dims first: they must match the activation; output dims take what is left.
    for pass_from_x in (True, False):
        for i, c in enumerate(w_letters):
            if (c in x_axes) != pass_from_x:
                continue
            axes = tuple(a for a in (x_axes.get(c) if pass_from_x else out_axes.get(c, ())) if a not in used)
            weight_spec[i] = axes
            used |= set(axes)
    weight_spec = PartitionSpec(*(a if a else None for a in weight_spec))
    return _einsum_regathering(equation, weight_spec, out_spec, x, weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum_regathering(equation: str, weight_spec: PartitionSpec, out_spec: PartitionSpec, x, weight):
    """``einsum(x, reshard(weight, weight_spec))`` that reshards the weight again in the backward pass instead of
    keeping the resharded (usually all-gathered) copy alive from the forward pass, as XLA does under Auto meshes.
    Kept, the gathered weights of every scanned layer cost the FSDP train step 13% more temporaries."""
    return jnp.einsum(equation, x, jax.reshard(weight, weight_spec), out_sharding=out_spec)


def _einsum_regathering_fwd(equation, weight_spec, out_spec, x, weight):
    return _einsum_regathering(equation, weight_spec, out_spec, x, weight), (x, weight)


def _einsum_regathering_bwd(equation, weight_spec, out_spec, residuals, grad):
    x, weight = residuals
    _, pullback = jax.vjp(lambda x, w: jnp.einsum(equation, x, w, out_sharding=out_spec), x,
                          jax.reshard(weight, weight_spec))
    dx, dweight = pullback(grad)
    return dx, jax.reshard(dweight, jax.typeof(weight).sharding.spec)


_einsum_regathering.defvjp(_einsum_regathering_fwd, _einsum_regathering_bwd)
