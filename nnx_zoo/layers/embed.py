"""Token embedding table: lookup, and use as a tied output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.linear import DEFAULT_INIT
from nnx_zoo.layers.spec import explicit_spec, weight_einsum
from nnx_zoo.sharding import shard

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
        # A gather from a (possibly vocab-sharded) table must be told its output layout under Explicit axes.
        rows = table.at[ids].get(out_sharding=explicit_spec(_OUT_NAMES, out_shape), mode="clip")
        return shard(rows.astype(self.dtype), _OUT_NAMES)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the table (tied output head): ``x [batch, seq, embed] @ embedding.T``."""
        table = self.embedding[...].astype(self.dtype)
        return shard(weight_einsum("bse,ve->bsv", x.astype(self.dtype), table, _LOGIT_NAMES), _LOGIT_NAMES)
