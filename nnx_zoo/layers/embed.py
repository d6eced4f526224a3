"""Token embedding table: lookup, and use as a tied output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.linear import DEFAULT_INIT
from nnx_zoo.layers.spec import ambient_mesh_or_none, explicit_spec, resolve_activation, weight_einsum
from nnx_zoo.sharding import current_rules, logical_to_mesh_axes, shard, shard_mode_of
from nnx_zoo.sharding.constrain import shard_to_spec

_OUT_NAMES = ("activation_batch", "activation_length", "activation_embed")
_LOGIT_NAMES = ("activation_batch", "activation_length", "activation_vocab")


class Embed(nnx.Module):
    """A ``[vocab, embed]`` table with logical names ``("vocab", "embed")``.

    >>> emb = Embed(1000, 64, rngs=nnx.Rngs(0))
    >>> emb(jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 64)
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        embedding_init: nnx.initializers.Initializer = DEFAULT_INIT,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype),
            out_sharding=("vocab", "embed"),
            eager_sharding=False,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        table = self.embedding[...]
        out_shape = ids.shape + table.shape[1:]
        vocab_axes, embed_axes = _table_axes(table)
        if embed_axes and not vocab_axes:
            return shard(_lookup_then_move(table, ids, embed_axes).astype(self.dtype), _OUT_NAMES)
        # A gather from a (possibly vocab-sharded) table must be told its output layout under Explicit axes.
        rows = table.at[ids].get(out_sharding=explicit_spec(_OUT_NAMES, out_shape), mode="clip")
        return shard(rows.astype(self.dtype), _OUT_NAMES)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the table (tied output head): ``x [batch, seq, embed] @ embedding.T``."""
        table = self.embedding[...].astype(self.dtype)
        return shard(weight_einsum("bse,ve->bsv", x.astype(self.dtype), table, _LOGIT_NAMES,
                                   weight_names=("vocab", "embed")), _LOGIT_NAMES)


def _table_axes(table: jax.Array) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes splitting the table's vocab and embed dims (from its type under Explicit axes, from the rules
    under Auto); none without a mesh."""
    mesh = ambient_mesh_or_none()
    if mesh is None or mesh.size == 1:
        return (), ()
    spec = (jax.typeof(table).sharding.spec if shard_mode_of(mesh) == "explicit"
            else logical_to_mesh_axes(("vocab", "embed"), current_rules(), mesh))
    entries = list(spec) + [None] * (2 - len(spec))
    return tuple(_axes(e) for e in entries[:2])


def _axes(entry: object) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _lookup_then_move(table: jax.Array, ids: jax.Array, embed_axes: tuple[str, ...]) -> jax.Array:
    """Rows of a table split only along its width: every device looks up every token's slice of the width (the
    ids, a small integer array, are gathered), then the output's batch and sequence dims take their mesh axes one
    dim at a time (an all-to-all each). Asked for the final layout at once, XLA replicated the whole output to
    re-split it over two dims ("Involuntary full rematerialization" under ep-as-cp); gathering the table instead
    would move the whole vocabulary."""
    ids = shard_to_spec(ids, PartitionSpec())
    current = [(), (), embed_axes]
    width_split = PartitionSpec(None, None, embed_axes)
    explicit = shard_mode_of(jax.sharding.get_abstract_mesh()) == "explicit"
    rows = shard_to_spec(table.at[ids].get(out_sharding=width_split if explicit else None, mode="clip"), width_split)
    target = resolve_activation(_OUT_NAMES, rows.shape)
    target = [_axes(e) for e in list(target) + [None] * (3 - len(target))]
    for dim in (0, 1):
        if target[dim] != current[dim]:
            current[dim] = target[dim]
            current[2] = tuple(a for a in current[2] if a not in target[dim])
            rows = shard_to_spec(rows, PartitionSpec(*(c or None for c in current)))
    return rows
