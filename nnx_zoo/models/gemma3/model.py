"""Gemma 3 (text): the shared dense decoder (``nnx_zoo.models.causal_lm``) with Gemma's sandwich layer.

What differs from Llama, and where it lives:
- ``Gemma3DecoderLayer`` (here): four ``(1 + w)`` RMSNorms per layer, two around attention and two around the
  MLP (``x + post_norm(attn(pre_norm(x)))``), ``(1 + w)`` q/k norms, the ``query_pre_attn_scalar`` softmax scale,
  a GELU-tanh gated MLP; sliding layers attend over a window (``Attention(window=)``, a ring cache when decoding).
- ``Gemma3`` (here): the embedding scaled by ``sqrt(hidden_size)`` (``Embed(scale=)``), a ``(1 + w)`` final norm,
  a rope table per layer kind (``_layer_rope``: the local base for sliding layers, the scaled global rope for the
  others), the output logits soft-capped when ``final_logit_softcapping`` is set; the head is tied.
Everything else (stacks per kind run as periodic scan segments, the cache, checkpoint I/O) is the core's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.hf.config_io import config_json_path, read_json_object
from nnx_zoo.layers.attention import Attention, AttentionMask
from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import rope_cos_sin, rope_frequencies
from nnx_zoo.layers.softcap import soft_cap
from nnx_zoo.models.causal_lm import CausalLM, _dtypes
from nnx_zoo.models.decoder_config import FULL
from nnx_zoo.models.gemma3 import hf
from nnx_zoo.models.gemma3.config import Gemma3Config
from nnx_zoo.sharding import shard
from nnx_zoo.sharding.rules import Rules

_BLE = ("activation_batch", "activation_length", "activation_embed")


def gemma_norm(dim: int, c: Any) -> RMSNorm:
    """Gemma's RMSNorm: weight stored centred on 0 and applied as ``1 + w``, the scale multiplied in float32."""
    return RMSNorm(dim, eps=c.rms_norm_eps, offset=1.0, scale_in_float32=True, **_dtypes(c))


def warn_if_multimodal(cls: type, path: str | Path) -> None:
    """Warn that only the text model of a multimodal checkpoint (``cls.config_class.MULTIMODAL_MODEL_TYPE``) loads."""
    multimodal = cls.config_class.MULTIMODAL_MODEL_TYPE
    if read_json_object(config_json_path(path), "model config").get("model_type") == multimodal:
        warnings.warn(f"{path} is a {multimodal!r} multimodal checkpoint: loading its text model (language_model "
                      "weights, text_config); its vision (and audio) towers and projectors are not loaded "
                      f"(nnx_zoo's {cls.__name__} is the text model, and saves as one)", stacklevel=3)


