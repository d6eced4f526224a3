"""Output shardings for ops that cannot infer them under an all-Explicit mesh.

Under Explicit axes a dot whose contraction dim is sharded, or a gather from a sharded table, needs the caller to
say how its output is laid out (``out_sharding=``). ``explicit_spec`` resolves logical activation names to that
spec with the ambient mesh and rules, and returns None elsewhere (no mesh, or Auto axes, where XLA decides), so a
call site can pass its result straight through: ``jnp.einsum(..., out_sharding=explicit_spec(names, shape))``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
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
