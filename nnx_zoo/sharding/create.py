"""Creating NNX modules directly sharded from their Variables' logical-name metadata.

The model is first built abstractly (``nnx.eval_shape``: shapes only), every Variable's ``out_sharding`` names
are resolved by ``logical_to_mesh_axes``, and the real initializer runs under ``jax.jit`` with those
``out_shardings``, so each device only ever materializes its own shards. Flax's eager sharding (a dict lookup
that drops fallback rules) is switched off while the module is built, so it never decides a placement.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import flax.errors
import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from nnx_zoo.sharding.resolve import Fallback, Resolution, ShardingError, resolve, unplaced_mesh_message
from nnx_zoo.sharding.rules import Rules, get_rules

M = TypeVar("M", bound=nnx.Module)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def path_str(path: tuple[Any, ...]) -> str:
    """``('moe_layers', 'attn', 'q_proj', 'kernel')`` -> ``'moe_layers.attn.q_proj.kernel'``."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(str(key))
    return ".".join(parts)


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a Variable was annotated with (``out_sharding`` metadata), or None."""
    names = variable.get_metadata().get("out_sharding")
    if names is None:
        return None
    if isinstance(names, PartitionSpec):
        names = tuple(names)
    return tuple(names)


def iter_variables(state_or_module: Any) -> Iterator[tuple[str, nnx.Variable]]:
    """``(dotted path, Variable)`` for every Variable of a module or state, in a stable order."""
    state = nnx.state(state_or_module) if isinstance(state_or_module, nnx.Module) else state_or_module
    for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_variable):
        if _is_variable(var):
            yield path_str(path), var


def variable_resolution(
    path: str,
    variable: nnx.Variable,
    rules: Rules,
    mesh: Mesh | AbstractMesh,
    *,
    strict: bool = True,
    allow_partial: bool = False,
) -> Resolution:
    """The resolved, divisibility-checked spec of one Variable (replicated when it carries no names), with the
    divisibility fallbacks ``allow_partial=True`` took (``nnx_zoo.sharding.resolve``)."""
    names = logical_names(variable)
    shape = tuple(variable.shape)
    if names is None:
        return Resolution(PartitionSpec())
    if len(names) != len(shape):
        raise ShardingError(
            f"{path}: {len(names)} logical names {names} for a {len(shape)}-d value of shape {shape}; annotate "
            "one name per dimension"
        )
    return resolve(names, rules, mesh, strict=strict, shape=shape, path=path, allow_partial=allow_partial)


def variable_spec(
    path: str, variable: nnx.Variable, rules: Rules, mesh: Mesh | AbstractMesh, **options: bool
) -> PartitionSpec:
    """The resolved, divisibility-checked spec of one Variable (replicated when it carries no names);
    ``variable_resolution``'s spec, same keyword options (``strict``, ``allow_partial``)."""
    return variable_resolution(path, variable, rules, mesh, **options).spec


def _resolve_state(
    state: nnx.State, mesh: Mesh | AbstractMesh, rules: Rules, strict: bool, allow_partial: bool
) -> list[Resolution]:
    # A Variable may hold no array at all (optax's MaskedNode, in the state of an optimizer that partitions the
    # parameters, e.g. Muon + AdamW): it has no leaf, so it gets no sharding.
    return [variable_resolution(path, var, rules, mesh, strict=strict, allow_partial=allow_partial)
            for path, var in iter_variables(state) if jax.tree.leaves(var.get_value())]


def state_shardings(
    state: nnx.State,
    mesh: Mesh,
    rules: Rules | str = "default",
    *,
    strict: bool = True,
    allow_partial: bool = False,
) -> list[NamedSharding]:
    """NamedShardings for the leaves of ``state`` (in ``jax.tree.leaves`` order)."""
    resolutions = _resolve_state(state, mesh, get_rules(rules), strict, allow_partial)
    return [NamedSharding(mesh, r.spec) for r in resolutions]


class ShardingFallbackWarning(UserWarning):
    """``create_sharded(..., allow_partial=True)`` placed some dimensions on fewer shards than their rules ask
    (the message lists them); a trainer filters on this category to print them its own way."""


