"""DeepSeek's own logical axis names, declared for the sharding resolver.

Each is placed by every rule set like the shared name it is declared ``like`` (unless a rule set names it), so no
rule set lists DeepSeek's names. Importing this module (the package ``__init__`` does) declares them.
"""

from __future__ import annotations

from nnx_zoo.sharding import declare_axis

# MLA's low-rank latents: the shared 'latent' (FSDP-sharded like the width, on fewer axes where MaxText's q_lora/
# kv_lora rules are narrower than its embed, so 512-wide latents divide at scale).
Q_LORA = declare_axis("q_lora", like="latent", doc="MLA query low-rank latent width (q_lora_rank)")
KV_LORA = declare_axis(
    "kv_lora", like="latent", doc="MLA key/value low-rank latent width (plus the shared rope key in kv_a_proj)"
)
# MaxText's MTP projection kernel is ("embed", None): its 2 x hidden input is placed like the width.
MTP_EMBED = declare_axis(
    "mtp_embed", like="embed", doc="input width of a multi-token-prediction projection (two hidden states concatenated)"
)
# The latents of activations are small (512-1536 wide) and feed a per-head up-projection: kept whole.
ACTIVATION_Q_LORA = declare_axis("activation_q_lora", like=None, doc="query latent dim of MLA activations")
ACTIVATION_KV_LORA = declare_axis("activation_kv_lora", like=None, doc="key/value latent dim of MLA activations")
# Layer stacks: one entry per layer (stack axes for the optimizer). The MoE layers are the pipelined stack (placed
# like the shared 'layers': split over 'stage'); the dense prefix (first_k_dense_replace, 3 of V3's 61 layers) and
# the MTP heads run outside the pipeline, whole on every stage (DeepSeekV3.forward), so they never go on 'stage'
# (3 dense layers would not split over 2 stages anyway).
DENSE_LAYERS = declare_axis("dense_layers", like="unpipelined_layers",
                            doc="stack axis of the first_k_dense_replace dense layers")
MOE_LAYERS = declare_axis("moe_layers", like="layers", doc="stack axis of the MoE decoder layers")
# The MoE layers before the last pipeline_layers ones (config.pipeline_layers): run before the pipeline with the dense
# prefix, whole on every stage.
PREFIX_MOE_LAYERS = declare_axis("prefix_moe_layers", like="unpipelined_layers",
                                 doc="stack axis of the MoE layers run before the pipeline (pipeline_layers)")
MTP_LAYERS = declare_axis("mtp_layers", like="unpipelined_layers",
                          doc="stack axis of the multi-token-prediction heads")
# DeepSeek-V3.2's lightning indexer: its heads are few and narrow (64 x 128); placed like attention heads.
INDEX_HEADS = declare_axis("index_heads", like="heads", doc="lightning indexer heads (index_n_heads, DeepSeek-V3.2)")
INDEX_KV = declare_axis("index_kv", like="kv", doc="lightning indexer head width (index_head_dim, DeepSeek-V3.2)")
