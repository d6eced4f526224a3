"""Token embedding table: lookup, and use as a tied output head."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.linear import DEFAULT_INIT
from nnx_zoo.layers.spec import ambient_mesh_or_none, explicit_spec, resolve_activation, weight_einsum
from nnx_zoo.sharding import axes_tuple, current_rules, logical_to_mesh_axes, shard, shard_mode_of
from nnx_zoo.sharding.constrain import shard_to_spec

# The embedding's output and the tied head's logits are outside any pipeline: their batch is split over 'stage'
# too (``activation_embed_and_logits_batch``; without a 'stage' axis it is ``activation_batch``'s).
_OUT_NAMES = ("activation_embed_and_logits_batch", "activation_length", "activation_embed")
_LOGIT_NAMES = ("activation_embed_and_logits_batch", "activation_length", "activation_vocab")


class Embed(nnx.Module):
    """A ``[vocab, embed]`` table with logical names ``("vocab", "embed")``.

    ``scale`` multiplies the looked-up rows (not the tied output head, ``attend``), the constant first cast to the
    compute dtype (a scaled embedding, e.g. ``sqrt(embed)``; in bfloat16 the factor itself rounds, as in the
    PyTorch models that store it as a buffer of the weights' dtype).

    >>> emb = Embed(1000, 64, rngs=nnx.Rngs(0))
    >>> emb(jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 64)
    >>> Embed(1000, 64, scale=64**0.5, rngs=nnx.Rngs(0))      # rows times 8.0
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        embedding_init: nnx.initializers.Initializer = DEFAULT_INIT,
        scale: float | None = None,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        self.scale = None if scale is None else float(scale)
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype),
            out_sharding=("vocab", "embed"),
            eager_sharding=False,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Rows of the table for ``ids [..., batch, seq]`` (leading dims, e.g. one per MTP depth, stay whole):
        ``[..., batch, seq, embed]``."""
        table = self.embedding[...]
        out_shape = ids.shape + table.shape[1:]
        names = _leading(ids.ndim - 2) + _OUT_NAMES
        vocab_axes, embed_axes = _table_axes(table)
        if (embed_axes and not vocab_axes) or (vocab_axes and _inside_manual_region()):
            rows = _lookup_then_move(table, ids, embed_axes, vocab_axes)
            return shard(self._scaled(rows.astype(self.dtype)), names)
        # A gather from a (possibly vocab-sharded) table must be told its output layout under Explicit axes.
        rows = table.at[ids].get(out_sharding=explicit_spec(names, out_shape), mode="clip")
        return shard(self._scaled(rows.astype(self.dtype)), names)

    def _scaled(self, rows: jax.Array) -> jax.Array:
        return rows if self.scale is None else rows * jnp.asarray(self.scale, rows.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the table (tied output head): ``x [..., batch, seq, embed] @ embedding.T``."""
        table = self.embedding[...].astype(self.dtype)
        lead = "mn"[: x.ndim - 3]
        names = _leading(x.ndim - 3) + _LOGIT_NAMES
        return shard(weight_einsum(f"{lead}bse,ve->{lead}bsv", x.astype(self.dtype), table, names,
                                   weight_names=("vocab", "embed")), names)


def _leading(count: int) -> tuple[None, ...]:
    return (None,) * count


