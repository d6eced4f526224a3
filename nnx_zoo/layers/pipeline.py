"""Pipeline parallelism over the ``stage`` mesh axis: a layer stack split into stages, micro-batches flowing through.

A rule set places a stack's leading layer dim (``layers`` and the names declared like it) on ``stage``, so stage
``s`` of ``S`` holds layers ``s L/S .. (s+1) L/S - 1`` of every stack. ``pipeline_stack`` runs them as one SPMD
program: ``jax.shard_map`` over ``stage`` alone (every other mesh axis stays Auto or Explicit inside, so FSDP,
tensor and the rest shard each stage's layers as they shard the un-pipelined model), and a scan over the
``M + S - 1`` time steps of the circular-shift formulation: at step ``t`` stage 0 takes micro-batch ``t``, every
stage runs its layers on what it holds, the last stage keeps what it finished (micro-batch ``t - S + 1``), and
``jax.lax.ppermute`` hands each stage's output to the next.

The schedule is GPipe's: differentiating the scan runs the time steps backwards, so every micro-batch's forward
finishes before the first backward starts, and the activations of all ``M`` micro-batches stay alive (as many as
the remat policy keeps). The bubble is ``(S - 1) / (M + S - 1)`` of each stage's time, forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.scan import _check_micro_batch, _explicit_spec_of, run_stack

STAGE_AXIS = "stage"  # the mesh axis the layer stacks are split over
SCHEDULES = ("gpipe",)  # the pipeline schedules ``pipeline_stack`` runs


def stage_count() -> int:
    """The size of the ambient mesh's ``stage`` axis (1 without a mesh or without that axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(STAGE_AXIS, 1)


def check_stages(layers: int, stages: int, what: str = "the layer stack") -> None:
    """A clear error when ``layers`` cannot be split into ``stages`` equal pipeline stages."""
    if layers % stages:
        fits = [s for s in range(1, layers + 1) if layers % s == 0]
        raise ValueError(
            f"{what} has {layers} layers, which do not split into {stages} pipeline stages (mesh axis "
            f"'{STAGE_AXIS}'={stages}); use a '{STAGE_AXIS}' mesh size that divides {layers} (one of {fits}), or a "
            f"layer count that is a multiple of {stages}"
        )


def pipeline_stack(
    stack: nnx.Module,
    layer_fn: Callable[..., jax.Array],
    x: jax.Array,
    *args: Any,
    microbatches: int,
    schedule: str = "gpipe",
    scan: bool = True,
    remat_policy: str = "none",
) -> jax.Array:
    """``layer_fn(layer, h, *args) -> h`` folded over the layers of ``stack`` (as ``run_stack`` would), pipelined
    over the ambient mesh's ``stage`` axis with ``microbatches`` micro-batches of ``x [batch, ...]``.

    ``stack`` is a stacked module (or an ``nnx.List`` of them, one layer of each per step, as a scan segment's
    group). Micro-batch ``j`` holds rows ``j, j + M, j + 2M, ...`` (each device keeps its rows, as in
    ``batch_split``); arguments (and pytree leaves, such as an ``AttentionMask``'s) with a leading batch dim are
    split the same way, others go to every micro-batch. Returns ``[batch, ...]`` like ``x``, in ``x``'s layout,
    whole on every stage: what follows the stack (the final norm, the head and the loss) runs outside the
    pipeline, replicated over ``stage``. With no ``stage`` axis (size 1) this is ``run_stack``.

    >>> h = pipeline_stack(model.layers, lambda layer, h, cos, sin: layer(h, cos, sin, None), h, cos, sin,
    ...                    microbatches=4)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    stages = stage_count()
    if stages == 1:
        return run_stack(stack, lambda group, h, _: (layer_fn(group, h, *args), None), x, scan=scan,
                         remat_policy=remat_policy)[0]
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline microbatches must be a positive integer, got {microbatches!r}")
    batch = x.shape[0]
    if batch % microbatches:
        raise ValueError(f"{microbatches} pipeline micro-batches do not divide the batch of {batch} rows; use a "
                         f"micro-batch count that divides {batch} (e.g. --microbatches {stages}), or another batch")
    spec = _explicit_spec_of(x)
    if spec is not None:  # each micro-batch's rows must still split over the devices that split the batch
        _check_micro_batch(jax.typeof(x).sharding.mesh, spec[0], batch, microbatches)
    graphdef, state = nnx.split(stack)
    check_stages(jax.tree.leaves(state)[0].shape[0], stages)
    micro = microbatches

    def split(a: jax.Array) -> jax.Array:  # [batch, ...] -> [batch / M, M, ...]: row j * M + m is micro-batch m
        spec = _explicit_spec_of(a)
        if spec is not None:
            spec = PartitionSpec(spec[0], None, *spec[1:])
        return jnp.reshape(a, (batch // micro, micro) + a.shape[1:], out_sharding=spec)

    def is_batched(a: Any) -> bool:
        return isinstance(a, jax.Array) and a.ndim > 0 and a.shape[0] == batch

    leaves, treedef = jax.tree.flatten(args)
    # Arrays go through shard_map's arguments; other leaves (python ints) stay static.
    dynamic = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
    batched = tuple(is_batched(leaves[i]) for i in dynamic)
    operands = [split(leaves[i]) if b else leaves[i] for i, b in zip(dynamic, batched)]

    def stage_program(state: Any, xs: jax.Array, operands: list[jax.Array]) -> jax.Array:
        stage = jax.lax.axis_index(STAGE_AXIS)
        local = nnx.merge(graphdef, state)

        def micro_args(index: jax.Array) -> Any:
            picked = list(leaves)
            for i, b, a in zip(dynamic, batched, operands):
                picked[i] = jax.lax.dynamic_index_in_dim(a, index, axis=1, keepdims=False) if b else a
            return jax.tree.unflatten(treedef, picked)

        def run_local(h: jax.Array, index: jax.Array) -> jax.Array:
            margs = micro_args(index)
            return run_stack(local, lambda group, h, _: (layer_fn(group, h, *margs), None), h, scan=scan,
                             remat_policy=remat_policy)[0]

        def time_step(carry: tuple[jax.Array, jax.Array], t: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
            held, done = carry
            index = jnp.clip(t - stage, 0, micro - 1)  # the micro-batch this stage works on at step t
            first_input = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, micro - 1), axis=1, keepdims=False)
            h = run_local(jnp.where(stage == 0, first_input, held), index)
            finished = (stage == stages - 1) & (t >= stages - 1)
            done = jnp.where(finished, jax.lax.dynamic_update_index_in_dim(done, h, index, axis=1), done)
            held = jax.lax.ppermute(h, STAGE_AXIS, [(s, s + 1) for s in range(stages - 1)])
            return (held, done), None

        varying = lambda a: jax.lax.pcast(a, STAGE_AXIS, to="varying")  # noqa: E731
        held = varying(jnp.zeros_like(jax.lax.index_in_dim(xs, 0, axis=1, keepdims=False)))
        (_, done), _ = jax.lax.scan(time_step, (held, varying(jnp.zeros_like(xs))), jnp.arange(micro + stages - 1))
        return jax.lax.psum(jnp.where(stage == stages - 1, done, 0), STAGE_AXIS)  # the last stage's, to all

    in_specs = (PartitionSpec(STAGE_AXIS), PartitionSpec(), [PartitionSpec()] * len(operands))
    done = jax.shard_map(stage_program, in_specs=in_specs, out_specs=PartitionSpec(),
                         axis_names={STAGE_AXIS})(state, split(x), operands)
    return jnp.reshape(done, x.shape, out_sharding=spec)
