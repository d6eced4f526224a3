"""Llama 4's text model: the shared dense core with sparse MoE MLPs (``nnx_zoo.models.moe_causal_lm``), its layers
in four kinds (rope or NoPE, dense or MoE; ``Llama4LayerKind``), each kind a stack run in model order as periodic
scan segments (Scout's three chunked rope layers and a NoPE one: one scan of four-layer steps).

What is Llama 4's own here: ``Llama4Attention`` (the shared ``Attention`` with pair rope or none, chunks, the
weightless L2 query/key norm on rope layers, and the NoPE layers' temperature tuning), dense layers of width
``intermediate_size_mlp``. The MoE block is the shared ``SparseMoE`` with the ``"sigmoid"`` router scaling each
chosen expert's input (``scale_inputs``) and one shared expert.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.attention import Attention, AttentionMask
from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.norm import L2Norm
from nnx_zoo.models.causal_lm import DecoderLayer, _dtypes
from nnx_zoo.models.llama4 import hf
from nnx_zoo.models.llama4.config import Llama4Config
from nnx_zoo.models.moe_causal_lm import MoECausalLM, MoEDecoderLayer


def temperature_scale(slots: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
    """Llama 4's NoPE query scale at cache ``slots``: ``1 + attn_scale * log1p(floor((slot + 1) / floor_scale))``
    (float32; 1 until slot ``floor_scale - 1``, then growing with the log of the position).

    >>> temperature_scale(jnp.array([0, 1, 3]), 2, 0.1)
    Array([1.       , 1.0693147, 1.1098612], dtype=float32)
    """
    return 1.0 + attn_scale * jnp.log1p(jnp.floor((slots.astype(jnp.float32) + 1.0) / floor_scale))


class Llama4Attention(Attention):
    """``Attention`` with Llama 4's extras: ``l2_qk_norm`` (the weightless ``L2Norm`` on each query and key head,
    eps ``norm_eps``; transformers applies it after rope, here before: rope is a rotation, it keeps each head's RMS)
    and ``temperature=(floor_scale, attn_scale)`` (queries times ``temperature_scale`` of their slot; a NoPE layer's).

    >>> attn = Llama4Attention(64, num_heads=4, num_kv_heads=2, head_dim=16, rope=None, temperature=(4, 0.1),
    ...                        rngs=nnx.Rngs(0))
    >>> attn(jnp.ones((2, 10, 64)), None, None, causal_mask(10)).shape
    (2, 10, 64)
    """

    def __init__(self, features: int, *, l2_qk_norm: bool = False, temperature: tuple[float, float] | None = None,
                 norm_eps: float = 1e-6, **kwargs: Any):
        super().__init__(features, norm_eps=norm_eps, **kwargs)
        if l2_qk_norm:  # in place of the None the base class set (a static attribute until told it is a module)
            self.q_norm, self.k_norm = nnx.data(L2Norm(eps=norm_eps)), nnx.data(L2Norm(eps=norm_eps))
        self.temperature = None if temperature is None else tuple(float(t) for t in temperature)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask | jax.Array | None) -> jax.Array:
        """``Attention.attend`` with the queries temperature-tuned first. Their slots are ``mask.q_offset + i``:
        0.. in a forward pass, the cache length on in a decode step (a NoPE layer is a full one: its mask is the
        cache's, never a ring's)."""
        if self.temperature is not None:
            first = mask.q_offset if isinstance(mask, AttentionMask) else 0
            scale = temperature_scale(first + jnp.arange(q.shape[1]), *self.temperature)
            q = (q.astype(jnp.float32) * scale[None, :, None, None]).astype(q.dtype)
        return super().attend(q, k, v, mask)


class Llama4DenseLayer(DecoderLayer):
    """A dense Llama 4 layer: ``Llama4Attention`` and a SwiGLU of width ``intermediate_size_mlp``."""

    attention_class: ClassVar[type[Attention]] = Llama4Attention

    def _make_mlp(self, c: Llama4Config, init: nnx.initializers.Initializer, rngs: nnx.Rngs) -> nnx.Module:
        return SwiGLU(c.hidden_size, c.intermediate_size_mlp, kernel_init=init, rngs=rngs, **_dtypes(c))


class Llama4MoELayer(MoEDecoderLayer):
    """An MoE Llama 4 layer: ``Llama4Attention`` and the sparse block (sigmoid top-k scaling the expert input, a
    shared expert)."""

    attention_class: ClassVar[type[Attention]] = Llama4Attention


class Llama4(MoECausalLM):
    """Llama 4 text model (exact against HF ``Llama4ForCausalLM``; loads the text model of a multimodal ``llama4``
    checkpoint too).

    >>> config = Llama4Config.preset("llama4-tiny")
    >>> model = Llama4.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or Llama4(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                             # [2, 16, vocab]
    >>> model = Llama4.from_pretrained("/path/to/Llama-4-Scout-17B-16E", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                         # a llama4_text checkpoint
    """

    config_class: ClassVar[type[Llama4Config]] = Llama4Config
    key_table = staticmethod(hf.key_table)

    def layer_class(self, kind: Any) -> type[nnx.Module]:
        return Llama4MoELayer if kind.moe else Llama4DenseLayer

    def _layer_rope(self, kind: Any, positions: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
        """Rope tables for rope layers; none for NoPE layers."""
        return super()._layer_rope(kind, positions) if kind.rope else (None, None)