def _table_axes(table: jax.Array) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes splitting the table's vocab and embed dims (from its type under Explicit axes, from the rules
    under Auto); none without a mesh."""
    mesh = ambient_mesh_or_none()
    if mesh is None or mesh.size == 1:
        return (), ()
    spec = (jax.typeof(table).sharding.spec if shard_mode_of(mesh) == "explicit"
            else logical_to_mesh_axes(("vocab", "embed"), current_rules(), mesh))
    entries = list(spec) + [None] * (2 - len(spec))
    return tuple(axes_tuple(e) for e in entries[:2])



def _inside_manual_region() -> bool:
    """Whether this runs inside a ``shard_map`` over some mesh axes (a pipeline's over ``stage``) with others left
    to the partitioner."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and bool(mesh.manual_axes)


def _lookup_then_move(table: jax.Array, ids: jax.Array, embed_axes: tuple[str, ...],
                      vocab_axes: tuple[str, ...] = ()) -> jax.Array:
    """Rows of a table split along its width (``embed_axes``), and along its vocabulary (``vocab_axes``) only
    inside a manual region: every device looks up every token's slice of the width (the ids, a small integer
    array, are gathered), then the output's batch and sequence dims take their mesh axes one dim at a time (an
    all-to-all each). Asked for the final layout at once, XLA replicated the whole output to re-split it over two
    dims ("Involuntary full rematerialization" under ep-as-cp); gathering the table instead would move the whole
    vocabulary."""
    ids = shard_to_spec(ids, PartitionSpec())
    lead = ids.ndim - 2
    current = [()] * (lead + 2) + [embed_axes]
    width_split = PartitionSpec(*_leading(lead + 2), embed_axes or None)
    if vocab_axes:
        rows = _vocab_parallel_rows(table, ids, vocab_axes, embed_axes)
    else:
        explicit = shard_mode_of(jax.sharding.get_abstract_mesh()) == "explicit"
        rows = table.at[ids].get(out_sharding=width_split if explicit else None, mode="clip")
    rows = shard_to_spec(rows, width_split)
    target = resolve_activation(_leading(lead) + _OUT_NAMES, rows.shape)
    target = [axes_tuple(e) for e in list(target) + [None] * (rows.ndim - len(target))]
    for dim in (lead, lead + 1):
        if target[dim] != current[dim]:
            current[dim] = target[dim]
            current[-1] = tuple(a for a in current[-1] if a not in target[dim])
            rows = shard_to_spec(rows, PartitionSpec(*(c or None for c in current)))
    return rows


def _vocab_parallel_rows(table: jax.Array, ids: jax.Array, vocab_axes: tuple[str, ...],
                         embed_axes: tuple[str, ...]) -> jax.Array:
    """``table[ids]`` (ids clipped into the vocabulary) for a table split over ``vocab_axes`` (and its width over
    ``embed_axes``), computed per shard: each shard looks up the ids in its block of rows, zeros the others, and
    the blocks are summed over ``vocab_axes``; ``[*ids.shape, embed]``, the width split over ``embed_axes``. Its
    gradient is each shard's scatter-add into its own block (no communication).

    Used inside a pipeline's ``shard_map`` over ``stage``, where XLA's SPMD partitioner (jax 0.10.2, XLA:CPU)
    aborts partitioning the gather (and its transpose, a scatter) of a vocab-sharded table ("Check failed:
    partition_group_list.num_replica_groups() * ... == device_groups.num_devices_per_group()" in
    ``ExpandDeviceGroupsWithIota``): here no partitioner sees a gather. The same masked lookup and sum as the
    partitioner's own plan for it. A ``custom_vjp``: differentiating the nested ``shard_map`` itself makes JAX
    name its residuals with the outer ``stage`` axis, which Shardy rejects."""
    mesh = jax.sharding.get_abstract_mesh()
    block = table.shape[0] // math.prod(mesh.shape[a] for a in vocab_axes)
    ids = jnp.clip(ids, 0, table.shape[0] - 1)  # the gather's mode="clip"
    width = embed_axes or None
    table_spec, rows_spec = PartitionSpec(vocab_axes, width), PartitionSpec(*_leading(ids.ndim), width)

    def on_shards(f: Callable[..., jax.Array], in_specs: tuple, out_specs: PartitionSpec) -> Callable[..., jax.Array]:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(vocab_axes) | set(embed_axes))

    def mine(ids: jax.Array) -> tuple[jax.Array, jax.Array]:  # (row in this shard's block, whether it is there)
        offset = ids - jax.lax.axis_index(vocab_axes) * block
        inside = (offset >= 0) & (offset < block)
        return jnp.where(inside, offset, 0), inside[..., None]

    def gather(part: jax.Array, ids: jax.Array) -> jax.Array:
        rows, inside = mine(ids)
        found = part.at[rows].get(mode="promise_in_bounds")
        return jax.lax.psum(jnp.where(inside, found, jnp.zeros((), found.dtype)), vocab_axes)

    def scatter(grad: jax.Array, ids: jax.Array) -> jax.Array:
        rows, inside = mine(ids)
        zero = jnp.zeros((block, grad.shape[-1]), grad.dtype)
        return zero.at[rows].add(jnp.where(inside, grad, jnp.zeros((), grad.dtype)), mode="promise_in_bounds")

    @jax.custom_vjp
    def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
        return on_shards(gather, (table_spec, PartitionSpec()), rows_spec)(table, ids)

    def forward(table: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lookup(table, ids), ids

    def backward(ids: jax.Array, grad: jax.Array) -> tuple[jax.Array, None]:
        return on_shards(scatter, (rows_spec, PartitionSpec()), table_spec)(grad, ids), None

    lookup.defvjp(forward, backward)
    return lookup(table, ids)
