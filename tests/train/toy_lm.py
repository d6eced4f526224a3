"""A tiny annotated language model for testing the trainer without the cost of DeepSeek."""

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.spec import explicit_spec
from nnx_zoo.sharding import shard


class ToyLM(nnx.Module):
    def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.05)
        p = lambda shape, names: nnx.Param(init(rngs.params(), shape), out_sharding=names, eager_sharding=False)  # noqa: E731
        self.embed = p((vocab, width), ("vocab", "embed"))
        self.up = p((width, 4 * width), ("embed", "mlp"))
        self.down = p((4 * width, width), ("mlp", "embed"))
        self.scale = nnx.Param(jnp.ones((width,)), out_sharding=("norm",), eager_sharding=False)
        self.head = p((width, vocab), ("embed", "vocab"))
        self.poison = nnx.Variable(jnp.zeros(()))  # set to NaN to make the loss non-finite

    def __call__(self, input_ids, attention_mask=None):
        vocab, width = self.embed.shape
        b, n = input_ids.shape
        acts = ("activation_batch", "activation_length")
        one_hot = jax.nn.one_hot(input_ids, vocab, dtype=jnp.float32)
        h = jnp.einsum("blv,vd->bld", one_hot, self.embed[...],
                       out_sharding=explicit_spec((*acts, "activation_embed"), (b, n, width)))
        up = jnp.einsum("bld,dm->blm", h, self.up[...],
                        out_sharding=explicit_spec((*acts, "activation_mlp"), (b, n, 4 * width)))
        h = h + jnp.einsum("blm,md->bld", jax.nn.gelu(up), self.down[...],
                           out_sharding=explicit_spec((*acts, "activation_embed"), (b, n, width)))
        h = shard(h * self.scale[...], (*acts, "activation_embed"))
        logits = jnp.einsum("bld,dv->blv", h, self.head[...],
                            out_sharding=explicit_spec((*acts, "activation_vocab"), (b, n, vocab)))
        return logits + self.poison[...]
