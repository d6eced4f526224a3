"""Llama 3.x: the shared dense decoder (``nnx_zoo.models.causal_lm``) with Llama's config and key table.

Everything a Llama layer does (RMSNorm, grouped-query attention with rotate-half rope under the llama3 schedule,
SwiGLU) is the shared ``DecoderLayer``; read ``CausalLM.__call__`` from the top.
"""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.causal_lm import CausalLM
from nnx_zoo.models.llama import hf
from nnx_zoo.models.llama.config import Llama3Config


class Llama3(CausalLM):
    """Llama 3.x causal language model (exact against HF ``LlamaForCausalLM``).

    >>> config = Llama3Config.preset("llama3-tiny")
    >>> model = Llama3.create(config, mesh=make_mesh({"fsdp": 8}))        # or Llama3(config, rngs=nnx.Rngs(0))
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                     # [2, 16, vocab]
    >>> model = Llama3.from_pretrained("/path/to/Llama-3.2-1B", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                 # loadable by transformers
    """

    config_class: ClassVar[type[Llama3Config]] = Llama3Config
    key_table = staticmethod(hf.key_table)
