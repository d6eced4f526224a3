"""Hugging Face checkpoints <-> DeepSeekV3: the DeepSeek key table, on the shared loader of ``nnx_zoo.hf``.

What is DeepSeek's own: the key table (MLA projections, V3.2's lightning indexer, the router and V3's correction
bias, shared and per-expert routed experts, the transformers-5 fused expert layout), the multi-token-prediction
(MTP) layers stored after the main ones (``model.layers.{num_hidden_layers + d}.``, which repeat the embedding and
head: written on export, skipped on import), and building only as many MTP heads as the files hold.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.hf import (
    DENSE,
    SAME,
    CheckpointMismatchError,
    Dense,
    FusedDown,
    FusedGateUp,
    KeyTable,
    Row,
    SafetensorsCheckpoint,
    Slot,
    Stack,
    dequantize_fp8,
    export_slots,
    load_module,
    save_module,
)
from nnx_zoo.hf.table import Shape
from nnx_zoo.models.causal_lm import pretrained_overrides
from nnx_zoo.models.deepseek.config import LAYER_STACKS, DeepSeekV3Config
from nnx_zoo.sharding import abstract_module, create_variables, get_rules
from nnx_zoo.sharding.rules import Rules

__all__ = ["CheckpointMismatchError", "canonical_slots", "dequantize_fp8", "iter_hf_keys", "key_table",
           "load_pretrained", "save_pretrained"]

TOP_TABLE = (
    Row("model.embed_tokens.weight", "embed.embedding"),
    Row("model.norm.weight", "norm.scale"),
    Row("lm_head.weight", "lm_head.kernel", DENSE),
)
# Keys of one decoder layer, under ``model.layers.{i}.``; ``{e}`` is the routed expert (our second stacked dim).
LAYER_TABLE = (
    Row("input_layernorm.weight", "input_norm.scale"),
    Row("post_attention_layernorm.weight", "post_attn_norm.scale"),
    Row("self_attn.q_proj.weight", "attn.q_proj.kernel", DENSE),
    Row("self_attn.q_a_proj.weight", "attn.q_a_proj.kernel", DENSE),
    Row("self_attn.q_a_proj.bias", "attn.q_a_proj.bias"),
    Row("self_attn.q_a_layernorm.weight", "attn.q_a_norm.scale"),
    Row("self_attn.q_b_proj.weight", "attn.q_b_proj.kernel", DENSE),
    Row("self_attn.kv_a_proj_with_mqa.weight", "attn.kv_a_proj.kernel", DENSE),
    Row("self_attn.kv_a_proj_with_mqa.bias", "attn.kv_a_proj.bias"),
    Row("self_attn.kv_a_layernorm.weight", "attn.kv_a_norm.scale"),
    Row("self_attn.kv_b_proj.weight", "attn.kv_b_proj.kernel", DENSE),
    Row("self_attn.o_proj.weight", "attn.o_proj.kernel", Dense(n_in=2)),
    Row("self_attn.o_proj.bias", "attn.o_proj.bias"),
    # DeepSeek-V3.2's lightning indexer (only with index_topk > 0; V3 / V2 models lack these Variables, so the
    # rows are skipped): wq_b reads the compressed query latent into [q_lora, index heads, index dim], wk and
    # weights_proj read the hidden state, k_norm is a LayerNorm (scale and bias). transformers keeps weights_proj
    # in float32.
    Row("self_attn.indexer.wq_b.weight", "attn.indexer.wq_b.kernel", DENSE),
    Row("self_attn.indexer.wk.weight", "attn.indexer.wk.kernel", DENSE),
    Row("self_attn.indexer.k_norm.weight", "attn.indexer.k_norm.scale"),
    Row("self_attn.indexer.k_norm.bias", "attn.indexer.k_norm.bias"),
    Row("self_attn.indexer.weights_proj.weight", "attn.indexer.weights_proj.kernel", DENSE),
    Row("mlp.gate_proj.weight", "mlp.gate.kernel", DENSE),
    Row("mlp.up_proj.weight", "mlp.up.kernel", DENSE),
    Row("mlp.down_proj.weight", "mlp.down.kernel", DENSE),
    Row("mlp.gate.weight", "mlp.router", DENSE),
    Row("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),
    Row("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.gate.kernel", DENSE),
    Row("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.up.kernel", DENSE),
    Row("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.down.kernel", DENSE),
    Row("mlp.experts.{e}.gate_proj.weight", "mlp.experts.wi_gate", DENSE),
    Row("mlp.experts.{e}.up_proj.weight", "mlp.experts.wi_up", DENSE),
    Row("mlp.experts.{e}.down_proj.weight", "mlp.experts.wo", DENSE),
)
# A multi-token-prediction depth: its own keys plus a full decoder layer (ours under ``layer.``).
MTP_TABLE = (
    Row("enorm.weight", "enorm.scale"),
    Row("hnorm.weight", "hnorm.scale"),
    Row("eh_proj.weight", "eh_proj.kernel", DENSE),
    Row("shared_head.norm.weight", "final_norm.scale"),
) + tuple(Row(r.hf, "layer." + r.ours, r.transform) for r in LAYER_TABLE)
# transformers-5 fused expert layout: one key fills a whole layer's experts of one or two Variables.
FUSED_EXPERTS = {
    "mlp.experts.gate_up_proj": (("mlp.experts.wi_gate", FusedGateUp(0)), ("mlp.experts.wi_up", FusedGateUp(1))),
    "mlp.experts.down_proj": (("mlp.experts.wo", FusedDown()),),
}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def key_table(config: DeepSeekV3Config) -> KeyTable:
    """The HF key table of a DeepSeek-V3 model with this config."""
    c, prefix = config, "model.layers.{i}."
    mtp_layers = range(c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers)
    mtp_fused = {hf: tuple(("layer." + ours, t) for ours, t in targets) for hf, targets in FUSED_EXPERTS.items()}
    head = ("embed.embedding", SAME) if c.tie_word_embeddings else ("lm_head.kernel", DENSE)
    # Hub MTP layers repeat the main model's embedding and head.
    copies = tuple(s for n in mtp_layers for s in (
        Slot(f"model.layers.{n}.embed_tokens.weight", "embed.embedding"),
        Slot(f"model.layers.{n}.shared_head.head.weight", head[0], (), head[1])))
    # One stack per kind of decoder layer (dense / MoE, and apart those reusing an earlier layer's top-k, which lack
    # the indexer rows), each over its layers' indices in model order. Experts are written per expert, or fused
    # where the architecture's transformers model reads only that layout (its table's "fused_experts").
    fused = c.HF_ARCHITECTURES[c.hf_model_type].get("fused_experts", False)
    layers = tuple(Stack(name, prefix, indices, LAYER_TABLE, FUSED_EXPERTS if LAYER_STACKS[name][0] else {},
                         export_alternates=fused) for name, indices in c.layer_stacks().items() if indices)
    return KeyTable(
        top=TOP_TABLE,
        stacks=(*layers, Stack("mtp_layers", prefix, mtp_layers, MTP_TABLE, mtp_fused, export_alternates=fused)),
        copies=copies,
        source="nnx_zoo/models/deepseek/hf.py",
    )


def canonical_slots(config: DeepSeekV3Config, shapes: dict[str, Shape]) -> list[Slot]:
    """Every HF key (per-expert layout) of a model whose Variables have ``shapes`` (path -> shape)."""
    return key_table(config).slots(shapes)


def iter_hf_keys(config: DeepSeekV3Config, shapes: dict[str, Shape]) -> Iterator[str]:
    """The HF keys ``save_pretrained`` writes for a model with these Variable shapes."""
    return iter(dict.fromkeys(s.key for s in export_slots(key_table(config), shapes)))


def _mtp_depth_present(ckpt: SafetensorsCheckpoint, config: DeepSeekV3Config) -> int:
    layers = {int(m.group(1)) for m in map(_LAYER_KEY.match, ckpt.entries) if m}
    depth = 0
    while config.num_hidden_layers + depth in layers:
        depth += 1
    return depth


def load_pretrained(cls: type, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                    dtype: Any = None, allow_partial: bool = False, **config_overrides: Any) -> Any:
    """Load an HF DeepSeek-V3 checkpoint directory into ``cls`` (``DeepSeekV3``).

    ``dtype`` sets both the parameter and compute dtype (default: the config's, float32); ``config_overrides``
    set any config field (``moe_impl="dense"``, ...). MTP heads are built only for the MTP layers the files
    hold. Float8 weights are dequantized with their ``weight_scale_inv`` blocks. ``allow_partial`` as in
    ``DeepSeekV3.create``: dimensions that do not divide go on a dividing prefix of their mesh axes.

    ``index_topk=K`` given for a checkpoint without lightning indexers (DeepSeek-V3, as DeepSeek started V3.2
    from V3.1): everything else is loaded and the indexers start from a random init (seed 0), with a warning, for
    ``indexer_training='dense_warmup'`` to train them.

    Unreadable files raise ``nnx_zoo.hf.CheckpointFormatError`` naming the file (weights holding NaN or
    infinities: every such key, after all were read); files that do not fit the model raise
    ``CheckpointMismatchError``.
    """
    directory = Path(path)
    overrides = pretrained_overrides(dtype, config_overrides)
    rules = get_rules(rules if rules is not None else "default")
    with SafetensorsCheckpoint(directory) as ckpt:
        config = cls.config_from_hf(directory, overrides)
        if "num_nextn_predict_layers" not in config_overrides:
            depth = min(config.num_nextn_predict_layers, _mtp_depth_present(ckpt, config))
            config = config.with_overrides(num_nextn_predict_layers=depth)
        if config.index_topk and "index_topk" in config_overrides and not any(
                ".indexer." in key for key in ckpt.entries):
            return _with_new_indexers(cls, ckpt, config, mesh, rules, allow_partial)
        abstract = abstract_module(lambda: cls(config, rngs=nnx.Rngs(0), rules=rules,
                                               allow_partial=allow_partial or None))
        return load_module(ckpt, key_table(config), abstract, mesh=mesh, rules=rules, allow_partial=allow_partial)


def _with_new_indexers(cls: type, ckpt: SafetensorsCheckpoint, config: DeepSeekV3Config, mesh: Mesh | None,
                       rules: Rules, allow_partial: bool) -> Any:
    """The checkpoint's weights in a model with freshly initialized lightning indexers (the checkpoint has none),
    holding one model's weights at a time."""
    warnings.warn(f"{ckpt.directory} holds no lightning-indexer weights: the indexers (index_topk="
                  f"{config.index_topk}) start from a random init; train them first (indexer_training="
                  "'dense_warmup'), or each query attends to the keys an untrained indexer picks", stacklevel=3)
    def make() -> Any:  # as DeepSeekV3.create(config) builds it (seed 0)
        return cls(config, rngs=nnx.Rngs(0), rules=rules, allow_partial=allow_partial or None)

    # Only the indexers are initialized (the values create(config) gives them: on a mesh to the bit, without one to
    # a float's last bit) and nothing else is built; every other weight is read from the files straight into its
    # place: one model in memory, not two.
    indexers = create_variables(make, lambda path: ".indexer." in path, mesh, rules, allow_partial=allow_partial)
    return load_module(ckpt, key_table(config), abstract_module(make), mesh=mesh, rules=rules,
                       allow_partial=allow_partial, given=indexers)


def save_pretrained(model: Any, path: str | Path, *, max_shard_bytes: int = 4 * 2**30) -> None:
    """Write ``config.json``, ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_shard_bytes`` (a
    single larger tensor gets a shard of its own) and ``model.safetensors.index.json``, per-expert keys."""
    config: DeepSeekV3Config = model.config
    save_module(model, path, key_table(config), config.to_hf_dict(), max_shard_bytes=max_shard_bytes)
