"""Pipeline parallelism over the ``stage`` mesh axis: a layer stack split into stages, micro-batches flowing through.

A rule set places a stack's leading layer dim (``layers`` and the names declared like it) on ``stage``, so stage
``s`` of ``S`` holds layers ``s L/S .. (s+1) L/S - 1`` of every stack. ``pipeline_stack`` runs them as one SPMD
program: ``jax.shard_map`` over ``stage`` alone (every other mesh axis stays Auto or Explicit inside, so FSDP,
tensor and the rest shard each stage's layers as they shard the un-pipelined model), and a scan over the
``M + S - 1`` time steps of the circular-shift formulation: at step ``t`` stage 0 takes micro-batch ``t``, every
stage runs its layers on what it holds, the last stage keeps what it finished (micro-batch ``t - S + 1``), and
``jax.lax.ppermute`` hands each stage's output to the next.

Its schedule is GPipe's: differentiating the scan runs the time steps backwards, so every micro-batch's forward
finishes before the first backward starts, and the activations of all ``M`` micro-batches stay alive (as many as
the remat policy keeps). The bubble is ``(S - 1) / (M + S - 1)`` of each stage's time, forward and backward.

``pipeline_1f1b_value_and_grad`` is the 1F1B schedule: it takes the head and loss too and returns the loss with
its gradients, running each micro-batch's backward on a stage as soon as the stage after it hands the gradient
back, and keeping at most ``2S - 1`` micro-batches' stage inputs whatever ``M``.
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
SCHEDULES = ("gpipe", "1f1b")  # gpipe: ``pipeline_stack`` differentiated; 1f1b: ``pipeline_1f1b_value_and_grad``


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
    with_aux: bool = False,
) -> Any:
    """``layer_fn(layer, h, *args) -> h`` folded over the layers of ``stack`` (as ``run_stack`` would), pipelined
    over the ambient mesh's ``stage`` axis with ``microbatches`` micro-batches of ``x [batch, ...]``.

    ``with_aux=True``: ``layer_fn`` returns ``(h, aux)`` (a pytree of per-layer outputs that are sums over the
    layer's rows: an MoE layer's expert load, dropped tokens, a balance loss summed over sequences), and the result
    is ``(h, aux)`` with each leaf stacked per layer (``[layers, ...]``, the layer dim on ``stage``, as the stack's
    weights) and summed over the micro-batches: for a sum over rows, the whole batch's value (a term that is not
    one, e.g. capacity-limited dropping, counts per micro-batch as gradient accumulation counts it). Each aux leaf
    is whole within a stage (not split over the other mesh axes: sums over the rows are).

    ``stack`` is a stacked module (or an ``nnx.List`` of them, one layer of each per step, as a scan segment's
    group). Micro-batch ``j`` holds rows ``j, j + M, j + 2M, ...`` (each device keeps its rows, as in
    ``batch_split``); arguments (and pytree leaves, such as an ``AttentionMask``'s) with a leading batch dim are
    split the same way, others go to every micro-batch. Returns ``[batch, ...]`` like ``x``, in ``x``'s layout,
    whole on every stage: what follows the stack (the final norm, the head and the loss) runs outside the
    pipeline, replicated over ``stage``. With no ``stage`` axis (size 1) this is ``run_stack``.

    >>> h = pipeline_stack(model.layers, lambda layer, h, cos, sin: layer(h, cos, sin, None), h, cos, sin,
    ...                    microbatches=4)
    """
    if schedule != "gpipe":
        raise ValueError(f"pipeline_stack runs the 'gpipe' schedule, got {schedule!r} ({SCHEDULES}: 1f1b needs the "
                         "loss inside the pipeline, pipeline_1f1b_value_and_grad)")
    stages = stage_count()

    def body(margs: Any) -> Callable[..., tuple[jax.Array, Any]]:  # run_stack's body: (h, this layer's aux)
        def fn(group: Any, h: jax.Array, _: Any) -> tuple[jax.Array, Any]:
            out = layer_fn(group, h, *margs)
            return out if with_aux else (out, None)
        return fn

    if stages == 1:
        h, aux = run_stack(stack, body(args), x, scan=scan, remat_policy=remat_policy)
        return (h, aux) if with_aux else h
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

        def run_local(h: jax.Array, index: jax.Array) -> tuple[jax.Array, Any]:
            return run_stack(local, body(micro_args(index)), h, scan=scan, remat_policy=remat_policy)

        def time_step(carry: tuple[jax.Array, jax.Array, Any], t: jax.Array
                      ) -> tuple[tuple[jax.Array, jax.Array, Any], None]:
            held, done, aux_sum = carry
            index = jnp.clip(t - stage, 0, micro - 1)  # the micro-batch this stage works on at step t
            first_input = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, micro - 1), axis=1, keepdims=False)
            h, aux = run_local(jnp.where(stage == 0, first_input, held), index)
            finished = (stage == stages - 1) & (t >= stages - 1)
            done = jnp.where(finished, jax.lax.dynamic_update_index_in_dim(done, h, index, axis=1), done)
            # Only the steps that run a real micro-batch on this stage count (the others repeat a clipped index).
            working = (t >= stage) & (t - stage < micro)
            aux_sum = jax.tree.map(lambda acc, a: acc + jnp.where(working, a, jnp.zeros_like(a)), aux_sum, aux)
            held = jax.lax.ppermute(h, STAGE_AXIS, [(s, s + 1) for s in range(stages - 1)])
            return (held, done, aux_sum), None

        varying = lambda a: jax.lax.pcast(a, STAGE_AXIS, to="varying")  # noqa: E731
        held = varying(jnp.zeros_like(jax.lax.index_in_dim(xs, 0, axis=1, keepdims=False)))
        aux_shapes = jax.eval_shape(run_local, held, jnp.zeros((), jnp.int32))[1]
        aux_zero = jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype)), aux_shapes)
        (_, done, aux_sum), _ = jax.lax.scan(time_step, (held, varying(jnp.zeros_like(xs)), aux_zero),
                                             jnp.arange(micro + stages - 1))
        return jax.lax.psum(jnp.where(stage == stages - 1, done, 0), STAGE_AXIS), aux_sum  # the last stage's h

    in_specs = (PartitionSpec(STAGE_AXIS), PartitionSpec(), [PartitionSpec()] * len(operands))
    # Per-layer aux: each stage's layers' sums, joined over stage in layer order (the layer dim on 'stage').
    done, aux = jax.shard_map(stage_program, in_specs=in_specs, out_specs=(PartitionSpec(), PartitionSpec(STAGE_AXIS)),
                              axis_names={STAGE_AXIS})(state, split(x), operands)
    done = jnp.reshape(done, x.shape, out_sharding=spec)
    return (done, aux) if with_aux else done


def pipeline_1f1b_value_and_grad(
    stack: nnx.Module,
    layer_fn: Callable[..., jax.Array],
    head_fn: Callable[[Any, jax.Array, Any], jax.Array],
    head_params: Any,
    x: jax.Array,
    targets: Any,
    *args: Any,
    microbatches: int,
) -> tuple[jax.Array, nnx.State, Any, jax.Array]:
    """The summed loss of ``head_fn(head_params, layers(x), targets)`` over ``microbatches`` micro-batches and its
    gradients ``(loss, d stack state, d head_params, d x)``, computed in 1F1B order over the ``stage`` axis.

    One SPMD program (``shard_map`` over ``stage``) whose ``M + 2S - 2`` ticks each run, on every stage, one
    micro-batch's forward (``f = t - s``) and one's backward (``b = t - 2S + 2 + s``): the last stage runs the head
    and the loss and starts a micro-batch's backward in the tick its forward arrives, and each stage keeps only the
    inputs of the micro-batches between its forward and its backward (at most ``2S - 1``, whatever ``M``; the
    backward recomputes the stage's layers from them), where GPipe keeps all ``M``. ``head_fn`` returns a scalar
    summed over its micro-batch; ``targets`` (a pytree) and ``args`` are split like ``x`` (rows ``j, j + M, ...``)
    when their leading dim is the batch. ``layer_fn`` as in ``pipeline_stack``. Needs a ``stage`` axis.

    The dense causal LM wraps it in a ``custom_vjp`` (``forward(..., pipeline_schedule="1f1b", loss_targets=...)``)
    so that a trainer's ``value_and_grad`` gets these gradients.
    """
    stages = stage_count()
    if stages == 1:
        raise ValueError("pipeline_1f1b_value_and_grad needs a mesh with a 'stage' axis of size > 1")
    batch = x.shape[0]
    if not isinstance(microbatches, int) or microbatches < 1 or batch % microbatches:
        raise ValueError(f"{microbatches} pipeline micro-batches do not divide the batch of {batch} rows")
    micro, slots = microbatches, 2 * stages - 1
    graphdef, state = nnx.split(stack)
    check_stages(jax.tree.leaves(state)[0].shape[0], stages)

    def split(a: jax.Array) -> jax.Array:
        spec = _explicit_spec_of(a)
        if spec is not None:
            spec = PartitionSpec(spec[0], None, *spec[1:])
        return jnp.reshape(a, (batch // micro, micro) + a.shape[1:], out_sharding=spec)

    leaves, treedef = jax.tree.flatten((targets, args))
    dynamic = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
    batched = tuple(leaves[i].ndim > 0 and leaves[i].shape[0] == batch for i in dynamic)
    operands = [split(leaves[i]) if b else leaves[i] for i, b in zip(dynamic, batched)]

    def stage_program(state: Any, head_params: Any, xs: jax.Array, operands: list[jax.Array]) -> Any:
        stage = jax.lax.axis_index(STAGE_AXIS)
        last = stage == stages - 1
        varying = lambda a: jax.lax.pcast(a, STAGE_AXIS, to="varying")  # noqa: E731
        head_params = jax.tree.map(varying, head_params)  # differentiated per stage, summed once at the end

        def micro_inputs(index: jax.Array) -> Any:
            picked = list(leaves)
            for i, b, a in zip(dynamic, batched, operands):
                picked[i] = jax.lax.dynamic_index_in_dim(a, index, axis=1, keepdims=False) if b else a
            return jax.tree.unflatten(treedef, picked)

        def stage_fn(state: Any, h: jax.Array, index: jax.Array) -> jax.Array:
            _, margs = micro_inputs(index)
            return run_stack(nnx.merge(graphdef, state), lambda group, h, _: (layer_fn(group, h, *margs), None),
                             h)[0]

        def keep(valid: jax.Array, new: Any, old: Any) -> Any:
            return jax.tree.map(lambda n, o: jnp.where(valid, n, o), new, old)

        def tick(carry: Any, t: jax.Array) -> tuple[Any, None]:
            fwd_in, bwd_in, saved, d_state, d_head, loss, d_x = carry
            f = t - stage
            f_ok = (f >= 0) & (f < micro)
            fi = jnp.clip(f, 0, micro - 1)
            first_input = jax.lax.dynamic_index_in_dim(xs, fi, axis=1, keepdims=False)
            h_in = jnp.where(stage == 0, first_input, fwd_in)
            saved = keep(f_ok, jax.lax.dynamic_update_index_in_dim(saved, h_in, fi % slots, 0), saved)
            h_out = stage_fn(state, h_in, fi)
            tgt, _ = micro_inputs(fi)
            mb_loss, (g_head, g_out) = jax.value_and_grad(head_fn, argnums=(0, 1))(head_params, h_out, tgt)
            at_head = last & f_ok
            loss = loss + jnp.where(at_head, mb_loss, 0.0)
            d_head = keep(at_head, jax.tree.map(jnp.add, d_head, g_head), d_head)

            b = t - (2 * stages - 2) + stage  # on the last stage b == f: its backward follows its forward
            b_ok = (b >= 0) & (b < micro)
            bi = jnp.clip(b, 0, micro - 1)
            h_saved = jax.lax.dynamic_index_in_dim(saved, bi % slots, 0, keepdims=False)
            _, pullback = jax.vjp(lambda s, h: stage_fn(s, h, bi), state, h_saved)
            g_state, g_in = pullback(jnp.where(last, g_out, bwd_in))
            d_state = keep(b_ok, jax.tree.map(jnp.add, d_state, g_state), d_state)
            d_x = keep((stage == 0) & b_ok, jax.lax.dynamic_update_index_in_dim(d_x, g_in, bi, axis=1), d_x)
            fwd_in = jax.lax.ppermute(h_out, STAGE_AXIS, [(s, s + 1) for s in range(stages - 1)])
            bwd_in = jax.lax.ppermute(g_in, STAGE_AXIS, [(s + 1, s) for s in range(stages - 1)])
            return (fwd_in, bwd_in, saved, d_state, d_head, loss, d_x), None

        one = jax.lax.index_in_dim(xs, 0, axis=1, keepdims=False)
        zeros = lambda a: varying(jnp.zeros_like(a))  # noqa: E731
        carry = (zeros(one), zeros(one), zeros(jnp.broadcast_to(one, (slots, *one.shape))),
                 jax.tree.map(jnp.zeros_like, state), jax.tree.map(jnp.zeros_like, head_params),
                 varying(jnp.zeros((), jnp.float32)), zeros(xs))
        (_, _, _, d_state, d_head, loss, d_x), _ = jax.lax.scan(tick, carry, jnp.arange(micro + 2 * stages - 2))
        total = lambda a: jax.lax.psum(a, STAGE_AXIS)  # noqa: E731  (each is nonzero on one stage, or summed)
        return total(loss), d_state, jax.tree.map(total, d_head), total(d_x)

    specs = (PartitionSpec(STAGE_AXIS), PartitionSpec(), PartitionSpec(), [PartitionSpec()] * len(operands))
    loss, d_state, d_head, d_x = jax.shard_map(
        stage_program, in_specs=specs, out_specs=(PartitionSpec(), PartitionSpec(STAGE_AXIS), PartitionSpec(),
                                                  PartitionSpec()),
        axis_names={STAGE_AXIS})(state, head_params, split(x), operands)
    return loss, d_state, d_head, jnp.reshape(d_x, x.shape, out_sharding=_explicit_spec_of(x))
