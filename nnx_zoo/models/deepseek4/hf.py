"""Hugging Face checkpoints <-> DeepSeekV4: the key table, on the shared loader of ``nnx_zoo.hf``.

Two namings of one checkpoint are read. DeepSeek's release names tensors as its own code does (``embed.weight``,
``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``, ``hc_head_fn``, ``mtp.{k}.*``);
transformers reads those and writes them back under ``model.`` (``model.layers.{i}.attn.wq_a.weight``,
``model.embed_tokens.weight``, ``model.hc_head.hc_fn``). The table is the second, which ``save_pretrained``
writes and transformers reloads; ``ALIASES`` rename the first on import. The MTP layers (``mtp.{k}.``; transformers
skips them on load) are read and written in the release's naming. The hash-routed layers' ``tid2eid`` tables are
integer tensors and load as such.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.hf import DENSE, Dense, GroupedDense, KeyTable, Row, SafetensorsCheckpoint, Stack, load_module, save_module
from nnx_zoo.models.causal_lm import pretrained_overrides
from nnx_zoo.models.deepseek4.config import DeepSeekV4Config, kind_name
from nnx_zoo.sharding import abstract_module, get_rules
from nnx_zoo.sharding.rules import Rules

TOP_TABLE = (
    Row("model.embed_tokens.weight", "embed.embedding"),
    Row("model.norm.weight", "norm.scale"),
    Row("head.weight", "lm_head.kernel", DENSE),
    Row("model.hc_head.hc_fn", "head_hc.fn", Dense(n_in=2)),
    Row("model.hc_head.hc_base", "head_hc.base"),
    Row("model.hc_head.hc_scale", "head_hc.scale"),
)


def _compressor_rows(hf: str, ours: str) -> tuple[Row, ...]:
    return (Row(f"{hf}.wkv.weight", f"{ours}.kv_proj.kernel", DENSE),
            Row(f"{hf}.wgate.weight", f"{ours}.gate_proj.kernel", DENSE),
            Row(f"{hf}.ape", f"{ours}.ape"),
            Row(f"{hf}.norm.weight", f"{ours}.norm.scale"))


# One decoder layer's keys (relative to ``model.layers.{i}.``); rows whose Variable a layer kind lacks (a
# compressor, an indexer, a hash table or a selection bias) are skipped.
LAYER_TABLE = (
    Row("attn_norm.weight", "input_norm.scale"),
    Row("ffn_norm.weight", "post_attn_norm.scale"),
    Row("attn.attn_sink", "attn.sinks"),
    Row("attn.wq_a.weight", "attn.q_a_proj.kernel", DENSE),
    Row("attn.q_norm.weight", "attn.q_a_norm.scale"),
    Row("attn.wq_b.weight", "attn.q_b_proj.kernel", DENSE),
    Row("attn.wkv.weight", "attn.kv_proj.kernel", DENSE),
    Row("attn.norm.weight", "attn.kv_norm.scale"),
    Row("attn.wo_a.weight", "attn.output.o_a", GroupedDense()),
    Row("attn.wo_b.weight", "attn.output.o_b.kernel", Dense(n_in=2)),
    *_compressor_rows("attn.compressor", "attn.compressor"),
    *_compressor_rows("attn.indexer.compressor", "attn.indexer.compressor"),
    Row("attn.indexer.wq_b.weight", "attn.indexer.q_b_proj.kernel", DENSE),
    Row("attn.indexer.weights_proj.weight", "attn.indexer.weights_proj.kernel", DENSE),
    Row("hc_attn_fn", "attn_hc.fn", Dense(n_in=2)),
    Row("hc_attn_base", "attn_hc.base"),
    Row("hc_attn_scale", "attn_hc.scale"),
    Row("hc_ffn_fn", "ffn_hc.fn", Dense(n_in=2)),
    Row("hc_ffn_base", "ffn_hc.base"),
    Row("hc_ffn_scale", "ffn_hc.scale"),
    Row("ffn.gate.weight", "mlp.router", DENSE),
    Row("ffn.gate.bias", "mlp.e_score_correction_bias"),
    Row("ffn.gate.tid2eid", "mlp.tid2eid"),
    Row("ffn.experts.{e}.w1.weight", "mlp.experts.wi_gate", DENSE),
    Row("ffn.experts.{e}.w3.weight", "mlp.experts.wi_up", DENSE),
    Row("ffn.experts.{e}.w2.weight", "mlp.experts.wo", DENSE),
    Row("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate.kernel", DENSE),
    Row("ffn.shared_experts.w3.weight", "mlp.shared_experts.up.kernel", DENSE),
    Row("ffn.shared_experts.w2.weight", "mlp.shared_experts.down.kernel", DENSE),
)
# An MTP depth (``mtp.{k}.``, the release's naming): its own keys, and a whole layer (ours under ``layer.``).
MTP_TABLE = (
    Row("enorm.weight", "enorm.scale"),
    Row("hnorm.weight", "hnorm.scale"),
    Row("e_proj.weight", "e_proj.kernel", DENSE),
    Row("h_proj.weight", "h_proj.kernel", DENSE),
    Row("norm.weight", "norm.scale"),
    Row("hc_head_fn", "head.fn", Dense(n_in=2)),
    Row("hc_head_base", "head.base"),
    Row("hc_head_scale", "head.scale"),
) + tuple(Row(r.hf, "layer." + r.ours, r.transform) for r in LAYER_TABLE)
# The release's naming -> the table's (transformers' save format).
ALIASES = (
    (r"^layers\.", "model.layers."),
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
)


def key_table(config: DeepSeekV4Config) -> KeyTable:
    """The HF key table of a DeepSeek-V4 model with this config: one stack per layer kind (``DeepSeekV4.stacks``),
    each over the layers of that kind."""
    c = config
    kinds = dict.fromkeys(c.layer_kinds)
    stacks = [Stack(f"stacks.{kind_name(k)}", "model.layers.{i}.",
                    tuple(i for i, kind in enumerate(c.layer_kinds) if kind == k), LAYER_TABLE) for k in kinds]
    stacks.append(Stack("mtp_layers", "mtp.{i}.", range(c.num_nextn_predict_layers), MTP_TABLE))
    return KeyTable(top=TOP_TABLE, stacks=tuple(stacks), aliases=ALIASES,
                    ignored=(r"^head\.weight$",) if c.tie_word_embeddings else (),
                    source="nnx_zoo/models/deepseek4/hf.py")


def load_pretrained(cls: type, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                    dtype: Any = None, allow_partial: bool = False, **config_overrides: Any) -> Any:
    """Load a DeepSeek-V4 checkpoint directory into ``cls`` (``DeepSeekV4``): the release's naming or
    transformers', each tensor read onto its shards. MTP heads are built for the MTP layers the files hold
    (transformers' saves hold none). ``dtype`` sets the parameter and compute dtype; ``config_overrides`` any
    config field. Unreadable files raise ``nnx_zoo.hf.CheckpointFormatError``, files that do not fit the model
    ``CheckpointMismatchError`` (every problem in one message)."""
    directory = Path(path)
    overrides = pretrained_overrides(dtype, config_overrides)
    rules = get_rules(rules if rules is not None else "default")
    with SafetensorsCheckpoint(directory) as ckpt:
        config = cls.config_from_hf(directory, overrides)
        if "num_nextn_predict_layers" not in config_overrides:
            depth = 0
            while any(key.startswith(f"mtp.{depth}.") for key in ckpt.entries):
                depth += 1
            config = config.with_overrides(num_nextn_predict_layers=min(depth, config.num_nextn_predict_layers))
        abstract = abstract_module(lambda: cls(config, rngs=nnx.Rngs(0), rules=rules,
                                               allow_partial=allow_partial or None))
        return load_module(ckpt, key_table(config), abstract, mesh=mesh, rules=rules, allow_partial=allow_partial)


def save_pretrained(model: Any, path: str | Path, *, max_shard_bytes: int = 4 * 2**30) -> None:
    """Write ``config.json`` and safetensors shards (transformers' naming; MTP layers in the release's)."""
    save_module(model, path, key_table(model.config), model.config.to_hf_dict(), max_shard_bytes=max_shard_bytes)


__all__ = ["ALIASES", "LAYER_TABLE", "MTP_TABLE", "TOP_TABLE", "key_table", "load_pretrained",
           "save_pretrained"]
