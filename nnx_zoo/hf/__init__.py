"""nnx_zoo.hf: Hugging Face checkpoint I/O shared by every model family.

A family supplies two things: its config mapping (``config.json`` dict <-> its config class) and a declarative
``KeyTable`` (which HF key fills which Variable, with which transform, per slot). Everything else is here:
safetensors read one tensor at a time onto each Variable's shards (``safetensors_io``), plan-then-load with every
missing / unexpected / misshapen / mistyped key in one error (``walker``), dequantisation of float8 block-scaled
weights (V3's float32 ``_scale_inv``, V4's UE8M0 ``.scale``) and of FP4 experts (``I8`` E2M1 pairs with UE8M0
scales per 32 inputs, where ``config.json`` declares ``expert_dtype: "fp4"``), NaN/Inf and dtype checks, and
sharded export with an index. It imports ``nnx_zoo.sharding`` and ``nnx_zoo.layers``, no model family. Errors:
``CheckpointFormatError`` (a file that cannot be read; names it) and ``CheckpointMismatchError`` (files that do not
fit the model), both ``CheckpointError``, a ``ValueError``.

A Llama-3 family (scanned stack ``layers``; our Variable paths on the right) would need only::

    from flax import nnx
    from nnx_zoo.hf import DENSE, KeyTable, Row, SafetensorsCheckpoint, Stack, load_module, save_module
    from nnx_zoo.sharding import abstract_module, get_rules

    LAYER = (Row("input_layernorm.weight", "input_norm.scale"),
             Row("self_attn.q_proj.weight", "attn.q_proj.kernel", DENSE),
             ...,  # k_proj, v_proj, o_proj, post_attention_layernorm
             Row("mlp.down_proj.weight", "mlp.down.kernel", DENSE))

    def key_table(c: Llama3Config) -> KeyTable:
        return KeyTable(
            top=(Row("model.embed_tokens.weight", "embed.embedding"), Row("model.norm.weight", "norm.scale"),
                 Row("lm_head.weight", "lm_head.kernel", DENSE)),   # skipped when the model has no lm_head
            stacks=(Stack("layers", "model.layers.{i}.", range(c.num_hidden_layers), LAYER),),
            ignored=(r"^lm_head\\.weight$",) if c.tie_word_embeddings else (),  # tied: a stored head is a copy
            source="nnx_zoo/models/llama/hf.py")

    def load_pretrained(cls, path, *, mesh=None, rules="default"):
        with SafetensorsCheckpoint(path) as ckpt:
            config = Llama3Config.from_hf(path)
            abstract = abstract_module(lambda: cls(config, rngs=nnx.Rngs(0), rules=rules))
            return load_module(ckpt, key_table(config), abstract, mesh=mesh, rules=get_rules(rules))

    def save_pretrained(model, path):
        save_module(model, path, key_table(model.config), model.config.to_hf_dict())

Table vocabulary (``table``): ``Row(hf, ours, transform)``; ``Stack(path, hf_prefix, layers, rows,
alternates)`` for stacked modules (``{e}`` in a row's key numbers the second stacked dim, e.g. routed experts;
``alternates`` map one key to whole-layer slots, e.g. transformers-5 fused experts); ``KeyTable.copies`` are keys
repeating another weight (written on export, skipped on import); transforms ``Same``, ``Dense(n_in)``,
``FusedGateUp(half)``, ``FusedDown``, ``Interleaved(half)`` (a key filling several Variables has a row per part).
"""

from nnx_zoo.hf.config_io import config_json_path, fp4_experts, fp8_block_size, json_kind, read_json_object
from nnx_zoo.hf.errors import CheckpointError, CheckpointFormatError, CheckpointMismatchError
from nnx_zoo.hf.safetensors_io import (
    SafetensorsCheckpoint,
    dequantize_fp4,
    dequantize_fp8,
    nonfinite_count,
    scale_to_float32,
    write_shards,
)
from nnx_zoo.hf.table import (
    DENSE,
    SAME,
    Dense,
    FusedDown,
    FusedGateUp,
    GroupedDense,
    Interleaved,
    KeyTable,
    Row,
    Same,
    Slot,
    Stack,
)
from nnx_zoo.hf.walker import export_slots, load_module, plan_load, save_module

__all__ = [
    "DENSE",
    "SAME",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "Dense",
    "FusedDown",
    "FusedGateUp",
    "GroupedDense",
    "Interleaved",
    "KeyTable",
    "Row",
    "SafetensorsCheckpoint",
    "Same",
    "Slot",
    "Stack",
    "config_json_path",
    "dequantize_fp4",
    "dequantize_fp8",
    "export_slots",
    "fp4_experts",
    "fp8_block_size",
    "json_kind",
    "load_module",
    "nonfinite_count",
    "plan_load",
    "read_json_object",
    "save_module",
    "scale_to_float32",
    "write_shards",
]
