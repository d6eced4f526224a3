"""Hugging Face ``LlamaForCausalLM`` checkpoints <-> ``Llama3``: the key table the shared loader walks.

Keys of one decoder layer live under ``model.layers.{i}.``; our Variables under ``layers.`` (stacked on the
leading layer dim). Rows whose Variable the model lacks (biases without ``attention_bias``, the head of a tied
model) are skipped by ``nnx_zoo.hf``; a tied checkpoint that stores ``lm_head.weight`` anyway is read without it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from nnx_zoo.hf import DENSE, Dense, KeyTable, Row, Stack
from nnx_zoo.models.decoder_config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class Flat:
    """A vector ``[prod(ours)]`` on disk <-> our array of any shape (a q/k/v bias ``[heads, head_dim]``)."""

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(ours),)

    def to_ours(self, a: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        return a.reshape(ours)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(-1)


FLAT = Flat()

TOP_TABLE = (
    Row("model.embed_tokens.weight", "embed.embedding"),
    Row("model.norm.weight", "norm.scale"),
    Row("lm_head.weight", "lm_head.kernel", DENSE),
)
LAYER_TABLE = (
    Row("input_layernorm.weight", "input_norm.scale"),
    Row("post_attention_layernorm.weight", "post_attn_norm.scale"),
    Row("self_attn.q_proj.weight", "attn.q_proj.kernel", DENSE),  # [heads * head_dim, embed] <-> [embed, heads, kv]
    Row("self_attn.k_proj.weight", "attn.k_proj.kernel", DENSE),
    Row("self_attn.v_proj.weight", "attn.v_proj.kernel", DENSE),
    Row("self_attn.o_proj.weight", "attn.o_proj.kernel", Dense(n_in=2)),  # [embed, heads * head_dim]
    Row("self_attn.q_proj.bias", "attn.q_proj.bias", FLAT),  # [heads * head_dim] <-> [heads, kv]
    Row("self_attn.k_proj.bias", "attn.k_proj.bias", FLAT),
    Row("self_attn.v_proj.bias", "attn.v_proj.bias", FLAT),
    Row("self_attn.o_proj.bias", "attn.o_proj.bias"),
    Row("mlp.gate_proj.weight", "mlp.gate.kernel", DENSE),
    Row("mlp.up_proj.weight", "mlp.up.kernel", DENSE),
    Row("mlp.down_proj.weight", "mlp.down.kernel", DENSE),
)


def key_table(config: DecoderConfig, layer_table: tuple[Row, ...] = LAYER_TABLE,
              source: str = "nnx_zoo/models/llama/hf.py") -> KeyTable:
    """The HF key table of a model with this config (Llama's layer rows unless ``layer_table`` is given)."""
    return KeyTable(
        top=TOP_TABLE,
        stacks=(Stack("layers", "model.layers.{i}.", range(config.num_hidden_layers), layer_table),),
        ignored=(r"^lm_head\.weight$",) if config.tie_word_embeddings else (),  # tied: a stored head is a copy
        source=source,
    )
