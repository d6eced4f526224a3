"""Mistral 4: DeepSeek-V3's model (``nnx_zoo.models.deepseek``: MLA, the MoE block, the HF key table) built from a
``Mistral4Config``, whose router (softmax limited to groups scored by their two best) and position-dependent query
scale (``Mistral4Config.query_scale``) are the differences."""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.deepseek.model import DeepSeekV3
from nnx_zoo.models.mistral4.config import Mistral4Config


class Mistral4(DeepSeekV3):
    """Mistral 4 causal language model (exact against HF ``Mistral4ForCausalLM``).

    >>> config = Mistral4Config.preset("mistral4-tiny")
    >>> model = Mistral4.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or Mistral4(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                              # [2, 16, vocab]
    >>> model = Mistral4.from_pretrained("/path/to/checkpoint", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                          # loadable by transformers
    """

    config_class: ClassVar[type[Mistral4Config]] = Mistral4Config
