"""Qwen3 (dense): the shared dense decoder (``nnx_zoo.models.causal_lm``) with Qwen3's config and key table.

What differs from Llama is configuration, not code: queries and keys are RMS-normalized per head before rope
(``Qwen3Config.QK_NORM`` switches on ``Attention(qk_norm=True)``), and ``head_dim`` is set on its own.
"""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.causal_lm import CausalLM
from nnx_zoo.models.qwen3 import hf
from nnx_zoo.models.qwen3.config import Qwen3Config


class Qwen3(CausalLM):
    """Qwen3 causal language model (exact against HF ``Qwen3ForCausalLM``).

    >>> config = Qwen3Config.preset("qwen3-tiny")
    >>> model = Qwen3.create(config, mesh=make_mesh({"fsdp": 4, "tensor": 2}))   # or Qwen3(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                            # [2, 16, vocab]
    >>> model = Qwen3.from_pretrained("/path/to/Qwen3-0.6B", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                        # loadable by transformers
    """

    config_class: ClassVar[type[Qwen3Config]] = Qwen3Config
    key_table = staticmethod(hf.key_table)
