"""The dense core's Hugging Face key table (``LlamaForCausalLM``'s layout, which Qwen3, the MoE families and many
others share): the rows the shared loader walks.

Keys of one decoder layer live under ``model.layers.{i}.``; our Variables under ``layers.`` (stacked on the
leading layer dim; a model with several layer kinds has one stack per kind). Rows whose Variable the model lacks
(biases without ``attention_bias``, the head of a tied model) are skipped by ``nnx_zoo.hf``; a tied checkpoint
that stores ``lm_head.weight`` anyway is read without it.
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
              source: str = "nnx_zoo/models/dense_hf.py") -> KeyTable:
    """The HF key table of a model on the dense core with this config: ``layer_table``'s rows (Llama's by default)
    for the layers of every stack (``config.layer_stacks()``: one ``layers`` unless the model has local layers)."""
    return KeyTable(
        top=TOP_TABLE,
        stacks=tuple(Stack(name, "model.layers.{i}.", indices, layer_table)
                     for name, _, indices in config.layer_stacks()),
        ignored=(r"^lm_head\.weight$",) if config.tie_word_embeddings else (),  # tied: a stored head is a copy
        source=source,
    )
