"""Output shardings for ops that cannot infer them under an all-Explicit mesh.

Under Explicit axes a dot whose contraction dim is sharded, or a gather from a sharded table, needs the caller to
say how its output is laid out (``out_sharding=``). ``explicit_spec`` resolves logical activation names to that
spec with the ambient mesh and rules, and returns None elsewhere (no mesh, or Auto axes, where XLA decides), so a
call site can pass its result straight through: ``jnp.einsum(..., out_sharding=explicit_spec(names, shape))``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from nnx_zoo.sharding import current_rules, logical_to_mesh_axes, shard_mode_of
from nnx_zoo.sharding.constrain import activation_spec, shard_to_spec


def explicit_spec(names: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec | None:
    """The spec ``names`` resolve to on the ambient mesh when its axes are Explicit, else None (``shape`` checked
    as ``shard`` checks it: ``use_rules(..., allow_partial=True)`` falls back to a dividing prefix)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or shard_mode_of(mesh) != "explicit":
        return None
    return activation_spec(names, shape)


def ambient_mesh_or_none() -> jax.sharding.AbstractMesh | None:
    """The mesh set with ``jax.set_mesh`` (abstract), or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def resolve_activation(names: Sequence[str | None], shape: Sequence[int] | None = None) -> PartitionSpec:
    """The spec ``names`` resolve to on the ambient mesh (any axis type; ``shape`` checked under Explicit axes, as
    ``shard`` does); ``P()`` without a mesh."""
    if ambient_mesh_or_none() is None:
        return PartitionSpec()
    return activation_spec(names, shape)


def _spec_entries(spec: PartitionSpec, ndim: int) -> list:
    parts = tuple(getattr(spec, "partitions", spec))  # a spec with reduced axes refuses plain iteration
    entries = list(parts) + [None] * (ndim - len(parts))
    return [(e,) if isinstance(e, str) else tuple(e or ()) for e in entries]


def weight_einsum(equation: str, x: jax.Array, weight: jax.Array, out_names: Sequence[str | None], *,
                  weight_names: Sequence[str | None] | None = None) -> jax.Array:
    """``jnp.einsum(equation, x, weight)`` for an activation ``x`` and a weight, output laid out as ``out_names``.

    Under an Explicit mesh the weight is first resharded so each of its dims is split like the activation's dim
    it contracts with, or like the output dim it produces (a mesh axis used twice keeps its first, contracting
    use): the FSDP "gather the weight, compute locally" pattern. Handing XLA a weight sharded on the axes that
    the activation's batch dim also uses made it miscompile some dots silently (a (data, fsdp)-batch activation
    against an fsdp-sharded kernel with heads on tensor_transpose returned wrong numbers on CPU, jax 0.10.2).

    Under an Auto mesh, ``weight_names`` (the weight's logical names) let the same layouts be asked for as
    sharding constraints (``_einsum_constrained_like_explicit``): the weight is first gathered over its FSDP axes
    (those the output's activation-only dims use) while its other axes stay, then moves as under Explicit. Left
    to choose alone, XLA went straight from ``(fsdp, tensor_transpose)`` on the input dim to ``tensor_transpose``
    on the output dim by replicating the whole weight ("Involuntary full rematerialization").
    """
    inputs, out_letters = equation.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    out_shape = tuple(
        x.shape[x_letters.index(c)] if c in x_letters else weight.shape[w_letters.index(c)] for c in out_letters
    )
    out_spec = explicit_spec(out_names, out_shape)
    if weight_names is not None and out_spec is None and _mesh_size() > 1:
        return _einsum_constrained_like_explicit(equation, x, weight, weight_names, out_names, out_shape)
    return weight_einsum_to_spec(equation, x, weight, out_spec)


def _mesh_size() -> int:
    mesh = ambient_mesh_or_none()
    return 1 if mesh is None else mesh.size


def _einsum_constrained_like_explicit(equation: str, x: jax.Array, weight: jax.Array,
                                      weight_names: Sequence[str | None], out_names: Sequence[str | None],
                                      out_shape: tuple[int, ...]) -> jax.Array:
    """``weight_einsum`` under an Auto mesh: the layouts an Explicit mesh would give the activation and the
    weight, as sharding constraints (their transposes constrain the backward's cotangents the same way).

    The activation's layout is not known under Auto axes: its dims shared with the output take the output's
    axes, its contracted dims the axes the weight keeps there once gathered over its FSDP axes. Left to choose
    the layouts between our constraints, XLA moved ``[tokens, mlp]``-wide activations and partial sums under
    tensor_transpose (the FSDP 4 + TP-transpose 2 train step: 1.21x the collective bytes on paper; 0.99x so).
    """
    inputs, out_letters = equation.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    out_axes = dict(zip(out_letters, _spec_entries(resolve_activation(out_names, out_shape), len(out_letters))))
    stored = _stored_entries(weight, weight_names)
    kept = _fsdp_gathered_entries(equation, x, weight, stored, out_names)
    used: set[str] = set()
    x_spec = []
    for c in x_letters:
        axes = out_axes[c] if c in out_axes else kept[w_letters.index(c)] if c in w_letters else ()
        x_spec.append(tuple(a for a in axes if a not in used))
        used |= set(axes)
    x_spec = _gather_contraction_when_output_is_larger(x_letters, w_letters, x, weight, x_spec, out_axes)
    weight_spec = _weight_entries(w_letters, dict(zip(x_letters, x_spec)), out_axes)
    for step in _resharding_steps(stored, weight_spec, weight.shape):
        weight = shard_to_spec(weight, _to_spec(step))  # as reshard_in_steps: move, then gather
    y = jnp.einsum(equation, shard_to_spec(x, _to_spec(x_spec)), weight)
    return shard_to_spec(y, _to_spec([out_axes[c] for c in out_letters]))


def _weight_entries(w_letters: str, x_axes: dict, out_axes: dict) -> list:
    """The weight's spec entries for a dot: each dim split like the activation's dim it contracts with (those
    first: they must match), or like the output dim it produces, a mesh axis used once."""
    used: set[str] = set()
    weight_spec = [()] * len(w_letters)
    for pass_from_x in (True, False):
        for i, c in enumerate(w_letters):
            if (c in x_axes) != pass_from_x:
                continue
            axes = tuple(a for a in (x_axes.get(c) if pass_from_x else out_axes.get(c, ())) if a not in used)
            weight_spec[i] = axes
            used |= set(axes)
    return weight_spec


def gather_fsdp_axes(equation: str, x: jax.Array, weight: jax.Array, weight_names: Sequence[str | None],
                     out_names: Sequence[str | None]) -> jax.Array:
    """``weight`` (logical ``weight_names``) laid out as its own spec minus the mesh axes that the dims of
    ``equation``'s output coming from ``x`` alone use (its FSDP axes): gathered over them, every other axis kept.
    Under an Explicit mesh the weight's own spec is read from its type; without a mesh it is returned unchanged.

    >>> w = gather_fsdp_axes("th,ehi->tei", x, w, ("exp", "embed", "mlp"), ("tokens", "exp", "mlp"))
    """
    mesh = ambient_mesh_or_none()
    if mesh is None or mesh.size == 1:
        return weight
    stored = _stored_entries(weight, weight_names)
    staying = _fsdp_gathered_entries(equation, x, weight, stored, out_names)
    return weight if staying == stored else shard_to_spec(weight, _to_spec(staying))


def _stored_entries(weight: jax.Array, weight_names: Sequence[str | None]) -> list:
    """The weight's own spec entries: from its type under Explicit axes, else from the rules (allow_partial: a
    weight created with ``create_sharded(allow_partial=True)`` sits on the dividing prefix; where everything
    divides this is the strict spec)."""
    mesh = ambient_mesh_or_none()
    if shard_mode_of(mesh) == "explicit":
        return _spec_entries(jax.typeof(weight).sharding.spec, weight.ndim)
    return _spec_entries(logical_to_mesh_axes(tuple(weight_names), current_rules(), mesh, shape=tuple(weight.shape),
                                              allow_partial=True), weight.ndim)


def _fsdp_gathered_entries(equation: str, x: jax.Array, weight: jax.Array, stored: list,
                           out_names: Sequence[str | None]) -> list:
    """The weight's spec entries (``stored``) minus its FSDP axes (those the output's activation-only dims use)."""
    inputs, out_letters = equation.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    out_shape = tuple(
        x.shape[x_letters.index(c)] if c in x_letters else weight.shape[w_letters.index(c)] for c in out_letters
    )
    out = _spec_entries(resolve_activation(out_names, out_shape), len(out_letters))
    fsdp = {a for c, axes in zip(out_letters, out) if c not in w_letters for a in axes}
    return [tuple(a for a in axes if a not in fsdp) for axes in stored]


def weight_einsum_to_spec(
    equation: str, x: jax.Array, weight: jax.Array, out_spec: PartitionSpec | None
) -> jax.Array:
    """`weight_einsum` with the output's spec given directly (None: no Explicit mesh, XLA decides)."""
    if out_spec is None:
        mesh = ambient_mesh_or_none()
        single_device = mesh is None or mesh.size == 1
        if single_device and x.dtype == weight.dtype and _matmul_shape(equation) is not None:
            return _einsum_row_major_grads(equation, x, weight)  # a layout fix for XLA:CPU (see below)
        return jnp.einsum(equation, x, weight)
    inputs, out_letters = equation.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    x_spec = _spec_entries(jax.typeof(x).sharding.spec, x.ndim)
    out_axes = dict(zip(out_letters, _spec_entries(out_spec, len(out_letters))))
    x_spec = _gather_contraction_when_output_is_larger(x_letters, w_letters, x, weight, x_spec, out_axes)
    x_axes = dict(zip(x_letters, x_spec))
    # The weight gradient contracts the activation's dims that the weight lacks (its tokens); it can stay
    # unsummed only over exactly the mesh axes those are split on. Otherwise it is summed here.
    grad_contracted = frozenset(a for c in x_letters if c not in w_letters for a in x_axes[c])
    if _reduced(weight) and _reduced(weight) != grad_contracted:
        weight = without_reduced(weight)
    weight_spec = _weight_entries(w_letters, x_axes, out_axes)
    return _einsum_regathering(equation, _to_spec(x_spec), _to_spec(weight_spec, _reduced(weight)), out_spec, x,
                               weight)


def _to_spec(entries: list, reduced: frozenset = frozenset()) -> PartitionSpec:
    return PartitionSpec(*(axes if axes else None for axes in entries), reduced=reduced)


def without_reduced(a: jax.Array) -> jax.Array:
    """``a`` with its reduced mesh axes (Explicit types) dropped, for ops that do not take them (reshape): its
    gradient is summed over those axes here, as for any replicated value."""
    if not _reduced(a):
        return a
    return jax.reshard(a, _to_spec(_spec_entries(jax.typeof(a).sharding.spec, a.ndim)))


def _reduced(a: jax.Array) -> frozenset:
    """The mesh axes ``a`` is marked reduced over (Explicit types): its cotangent stays unsummed over them."""
    return frozenset(getattr(jax.typeof(a).sharding.spec, "reduced", ()) or ())


def _gather_contraction_when_output_is_larger(x_letters: str, w_letters: str, x: jax.Array, weight: jax.Array,
                                              x_spec: list, out_axes: dict) -> list:
    """``x``'s spec entries, minus the mesh axes worth all-gathering ``x`` over before the dot.

    A mesh axis that splits both a contracted dim of ``x`` and a weight dim of the output can be served two ways:
    contract the local slices and reduce-scatter partial outputs (each device briefly holds the output unsplit on
    that axis), or all-gather ``x`` along the contracted dim and let the axis split the weight's output dim. The
    smaller temporary wins: under tensor_transpose an lm_head or MLP up-projection gathers its narrow input
    instead of materializing vocab- or mlp-wide partial sums (XLA's own choice under Auto meshes); the
    down-projection, whose output is the narrow one, keeps reduce-scattering.
    """
    axis_sizes = jax.sharding.get_abstract_mesh().shape
    sizes = dict(zip(w_letters, weight.shape)) | dict(zip(x_letters, x.shape))

    def local_size(letters, spec) -> int:
        return math.prod(sizes[c] for c in letters) // math.prod(axis_sizes.get(a, 1) for axes in spec for a in axes)

    x_local, out_local = local_size(x_letters, x_spec), local_size(out_axes.keys(), out_axes.values())
    spec = list(x_spec)
    for i, c in enumerate(x_letters):
        if c not in w_letters or c in out_axes:  # batch or kept dims: nothing is summed over them
            continue
        conflicting = {a for a in spec[i] for d in w_letters if d not in x_letters and a in out_axes.get(d, ())}
        if conflicting and out_local > x_local:
            spec[i] = tuple(a for a in spec[i] if a not in conflicting)
    return spec


def _einsum_resharded(equation: str, x_spec: PartitionSpec, weight_spec: PartitionSpec, out_spec: PartitionSpec,
                      x: jax.Array, weight: jax.Array) -> jax.Array:
    return jnp.einsum(equation, jax.reshard(x, x_spec), reshard_in_steps(weight, weight_spec), out_sharding=out_spec)


def reshard_in_steps(a: jax.Array, spec: PartitionSpec) -> jax.Array:
    """``jax.reshard(a, spec)`` for an Explicit ``a``, done as a move and then a gather.

    Going at once from a weight split over ``(fsdp, tensor_transpose)`` on its input dim to one split over
    ``tensor_transpose`` on its output dim, XLA's partitioner replicates the whole weight and slices it
    ("Involuntary full rematerialization"). Instead, first every mesh axis that changes dim moves there while
    the axes leaving the array stay put (``P((fsdp, tensor_transpose), None) -> P(fsdp, tensor_transpose)``: an
    all-to-all within the moving axes' groups, on the still FSDP-split weight), then the leaving axes are
    gathered (an all-gather, to ``P(None, tensor_transpose)``). Where that middle layout does not divide, every
    axis that leaves its dim is gathered first and the arriving ones are sliced locally: the same end, but the
    moving axes are gathered whole (for the weight above, 2x the bytes: ``benchmarks/README.md`` 4.1).
    """
    current = _spec_entries(jax.typeof(a).sharding.spec, a.ndim)
    reduced = _reduced(a)  # kept on the way: only the last step may change it
    for step in _resharding_steps(current, _spec_entries(spec, a.ndim), a.shape)[:-1]:
        a = jax.reshard(a, _to_spec(step, reduced))
    return jax.reshard(a, spec)


def _resharding_steps(current: list, target: list, shape: tuple[int, ...]) -> list:
    """The layouts (spec entries) ``reshard_in_steps`` passes through from ``current`` to ``target``, ending
    with ``target``: the moving axes moved (when that divides), then the leaving axes gathered."""
    moved = _moving_axes_moved(current, target, shape)
    if moved == target:  # only moves: one all-to-all
        return [target]
    steps = []
    if moved is not None and moved != current:
        steps.append(moved)
        current = moved
    staying = [tuple(ax for ax in cur if ax in tgt) for cur, tgt in zip(current, target)]
    if staying != current and staying != target:
        steps.append(staying)
    return steps + [target]


def _moving_axes_moved(current: list, target: list, shape: tuple[int, ...]) -> list | None:
    """``current`` with each mesh axis that ``target`` puts on another dim moved there (appended after the axes
    that dim keeps), every other axis left where it is; None when that layout does not divide ``shape``."""
    moving = {ax for d, cur in enumerate(current) for ax in cur
              if ax not in target[d] and any(ax in tgt for tgt in target)}
    if not moving:
        return current
    moved = [tuple(ax for ax in cur if ax not in moving) + tuple(ax for ax in tgt if ax in moving and ax not in cur)
             for cur, tgt in zip(current, target)]
    sizes = jax.sharding.get_abstract_mesh().shape
    if any(n % math.prod(sizes[ax] for ax in axes) for n, axes in zip(shape, moved)):
        return None
    return moved


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _einsum_regathering(equation, x_spec, weight_spec, out_spec, x, weight):
    """`_einsum_resharded` that reshards its inputs again in the backward pass instead of keeping the resharded
    (usually all-gathered) copies alive from the forward pass, as XLA does under Auto meshes. Kept, the gathered
    weights of every scanned layer cost the FSDP train step 13% more temporaries."""
    return _einsum_resharded(equation, x_spec, weight_spec, out_spec, x, weight)


def _einsum_regathering_fwd(equation, x_spec, weight_spec, out_spec, x, weight):
    return _einsum_resharded(equation, x_spec, weight_spec, out_spec, x, weight), (x, weight)


def _einsum_regathering_bwd(equation, x_spec, weight_spec, out_spec, residuals, grad):
    # The pullback of the reshards returns each cotangent in its input's own sharding.
    _, pullback = jax.vjp(functools.partial(_einsum_resharded, equation, x_spec, weight_spec, out_spec), *residuals)
    return pullback(grad)


_einsum_regathering.defvjp(_einsum_regathering_fwd, _einsum_regathering_bwd)


def _matmul_shape(equation: str) -> int | None:
    """The number of leading (row) dims of x when ``equation`` is a plain matmul over flattened dims,
    ``{lead}{contract},{contract}{out}->{lead}{out}`` (every Linear, the fused expert projections), else None."""
    inputs, out_letters = equation.replace(" ", "").split("->")
    x_letters, w_letters = inputs.split(",")
    contract = "".join(c for c in x_letters if c in w_letters)
    lead = x_letters[: len(x_letters) - len(contract)]
    if not contract or x_letters != lead + contract or not w_letters.startswith(contract):
        return None
    if out_letters != lead + w_letters[len(contract):]:
        return None
    return len(lead)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_row_major_grads(equation, x, weight):
    """``jnp.einsum(equation, x, weight)`` for a `_matmul_shape` equation, with a backward pass written as two
    row-major 2-D matmuls: ``dx = g @ W^T`` and ``dW = x^T @ g``. Autodiff's own dot_general for ``dW``
    contracts the output cotangent over its leading (token) dim, and XLA:CPU lays that out by writing a
    transposed copy of the cotangent: for the lm_head that is the [tokens, vocab] cotangent, the largest tensor of
    the step (57 ms of a 690 ms deepseek3-tiny step). Transposing ``x`` instead moves the small operand."""
    return jnp.einsum(equation, x, weight)


def _einsum_row_major_grads_fwd(equation, x, weight):
    return jnp.einsum(equation, x, weight), (x, weight)


def _einsum_row_major_grads_bwd(equation, residuals, grad):
    x, weight = residuals
    n_lead = _matmul_shape(equation)
    x2 = x.reshape(math.prod(x.shape[:n_lead]), -1)  # [rows, contracted]
    w2 = weight.reshape(x2.shape[1], -1)  # [contracted, out]
    g2 = grad.reshape(x2.shape[0], -1)  # [rows, out]
    return (g2 @ w2.T).reshape(x.shape), (x2.T @ g2).reshape(weight.shape)


_einsum_row_major_grads.defvjp(_einsum_row_major_grads_fwd, _einsum_row_major_grads_bwd)


def gather_weight_fsdp_axes(weight: jax.Array, weight_names: Sequence[str | None]) -> jax.Array:
    """``weight`` (logical ``weight_names``) gathered over its FSDP axes: every mesh axis the rules give the
    ``activation_tokens`` dim is dropped from each of its dims except ``exp`` (experts stay on their EP axes),
    every other axis kept, as `gather_fsdp_axes` leaves a weight whose einsum output carries the tokens dim.
    Under an Explicit mesh the result is typed reduced over the token axes it is whole on, so gathering a weight
    once for several uses (``batch_split``'s micro-batches, a shared output head) sums their gradients before one
    reduction. Without a mesh it is returned unchanged.

    >>> kernel = gather_weight_fsdp_axes(kernel, ("embed", "mlp"))
    """
    mesh = ambient_mesh_or_none()
    if mesh is None or mesh.size == 1:
        return weight
    stored = _stored_entries(weight, weight_names)
    fsdp = {a for axes in _spec_entries(logical_to_mesh_axes(("activation_tokens",), current_rules(), mesh), 1)
            for a in axes}
    staying = [axes if name == "exp" else tuple(a for a in axes if a not in fsdp)
               for name, axes in zip(weight_names, stored)]
    if staying == stored:
        return weight
    if shard_mode_of(mesh) != "explicit":
        return shard_to_spec(weight, _to_spec(staying))
    # Marked reduced over the token axes it is now whole on: each use's weight gradient stays unsummed over them
    # and the uses' sum is reduced once (a reduce-scatter over the gathered axes), not once per use.
    sizes = mesh.shape
    reduced = frozenset(a for a in fsdp if sizes[a] > 1 and not any(a in stay for stay in staying))
    return reshard_in_steps(weight, _to_spec(staying, reduced))
