"""Stacks of identical layers: created with ``nnx.vmap`` under a logical stack-axis name, applied with a scan.

``create_stack`` builds ``count`` layers at once; every Variable gains a leading dim named ``axis_name``
(``dense_layers``, ``moe_layers``, ...) so the resolver sees the stacked rank. ``run_stack`` applies them in
order, either with ``jax.lax.scan`` (one compiled layer body) or unrolled in Python (for debugging, same
numbers), with an optional rematerialization policy. ``batch_split`` runs one layer on micro-batches (the
batch-split schedule).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.spec import gather_weight_fsdp_axes
from nnx_zoo.sharding import restore_sharding, shard_mode_of, sharding_of
from nnx_zoo.sharding.plan_layers import periodic_runs as _periodic_runs

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
    graphdef, stored, cast, state = cast_once(stack, recomputed=remat_policy != "none")

    def step(carry: Any, layer_state_and_x: Any) -> tuple[Any, Any]:
        (layer_stored, layer_cast, layer_state), x = layer_state_and_x
        return body(nnx.merge(graphdef, use_cast(layer_stored, layer_cast), layer_state), carry, x)

    if remat_policy != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[remat_policy], prevent_cse=not scan)
    if scan:
        return jax.lax.scan(step, carry, ((stored, cast, state), xs))
    count = jax.tree.leaves(state)[0].shape[0]
    outputs = []
    for i in range(count):
        carry, out = step(carry, jax.tree.map(lambda a, i=i: a[i], ((stored, cast, state), xs)))
        outputs.append(out)
    return carry, jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *outputs)


def cast_once(stack: nnx.Module, *, recomputed: bool = True) -> tuple[Any, nnx.State, nnx.State, nnx.State]:
    """``(graphdef, stored, cast, rest)``: the Params of ``stack`` that its modules cast whole to their compute
    dtype in every layer (``stored``), their cast (``cast``: made here, once for all the stacked layers), and the
    rest of its state. A layer is ``nnx.merge(graphdef, use_cast(stored, cast), rest)`` (sliced to one layer).

    A module names those Params with a ``params_cast_once()`` method, ``{path relative to it: dtype}``
    (``SparseMoE``'s expert weights when they are computed in bfloat16). Cast here, outside the (rematerialized)
    layer body, the cast runs once a step, not again in the backward's recomputation (inside, the module's own
    cast is then a no-op). The cast is fenced (``optimization_barrier``) so that XLA keeps it out of the loop. Its
    bfloat16 copy of the stack lives through the step, so only a ``recomputed`` stack (remat) casts here: without
    remat each layer casts once anyway, and a decoding step holds one layer's cast at a time.

    >>> graphdef, stored, cast, rest = cast_once(stack)
    >>> layer = nnx.merge(graphdef, use_cast(stored, cast), rest)
    """
    dtypes: dict[tuple[Any, ...], Any] = {}
    for path, node in nnx.iter_graph(stack) if recomputed else ():
        if isinstance(node, nnx.Module) and hasattr(node, "params_cast_once"):
            dtypes.update({(*path, *name): dtype for name, dtype in node.params_cast_once().items()})
    graphdef, stored, rest = nnx.split(stack, lambda path, _: tuple(path) in dtypes, ...)
    cast = nnx.map_state(lambda path, v: v.replace(v.get_value().astype(dtypes[tuple(path)])), stored)
    if dtypes:
        cast = jax.lax.optimization_barrier(jax.lax.stop_gradient(cast))
    return graphdef, stored, cast, rest


def use_cast(stored: nnx.State, cast: nnx.State) -> nnx.State:
    """``cast``'s values, with gradients flowing to ``stored`` (``cast_once``): the cast's gradient, converted
    back to each stored dtype within the layer, as when the layer cast its weights itself."""
    return jax.tree.map(lambda s, c: _cast_value(s, c, jnp.dtype(s.dtype)), stored, cast)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cast_value(stored: jax.Array, cast: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return cast


def _cast_value_fwd(stored, cast, dtype):
    return cast, None


def _cast_value_bwd(dtype, _, d_cast):
    return d_cast.astype(dtype), None


_cast_value.defvjp(_cast_value_fwd, _cast_value_bwd)


def periodic_runs(kinds: Sequence[Hashable], max_period: int = 4) -> list[tuple[tuple[Hashable, ...], int]]:
    """A layer schedule (one kind per layer) as consecutive segments ``(pattern, repeats)``: ``pattern`` repeated
    ``repeats`` times covers the segment's layers in order. From each position the period (up to
    ``max_period``) whose repeats cover the most layers wins, ties to the shorter period; a pattern seen once
    covers one layer. A model scans each segment with one body over its pattern, so an interleaved schedule
    compiles one body per segment, not one per layer.

    >>> periodic_runs(["s", "s", "c", "h", "c", "h", "c"])
    [(('s',), 2), (('c', 'h'), 2), (('c',), 1)]
    """
    return _periodic_runs(kinds, max_period)  # one rule, shared with the memory plan (sharding can't import layers)


class Segment(NamedTuple):
    """Consecutive layers a model runs as one scan (``segments``): its ``pattern`` of stack names ``repeats``
    times; ``group`` holds, per pattern position, the layers of that stack those repeats use, ``starts`` the first
    of them within its stack and ``strides`` the step between them: a name that appears ``m`` times in the pattern
    (Gemma 3's five sliding layers per global one) takes every ``m``-th layer of its stack at each of its positions.
    A cache's layer index is ``starts[p] + strides[p] * repeat``."""

    group: Any  # nnx.List of stacked modules
    pattern: tuple[str, ...]
    repeats: int
    starts: tuple[int, ...]
    strides: tuple[int, ...]


def segments(layer_stacks: Sequence[str], stacks: dict[str, Any], max_period: int = 8) -> list[Segment]:
    """A model's layers as scan segments (``periodic_runs`` over ``layer_stacks``, the stack name of each layer
    in model order; ``stacks`` maps the names to the stacked modules, whose layers are in model order).

    >>> [(s.pattern, s.repeats) for s in segments(["sliding_layers"] * 5 + ["layers"], model_stacks)]
    [(('sliding_layers',), 5), (('layers',), 1)]
    >>> [(s.starts, s.strides) for s in segments((["sliding_layers"] * 2 + ["layers"]) * 3, model_stacks)]
    [((0, 1, 0), (2, 2, 1))]

    In the second, the pattern (sliding, sliding, global) runs three times: its first position takes sliding
    layers 0, 2, 4, its second 1, 3, 5, as the model orders them.
    """
    taken = dict.fromkeys(stacks, 0)
    out = []
    for pattern, repeats in periodic_runs(layer_stacks, max_period):
        parts, starts, strides = [], [], []
        seen: dict[str, int] = {}
        for name in pattern:
            every = pattern.count(name)  # this name's layers in one repeat: each of its positions takes every m-th
            start = taken[name] + seen.get(name, 0)
            seen[name] = seen.get(name, 0) + 1
            stack = stacks[name]
            count = jax.tree.leaves(nnx.state(stack))[0].shape[0]
            whole = every == 1 and repeats == count
            parts.append(stack if whole else take_layers(stack, start, start + every * (repeats - 1) + 1, every))
            starts.append(start)
            strides.append(every)
        for name in seen:
            taken[name] += seen[name] * repeats
        out.append(Segment(nnx.List(parts), tuple(pattern), repeats, tuple(starts),  # type: ignore[arg-type]
                           tuple(strides)))
    return out


def model_order(per_position: Sequence[Any]) -> Any:
    """A segment's per-layer outputs in model order: ``per_position[p]`` holds pattern position ``p``'s, stacked
    over the repeats; the layers ran repeat-major (``r0p0, r0p1, ..., r1p0, ...``)."""
    return jax.tree.map(lambda *a: jnp.stack(a, axis=1).reshape(-1, *a[0].shape[1:]), *per_position)


def take_layers(stack: M, start: int, stop: int, step: int = 1) -> M:
    """Layers ``start:stop:step`` of a stacked module (the same Variables, sliced on the leading layer dim)."""
    graphdef, state = nnx.split(stack)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[start:stop:step], state))


