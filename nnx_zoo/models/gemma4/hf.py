"""Hugging Face ``Gemma4ForCausalLM`` checkpoints <-> ``Gemma4``: the key table the shared loader walks.

A layer holds Gemma 3's attention and MLP rows (every norm weight as stored: Gemma 4 applies ``w``, not ``1 + w``)
plus the per-layer input gate (``per_layer_input_gate``, ``per_layer_projection``, ``post_per_layer_input_norm``),
the ``layer_scalar`` buffer and, with the MoE block, the router (``router.proj``, ``router.scale``,
``router.per_expert_scale``), the experts in transformers' fused layout (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``; written so, read so or per expert) and three more norms. Rows of Variables a layer
lacks are skipped: a shared-K/V layer has no ``k_proj`` / ``v_proj`` / ``k_norm`` (keys a checkpoint stores for
them anyway are ignored, as transformers ignores them), a global layer with ``attention_k_eq_v`` no ``v_proj``.
A ``gemma4`` multimodal checkpoint's text model (``model.language_model.``) is read as ``model.``; its vision and
audio towers and embedders are skipped (``Gemma4.from_pretrained`` says so).
"""

from __future__ import annotations

from nnx_zoo.hf import DENSE, FusedDown, FusedGateUp, KeyTable, Row
from nnx_zoo.hf.table import Stack
from nnx_zoo.models import dense_hf
from nnx_zoo.models.gemma3 import hf as gemma3_hf
from nnx_zoo.models.gemma4.config import Gemma4Config

TOP_TABLE = dense_hf.TOP_TABLE + (
    Row("model.embed_tokens_per_layer.weight", "embed_per_layer.embedding"),
    Row("model.per_layer_model_projection.weight", "per_layer_proj.kernel", DENSE),  # [L * P, H] <-> [H, L, P]
    Row("model.per_layer_projection_norm.weight", "per_layer_norm.scale"),
)
LAYER_TABLE = gemma3_hf.LAYER_TABLE + (
    Row("per_layer_input_gate.weight", "per_layer_gate.kernel", DENSE),
    Row("per_layer_projection.weight", "per_layer_proj.kernel", DENSE),
    Row("post_per_layer_input_norm.weight", "post_per_layer_norm.scale"),
    Row("layer_scalar", "layer_scalar"),
    Row("router.proj.weight", "mlp.router.proj.kernel", DENSE),
    Row("router.scale", "mlp.router.scale"),
    Row("router.per_expert_scale", "mlp.router.per_expert_scale"),
    Row("post_feedforward_layernorm_1.weight", "mlp.post_dense_norm.scale"),
    Row("pre_feedforward_layernorm_2.weight", "mlp.pre_experts_norm.scale"),
    Row("post_feedforward_layernorm_2.weight", "mlp.post_experts_norm.scale"),
    # One expert's projections (read when a file has them); transformers' own layout is the fused one below.
    Row("experts.{e}.gate_proj.weight", "mlp.experts.wi_gate", DENSE),
    Row("experts.{e}.up_proj.weight", "mlp.experts.wi_up", DENSE),
    Row("experts.{e}.down_proj.weight", "mlp.experts.wo", DENSE),
)
FUSED_EXPERTS = {
    "experts.gate_up_proj": (("mlp.experts.wi_gate", FusedGateUp(0)), ("mlp.experts.wi_up", FusedGateUp(1))),
    "experts.down_proj": (("mlp.experts.wo", FusedDown()),),
}
MULTIMODAL_ALIASES = ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
                      (r"^language_model\.lm_head\.", "lm_head."))
MULTIMODAL_ONLY = r"^(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector)\."


def key_table(config: Gemma4Config) -> KeyTable:
    """The HF key table of a Gemma 4 text model with this config (reads multimodal checkpoints' text part too)."""
    stacks = tuple(Stack(name, "model.layers.{i}.", indices, LAYER_TABLE, FUSED_EXPERTS,  # type: ignore[arg-type]
                         export_alternates=True) for name, _, indices in config.layer_stacks())
    shared = [i for i, kind in enumerate(config.layer_kinds()) if kind.kv == "shared"]
    ignored = [MULTIMODAL_ONLY] + ([r"^lm_head\.weight$"] if config.tie_word_embeddings else [])
    if shared:  # K/V projections a checkpoint may hold for layers that reuse another layer's
        ignored.append(rf"^model\.layers\.({'|'.join(map(str, shared))})\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")
    return KeyTable(top=TOP_TABLE, stacks=stacks, ignored=tuple(ignored), aliases=MULTIMODAL_ALIASES,
                    source="nnx_zoo/models/gemma4/hf.py")
