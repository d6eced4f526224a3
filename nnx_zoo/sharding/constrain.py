"""Constraining activations by logical names, and restoring an input's sharding.

This module is the only place in the package that calls ``with_sharding_constraint``: under a mesh whose axes
are all Explicit that call is a hard assert, so activations are moved with ``jax.reshard`` there instead.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding

from nnx_zoo.sharding.mesh import shard_mode_of
from nnx_zoo.sharding.resolve import ShardingError, logical_to_mesh_axes
from nnx_zoo.sharding.rules import DEFAULT, Rules, get_rules

OUTSIDE_PIPELINE_BATCH = "activation_embed_and_logits_batch"  # the batch of activations outside the pipeline
_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("nnx_zoo_rules", default=None)
_ALLOW_PARTIAL: contextvars.ContextVar[bool] = contextvars.ContextVar("nnx_zoo_allow_partial", default=False)
_RECORDING: contextvars.ContextVar[list[tuple[Any, ...]] | None] = contextvars.ContextVar(
    "nnx_zoo_recording", default=None
)


@contextlib.contextmanager
def record_shardings() -> Iterator[list[tuple[tuple[str | None, ...], tuple[int, ...], Any]]]:
    """Collect ``(logical names, shape, PartitionSpec)`` of every ``shard`` call traced inside this block.

    For inspecting where a model's activations live (``jax.eval_shape`` the model under ``jax.set_mesh``):

    >>> with record_shardings() as seen:
    ...     jax.eval_shape(model, ids)
    """
    token = _RECORDING.set([])
    try:
        yield _RECORDING.get()
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def use_rules(rules: Rules | str, *, allow_partial: bool | None = None) -> Iterator[Rules]:
    """Make ``rules`` the rule set that ``shard`` resolves against inside this block.

    Rules are read while tracing, so enter this block inside the function you jit (the models do this in their
    ``__call__``, from the rules they were created with), not around a call to an already-compiled function.

    ``allow_partial=True``: under an Explicit mesh, an activation dimension that does not divide over its rule's
    mesh axes goes on the longest dividing prefix of them, as the weights of
    ``create_sharded(..., allow_partial=True)`` do (``nnx_zoo.sharding.resolve``); ``False``: such a dimension is
    an error (the default outside any block). ``None`` keeps the enclosing block's setting, so a model entering
    its own rules inside a step that the trainer traced under ``TrainConfig(allow_partial=True)`` keeps it.
    (Under Auto meshes activations are never checked: XLA pads uneven shards.)

    >>> with jax.set_mesh(mesh), use_rules("default", allow_partial=True):
    ...     logits = model(ids)   # inside the jitted function
    """
    token = _ACTIVE_RULES.set(get_rules(rules))
    partial_token = None if allow_partial is None else _ALLOW_PARTIAL.set(bool(allow_partial))
    try:
        yield _ACTIVE_RULES.get()
    finally:
        if partial_token is not None:
            _ALLOW_PARTIAL.reset(partial_token)
        _ACTIVE_RULES.reset(token)


def current_rules() -> Rules:
    """The rule set in force (``use_rules``), or the ``default`` set."""
    rules = _ACTIVE_RULES.get()
    return DEFAULT if rules is None else rules


def current_allow_partial() -> bool:
    """Whether activations may fall back to a dividing prefix of their mesh axes (``use_rules``; False outside)."""
    return _ALLOW_PARTIAL.get()


def activation_spec(names: Sequence[str | None], shape: Sequence[int] | None = None, *,
                    rules: Rules | str | None = None) -> jax.sharding.PartitionSpec:
    """The spec activation dims ``names`` resolve to on the ambient (non-empty) mesh, with the rules and the
    ``allow_partial`` setting in force (``use_rules``). Under an Explicit mesh ``shape`` is checked to divide
    (Auto may pad uneven shards; Explicit may not): strictly by default, else with the fallback of
    ``use_rules(..., allow_partial=True)``. The one place ``shard`` and ``nnx_zoo.layers.spec`` resolve
    activations.

    >>> spec = activation_spec(("activation_batch", "activation_length"), x.shape)
    """
    mesh = jax.sharding.get_abstract_mesh()
    rules = current_rules() if rules is None else get_rules(rules)
    checked = tuple(shape) if shape is not None and shard_mode_of(mesh) == "explicit" else None
    allow_partial = current_allow_partial()
    if checked is not None and not allow_partial and OUTSIDE_PIPELINE_BATCH in names:
        # The batch outside the pipeline ends in 'stage': a batch that divides its batch axes (checked strictly,
        # as activation_batch) but not 'stage' too stays whole over stage, as before the name existed.
        inside = tuple("activation_batch" if n == OUTSIDE_PIPELINE_BATCH else n for n in names)
        activation_spec(inside, shape, rules=rules)
        return logical_to_mesh_axes(names, rules, mesh, shape=checked, path="activation", allow_partial=True)
    try:
        return logical_to_mesh_axes(names, rules, mesh, shape=checked, path="activation",
                                    allow_partial=allow_partial)
    except ShardingError as err:
        if checked is None or allow_partial:
            raise
        raise ShardingError(
            f"{err}\nUnder an Explicit mesh activations are placed strictly unless the step runs under "
            "use_rules(rules, allow_partial=True) (the trainer enters it for TrainConfig(allow_partial=True), "
            "recipes: --allow-partial), or use shard_mode='auto' (XLA pads uneven shards).") from err


def shard(x: jax.Array, names: Sequence[str | None], *, rules: Rules | str | None = None) -> jax.Array:
    """Lay ``x`` out as its logical dimension ``names`` say, on the ambient mesh (``jax.set_mesh``).

    Explicit mesh: ``jax.reshard``. Auto mesh: a sharding constraint. No mesh: ``x`` unchanged. Inside
    ``shard_map`` the Manual axes are left out of the spec (and with every axis Manual, ``x`` is unchanged).
    A dimension that does not divide is an error under Explicit axes unless ``use_rules(..., allow_partial=True)``.

    >>> h = shard(h, ("activation_batch", "activation_length", "activation_embed"))
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(t == AxisType.Manual for t in mesh.axis_types):
        return x
    spec = activation_spec(names, x.shape, rules=rules)
    recording = _RECORDING.get()
    if recording is not None:
        recording.append((tuple(names), tuple(x.shape), spec))
    if shard_mode_of(mesh) == "explicit":
        return jax.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def shard_to_spec(x: jax.Array, spec: jax.sharding.PartitionSpec) -> jax.Array:
    """Lay ``x`` out as the mesh-axis ``spec`` on the ambient mesh (``shard`` for a spec already resolved):
    ``jax.reshard`` under Explicit axes, a sharding constraint under Auto, ``x`` unchanged without a mesh.

    >>> w = shard_to_spec(w, PartitionSpec("tensor_transpose", None))
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(t == AxisType.Manual for t in mesh.axis_types):
        return x
    if shard_mode_of(mesh) == "explicit":
        return jax.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def sharding_of(x: jax.Array) -> NamedSharding:
    """The sharding carried by ``x``'s type (meaningful under Explicit meshes)."""
    return jax.typeof(x).sharding


def restore_sharding(out: Any, sharding: NamedSharding) -> Any:
    """Give every array in ``out`` the sharding an input arrived with (``sharding_of(x)`` taken on entry).

    Under an Explicit mesh this reshards, so a module that relays out activations internally hands them back
    exactly as received and downstream constraints hold. Under Auto, array types carry no sharding and XLA's
    propagation decides, so nothing is done. The sharding itself (not just its spec) is passed on, so this also
    works on concrete arrays outside ``jax.set_mesh``.
    """
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return out
    free = [t for t in mesh.axis_types if t != AxisType.Manual]
    if not free or not all(t == AxisType.Explicit for t in free):
        return out
    return jax.tree.map(lambda a: jax.reshard(a, sharding), out)
