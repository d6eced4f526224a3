"""Pipeline parallelism over the ``stage`` mesh axis: a layer stack split into stages, micro-batches flowing through.

A rule set places a stack's leading layer dim (``layers`` and the names declared like it) on ``stage``, so stage
``s`` of ``S`` holds layers ``s L/S .. (s+1) L/S - 1`` of every stack. ``pipeline_stack`` runs them as one SPMD
program: ``jax.shard_map`` over ``stage`` alone (every other mesh axis stays Auto or Explicit inside, so FSDP,
tensor and the rest shard each stage's layers as they shard the un-pipelined model), and a scan over the
``M + S - 1`` time steps of the circular-shift formulation: at step ``t`` stage 0 takes micro-batch ``t``, every
stage that holds a micro-batch (stage ``s`` holds ``t - s``) runs its layers on it, the last stage keeps what it
finished (micro-batch ``t - S + 1``), and ``jax.lax.ppermute`` hands each stage's output to the next.

Several stacks (one per layer kind: Gemma 3's sliding and global layers) pipeline when the model's layer sequence
(the stack name of each layer, in model order) is ``S V`` identical chunks (``pipeline_chunk``; ``V`` virtual
stages, 1 but for interleaved 1F1B). Then chunk ``k`` holds layers ``k n / (S V) .. (k + 1) n / (S V) - 1`` of every
stack of ``n`` layers, which is exactly what the contiguous placement puts on a stage (a block of ``V`` chunks), and
a stage runs a chunk as the scan segments of one chunk's sequence over its local slices of the stacks
(``nnx_zoo.layers.scan.segments``; slicing local arrays, no traffic). A lone stack is the one-kind case.

Its schedule is GPipe's: differentiating the scan runs the time steps backwards, so every micro-batch's forward
finishes before the first backward starts, and the activations of all ``M`` micro-batches stay alive (as many as
the remat policy keeps). The bubble is ``(S - 1) / (M + S - 1)`` of each stage's time, forward and backward.

Idle work costs nothing: a stage with nothing to do in a tick (GPipe's first ``s`` and last ``S - 1 - s`` steps,
1F1B's warm-up and cool-down halves) takes the idle branch of a ``jax.lax.cond`` on the tick's validity and runs
none of its layers. The predicate depends only on the stage and the tick, so all devices of a stage's fsdp /
tensor group take the same branch and the collectives inside stay matched; the ``ppermute``s over ``stage`` run
outside every branch, every tick. One exception, decided in one place (``skips_idle_ticks``, ``IDLE_TICKS``): on
the CPU backend with another mesh axis > 1, XLA:CPU's in-process collectives can deadlock on collectives inside a
branch, so there the idle work is computed and masked (``jnp.where``), the program before. XLA's
``cost_analysis()`` (and any static count of the compiled program) counts both branches of a conditional, so it
reads the same as the masked program: what changes is what runs. On XLA:CPU with fake devices a pipeline needs
``CPU_WORKERS_PER_DEVICE`` collective workers per device (``nnx_zoo.sharding.reserve_cpu_workers``; it warns
without them), masked or not: a device waiting in several collectives at once can starve the one they wait for.

``pipeline_1f1b_value_and_grad`` is the 1F1B schedule and, with ``virtual_stages=V > 1``, interleaved 1F1B (each
stage holds ``V`` non-contiguous chunks of the stack): it takes the head and loss too and returns the loss with
its gradients, running each micro-batch's backward on a stage as soon as the stage after it hands the gradient
back, and keeping at most ``(V + 1) S - 1`` stage inputs whatever ``M``. ``SCHEDULES`` says, per schedule name, which
of the two runs and whether the loss runs inside the pipeline: the model and the trainer both read it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.scan import _check_micro_batch, _explicit_spec_of, run_stack, segments
from nnx_zoo.sharding.mesh import warn_if_few_cpu_workers

STAGE_AXIS = "stage"  # the mesh axis the layer stacks are split over


class Schedule(NamedTuple):
    """What a pipeline schedule name runs, the one table (``SCHEDULES``) the model's forward, the trainer and the
    recipe read: ``loss_inside`` (the final norm, head and loss run on the last stage, in
    ``pipeline_1f1b_value_and_grad``: the forward needs ``loss_targets`` and returns ``loss_sum``; else the
    trainer differentiates ``pipeline_stack`` and computes the loss itself) and ``virtual_stages`` (the default
    number of stack chunks each stage holds; only ``interleaved`` takes more than 1).

    >>> resolve_schedule("interleaved")
    Schedule(name='interleaved', loss_inside=True, virtual_stages=2, interleaved=True)
    """

    name: str
    loss_inside: bool
    virtual_stages: int
    interleaved: bool  # takes virtual_stages > 1


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", loss_inside=False, virtual_stages=1, interleaved=False),  # ``pipeline_stack``, differentiated
    Schedule("1f1b", loss_inside=True, virtual_stages=1, interleaved=False),  # ``pipeline_1f1b_value_and_grad``
    Schedule("interleaved", loss_inside=True, virtual_stages=2, interleaved=True),  # the same, V > 1
)}


def resolve_schedule(name: str, virtual_stages: int | None = None) -> Schedule:
    """``SCHEDULES[name]`` with ``virtual_stages`` (None: the schedule's default) checked and filled in; an
    unknown name, or virtual stages other than 1 with a schedule that is not interleaved, is a clear error."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; one of {tuple(SCHEDULES)}")
    schedule = SCHEDULES[name]
    if virtual_stages is None:
        return schedule
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual stages must be a positive integer, got {virtual_stages!r}")
    if virtual_stages != 1 and not schedule.interleaved:
        raise ValueError(f"{virtual_stages} virtual stages need the 'interleaved' schedule (--pipeline-schedule "
                         f"interleaved); the {name!r} schedule holds one contiguous block of layers per stage "
                         "(--virtual-stages 1)")
    return schedule._replace(virtual_stages=virtual_stages)


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


