"""GPT-OSS: the shared dense core with sparse MoE MLPs (``nnx_zoo.models.moe_causal_lm``), GPT-OSS's config and
key table. Sliding-window and full-attention layers alternate (one stack each, run as one scan of two-layer
steps), every layer with learned per-head sinks and q/k/v/o biases; the router is a biased linear map, softmax
over the top-k logits; the experts have biases and the clamped SwiGLU ``(clip(up) + 1) * g * sigmoid(alpha g)``."""

from __future__ import annotations

from typing import ClassVar

from nnx_zoo.models.gpt_oss import hf
from nnx_zoo.models.gpt_oss.config import GptOssConfig
from nnx_zoo.models.moe_causal_lm import MoECausalLM


class GptOss(MoECausalLM):
    """GPT-OSS causal language model (exact against HF ``GptOssForCausalLM``).

    Parameters: ``sliding_layers.*`` and ``layers.*`` (the window and the full-attention layers, each stacked),
    with ``attn.sinks [heads]``, ``mlp.router_bias [E]`` and ``mlp.experts.{wi_gate,wi_up,wo}_bias``.

    >>> config = GptOssConfig.preset("gpt-oss-tiny")
    >>> model = GptOss.create(config, mesh=make_mesh({"fsdp": 4, "expert": 2}))   # or GptOss(config, rngs=...)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                             # [2, 16, vocab]
    >>> model = GptOss.from_pretrained("/path/to/gpt-oss-20b", dtype="bfloat16")  # MXFP4 experts dequantized
    >>> model.save_pretrained("/tmp/out")                                         # loadable by transformers
    """

    config_class: ClassVar[type[GptOssConfig]] = GptOssConfig
    key_table = staticmethod(hf.key_table)
