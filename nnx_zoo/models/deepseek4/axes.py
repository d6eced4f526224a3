"""DeepSeek-V4's own logical axis names, declared for the sharding resolver (placed like the shared name each is
declared ``like`` by every rule set that does not name it). Importing this module (the package does) declares them.
"""

from __future__ import annotations

from nnx_zoo.models.deepseek import axes as _deepseek_axes  # noqa: F401  (q_lora, index_heads, index_kv, mtp_layers)
from nnx_zoo.sharding import declare_axis

# The one shared key-value head's width: never split (a rule for per-head widths must not cut the only head).
V4_KV = declare_axis("v4_kv", like=None, doc="width of DeepSeek-V4's single shared key-value head (head_dim)")
ACTIVATION_V4_KV = declare_axis("activation_v4_kv", like=None,
                                doc="width dim of DeepSeek-V4's shared key-value activations and compressed entries")
# The grouped output projection: its groups are blocks of consecutive heads, split as heads are.
O_GROUPS = declare_axis("o_groups", like="heads", doc="head groups of DeepSeek-V4's grouped output projection")
O_LORA = declare_axis("o_lora", like="latent", doc="per-group low-rank width of DeepSeek-V4's output projection")
# The hash-routed first layers (num_hash_layers) run before the pipeline, whole on every stage, as DeepSeek-V3's
# dense prefix does; the top-k layers' stacks are the shared 'layers' (split over 'stage').
HASH_LAYERS = declare_axis("hash_layers", like="unpipelined_layers",
                           doc="stack axis of DeepSeek-V4's hash-routed first layers (num_hash_layers)")