def _chunks_fit(kinds: tuple[Hashable, ...], chunks: int) -> bool:
    """Whether ``kinds`` is ``chunks`` identical chunks."""
    return len(kinds) % chunks == 0 and kinds == kinds[:len(kinds) // chunks] * chunks


def pipeline_layer_counts(kinds: Sequence[Hashable], chunks: int) -> list[int]:
    """The values of a model's ``pipeline_layers`` (its last ``P`` layers pipelined, the ones before run ahead of
    the pipeline) whose layers split into ``chunks`` identical chunks, largest first; ``kinds``: each layer's kind
    (stack name) in model order.

    >>> pipeline_layer_counts(["dense"] * 3 + ["moe"] * 58, 16)
    [48, 32, 16]
    """
    kinds = tuple(kinds)
    return [p for p in range(len(kinds), 0, -1) if _chunks_fit(kinds[len(kinds) - p:], chunks)]


def pipeline_chunk(layer_stacks: Sequence[Hashable], stages: int, virtual_stages: int = 1, *,
                   unpipelined: Sequence[Hashable] = (), suffix_advice: bool = True) -> tuple[Hashable, ...]:
    """The stack names of one chunk's layers when ``layer_stacks`` (the stack name of each layer, in model order)
    is ``stages * virtual_stages`` identical chunks; else a clear error naming the chunk counts that fit (or saying
    that none does), the ``pipeline_layers`` values that fit (``unpipelined``: the kinds of the layers that run
    before the pipeline, for that advice; ``suffix_advice=False``: none, for a model without that setting) and how
    to fix it.

    >>> pipeline_chunk(["sliding", "sliding", "full"] * 4, stages=2)
    ('sliding', 'sliding', 'full', 'sliding', 'sliding', 'full')
    """
    kinds = tuple(layer_stacks)
    layers, wanted = len(kinds), stages * virtual_stages
    fits = [n for n in range(1, layers + 1) if _chunks_fit(kinds, n)]
    if wanted in fits:
        return kinds[:layers // wanted]
    runs: list[list[Any]] = []
    for kind in kinds:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    shown = ", ".join(f"{kind} x{count}" for kind, count in runs[:8]) + (", ..." if len(runs) > 8 else "")
    split = (f"{wanted} identical chunks ({stages} pipeline stages x {virtual_stages} virtual stages)"
             if virtual_stages > 1 else f"{stages} identical chunks, one per pipeline stage (mesh axis "
             f"'{STAGE_AXIS}'={stages})")
    more = [n for n in fits if n > 1]
    if more and virtual_stages > 1 and any(n % stages == 0 for n in more):
        fix = f"use --virtual-stages one of {[n // stages for n in fits if n % stages == 0]}"
    elif more:
        fix = (f"use a '{STAGE_AXIS}' mesh size (times --virtual-stages, when interleaved) that is one of {more}, "
               "the chunk counts that fit")
    else:
        def period_of(seq: tuple[Hashable, ...]) -> int:
            return next(p for p in range(1, len(seq) + 1) if all(seq[i] == seq[i - p] for i in range(p, len(seq))))

        # Leading layers of kinds that never come back (a dense prefix) are no part of a repeating rest.
        lead = next((i for i in range(1, layers) if not set(kinds[:i]) & set(kinds[i:])
                     and period_of(kinds[i:]) < layers - i), 0)
        period = period_of(kinds[lead:])
        fix = f"no chunk count above 1 fits; train this model on a mesh without '{STAGE_AXIS}', or use a layer count "
        fix += (f"that is a multiple of {period * wanted} (its kinds repeat every {period} layers) so that {wanted} "
                "chunks hold whole repeats" if not lead else
                f"of {lead} + a multiple of {period * wanted} (the first {lead} layers' kinds never recur, the rest "
                f"repeat every {period} layers) with --model.pipeline_layers that multiple")
    whole = tuple(unpipelined) + kinds
    counts = [p for p in pipeline_layer_counts(whole, wanted) if p < len(whole)][:3] if suffix_advice else []
    if counts:  # MaxText's pipeline_parallel_layers: only the last layers pipelined, the first ones ahead of it
        fix += "; or pipeline only the last layers: " + ", ".join(
            f"--model.pipeline_layers {p} (the first {len(whole) - p} layers run before the pipeline)"
            for p in counts)
    lead = f"the {layers} pipelined layers (of {len(whole)})" if unpipelined else f"the {layers} layers"
    raise ValueError(f"{lead} (stack of each, in model order: {shown}) do not split into {split}: "
                     "every chunk must hold the same sequence of layer kinds, so that each stage's contiguous "
                     f"block of every stack holds its chunks' layers; {fix}")


_LONE = "layers"  # the name a lone stack runs under (what an error about its layer sequence calls it)


class _Stacks(NamedTuple):
    """What a pipeline runs, one form for a lone stack and for several: per stack name its graph definition and
    state, the stack name of each layer in model order, and ``layer_fn(name, layer, h, *args)``."""

    graphdefs: dict[Hashable, Any]
    states: dict[Hashable, Any]
    layer_stacks: tuple[Hashable, ...]
    layer_fn: Callable[..., Any]
    lone: bool  # one stack given bare: its per-layer aux (and gradients) are returned bare, not by name


def _stacks_of(stack: Any, layer_fn: Callable[..., Any], layer_stacks: Sequence[Hashable] | None) -> _Stacks:
    """``stack`` (a stacked module, an ``nnx.List`` of them run one layer of each per step, or a mapping of stack
    names to stacked modules with ``layer_stacks``) as a ``_Stacks``."""
    if not isinstance(stack, Mapping):
        if layer_stacks is not None:
            raise ValueError("layer_stacks= names the stack of each layer when the stacks come as a mapping of "
                             "names to stacked modules; a lone stack runs its layers in order (drop layer_stacks)")
        graphdef, state = nnx.split(stack)
        count = jax.tree.leaves(state)[0].shape[0]
        return _Stacks({_LONE: graphdef}, {_LONE: state}, (_LONE,) * count,
                       lambda name, layer, h, *args: layer_fn(layer, h, *args), True)
    if layer_stacks is None:
        raise ValueError(f"stacks {sorted(map(str, stack))} given by name need layer_stacks=, the stack name of each "
                         "layer in model order (a CausalLM's config.layer_stacks() as one name per layer)")
    split = {name: nnx.split(module) for name, module in stack.items()}
    counts = {name: jax.tree.leaves(state)[0].shape[0] for name, (_, state) in split.items()}
    named = {name: list(layer_stacks).count(name) for name in dict.fromkeys(layer_stacks)}
    if named != counts:
        raise ValueError(f"layer_stacks names {named} layers per stack, but the stacks hold {counts}; give one "
                         "name per layer, each stack named once per layer it holds")
    return _Stacks({n: g for n, (g, _) in split.items()}, {n: s for n, (_, s) in split.items()}, tuple(layer_stacks),
                   layer_fn, False)


def _run_chunk(graphdefs: dict[Hashable, Any], states: dict[Hashable, Any], chunk: tuple[Hashable, ...],
               layer_fn: Callable[..., tuple[jax.Array, Any]], h: jax.Array, args: Any, *, scan: bool = True,
               remat_policy: str = "none", chunk_carry: Callable[[jax.Array], Any] | None = None
               ) -> tuple[jax.Array, dict[Hashable, Any]]:
    """The layers of one chunk (``chunk``: the stack name of each, in model order; ``states``: each stack's layers
    of this chunk, in model order) on ``h``, run as the chunk's scan segments (``segments``) in order, each layer
    ``layer_fn(name, layer, h, *args) -> (h, aux)``. Returns ``h`` and, per stack name, the layers' ``aux``
    stacked per layer in that stack's order. ``chunk_carry``: see ``pipeline_stack``."""
    local = {name: nnx.merge(graphdefs[name], state) for name, state in states.items()}
    carry = h if chunk_carry is None else (h, chunk_carry(h))
    ran: dict[Hashable, list[tuple[np.ndarray, Any]]] = {name: [] for name in local}
    for segment in segments(chunk, local):
        def body(group: Any, h: jax.Array, _: Any, pattern: tuple[Hashable, ...] = segment.pattern) -> Any:
            outputs = []
            for name, layer in zip(pattern, group):
                h, aux = layer_fn(name, layer, h, *args)
                outputs.append(aux)
            return h, outputs

        carry, outputs = run_stack(segment.group, body, carry, scan=scan, remat_policy=remat_policy)
        for name, start, stride, out in zip(segment.pattern, segment.starts, segment.strides, outputs):
            ran[name].append((start + stride * np.arange(segment.repeats), out))
    aux = {}
    for name, parts in ran.items():
        order = np.argsort(np.concatenate([indices for indices, _ in parts]), kind="stable")
        if len(parts) == 1 and (order == np.arange(order.size)).all():
            aux[name] = parts[0][1]
        else:  # a stack whose layers ran in several segments or pattern positions: back into its order
            aux[name] = jax.tree.map(lambda *a, order=order: jnp.concatenate(a)[order], *(out for _, out in parts))
    return (carry if chunk_carry is None else carry[0]), aux


def run_unpipelined(stacks: Mapping[Hashable, Any], layer_fn: Callable[..., tuple[jax.Array, Any]], x: jax.Array,
                    *args: Any, layer_stacks: Sequence[Hashable], scan: bool = True, remat_policy: str = "none"
                    ) -> tuple[jax.Array, dict[Hashable, Any]]:
    """The layers of ``stacks`` (by name; ``layer_stacks`` the stack name of each layer, in model order) on ``x`` in
    model order, not pipelined, each ``layer_fn(name, layer, h, *args) -> (h, aux)``: the layers a model runs
    before its pipeline (``pipeline_layers``). Returns ``h`` and, per stack name, the layers' ``aux`` stacked in
    that stack's order, as ``pipeline_stack(..., with_aux=True)`` gives them.

    >>> h, stats = run_unpipelined({"prefix_layers": model.prefix_layers}, layer_fn, h, ropes, mask,
    ...                            layer_stacks=("prefix_layers",))
    """
    parts = _stacks_of(stacks, layer_fn, layer_stacks)
    return _run_chunk(parts.graphdefs, parts.states, parts.layer_stacks, parts.layer_fn, x, args, scan=scan,
                      remat_policy=remat_policy)


def pipeline_stack(
    stack: Any,
    layer_fn: Callable[..., Any],
    x: jax.Array,
    *args: Any,
    microbatches: int,
    schedule: str = "gpipe",
    scan: bool = True,
    remat_policy: str = "none",
    with_aux: bool = False,
    layer_stacks: Sequence[Hashable] | None = None,
    chunk_carry: Callable[[jax.Array], Any] | None = None,
) -> Any:
    """``layer_fn(layer, h, *args) -> h`` folded over the layers of ``stack`` (as ``run_stack`` would), pipelined
    over the ambient mesh's ``stage`` axis with ``microbatches`` micro-batches of ``x [batch, ...]``.

    ``stack`` is a stacked module (or an ``nnx.List`` of them, one layer of each per step, as a scan segment's
    group), or several stacks: a mapping of stack names to stacked modules, with ``layer_stacks`` the stack name of
    each layer in model order (each stack's layers in model order), and then ``layer_fn(name, layer, h, *args)``.
    The layer sequence must be ``S`` identical chunks (``pipeline_chunk``; a lone stack's layer count a multiple
    of ``S``): stage ``s`` runs chunk ``s``, its local block of every stack, as the chunk's scan segments.

    ``with_aux=True``: ``layer_fn`` returns ``(h, aux)`` (a pytree of per-layer outputs that are sums over the
    layer's rows: an MoE layer's expert load, dropped tokens, a balance loss summed over sequences), and the result
    is ``(h, aux)`` with each leaf stacked per layer (``[layers, ...]``, the layer dim on ``stage``, as the stack's
    weights) and summed over the micro-batches: for a sum over rows, the whole batch's value (a term that is not
    one, e.g. capacity-limited dropping, counts per micro-batch as gradient accumulation counts it). Each aux leaf
    is whole within a stage (not split over the other mesh axes: sums over the rows are). With stacks by name,
    ``aux`` is a dict by stack name, each stacked per layer of that stack, in the stack's (model) order.

    ``chunk_carry(h)``: a value the layers of a chunk hand on among themselves (GLM-5's top-k, chosen by a layer
    and read by the next ones), made afresh from the chunk's input at the start of every chunk and dropped at its
    end, so it never crosses a stage; ``layer_fn`` then takes and returns ``(h, value)`` in place of ``h``. The
    caller makes sure no layer reads a value made before its chunk's first writer.

    Micro-batch ``j`` holds rows ``j, j + M, j + 2M, ...`` (each device keeps its rows, as in
    ``batch_split``); arguments (and pytree leaves, such as an ``AttentionMask``'s) with a leading batch dim are
    split the same way, others go to every micro-batch. Returns ``[batch, ...]`` like ``x``, in ``x``'s layout,
    whole on every stage: what follows the stack (the final norm, the head and the loss) runs outside the
    pipeline, where the models split its batch over ``stage`` again (``activation_embed_and_logits_batch``). With
    no ``stage`` axis (size 1) the layers run in order, unpipelined.

    >>> h = pipeline_stack(model.layers, lambda layer, h, cos, sin: layer(h, cos, sin, None), h, cos, sin,
    ...                    microbatches=4)
    >>> h = pipeline_stack({"sliding": model.sliding, "full": model.full},
    ...                    lambda name, layer, h, mask: layer(h, *ropes[name], mask), h, mask, microbatches=4,
    ...                    layer_stacks=("sliding", "sliding", "full") * 4)
    """
    if schedule != "gpipe":
        raise ValueError(f"pipeline_stack runs the 'gpipe' schedule, got {schedule!r} ({tuple(SCHEDULES)}: the "
                         "others run the loss inside the pipeline, pipeline_1f1b_value_and_grad)")
    stages = stage_count()
    stacks = _stacks_of(stack, layer_fn, layer_stacks)
    fn = stacks.layer_fn if with_aux else (lambda *a: (stacks.layer_fn(*a), None))
    run = dict(scan=scan, remat_policy=remat_policy)

    def result(h: jax.Array, aux: dict[Hashable, Any]) -> Any:
        return (h, aux[_LONE] if stacks.lone else aux) if with_aux else h

    if stages == 1:
        return result(*_run_chunk(stacks.graphdefs, stacks.states, stacks.layer_stacks, fn, x, args,
                                  chunk_carry=chunk_carry, **run))
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline microbatches must be a positive integer, got {microbatches!r}")
    warn_if_few_cpu_workers("a pipelined GPipe step")
    batch = x.shape[0]
    if batch % microbatches:
        raise ValueError(f"{microbatches} pipeline micro-batches do not divide the batch of {batch} rows; use a "
                         f"micro-batch count that divides {batch} (e.g. --microbatches {stages}), or another batch")
    spec = _explicit_spec_of(x)
    if spec is not None:  # each micro-batch's rows must still split over the devices that split the batch
        _check_micro_batch(jax.typeof(x).sharding.mesh, spec[0], batch, microbatches)
    chunk = pipeline_chunk(stacks.layer_stacks, stages)
    micro = microbatches

    def split(a: jax.Array) -> jax.Array:  # [batch, ...] -> [batch / M, M, ...]: row j * M + m is micro-batch m
        spec = _explicit_spec_of(a)
        if spec is not None:
            spec = PartitionSpec(spec[0], None, *spec[1:])
        return jnp.reshape(a, (batch // micro, micro) + a.shape[1:], out_sharding=spec)

    def is_batched(a: Any) -> bool:
        return isinstance(a, jax.Array) and a.ndim > 0 and a.shape[0] == batch

    leaves, treedef = jax.tree.flatten(args)
    leaves = [jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in leaves]  # a numpy mask is split too
    # Arrays go through shard_map's arguments; other leaves (python ints) stay static.
    dynamic = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
    batched = tuple(is_batched(leaves[i]) for i in dynamic)
    operands = [split(leaves[i]) if b else leaves[i] for i, b in zip(dynamic, batched)]

    def stage_program(states: Any, xs: jax.Array, operands: list[jax.Array]) -> jax.Array:
        stage = jax.lax.axis_index(STAGE_AXIS)

        def micro_args(index: jax.Array) -> Any:
            picked = list(leaves)
            for i, b, a in zip(dynamic, batched, operands):
                picked[i] = jax.lax.dynamic_index_in_dim(a, index, axis=1, keepdims=False) if b else a
            return jax.tree.unflatten(treedef, picked)

        def run_local(h: jax.Array, index: jax.Array) -> tuple[jax.Array, Any]:  # this stage's chunk
            return _run_chunk(stacks.graphdefs, states, chunk, fn, h, micro_args(index), chunk_carry=chunk_carry,
                              **run)

        def time_step(carry: tuple[jax.Array, jax.Array, Any], t: jax.Array
                      ) -> tuple[tuple[jax.Array, jax.Array, Any], None]:
            held, done, aux_sum = carry
            index = jnp.clip(t - stage, 0, micro - 1)  # the micro-batch this stage works on at step t
            busy = (t >= stage) & (t - stage < micro)  # idle in the first ``stage`` steps and the last S-1-stage
            first_input = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, micro - 1), axis=1, keepdims=False)
            def work(h: jax.Array, index: jax.Array, aux_sum: Any) -> tuple[jax.Array, Any]:
                h, aux = run_local(h, index)
                return h, jax.tree.map(jnp.add, aux_sum, aux)

            # Idle steps (which would repeat a clipped index) run nothing and count nothing.
            h, aux_sum = _when(busy, work, lambda h, _, aux_sum: (h, aux_sum),
                               jnp.where(stage == 0, first_input, held), index, aux_sum)
            finished = busy & (stage == stages - 1)
            done = jnp.where(finished, jax.lax.dynamic_update_index_in_dim(done, h, index, axis=1), done)
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
    def program(*operands: Any) -> Any:  # the shard_map built in the mesh context it runs in
        return jax.shard_map(stage_program, in_specs=in_specs,
                             out_specs=(PartitionSpec(), PartitionSpec(STAGE_AXIS)), axis_names={STAGE_AXIS})(*operands)

    xs = split(x)
    if spec is not None:
        # Under an Explicit mesh the scan's saved residuals leave the shard_map gathered whole over the other
        # axes (fsdp: 2.6x the temporaries of Auto, measured on a 4-layer Llama, stage 2 x fsdp 4) and are sliced
        # again; run the program with the mesh's axes Auto and give the outputs their Explicit types back.
        aux_shapes = jax.eval_shape(program, stacks.states, xs, operands)[1]
        program = jax.sharding.auto_axes(program, out_sharding=(
            jax.typeof(xs).sharding.spec, jax.tree.map(lambda _: PartitionSpec(STAGE_AXIS), aux_shapes)))
    done, aux = program(stacks.states, xs, operands)
    return result(jnp.reshape(done, x.shape, out_sharding=spec), aux)


# The columns of ``pipeline_order``'s table: per tick and stage, the forward's and the backward's work item.
F_OK, F_MICRO, F_CHUNK, F_SLOT, B_OK, B_MICRO, B_CHUNK, B_SLOT = range(8)


def pipeline_order(stages: int, virtual_stages: int, microbatches: int) -> np.ndarray:
    """The (interleaved) 1F1B schedule as data: ``[ticks, stages, 8]`` int32, per tick ``t`` and stage ``s`` the
    forward's (valid, micro-batch, chunk ``v``, saved-input slot) and the backward's (the same four), columns
    ``F_OK .. B_SLOT``. ``pipeline_1f1b_value_and_grad`` runs exactly this table.

    With ``S`` stages and ``V`` virtual stages, virtual stage ``k = v S + s`` (layer chunk ``k``) is chunk ``v`` of
    stage ``s``. Forward item ``i = t - s`` (``0 <= i < M V``): group ``g = i // (S V)`` of ``S`` micro-batches,
    chunk ``v = (i % (S V)) // S``, micro-batch ``m = g S + i % S``; so a micro-batch's chunk ``v`` on stage ``s``
    runs one tick after chunk ``v`` on stage ``s - 1``, and chunk ``v`` on stage 0 one tick after chunk ``v - 1``
    on stage ``S - 1`` (the ring). Backward item ``j = t - (V S - 1) - (S - 1 - s)``: ``g = j // (S V)``,
    ``v = V - 1 - (j % (S V)) // S``, ``m = g S + j % S``: the last virtual stage's backward runs in the tick of
    its forward (the head and loss run there), and each other one tick after the one it needs. Ticks:
    ``T = M V + V S + S - 2`` (``M + 2S - 2`` for ``V = 1``, plain 1F1B). A stage keeps each forward's input
    until its backward (at most ``2 V S - 2`` ticks later) in the lowest slot free when the forward runs (freed
    after the backward reads it): at most ``(V + 1) S - 1 - 2 s`` inputs at once on stage ``s``, so
    ``(V + 1) S - 1`` slots (``2S - 1`` for 1F1B; a ring by forward index ``i mod slots`` would need
    ``2 V S - 1``). With ``V > 1``, ``M`` must be a multiple of ``S``.
    """
    V, S, M = virtual_stages, stages, microbatches
    ticks = M * V + V * S + S - 2
    table = np.zeros((ticks, S, 8), np.int32)
    for s in range(S):
        free, slot_of = list(range(2 * V * S - 1)), {}  # slots in use: item -> slot
        for t in range(ticks):
            i = t - s
            j = t - (V * S - 1) - (S - 1 - s)
            for ok, index, chunk in ((F_OK, i, lambda r: r // S), (B_OK, j, lambda r: V - 1 - r // S)):
                valid = 0 <= index < M * V
                g, r = divmod(min(max(index, 0), M * V - 1), S * V)
                item = (g * S + r % S, chunk(r))  # (micro-batch, chunk)
                if valid and ok == F_OK:  # the lowest free slot; written before this tick's backward reads
                    slot_of[item] = free.pop(free.index(min(free)))
                table[t, s, ok:ok + 4] = (valid, *item, slot_of[item] if valid else 0)
            if table[t, s, B_OK]:  # free once read: the next tick's forward may take it
                free.append(slot_of.pop(tuple(table[t, s, B_MICRO:B_CHUNK + 1])))
    return table


def pipeline_1f1b_value_and_grad(
    stack: Any,
    layer_fn: Callable[..., Any],
    head_fn: Callable[[Any, jax.Array, Any], jax.Array],
    head_params: Any,
    x: jax.Array,
    targets: Any,
    *args: Any,
    microbatches: int,
    virtual_stages: int = 1,
    with_aux: bool = False,
    layer_stacks: Sequence[Hashable] | None = None,
    chunk_carry: Callable[[jax.Array], Any] | None = None,
) -> tuple[Any, ...]:
    """The summed loss of ``head_fn(head_params, layers(x), targets)`` over ``microbatches`` micro-batches and its
    gradients ``(loss, d stack state, d head_params, d x)``, computed in 1F1B order over the ``stage`` axis;
    interleaved 1F1B with ``virtual_stages=V > 1`` (each stage runs ``V`` non-contiguous chunks of ``L / (V S)``
    layers: chunks ``s, S + s, ..., (V - 1) S + s`` on stage ``s``).

    One SPMD program (``shard_map`` over ``stage``) whose ``T = M V + V S + S - 2`` ticks each run, on every
    stage, at most one chunk's forward and one chunk's backward, in the order ``pipeline_order`` tabulates: the
    last stage runs the head and the loss and starts a micro-batch's backward in the tick its last chunk's
    forward arrives, and each stage keeps only the inputs of the items between their forward and their backward
    (at most ``(V + 1) S - 1``, whatever ``M``; the backward recomputes the chunk's layers from them), where GPipe
    keeps all ``M``. ``head_fn`` returns a scalar summed over its micro-batch; ``targets`` (a pytree) and ``args``
    are split like ``x`` (rows ``j, j + M, ...``) when their leading dim is the batch. ``layer_fn`` as in
    ``pipeline_stack``.
    Needs a ``stage`` axis; with ``V > 1``, ``M`` a multiple of ``S``. ``stack`` and ``layer_stacks`` as in
    ``pipeline_stack`` (several stacks by name: ``d stack state`` is then a dict of their states' gradients), and
    ``chunk_carry`` too (each virtual stage's chunk starts it afresh): the
    layer sequence must be ``V S`` identical chunks (``pipeline_chunk``), chunk ``k`` holding the ``k``-th ``1 / (V
    S)`` of every stack, run as that chunk's scan segments.

    Bubble: each stage runs a chunk's forward only in a tick that has one for it, its backward (and the last
    stage its head) likewise (``jax.lax.cond`` per stage, see the module's docstring), so with ``f`` and ``b`` a
    chunk's forward and backward times (``b`` includes the recompute), the ``V S - 1`` warm-up ticks cost ``f``
    (forwards only), the ``V S - 1`` cool-down ticks ``b``, and the ``M V - V S + S`` between ``f + b`` (the last
    stage does both in each): ``(M V + S - 1)(f + b)`` for ``M V (f + b)`` of useful work per stage, so the bubble
    is Megatron's, ``(S - 1) / (M V + S - 1)`` (1F1B: ``(S - 1) / (M + S - 1)``, GPipe's; interleaving divides it
    by about ``V``). The masked program (``skips_idle_ticks()`` False) runs both halves in all ``T`` ticks:
    ``(V S + S - 2) / (M V + V S + S - 2)``.

    Placement of the chunks: the stored stack keeps layer order and the rule set puts it on ``stage`` in
    contiguous blocks (stage ``b`` holds chunks ``b V .. b V + V - 1``; HF load/save and checkpoints rely on that
    order). The program moves each chunk to its stage at its start (``_move_chunks``: one ``ppermute`` over
    ``stage`` per pair of source and destination positions, so each chunk travels once, directly, and one already
    on its stage, ``k // V == k % S``, stays), and the gradients back the same way at its end (the inverse
    permutation: exact, nothing summed). Why this and not a reshape or gather of the global stack: its bytes are
    known, no device holds more than its own share at any time (a gather over the sharded layer dim may gather the
    whole stack first), and it reads the same under Auto and Explicit meshes. Its cost, per call (once per
    accumulation step): the stack's parameter bytes less the chunks that stay (a fraction about ``1 / S``) over
    the stage links for the parameters, and as many for their gradients. Storing the stacks in pipeline order
    would remove it (the follow-up; it touches HF load/save and checkpoints).

    The dense causal LM wraps it in a ``custom_vjp`` (``forward(..., pipeline_schedule="1f1b" | "interleaved",
    loss_targets=...)``) so that a trainer's ``value_and_grad`` gets these gradients.

    ``with_aux=True`` (an MoE stack's aux terms): ``layer_fn`` returns ``(h, (loss_part, stats))``, where
    ``loss_part`` is a scalar that the layer adds to the loss (a weighted balance loss: its gradient flows through
    the layer's backward) and ``stats`` a pytree the loss does not see (expert load, dropped tokens); ``head_fn``
    returns ``(loss, head_stats)``. The result is then ``(loss, d stack state, d head_params, d x, stats,
    head_stats)``: ``loss`` includes every layer's ``loss_part``, ``stats`` is stacked per layer (the layer dim on
    ``stage``) and summed over the micro-batches, ``head_stats`` summed over them; with stacks by name ``stats`` is
    a dict by stack name, each stacked per layer of that stack in its (model) order.

    >>> loss, d_stack, d_head, d_x = pipeline_1f1b_value_and_grad(stack, layer_fn, head_fn, w, x, targets,
    ...                                                           microbatches=4, virtual_stages=2)
    """
    stages = stage_count()
    if stages == 1:
        raise ValueError("pipeline_1f1b_value_and_grad needs a mesh with a 'stage' axis of size > 1")
    warn_if_few_cpu_workers("a pipelined 1F1B step")
    virtual = virtual_stages
    if not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual stages must be a positive integer, got {virtual!r}")
    batch = x.shape[0]
    if not isinstance(microbatches, int) or microbatches < 1 or batch % microbatches:
        raise ValueError(f"{microbatches} pipeline micro-batches do not divide the batch of {batch} rows")
    micro = microbatches
    if virtual > 1 and micro % stages:
        fits = [m for m in range(stages, batch + 1, stages) if batch % m == 0]
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of the {stages} stages: {micro} "
                         f"micro-batches is not a multiple of {stages}; use a multiple of {stages} that divides the "
                         f"batch of {batch} (one of {fits}), or --virtual-stages 1")
    spec = _explicit_spec_of(x)
    if spec is not None:  # each micro-batch's rows must still split over the devices that split the batch
        _check_micro_batch(jax.typeof(x).sharding.mesh, spec[0], batch, micro)
    stacks = _stacks_of(stack, layer_fn, layer_stacks)
    chunk_kinds = pipeline_chunk(stacks.layer_stacks, stages, virtual)
    state = stacks.states
    order = pipeline_order(stages, virtual, micro)
    slots, last_chunk = int(order[..., F_SLOT].max()) + 1, virtual - 1  # at most (V + 1) S - 1
    # The ring closes (stage S-1 hands chunk v's output to stage 0's chunk v+1) only when there are chunks to chain.
    ahead = [(s, s + 1) for s in range(stages - 1)] + ([(stages - 1, 0)] if virtual > 1 else [])
    back = [(b, a) for a, b in ahead]

    def split(a: jax.Array) -> jax.Array:
        spec = _explicit_spec_of(a)
        if spec is not None:
            spec = PartitionSpec(spec[0], None, *spec[1:])
        return jnp.reshape(a, (batch // micro, micro) + a.shape[1:], out_sharding=spec)

    leaves, treedef = jax.tree.flatten((targets, args))
    leaves = [jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in leaves]  # a numpy mask is split too
    dynamic = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
    batched = tuple(leaves[i].ndim > 0 and leaves[i].shape[0] == batch for i in dynamic)
    operands = [split(leaves[i]) if b else leaves[i] for i, b in zip(dynamic, batched)]

    def stage_program(state: Any, head_params: Any, xs: jax.Array, operands: list[jax.Array]) -> Any:
        stage = jax.lax.axis_index(STAGE_AXIS)
        last = stage == stages - 1
        varying = lambda a: jax.lax.pcast(a, STAGE_AXIS, to="varying")  # noqa: E731
        head_params = jax.tree.map(varying, head_params)  # differentiated per stage, summed once at the end
        # Each stack's [V n, ...] in layer order (chunks b V + u) -> [V, n, ...] (n: its layers in a chunk), then
        # chunk v = v S + s (identity for V = 1): leaf by leaf, so stacks of different lengths move alike.
        chunks = jax.tree.map(lambda a: jnp.reshape(a, (virtual, a.shape[0] // virtual, *a.shape[1:])), state)
        chunks = _move_chunks(chunks, stages, lambda s, v: divmod(v * stages + s, virtual))
        table = jnp.asarray(order)

        def micro_inputs(index: jax.Array) -> Any:
            picked = list(leaves)
            for i, b, a in zip(dynamic, batched, operands):
                picked[i] = jax.lax.dynamic_index_in_dim(a, index, axis=1, keepdims=False) if b else a
            return jax.tree.unflatten(treedef, picked)

        def chunk_of(tree: Any, v: jax.Array) -> Any:
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, 0, keepdims=False), tree)

        def fn(*a: Any) -> tuple[jax.Array, Any]:  # one layer: (h, (loss_part, stats))
            out = stacks.layer_fn(*a)
            return out if with_aux else (out, (jnp.zeros((), jnp.float32), None))

        def stage_fn(chunk: Any, h: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
            """The chunk on ``h``: ``(h, its layers' summed loss_part, their stats per stack [n, ...])``."""
            _, margs = micro_inputs(index)
            h, aux = _run_chunk(stacks.graphdefs, chunk, chunk_kinds, fn, h, margs, chunk_carry=chunk_carry)
            return h, sum(jnp.sum(parts) for parts, _ in aux.values()), {name: st for name, (_, st) in aux.items()}

        def head_value_and_grad(head_params: Any, h: jax.Array, tgt: Any) -> tuple[Any, Any]:
            if with_aux:
                return jax.value_and_grad(head_fn, argnums=(0, 1), has_aux=True)(head_params, h, tgt)
            loss, grads = jax.value_and_grad(head_fn, argnums=(0, 1))(head_params, h, tgt)
            return (loss, None), grads

        def put(valid: jax.Array, tree: jax.Array, new: jax.Array, index: jax.Array, axis: int) -> jax.Array:
            """``tree`` with ``new`` at ``index`` on ``axis`` where ``valid``."""
            return jnp.where(valid, jax.lax.dynamic_update_index_in_dim(tree, new, index, axis), tree)

        def tick(carry: Any, t: jax.Array) -> tuple[Any, None]:
            fwd_in, bwd_in, saved, d_chunks, d_head, loss, d_x, stats_acc, head_acc = carry
            row = table[t, stage]
            f_ok, fm, fv, f_slot = row[F_OK] > 0, row[F_MICRO], row[F_CHUNK], row[F_SLOT]
            first_input = jax.lax.dynamic_index_in_dim(xs, fm, axis=1, keepdims=False)
            h_in = jnp.where((stage == 0) & (fv == 0), first_input, fwd_in)
            saved = put(f_ok, saved, h_in, f_slot, 0)

            def forward(h: jax.Array, loss: jax.Array, stats_acc: Any) -> tuple[jax.Array, jax.Array, Any]:
                h, part, stats = stage_fn(chunk_of(chunks, fv), h, fm)
                return h, loss + part, jax.tree.map(  # the layers' own loss terms and stats, once per item
                    lambda acc, a: jax.lax.dynamic_update_index_in_dim(
                        acc, jax.lax.dynamic_index_in_dim(acc, fv, 0, keepdims=False) + a, fv, 0), stats_acc, stats)

            h_out, loss, stats_acc = _when(f_ok, forward, lambda h, loss, stats_acc: (h, loss, stats_acc), h_in,
                                           loss, stats_acc)

            def head(loss: jax.Array, d_head: Any, head_acc: Any, h: jax.Array) -> tuple[jax.Array, Any, Any, Any]:
                (mb_loss, head_stats), (g_head, g_out) = head_value_and_grad(head_params, h, micro_inputs(fm)[0])
                return (loss + mb_loss, jax.tree.map(jnp.add, d_head, g_head),
                        jax.tree.map(jnp.add, head_acc, head_stats), g_out)

            at_head = last & (fv == last_chunk) & f_ok
            loss, d_head, head_acc, g_out = _when(
                at_head, head, lambda loss, d_head, head_acc, h: (loss, d_head, head_acc, jnp.zeros_like(h)),
                loss, d_head, head_acc, h_out)

            # The last virtual stage's backward is this tick's forward item (pipeline_order), seeded by the head.
            b_ok, bm, bv, b_slot = row[B_OK] > 0, row[B_MICRO], row[B_CHUNK], row[B_SLOT]

            def backward(d_chunks: Any, g_h: jax.Array) -> tuple[Any, jax.Array]:
                h_saved = jax.lax.dynamic_index_in_dim(saved, b_slot, 0, keepdims=False)
                if with_aux:  # the layers' loss parts count once each: cotangent 1
                    (_, b_part), pullback = jax.vjp(lambda c, h: stage_fn(c, h, bm)[:2], chunk_of(chunks, bv),
                                                    h_saved)
                    g_chunk, g_in = pullback((g_h, jnp.ones_like(b_part)))
                else:
                    _, pullback = jax.vjp(lambda c, h: stage_fn(c, h, bm)[0], chunk_of(chunks, bv), h_saved)
                    g_chunk, g_in = pullback(g_h)
                return jax.tree.map(lambda d, g: jax.lax.dynamic_update_index_in_dim(
                    d, jax.lax.dynamic_index_in_dim(d, bv, 0, keepdims=False) + g, bv, 0), d_chunks, g_chunk), g_in

            d_chunks, g_in = _when(b_ok, backward, lambda d_chunks, g: (d_chunks, jnp.zeros_like(g)), d_chunks,
                                   jnp.where(last & (bv == last_chunk), g_out, bwd_in))
            d_x = put((stage == 0) & (bv == 0) & b_ok, d_x, g_in, bm, 1)
            fwd_in = jax.lax.ppermute(h_out, STAGE_AXIS, ahead)
            bwd_in = jax.lax.ppermute(g_in, STAGE_AXIS, back)
            return (fwd_in, bwd_in, saved, d_chunks, d_head, loss, d_x, stats_acc, head_acc), None

        one = jax.lax.index_in_dim(xs, 0, axis=1, keepdims=False)
        zeros = lambda a: varying(jnp.zeros_like(a))  # noqa: E731
        shaped = lambda a: varying(jnp.zeros(a.shape, a.dtype))  # noqa: E731
        index0 = jnp.zeros((), jnp.int32)
        stats_shape = jax.eval_shape(stage_fn, chunk_of(chunks, 0), zeros(one), index0)[2]
        head_shape = jax.eval_shape(head_value_and_grad, head_params, zeros(one), micro_inputs(index0)[0])[0][1]
        carry = (zeros(one), zeros(one), zeros(jnp.broadcast_to(one, (slots, *one.shape))),
                 jax.tree.map(jnp.zeros_like, chunks), jax.tree.map(jnp.zeros_like, head_params),
                 varying(jnp.zeros((), jnp.float32)), zeros(xs),
                 jax.tree.map(lambda a: shaped(jax.ShapeDtypeStruct((virtual, *a.shape), a.dtype)), stats_shape),
                 jax.tree.map(shaped, head_shape))
        (_, _, _, d_chunks, d_head, loss, d_x, stats, head_stats), _ = jax.lax.scan(tick, carry,
                                                                                  jnp.arange(len(order)))
        # Each stored chunk's gradient (and stats) back to where it is stored (chunk b V + u = v S + s: the
        # inverse move).
        inverse = lambda b, u: divmod(b * virtual + u, stages)[::-1]  # noqa: E731
        d_chunks = _move_chunks(d_chunks, stages, inverse)
        d_state = jax.tree.map(lambda d, a: jnp.reshape(d, a.shape), d_chunks, state)
        if jax.tree.leaves(stats):
            stats = jax.tree.map(lambda a: jnp.reshape(a, (-1, *a.shape[2:])), _move_chunks(stats, stages, inverse))
        total = lambda a: jax.lax.psum(a, STAGE_AXIS)  # noqa: E731  (each is nonzero on one stage, or summed)
        return total(loss), d_state, jax.tree.map(total, d_head), total(d_x), stats, jax.tree.map(total, head_stats)

    specs = (PartitionSpec(STAGE_AXIS), PartitionSpec(), PartitionSpec(), [PartitionSpec()] * len(operands))
    loss, d_state, d_head, d_x, stats, head_stats = jax.shard_map(
        stage_program, in_specs=specs, out_specs=(PartitionSpec(), PartitionSpec(STAGE_AXIS), PartitionSpec(),
                                                  PartitionSpec(), PartitionSpec(STAGE_AXIS), PartitionSpec()),
        axis_names={STAGE_AXIS})(state, head_params, split(x), operands)
    d_x = jnp.reshape(d_x, x.shape, out_sharding=_explicit_spec_of(x))
    if stacks.lone:
        d_state, stats = d_state[_LONE], stats[_LONE]
    return (loss, d_state, d_head, d_x, stats, head_stats) if with_aux else (loss, d_state, d_head, d_x)


# How a stage spends a tick it has no work for. "skip": ``jax.lax.cond`` on the tick's validity, so an idle stage
# runs none of its layers (nor the head, nor the backward); the predicate depends only on the stage index and the
# tick, so every device of a stage's fsdp / tensor group takes the same branch and the collectives inside a branch
# stay matched (the ``ppermute``s over ``stage`` stay outside it). "mask": every stage computes every tick and
# ``jnp.where`` drops the idle results (the program before idle skipping: what the benchmarks compare against).
# "auto" (the default): "skip", except on the CPU backend when a mesh axis other than ``stage`` is larger than 1.
# There the branches hold that group's collectives (FSDP's all-gathers, ...), and XLA:CPU's in-process collectives
# (jax 0.10.2) intermittently deadlock on them: two devices of one stage's fsdp pair wait in different collectives
# (an all-gather and an all-to-all) until the 40 s rendezvous timeout aborts the process. Seen with 1F1B and
# interleaved train steps of an 8-layer Llama on stage 4 x fsdp 2 when compiled steps alternate (within 15 rounds),
# never with a stage-only mesh (no collective in a branch) nor with the masked program.
IDLE_TICKS = "auto"


def skips_idle_ticks() -> bool:
    """Whether the pipelines run idle ticks' work under ``jax.lax.cond`` (skipped) rather than masked, on the
    ambient mesh: the one place that decides (``IDLE_TICKS``)."""
    if IDLE_TICKS not in ("auto", "skip", "mask"):
        raise ValueError(f"IDLE_TICKS must be 'auto', 'skip' or 'mask', got {IDLE_TICKS!r}")
    if IDLE_TICKS != "auto":
        return IDLE_TICKS == "skip"
    mesh = jax.sharding.get_abstract_mesh()
    grouped = not mesh.empty and any(size > 1 for name, size in mesh.shape.items() if name != STAGE_AXIS)
    return not (grouped and jax.default_backend() == "cpu")


def _when(busy: jax.Array, work: Callable[..., Any], idle: Callable[..., Any], *operands: Any) -> Any:
    """``work(*operands)`` where ``busy``, else ``idle(*operands)`` (same types; ``idle`` does no real work):
    skipped under ``jax.lax.cond`` or computed and masked, as ``skips_idle_ticks`` decides."""
    if skips_idle_ticks():
        return jax.lax.cond(busy, work, idle, *operands)
    return jax.tree.map(lambda a, b: jnp.where(busy, a, b), work(*operands), idle(*operands))


def _move_chunks(tree: Any, stages: int, source: Callable[[int, int], tuple[int, int]]) -> Any:
    """Inside ``shard_map`` over ``stage``: each leaf ``[P, ...]`` (``P`` chunks per stage) rearranged so that
    stage ``d``'s position ``p`` holds what stage ``source(d, p) = (stage, position)`` held. One ``ppermute`` per
    (destination position, source position) pair that some stage uses (a permutation: each stage receives one
    chunk per position), so every chunk travels once; where the source is the stage itself nothing moves.
    The identity (one position, each stage its own) costs nothing."""
    positions = jax.tree.leaves(tree)[0].shape[0]
    if positions == 1 and all(source(d, 0) == (d, 0) for d in range(stages)):
        return tree
    stage = jax.lax.axis_index(STAGE_AXIS)

    def move(a: jax.Array) -> jax.Array:
        out = []
        for p in range(positions):
            got = None
            for q in range(positions):
                pairs = [(source(d, p)[0], d) for d in range(stages) if source(d, p)[1] == q]
                if not pairs:
                    continue
                received = jax.lax.ppermute(a[q], STAGE_AXIS, pairs)
                mine = jnp.asarray(np.isin(np.arange(stages), [d for _, d in pairs]))[stage]
                got = received if got is None else jnp.where(mine, received, got)
            out.append(got)
        return jnp.stack(out)

    return jax.tree.map(move, tree)
