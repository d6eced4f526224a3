"""GLM-5: DeepSeek-V3.2's model (``nnx_zoo.models.deepseek``: MLA, the lightning indexer, the MoE block, the HF key
table) built from a ``Glm5Config``. What differs is config: the indexer's rope layout, layers reusing the previous
full layer's top-k (their own stacks, no indexer), the per-layer MLP kinds."""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.deepseek.model import DeepSeekV3
from nnx_zoo.models.glm5.config import Glm5Config


class Glm5(DeepSeekV3):
    """GLM-5 causal language model (exact against HF ``GlmMoeDsaForCausalLM``).

    >>> config = Glm5Config.preset("glm5-tiny", num_hidden_layers=2)   # layer 1 reuses layer 0's top-k
    >>> model = Glm5.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or Glm5(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 64), jnp.int32))                          # [2, 64, vocab]
    >>> model = Glm5.from_pretrained("/path/to/GLM-5", dtype="bfloat16")      # FP8 weights dequantized
    >>> model.save_pretrained("/tmp/out")                                      # loadable by transformers
    """

    config_class: ClassVar[type[Glm5Config]] = Glm5Config