class Summed(NamedTuple):
    """An ``aux`` subtree that ``batch_split`` sums over the micro-batches whatever its leaves' shapes (e.g. an MoE
    layer's per-expert counts ``[E]``, which a leading-dim rule could mistake for rows).

    >>> y, (idx, sums) = batch_split(lambda x: (f(x), (indices(x), Summed(counts(x)))), x, factor=2)
    >>> sums.value  # counts over the whole batch
    """

    value: Any


def batch_split(
    fn: Callable[..., tuple[jax.Array, Any]], x: jax.Array, *args: Any, factor: int
) -> tuple[jax.Array, Any]:
    """``fn(x, *args) -> (y, aux)`` run on ``factor`` micro-batches of ``x`` (the batch-split schedule).

    Micro-batch ``j`` holds rows ``j, j + factor, j + 2 factor, ...``: splitting ``[B, ...]`` as
    ``[B / factor, factor, ...]`` keeps each device's rows on it (the batch dim keeps its sharding, whatever mesh
    axes the rules gave it), so no collective is needed to split or merge. The micro-batches are independent
    calls, unrolled, so XLA may overlap one's compute with the next one's collectives. Arguments (and the leaves
    of pytree arguments, such as an ``AttentionMask``) whose leading dim is the batch are split too; others
    (rope tables, a batch-1 mask) go to every micro-batch. ``y`` (shaped like ``x``) and the leaves of ``aux``
    with a leading batch dim are put back in order; scalar leaves of ``aux``, and ``Summed`` subtrees, are
    summed. ``y`` leaves with
    exactly ``x``'s sharding (``restore_sharding``). ``factor=1`` calls ``fn``.
    """
    if not isinstance(factor, int) or factor < 1:
        raise ValueError(f"batch_split_factor must be a positive integer, got {factor!r}")
    if factor == 1:
        return fn(x, *args)
    batch = x.shape[0]
    if batch % factor:
        raise ValueError(
            f"batch_split_factor={factor} must divide the batch size, got a batch of {batch}; choose a factor "
            f"that divides {batch}, or 1 to turn batch splitting off"
        )
    in_sharding = sharding_of(x)

    def split(a: Any) -> list[Any]:
        if not isinstance(a, jax.Array) or a.ndim == 0 or a.shape[0] != batch:
            return [a] * factor
        spec = _explicit_spec_of(a)
        if spec is not None:
            _check_micro_batch(jax.typeof(a).sharding.mesh, spec[0], batch, factor)
            spec = PartitionSpec(spec[0], None, *spec[1:])
        a = jnp.reshape(a, (batch // factor, factor) + a.shape[1:], out_sharding=spec)
        return [jax.lax.index_in_dim(a, j, axis=1, keepdims=False) for j in range(factor)]

    def split_tree(tree: Any) -> list[Any]:  # an argument may be a pytree (an AttentionMask): split each leaf
        leaves, treedef = jax.tree.flatten(tree)
        per_leaf = [split(leaf) for leaf in leaves]
        return [jax.tree.unflatten(treedef, [p[j] for p in per_leaf]) for j in range(factor)]

    pieces = [split_tree(a) for a in (x, *args)]
    outs = [fn(*(p[j] for p in pieces)) for j in range(factor)]

    def merge(*leaves: Any) -> Any:
        if isinstance(leaves[0], Summed):
            return Summed(jax.tree.map(lambda *parts: sum(parts[1:], parts[0]), *(s.value for s in leaves)))
        if leaves[0].ndim == 0:
            return sum(leaves[1:], leaves[0])
        stacked = jnp.stack(leaves, axis=1)
        spec = _explicit_spec_of(stacked)
        if spec is not None:
            spec = PartitionSpec(spec[0], *spec[2:])
        return jnp.reshape(stacked, (batch,) + stacked.shape[2:], out_sharding=spec)

    y, aux = jax.tree.map(merge, *outs, is_leaf=lambda t: isinstance(t, Summed))
    return restore_sharding(y, in_sharding), aux


def gathered_over_fsdp(module: M) -> M:
    """A copy of ``module`` whose parameters are gathered over their FSDP axes (`gather_weight_fsdp_axes`, from
    each Param's ``out_sharding`` names); other state is shared. Run every micro-batch of ``batch_split`` on it
    (or every use of a shared weight, such as the output head of the main model and its MTP heads): the weights
    are gathered once instead of once per use, and under Explicit meshes (typed reduced) the uses' gradients are
    summed before one reduction. Under Auto meshes XLA places that reduction.

    >>> y, aux = batch_split(gathered_over_fsdp(layer), x, factor=2)  # layer(x) -> (y, aux)
    """
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def gather(v: nnx.Variable) -> nnx.Variable:
        value, names = v.get_value(), tuple(v.get_metadata().get("out_sharding") or ())
        # Inside a layer scan the names still start with the stack axis, which the value no longer has.
        names = names[len(names) - value.ndim:] if value.ndim else ()
        return v if not names else v.replace(gather_weight_fsdp_axes(value, names))

    params = jax.tree.map(gather, params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.merge(graphdef, params, rest)


def _explicit_spec_of(a: jax.Array) -> PartitionSpec | None:
    """``a``'s full-rank spec when its type carries an Explicit sharding, else None (Auto or no mesh)."""
    sharding = jax.typeof(a).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or shard_mode_of(mesh) != "explicit":
        return None
    spec = tuple(sharding.spec)
    return PartitionSpec(*(spec + (None,) * (a.ndim - len(spec))))


def _check_micro_batch(mesh: Any, entry: Any, batch: int, factor: int) -> None:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    shards = 1
    for name in axes:
        shards *= sizes.get(name, 1)
    if (batch // factor) % shards:
        raise ValueError(
            f"batch_split_factor={factor}: the micro-batch of {batch // factor} rows cannot be split over the "
            f"{shards} devices that shard the batch (mesh axes {axes}); use a batch that is a multiple of "
            f"{factor * shards}, or a smaller factor"
        )
