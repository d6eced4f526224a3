"""The vocabulary: every mesh axis and every logical axis name the package uses.

Model code names dimensions with the logical names below; rule sets (``rules.py``) map them to the mesh axes.
A logical name that is neither declared here nor mentioned by the rule set in use is a typo, and the resolver
rejects it in strict mode, so that a misspelt name cannot silently replicate a large tensor.
"""

from __future__ import annotations

# Physical mesh axes, in mesh order (outermost first).
MESH_AXES: tuple[str, ...] = (
    "data",  # pure data parallelism: batch split, parameters replicated
    "fsdp",  # data parallelism with parameters (and optimizer state) sharded
    "fsdp_transpose",  # a second FSDP axis that shards the other matrix dimension
    "context",  # context (sequence) parallelism
    "tensor",  # tensor parallelism (Megatron-style: heads and MLP width)
    "tensor_transpose",  # tensor parallelism over the model width
    "expert",  # expert parallelism
)

LOGICAL_AXES: dict[str, str] = {
    # ---- parameters ----
    "vocab": "vocabulary rows of the token embedding and the output head",
    "embed": "model width (hidden_size) of non-expert weights",
    "embed_no_exp": "model width of routed-expert weights (never bound to the axes that shard experts)",
    "mlp": "hidden width of a dense (SwiGLU) MLP, including the shared experts",
    "moe_mlp": "hidden width of one routed expert",
    "exp": "routed-expert index of the stacked expert weights",
    "exp_router": "expert dim of the router weight and its correction bias (replicated: top-k needs all scores)",
    "heads": "attention heads",
    "kv_heads": "key/value heads of grouped-query attention weights (num_key_value_heads; heads when MHA)",
    "kv": "per-head feature width (query/key width or value width)",
    "q_lora": "MLA query low-rank latent width",
    "kv_lora": "MLA key/value low-rank latent width (plus the shared rope key in the down-projection)",
    "mtp_embed": "input width of a multi-token-prediction projection (two hidden states concatenated)",
    "norm": "RMSNorm scale vectors",
    "bias": "bias vectors",
    "lora_rank": "rank of a LoRA adapter",
    "layers": "leading stack axis of the scanned decoder layers of a dense model (Llama, Qwen3)",
    "dense_layers": "leading stack axis of the scanned dense decoder layers",
    "moe_layers": "leading stack axis of the scanned MoE decoder layers",
    "mtp_layers": "leading stack axis of the multi-token-prediction heads",
    # ---- activations ----
    "activation_batch": "batch dim of activations",
    "activation_length": "sequence dim of activations (the context-parallel dim)",
    "activation_kv_length": "key/value sequence dim inside attention",
    "activation_embed": "model-width dim of activations",
    "activation_heads": "attention-head dim of activations",
    "activation_kv_heads": "key/value-head dim of grouped-query attention's keys, values and scores",
    "activation_kv": "per-head feature dim of activations",
    "activation_q_lora": "query latent dim of activations",
    "activation_kv_lora": "key/value latent dim of activations",
    "activation_mlp": "hidden dim of dense-MLP activations",
    "activation_vocab": "vocabulary dim of logits",
    "activation_exp": "expert dim of activations inside the MoE block",
    "activation_moe_mlp": "hidden dim of expert activations",
    "activation_tokens": "flattened token dim (batch x length) inside the MoE block",
    "activation_topk": "the k selected experts of each token",
    "activation_stack": "stacked (scanned) layer dim of per-layer outputs",
    "activation_microbatch": "micro-batch index of the batch-split schedule",
    "cache_batch": "batch dim of a decoding cache",
    "cache_length": "sequence dim of a decoding cache",
    "cache_kv": "feature dim of a decoding cache",
    "cache_kv_heads": "key/value-head dim of a grouped-query attention decoding cache",
}

# The names above that are leading layer-stack axes (the ``axis_name`` of ``nnx_zoo.layers.scan.create_stack``):
# one entry per layer, never a matrix dim, so per-matrix optimizers (Muon) treat them as batch dims.
STACK_AXES: frozenset[str] = frozenset({"layers", "dense_layers", "moe_layers", "mtp_layers"})


def describe(name: str) -> str:
    """One line on what a logical axis name means (KeyError for unknown names)."""
    return LOGICAL_AXES[name]
