"""Hugging Face ``Gemma3ForCausalLM`` checkpoints <-> ``Gemma3``: the key table the shared loader walks.

A layer holds Llama's rows plus the sandwich norms (``pre_feedforward_layernorm``, ``post_feedforward_layernorm``
beside ``input_layernorm`` / ``post_attention_layernorm``) and the per-head ``q_norm`` / ``k_norm``; every norm
weight is stored as HF stores it (``w`` of the ``(1 + w)`` scale). Sliding and global layers are two stacks of ours
(``sliding_layers``, ``layers``), each listing its HF layer numbers.

A ``gemma3`` image-text checkpoint holds the same text model under ``language_model.model.`` (what transformers 5
writes) or ``model.language_model.`` (its in-memory naming): both are read as ``model.``; its vision tower and
projector are not part of this text model and are skipped (``Gemma3.from_pretrained`` says so).
"""

from __future__ import annotations

from nnx_zoo.hf import DENSE, Dense, KeyTable, Row, Stack
from nnx_zoo.models import dense_hf
from nnx_zoo.models.gemma3.config import Gemma3Config

ATTENTION_TABLE = (
    Row("input_layernorm.weight", "input_norm.scale"),
    Row("post_attention_layernorm.weight", "post_attn_norm.scale"),
    Row("self_attn.q_proj.weight", "attn.q_proj.kernel", DENSE),
    Row("self_attn.k_proj.weight", "attn.k_proj.kernel", DENSE),
    Row("self_attn.v_proj.weight", "attn.v_proj.kernel", DENSE),
    Row("self_attn.o_proj.weight", "attn.o_proj.kernel", Dense(n_in=2)),
    Row("self_attn.q_proj.bias", "attn.q_proj.bias", dense_hf.FLAT),
    Row("self_attn.k_proj.bias", "attn.k_proj.bias", dense_hf.FLAT),
    Row("self_attn.v_proj.bias", "attn.v_proj.bias", dense_hf.FLAT),
    Row("self_attn.o_proj.bias", "attn.o_proj.bias"),
    Row("self_attn.q_norm.weight", "attn.q_norm.scale"),
    Row("self_attn.k_norm.weight", "attn.k_norm.scale"),
)
MLP_TABLE = (
    Row("pre_feedforward_layernorm.weight", "pre_mlp_norm.scale"),
    Row("post_feedforward_layernorm.weight", "post_mlp_norm.scale"),
    Row("mlp.gate_proj.weight", "mlp.gate.kernel", DENSE),
    Row("mlp.up_proj.weight", "mlp.up.kernel", DENSE),
    Row("mlp.down_proj.weight", "mlp.down.kernel", DENSE),
)
LAYER_TABLE = ATTENTION_TABLE + MLP_TABLE

# A multimodal checkpoint's text model, in either naming, read as a text model's keys.
MULTIMODAL_ALIASES = (
    (r"^language_model\.model\.", "model."),
    (r"^model\.language_model\.", "model."),
    (r"^language_model\.lm_head\.", "lm_head."),
)
# The image side of a multimodal checkpoint (SigLIP tower and projector), in either naming.
MULTIMODAL_ONLY = r"^(model\.)?(vision_tower|multi_modal_projector)\."


def layer_stacks(config: Gemma3Config, rows: tuple[Row, ...] = LAYER_TABLE) -> tuple[Stack, ...]:
    """One ``Stack`` per layer kind of ``config`` (our stack name, its HF layer numbers), all with ``rows``."""
    return tuple(Stack(name, "model.layers.{i}.", indices, rows)  # type: ignore[arg-type]
                 for name, _, indices in config.layer_stacks())


def key_table(config: Gemma3Config) -> KeyTable:
    """The HF key table of a Gemma 3 text model with this config (reads multimodal checkpoints' text part too)."""
    ignored = (MULTIMODAL_ONLY,) + ((r"^lm_head\.weight$",) if config.tie_word_embeddings else ())
    return KeyTable(top=dense_hf.TOP_TABLE, stacks=layer_stacks(config), ignored=ignored,
                    aliases=MULTIMODAL_ALIASES, source="nnx_zoo/models/gemma3/hf.py")
