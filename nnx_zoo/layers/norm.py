"""RMSNorm (and its weightless form, ``L2Norm``), computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.sharding.constrain import shard_to_spec

# In the rows whose mean square overflows, the squares sum past 2**128 and none exceeds 2**256. Scaled by 2**-96,
# their mean square lies in [2**-64 / n, 2**64]: its sum cannot overflow, and rsqrt's derivative (mean square to
# the power -1.5) stays a normal float32 for any realistic n instead of flushing to 0.
_RESCALE = 2.0**-96


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x**2) + eps)`` over the last dim without a scale (an unweighted RMSNorm), statistics in
    float32, returned in ``x``'s dtype.

    >>> rms_normalize(jnp.array([1.0, 2.0, 3.0]), 1e-6)
    Array([0.46291, 0.92582, 1.38873], dtype=float32)
    """
    xf = x.astype(jnp.float32)
    # The factor is cast to x's dtype before it multiplies x (as transformers' DeepSeek-V4 does).
    return x * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps).astype(x.dtype)


class RMSNorm(nnx.Module):
    """``scale * x / sqrt(mean(x**2) + eps)``; the statistics are float32 whatever the input dtype.

    The normalized value is cast back to the input dtype before the scale multiplies it (as Hugging Face does),
    and the result is returned in ``dtype``. Rows whose mean square overflows float32 (|x| beyond ~1.8e19) are
    rescaled by an exact power of two first, so they still norm to a finite, unit-RMS value with finite gradients.

    ``axes`` trailing dims share one statistic (default 1: the last dim). With ``axes=2`` on ``[..., heads,
    head_dim]`` the norm runs over all heads at once, as a norm over a whole projection's output before it is split
    into heads; the scale is stored flat, ``[dim]`` with ``dim = heads * head_dim`` (the checkpoint's layout), and
    viewed as those dims.

    >>> norm = RMSNorm(64, rngs=nnx.Rngs(0))
    >>> norm(jnp.ones((2, 8, 64))).shape
    (2, 8, 64)
    >>> RMSNorm(4 * 16, axes=2)(jnp.ones((2, 8, 4, 16))).shape     # one statistic over 4 heads of 16
    (2, 8, 4, 16)
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        axes: int = 1,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs  # ones-initialized; accepted so every layer is built the same way
        if not (isinstance(axes, int) and axes >= 1):
            raise ValueError(f"axes must be a positive integer (trailing dims one statistic spans), got {axes!r}")
        self.eps = float(eps)
        self.axes = axes
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        dims = tuple(range(-self.axes, 0))
        xf = x.astype(jnp.float32)
        # Where |x| is past ~1.8e19 (the root of float32's max), x * x overflows: the mean square is inf and
        # rsqrt(inf) = 0 makes the output, and every gradient through it, silently 0, until the backward's
        # sum(grad * x) overflows too and 0 * inf gives NaN. The norm itself is finite and scale-invariant, so such
        # rows are normed from x * 2**-96 (exact; eps * 2**-192 is 0 next to their mean square). The factor is a
        # constant to differentiation (the result does not depend on it), and 1 in every other row, which are
        # computed bit for bit as before (and as Hugging Face does).
        overflow = jnp.isinf(jnp.mean(xf * xf, axis=dims, keepdims=True))
        factor = jnp.where(overflow, _RESCALE, 1.0)
        xf = xf * factor
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=dims, keepdims=True) + self.eps * factor * factor)
        scale = self.scale[...]
        if self.axes > 1:
            # Kept replicated, as the flat scale is ('norm'): its [heads, head_dim] view beside heads split over
            # devices would otherwise lead XLA to split it, its gradient and its Adam moments the same way.
            scale = shard_to_spec(scale.reshape(x.shape[-self.axes:]), PartitionSpec())
        return scale.astype(self.dtype) * normed.astype(x.dtype).astype(self.dtype)


class L2Norm(nnx.Module):
    """``x / sqrt(mean(x**2) + eps)`` over the last dim, with no weight (an RMSNorm without its scale; transformers
    calls it an L2 norm, e.g. Llama 4's query/key norm). Statistics and product in float32, returned in ``x``'s
    dtype. A module so it can stand where an ``RMSNorm`` stands (``Attention.q_norm`` / ``k_norm``).

    >>> L2Norm(eps=1e-5)(jnp.array([3.0, 4.0]))  # rms 3.54
    Array([0.8485, 1.1314], dtype=float32)
    """

    def __init__(self, *, eps: float = 1e-6, rngs: nnx.Rngs | None = None):
        del rngs  # no parameters; accepted so every norm is built the same way
        self.eps = float(eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """``scale * (x - mean) / sqrt(var + eps) + bias`` over the last dim, statistics in float32 (PyTorch's
    ``nn.LayerNorm``, which DeepSeek-V3.2's indexer uses on its keys). Returned in ``dtype``.

    >>> norm = LayerNorm(32, rngs=nnx.Rngs(0))
    >>> norm(jnp.ones((2, 8, 32))).shape
    (2, 8, 32)
    """

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32, names: tuple[str] = ("norm",), rngs: nnx.Rngs | None = None):
        del rngs  # ones / zeros initialized
        self.eps = float(eps)
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=names, eager_sharding=False)
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), out_sharding=names, eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        normed = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim in float32 (the linear-attention layers' q/k normalization,
    as the FLA kernels and transformers compute it), returned in ``x``'s dtype.

    >>> l2_normalize(jnp.array([3.0, 4.0]))
    Array([0.6, 0.8], dtype=float32)
    """
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """``scale * rms_normalize(x) * act(gate)``: a linear-attention layer's output norm, gated by another projection
    of the layer's input (Gated DeltaNet's, with SiLU). The normalized value is cast to ``x``'s dtype before the
    scale multiplies it and the gate is applied in float32, as transformers does.

    >>> norm = GatedRMSNorm(64, rngs=nnx.Rngs(0))
    >>> norm(jnp.ones((2, 8, 4, 64)), jnp.ones((2, 8, 4, 64))).shape
    (2, 8, 4, 64)
    """

    ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}

    def __init__(self, dim: int, *, eps: float = 1e-6, activation: str = "silu", dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        del rngs  # ones-initialized
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(self.ACTIVATIONS)}")
        self.eps, self.activation, self.dtype = float(eps), activation, dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        out = self.scale[...].astype(jnp.float32) * normed.astype(jnp.float32)
        return (out * self.ACTIVATIONS[self.activation](gate.astype(jnp.float32))).astype(self.dtype)
