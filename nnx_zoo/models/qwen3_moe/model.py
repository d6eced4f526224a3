"""Qwen3-MoE: the shared dense core with sparse MoE MLPs (``nnx_zoo.models.moe_causal_lm``), Qwen3-MoE's config
and key table. Routing is softmax top-k (``nnx_zoo.layers.routers``), renormalised with ``norm_topk_prob``."""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.moe_causal_lm import MoECausalLM
from nnx_zoo.models.qwen3_moe import hf
from nnx_zoo.models.qwen3_moe.config import Qwen3MoEConfig


class Qwen3MoE(MoECausalLM):
    """Qwen3-MoE causal language model (exact against HF ``Qwen3MoeForCausalLM``).

    >>> config = Qwen3MoEConfig.preset("qwen3-moe-tiny", moe_impl="gmm")
    >>> model = Qwen3MoE.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or Qwen3MoE(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                               # [2, 16, vocab]
    >>> model = Qwen3MoE.from_pretrained("/path/to/Qwen3-30B-A3B", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                           # loadable by transformers
    """

    config_class: ClassVar[type[Qwen3MoEConfig]] = Qwen3MoEConfig
    key_table = staticmethod(hf.key_table)
