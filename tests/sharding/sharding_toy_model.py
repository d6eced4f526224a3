"""Small NNX models annotated with the logical names a DeepSeek-like model uses (shared by the sharding tests).

``ToyModel`` fills its weights with a cheap deterministic function of a seed (iotas: the jitted init compiles in a
fraction of a second, so every rule set x mesh x mode can be created). ``RandomToyModel`` draws from ``nnx.Rngs``
(threefry, slow to compile on CPU) for the same-seed check. Every dimension divides over every 8-device mesh the
tests use, under every named rule set.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, EMBED, HEADS, KV, MLP, EXPERTS, MOE_MLP, LAYERS = 64, 32, 8, 16, 48, 8, 24, 2


def _values(shape: tuple[int, ...], salt: jax.Array | float) -> jax.Array:
    """A distinct value per element (its flat index, exact in float32, plus a salt) from broadcasted iotas: cheap
    to compile, and the same jitted or eager (no transcendental functions, whose versions differ)."""
    index = sum(
        jax.lax.broadcasted_iota(jnp.float32, shape, dim) * float(math.prod(shape[dim + 1 :]))
        for dim in range(len(shape))
    )
    return index * 1e-3 + salt


def _param(value: jax.Array, names: tuple[str, ...], *, eager_default: bool = False) -> nnx.Param:
    if eager_default:  # Flax's default: eager_sharding follows nnx.use_eager_sharding (True unless switched off)
        return nnx.Param(value, out_sharding=names)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class MoEBlock(nnx.Module):
    """One stacked layer: routed experts, router and a norm."""

    def __init__(self, salt: jax.Array):
        self.wi = _param(_values((EXPERTS, EMBED, MOE_MLP), salt + 0.1), ("exp", "embed_no_exp", "moe_mlp"))
        self.wo = _param(_values((EXPERTS, MOE_MLP, EMBED), salt + 0.2), ("exp", "moe_mlp", "embed_no_exp"))
        self.router = _param(_values((EMBED, EXPERTS), salt + 0.3), ("embed", "exp_router"))
        self.norm = _param(jnp.ones((EMBED,)) + salt, ("norm",))


class ToyModel(nnx.Module):
    def __init__(self, seed: int = 0):
        s = float(seed)
        # The one Variable left on Flax's default eager sharding: create_sharded must still decide its placement.
        self.embedding = _param(_values((VOCAB, EMBED), s + 1.0), ("vocab", "embed"), eager_default=True)
        self.wq = _param(_values((EMBED, HEADS, KV), s + 2.0), ("embed", "heads", "kv"))
        self.wo = _param(_values((HEADS, KV, EMBED), s + 3.0), ("heads", "kv", "embed"))
        self.mlp_in = _param(_values((EMBED, MLP), s + 4.0), ("embed", "mlp"))
        self.mlp_out = _param(_values((MLP, EMBED), s + 5.0), ("mlp", "embed"))
        self.final_norm = _param(jnp.ones((EMBED,)), ("norm",))
        # An nnx.vmap-stacked sub-block: the stack axis gets the logical name 'moe_layers'.
        stack = nnx.vmap(MoEBlock, in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "moe_layers"})
        self.layers = stack(s + 10.0 * jnp.arange(1, LAYERS + 1, dtype=jnp.float32))


# dotted path -> (shape, logical names) that ToyModel exposes
EXPECTED = {
    "embedding": ((VOCAB, EMBED), ("vocab", "embed")),
    "final_norm": ((EMBED,), ("norm",)),
    "layers.norm": ((LAYERS, EMBED), ("moe_layers", "norm")),
    "layers.router": ((LAYERS, EMBED, EXPERTS), ("moe_layers", "embed", "exp_router")),
    "layers.wi": ((LAYERS, EXPERTS, EMBED, MOE_MLP), ("moe_layers", "exp", "embed_no_exp", "moe_mlp")),
    "layers.wo": ((LAYERS, EXPERTS, MOE_MLP, EMBED), ("moe_layers", "exp", "moe_mlp", "embed_no_exp")),
    "mlp_in": ((EMBED, MLP), ("embed", "mlp")),
    "mlp_out": ((MLP, EMBED), ("mlp", "embed")),
    "wo": ((HEADS, KV, EMBED), ("heads", "kv", "embed")),
    "wq": ((EMBED, HEADS, KV), ("embed", "heads", "kv")),
}


class RandomBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.wi = nnx.Param(
            init(rngs.params(), (EXPERTS, EMBED, MOE_MLP)),
            out_sharding=("exp", "embed_no_exp", "moe_mlp"),
            eager_sharding=False,
        )


class RandomToyModel(nnx.Module):
    """Initialized from ``nnx.Rngs``: same seed, same values, whether created sharded or not."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embedding = nnx.Param(init(rngs.params(), (VOCAB, EMBED)), out_sharding=("vocab", "embed"))

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "moe_layers"})
        def stack(rngs: nnx.Rngs) -> RandomBlock:
            return RandomBlock(rngs)

        self.layers = stack(rngs)