def fallback_message(fallbacks: list[Fallback] | tuple[Fallback, ...], limit: int = 10) -> str:
    """A few lines naming the dimensions that fell back to fewer shards (for a warning or a log)."""
    lines = [f"{len(fallbacks)} dimension(s) do not divide over their rule's mesh axes and were placed on the "
             "longest prefix that divides them (more replication than the rule asked for):"]
    lines += [f"  {f}" for f in fallbacks[:limit]]
    if len(fallbacks) > limit:
        lines.append(f"  ... and {len(fallbacks) - limit} more (sharding_report(...).fallbacks lists them all)")
    return "\n".join(lines)


def abstract_module(make: Callable[[], M]) -> M:
    """The module ``make()`` would build, with shapes only (no memory), Flax eager sharding off.

    ``make`` is traced (here, and again under ``jax.jit`` by ``create_sharded``), so it must build its own
    ``nnx.Rngs``: ``lambda: Model(rngs=nnx.Rngs(0))``, not a lambda closing over an ``Rngs`` made outside.
    """
    try:
        with nnx.use_eager_sharding(False):
            return nnx.eval_shape(make)
    except flax.errors.TraceContextError as e:
        raise ShardingError(
            f"{e}\n\nmake() mutated state created outside it (usually an nnx.Rngs it closes over). make() is "
            "traced, so it must create its own Rngs: `lambda: Model(..., rngs=nnx.Rngs(seed))`."
        ) from e


def create_sharded(
    make: Callable[[], M],
    mesh: Mesh,
    rules: Rules | str = "default",
    *,
    strict: bool = True,
    allow_partial: bool = False,
) -> M:
    """Build ``make()`` with every Variable born on the sharding its logical names resolve to.

    >>> mesh = make_mesh({"fsdp": 8})
    >>> model = create_sharded(lambda: MyModel(rngs=nnx.Rngs(0)), mesh, "default")

    Warns when ``rules`` can place nothing on a mesh of more than one device (``unplaced_mesh_message``). A
    dimension that does not divide over its mesh axes is an error unless ``allow_partial=True``, which places it
    on the longest dividing prefix of those axes and warns with the list of what was degraded.
    """
    problem = unplaced_mesh_message(rules, mesh)
    if problem is not None:
        warnings.warn(problem, stacklevel=2)
    graphdef, abstract_state = nnx.split(abstract_module(make))
    resolutions = _resolve_state(abstract_state, mesh, get_rules(rules), strict, allow_partial)
    fallbacks = [f for r in resolutions for f in r.fallbacks]
    if fallbacks:
        warnings.warn(fallback_message(fallbacks), ShardingFallbackWarning, stacklevel=2)
    shardings = [NamedSharding(mesh, r.spec) for r in resolutions]
    treedef = jax.tree.structure(abstract_state)

    def init() -> list[jax.Array]:
        with nnx.use_eager_sharding(False):
            return jax.tree.leaves(nnx.state(make()))

    leaves = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def create_variables(
    make: Callable[[], nnx.Module],
    select: Callable[[str], bool],
    mesh: Mesh | None,
    rules: Rules | str = "default",
    *,
    allow_partial: bool = False,
) -> dict[str, jax.Array]:
    """``path -> value`` of the Variables of ``make()`` whose dotted path ``select`` accepts, each born on its
    resolved sharding (on the default device when ``mesh`` is None), and nothing else materialized: one jitted
    initializer that returns only these, so XLA drops the computation of every other Variable. The values are
    those ``create_sharded(make, mesh, rules)`` gives these Variables, bit for bit (the same jitted draws; ``make()``
    run eagerly, as ``create`` without a mesh runs it, can round a float's last bit differently).

    >>> new = create_variables(lambda: Model(config, rngs=nnx.Rngs(0)), lambda p: ".adapter." in p, mesh)
    """
    abstract = dict(iter_variables(abstract_module(make)))
    paths = [p for p, v in abstract.items() if select(p) and jax.tree.leaves(v.get_value())]
    if mesh is None:
        shardings = [SingleDeviceSharding(jax.devices()[0])] * len(paths)
    else:
        rules = get_rules(rules)
        shardings = [NamedSharding(mesh, variable_spec(p, abstract[p], rules, mesh, allow_partial=allow_partial))
                     for p in paths]

    def init() -> list[jax.Array]:
        with nnx.use_eager_sharding(False):
            variables = dict(iter_variables(make()))
        return [variables[p].get_value() for p in paths]

    return dict(zip(paths, jax.jit(init, out_shardings=shardings)(), strict=True))
