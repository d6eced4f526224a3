"""The gated feed-forward block (``SwiGLU``), and its activation (``Glu``: SiLU or tanh-approximated GELU on the
gate, plain or with clamped pre-activations, a sigmoid gain and a shifted up projection)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.linear import DEFAULT_INIT, Linear

_HIDDEN = ("activation_batch", "activation_length", "activation_mlp")
_OUT = ("activation_batch", "activation_length", "activation_embed")


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation, ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` (PyTorch's
    ``gelu(approximate="tanh")``, HF's ``gelu_pytorch_tanh``)."""
    return jax.nn.gelu(x, approximate=True)


# Gate activations by name (HF ``hidden_act`` / ``hidden_activation`` values map onto these).
GATE_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {"silu": jax.nn.silu, "gelu_tanh": gelu_tanh}


@dataclasses.dataclass(frozen=True)
class Glu:
    """The gated activation ``act(gate) * up`` of a gated MLP: ``act`` is ``silu`` (a SwiGLU) or ``gelu_tanh``
    (a GeGLU with tanh-approximated GELU), by name (``GATE_ACTIVATIONS``); with optional clamping (``limit``):
    the gate's pre-activation is capped at ``limit`` and the up projection's clipped to ``[-limit, limit]``
    (DeepSeek-V4's ``swiglu_limit``). ``alpha`` is a SiLU gate's sigmoid gain, ``gate * sigmoid(alpha * gate)``
    (1: silu), and ``up_offset`` is added to the (clipped) up projection. Frozen and hashable: modules keep it as a
    static attribute.

    >>> Glu()(gate, up)                        # silu(gate) * up
    >>> Glu(limit=10.0)(gate, up)              # silu(min(gate, 10)) * clip(up, -10, 10)
    >>> Glu(7.0, 1.702, 1.0)(gate, up)         # g * sigmoid(1.702 g) * (clip(up, -7, 7) + 1), g = min(gate, 7)
    >>> Glu(activation="gelu_tanh")(gate, up)  # gelu_tanh(gate) * up
    """

    limit: float | None = None
    alpha: float = 1.0
    up_offset: float = 0.0
    activation: str = "silu"

    def __post_init__(self) -> None:
        if self.activation not in GATE_ACTIVATIONS:
            raise ValueError(f"unknown gate activation {self.activation!r}; choose one of {sorted(GATE_ACTIVATIONS)}")
        if self.alpha != 1.0 and self.activation != "silu":
            raise ValueError(f"alpha={self.alpha} is a SiLU gate's sigmoid gain; activation {self.activation!r} "
                             "has none (leave alpha at 1.0)")

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.limit is not None:
            gate = jnp.minimum(gate, jnp.asarray(self.limit, gate.dtype))
            up = jnp.clip(up, -jnp.asarray(self.limit, up.dtype), jnp.asarray(self.limit, up.dtype))
        if self.up_offset:  # Python constants: the defaults trace nothing beyond act(gate) * up
            up = up + jnp.asarray(self.up_offset, up.dtype)
        if self.alpha != 1.0:
            return gate * jax.nn.sigmoid(jnp.asarray(self.alpha, gate.dtype) * gate) * up
        return GATE_ACTIVATIONS[self.activation](gate) * up


PLAIN = Glu()  # silu(gate) * up, unclamped


class SwiGLU(nnx.Module):
    """``down(act(gate(x), up(x)))`` with weights named ``("embed", "mlp")`` / ``("mlp", "embed")``; ``act`` is
    ``Glu(limit, activation=activation)``: ``silu(gate) * up`` (or ``gelu_tanh(gate) * up`` with
    ``activation="gelu_tanh"``: a GeGLU), with the pre-activations clamped when ``limit`` is set.

    >>> mlp = SwiGLU(64, 256, rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((2, 8, 64))).shape
    (2, 8, 64)
    """

    def __init__(
        self,
        features: int,
        hidden: int,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: nnx.initializers.Initializer = DEFAULT_INIT,
        limit: float | None = None,
        activation: str = "silu",
        rngs: nnx.Rngs,
    ):
        self.act = Glu(limit, activation=activation)
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.gate = Linear(features, hidden, kernel_names=("embed", "mlp"), **kw)
        self.up = Linear(features, hidden, kernel_names=("embed", "mlp"), **kw)
        self.down = Linear(hidden, features, kernel_names=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = self.act(self.gate(x, _HIDDEN), self.up(x, _HIDDEN))
        return self.down(hidden, _OUT)
