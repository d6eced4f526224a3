"""MiniMax-M2: the shared dense core with sparse MoE MLPs (``nnx_zoo.models.moe_causal_lm``), MiniMax-M2's config
and key table. Attention norms queries and keys over the whole projection and ropes each head's first
``rotary_dim`` dims; every layer routes by sigmoid scores with a selection-only bias (``nnx_zoo.layers.routers``)."""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.minimax_m2 import hf
from nnx_zoo.models.minimax_m2.config import MiniMaxM2Config
from nnx_zoo.models.moe_causal_lm import MoECausalLM


class MiniMaxM2(MoECausalLM):
    """MiniMax-M2 causal language model (exact against HF ``MiniMaxM2ForCausalLM``).

    >>> config = MiniMaxM2Config.preset("minimax-m2-tiny", moe_impl="ep")
    >>> model = MiniMaxM2.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or MiniMaxM2(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                                # [2, 16, vocab]
    >>> model = MiniMaxM2.from_pretrained("/path/to/MiniMax-M2", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                                            # loadable by transformers
    """

    config_class: ClassVar[type[MiniMaxM2Config]] = MiniMaxM2Config
    key_table = staticmethod(hf.key_table)
