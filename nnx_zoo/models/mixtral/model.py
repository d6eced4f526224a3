"""Mixtral: the shared dense core with a sparse MoE MLP in every layer (``nnx_zoo.models.moe_causal_lm``),
Mixtral's config and key table. Routing is softmax top-k, always renormalised (``nnx_zoo.layers.routers``)."""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.mixtral import hf
from nnx_zoo.models.mixtral.config import MixtralConfig
from nnx_zoo.models.moe_causal_lm import MoECausalLM


class Mixtral(MoECausalLM):
    """Mixtral causal language model (exact against HF ``MixtralForCausalLM``).

    >>> config = MixtralConfig.preset("mixtral-tiny", moe_impl="ep")
    >>> model = Mixtral.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or Mixtral(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                              # [2, 16, vocab]
    >>> model = Mixtral.from_pretrained("/path/to/Mixtral-8x7B-v0.1", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                          # loadable by transformers
    """

    config_class: ClassVar[type[MixtralConfig]] = MixtralConfig
    key_table = staticmethod(hf.key_table)