class Gemma3DecoderLayer(nnx.Module):
    """Gemma 3's sandwich block: ``h = x + post_attn_norm(attn(input_norm(x)))``, then
    ``h + post_mlp_norm(mlp(pre_mlp_norm(h)))``; every norm ``(1 + w)``.

    >>> config = Gemma3Config.preset("gemma3-tiny")
    >>> layer = Gemma3DecoderLayer(config, kind=config.layer_kinds()[0], rngs=nnx.Rngs(0))   # a sliding layer
    >>> cos, sin = rope_cos_sin(jnp.arange(8)[None], rope_frequencies(32, 1e4)[0])
    >>> layer(jnp.ones((2, 8, 128)), cos, sin, causal_mask(8)).shape
    (2, 8, 128)
    """

    def __init__(self, config: Gemma3Config, *, kind: Any = FULL, rngs: nnx.Rngs):
        c = config
        init = nnx.initializers.normal(c.initializer_range)
        self.input_norm = gemma_norm(c.hidden_size, c)
        self.attn = Attention(c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                              head_dim=c.head_dim, use_bias=c.attention_bias, o_bias=c.attention_output_bias,
                              scale=c.attention_scale, attention_impl=c.attention_impl, kernel_init=init, rngs=rngs,
                              **c.attention_options(kind), **_dtypes(c))
        self.attn.q_norm = nnx.data(gemma_norm(c.head_dim, c))  # (1 + w) q/k norms in place of the plain ones
        self.attn.k_norm = nnx.data(gemma_norm(c.head_dim, c))
        self.post_attn_norm = gemma_norm(c.hidden_size, c)
        self.pre_mlp_norm = gemma_norm(c.hidden_size, c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, activation=c.gate_activation, kernel_init=init,
                          rngs=rngs, **_dtypes(c))
        self.post_mlp_norm = gemma_norm(c.hidden_size, c)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | None) -> jax.Array:
        """``x [batch, seq, embed]`` -> same shape; ``mask``: ``causal_mask``'s."""
        h = shard(x + self.post_attn_norm(self.attn(self.input_norm(x), cos, sin, mask)), _BLE)
        return self._mlp_block(h)

    def _mlp_block(self, h: jax.Array) -> jax.Array:
        return shard(h + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(h))), _BLE)

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               start: jax.Array, mask: AttentionMask) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The layer on ``t`` new tokens against its cache (``Attention.decode``; a ring for a sliding layer)."""
        attn, k_cache, v_cache = self.attn.decode(self.input_norm(x), cos, sin, k_cache, v_cache, start, mask)
        return self._mlp_block(shard(x + self.post_attn_norm(attn), _BLE)), k_cache, v_cache


class Gemma3(CausalLM):
    """Gemma 3 causal language model, the text model (exact against HF ``Gemma3ForCausalLM``, and the text part of
    ``Gemma3ForConditionalGeneration``).

    >>> config = Gemma3Config.preset("gemma3-tiny")
    >>> model = Gemma3.create(config, mesh=make_mesh({"fsdp": 8}))          # or Gemma3(config, rngs=nnx.Rngs(0))
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                       # [2, 16, vocab]
    >>> model = Gemma3.from_pretrained("/path/to/gemma-3-1b-pt", dtype="bfloat16")
    >>> model = Gemma3.from_pretrained("/path/to/gemma-3-4b-it")            # a gemma3 checkpoint: its text model
    >>> model.save_pretrained("/tmp/out")                                   # a gemma3_text checkpoint

    Parameters: ``embed.embedding`` (also the output head), ``sliding_layers.*`` and ``layers.*`` (the sliding and
    the global layers, each stacked), ``norm.scale``.
    """

    config_class: ClassVar[type[Gemma3Config]] = Gemma3Config
    key_table = staticmethod(hf.key_table)

    def __init__(self, config: Gemma3Config, *, rngs: nnx.Rngs, rules: Rules | str = "default",
                 allow_partial: bool | None = None):
        super().__init__(config, rngs=rngs, rules=rules, allow_partial=allow_partial)
        c = config
        # The core builds Llama's plain table and norm; Gemma scales the looked-up rows by sqrt(hidden_size) (not
        # the tied head) and norms with (1 + w).
        self.embed.scale = float(c.hidden_size**0.5)
        self.norm = gemma_norm(c.hidden_size, c)
        self.local_rope_inv_freq = tuple(float(f) for f in rope_frequencies(c.head_dim, c.rope_local_base_freq)[0])

    def layer_class(self, kind: Any) -> type[nnx.Module]:
        del kind
        return Gemma3DecoderLayer

    def _layer_rope(self, kind: Any, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Sliding layers: the default schedule at ``rope_local_base_freq``; global ones: ``rope_theta`` with its
        scaling (the core's table)."""
        if kind.attention == "sliding":
            return rope_cos_sin(positions, jnp.asarray(self.local_rope_inv_freq, jnp.float32))
        return self._rope(positions)

    def _logits(self, hidden: jax.Array, head: Embed | Linear | None = None) -> jax.Array:
        return soft_cap(super()._logits(hidden, head=head), self.config.final_logit_softcapping)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                        dtype: Any = None, allow_partial: bool = False, **config_overrides: Any) -> Gemma3:
        """``CausalLM.from_pretrained``; a multimodal checkpoint (``model_type`` ``gemma3``) gives its text model,
        with a warning that its vision tower and projector are left out. A config with ``attn_logit_softcapping``
        set warns that transformers' Gemma 3 ignores it (nnx_zoo applies it)."""
        warn_if_multimodal(cls, path)
        model = super().from_pretrained(path, mesh=mesh, rules=rules, dtype=dtype, allow_partial=allow_partial,
                                        **config_overrides)
        if model.config.attn_logit_softcapping is not None:
            warnings.warn(f"{path}: attn_logit_softcapping={model.config.attn_logit_softcapping} is applied here; "
                          "transformers' Gemma 3 reads it but does not apply it, so its logits differ from these",
                          stacklevel=2)
        return model


