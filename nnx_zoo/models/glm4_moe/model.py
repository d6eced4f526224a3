"""GLM-4.5: the shared dense core with sparse MoE MLPs (``nnx_zoo.models.moe_causal_lm``), GLM-4.5's config and
key table. Attention ropes each head's first half (partial rotary), routing is sigmoid + selection bias with
shared experts (``nnx_zoo.layers.routers``)."""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.glm4_moe import hf
from nnx_zoo.models.glm4_moe.config import Glm4MoEConfig
from nnx_zoo.models.moe_causal_lm import MoECausalLM


class Glm4MoE(MoECausalLM):
    """GLM-4.5 causal language model (exact against HF ``Glm4MoeForCausalLM``).

    >>> config = Glm4MoEConfig.preset("glm4.5-tiny", moe_impl="ep")
    >>> model = Glm4MoE.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or Glm4MoE(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                              # [2, 16, vocab]
    >>> model = Glm4MoE.from_pretrained("/path/to/GLM-4.5-Air", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                          # loadable by transformers
    """

    config_class: ClassVar[type[Glm4MoEConfig]] = Glm4MoEConfig
    key_table = staticmethod(hf.key_table)
