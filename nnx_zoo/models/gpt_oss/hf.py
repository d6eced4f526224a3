"""Hugging Face ``GptOssForCausalLM`` checkpoints <-> ``GptOss``.

Per layer (``model.layers.{i}.``, in the stack of its kind: ``sliding_layers`` or ``layers``): Llama's attention
rows with q/k/v/o biases and ``self_attn.sinks``; the router ``mlp.router.weight [E, embed]`` / ``.bias [E]``; the
experts fused as transformers holds them, ``mlp.experts.gate_up_proj [E, embed, 2I]`` (gate and up interleaved
along the last dim: gate ``[..., ::2]``, up ``[..., 1::2]``) with ``gate_up_proj_bias [E, 2I]``, and
``down_proj [E, I, embed]`` with ``down_proj_bias [E, embed]``: what transformers' ``save_pretrained`` writes and
what is written here. The published checkpoints store the two expert matrices in MXFP4 (``quantization_config``
``quant_method: "mxfp4"``): ``gate_up_proj_blocks`` / ``down_proj_blocks`` (``U8``, ``[E, out, in / 32, 16]``) with
``*_scales``, renamed here to ``gate_up_proj`` / ``down_proj`` and dequantized one tensor at a time by
``nnx_zoo.hf`` into that same layout.
"""

from __future__ import annotations

from nnx_zoo.hf import DENSE, Interleaved, KeyTable, Row, Stack
from nnx_zoo.models import dense_hf
from nnx_zoo.models.gpt_oss.config import GptOssConfig

ATTENTION_ROWS = tuple(r for r in dense_hf.LAYER_TABLE if not r.hf.startswith("mlp.")) + (
    Row("self_attn.sinks", "attn.sinks"),
)
MOE_ROWS = (
    Row("mlp.router.weight", "mlp.router", DENSE),
    Row("mlp.router.bias", "mlp.router_bias"),
    Row("mlp.experts.gate_up_proj", "mlp.experts.wi_gate", Interleaved(0)),
    Row("mlp.experts.gate_up_proj", "mlp.experts.wi_up", Interleaved(1)),
    Row("mlp.experts.gate_up_proj_bias", "mlp.experts.wi_gate_bias", Interleaved(0)),
    Row("mlp.experts.gate_up_proj_bias", "mlp.experts.wi_up_bias", Interleaved(1)),
    Row("mlp.experts.down_proj", "mlp.experts.wo"),
    Row("mlp.experts.down_proj_bias", "mlp.experts.wo_bias"),
)
# The MXFP4 release's names of the two quantized expert matrices, read as the unquantized ones.
MXFP4_ALIASES = ((r"^(model\.layers\.\d+\.mlp\.experts\.(?:gate_up|down)_proj)_blocks$", r"\1"),)


def key_table(config: GptOssConfig) -> KeyTable:
    """The HF key table of a GPT-OSS model with this config (one stack per attention kind)."""
    stacks = tuple(Stack(name, "model.layers.{i}.", indices, ATTENTION_ROWS + MOE_ROWS)  # type: ignore[arg-type]
                   for name, _, indices in config.layer_stacks())
    return KeyTable(top=dense_hf.TOP_TABLE, stacks=stacks, aliases=MXFP4_ALIASES,
                    ignored=(r"^lm_head\.weight$",) if config.tie_word_embeddings else (),
                    source="nnx_zoo/models/gpt_oss/hf.py")
