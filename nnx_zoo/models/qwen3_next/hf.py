"""Hugging Face ``Qwen3NextForCausalLM`` checkpoints <-> ``Qwen3Next`` (and, with ``packed=False``, the Qwen3.5
models' text layers).

Per layer ``model.layers.{i}.``: the two ``(1 + w)`` norms; a full layer's ``self_attn.{q,k,v,o}_proj`` (``q_proj``
``[heads * 2 * head_dim, embed]``: per head the query's rows, then the gate's) and ``q_norm`` / ``k_norm``; a linear
layer's ``linear_attn.*``: ``in_proj_qkvz`` and ``in_proj_ba`` (packed per query/key head) or ``in_proj_qkv``
(regrouped per query/key head on load: ``PerKeyHead``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, then
``conv1d.weight [C, 1, K]`` (its channels regrouped the same way), ``dt_bias``, ``A_log``, ``norm.weight`` and
``out_proj``; the MLP as Qwen3-MoE's (router ``mlp.gate``, per-expert or fused experts) plus
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight [1, embed]``, or a dense layer's ``mlp.*_proj``.

The multi-token-prediction depth (``config.mtp_num_hidden_layers > 0``): ``mtp.pre_fc_norm_embedding.weight``,
``mtp.pre_fc_norm_hidden.weight``, ``mtp.fc.weight [embed, 2 * embed]``, ``mtp.norm.weight`` and its full-attention
layers under ``mtp.layers.{j}.`` with the keys of ``model.layers.{i}.``; with none, the files' ``mtp.*`` keys are
skipped (as transformers skips them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nnx_zoo.hf import DENSE, Dense, KeyTable, Row, Stack
from nnx_zoo.models import dense_hf
from nnx_zoo.models.moe_causal_lm import FUSED_EXPERTS, expert_rows
from nnx_zoo.models.moe_decoder_config import MoEDecoderConfig


@dataclasses.dataclass(frozen=True)
class PerKeyHead:
    """A tensor whose first HF dim is the convolution's channels ``C`` (all queries, all keys, all values) <-> ours
    with them grouped per query/key head, ``[hk, 2 dk + r dv]`` (its queries, keys, then its ``r`` value heads'
    values; Qwen3-Next's packed order), so tensor parallelism splits them by heads. ``dense``: an ``nn.Linear``
    weight ``[C, embed]`` <-> our kernel ``[embed, hk, 2 dk + r dv]``; else the depthwise conv ``[C, 1, K]`` <->
    ``[hk, 2 dk + r dv, K]``."""

    key_dim: int
    dense: bool

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (ours[1] * ours[2], ours[0]) if self.dense else (ours[0] * ours[1], 1, ours[2])

    def to_ours(self, a: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        hk, dk = (ours[1] if self.dense else ours[0]), self.key_dim
        a = a if self.dense else a[:, 0, :]  # [C, rest]
        q, k, v = np.split(a, [hk * dk, 2 * hk * dk])
        grouped = np.concatenate([x.reshape(hk, -1, a.shape[1]) for x in (q, k, v)], axis=1)  # [hk, w, rest]
        return np.moveaxis(grouped, 2, 0) if self.dense else grouped

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        grouped = np.moveaxis(a, 0, 2) if self.dense else a  # [hk, w, rest]
        dk = self.key_dim
        q, k, v = np.split(grouped, [dk, 2 * dk], axis=1)
        flat = np.concatenate([x.reshape(-1, grouped.shape[2]) for x in (q, k, v)])  # [C, rest]
        return flat if self.dense else flat[:, None, :]


NORM_ROWS = (Row("input_layernorm.weight", "input_norm.scale"),
             Row("post_attention_layernorm.weight", "post_attn_norm.scale"))
FULL_ROWS = (
    Row("self_attn.q_proj.weight", "attn.q_proj.kernel", DENSE),  # [heads * 2 hd, embed] <-> [embed, heads, 2 hd]
    Row("self_attn.k_proj.weight", "attn.k_proj.kernel", DENSE),
    Row("self_attn.v_proj.weight", "attn.v_proj.kernel", DENSE),
    Row("self_attn.o_proj.weight", "attn.o_proj.kernel", Dense(n_in=2)),
    Row("self_attn.q_norm.weight", "attn.q_norm.scale"),
    Row("self_attn.k_norm.weight", "attn.k_norm.scale"),
)


def _linear_common(key_dim: int) -> tuple[Row, ...]:
    return (Row("linear_attn.conv1d.weight", "attn.conv.weight", PerKeyHead(key_dim, dense=False)),) + _LINEAR_REST


_LINEAR_REST = (
    Row("linear_attn.dt_bias", "attn.dt_bias"),
    Row("linear_attn.A_log", "attn.A_log"),
    Row("linear_attn.norm.weight", "attn.norm.scale"),
    Row("linear_attn.out_proj.weight", "attn.out_proj.kernel", Dense(n_in=2)),
)
PACKED_LINEAR_ROWS = (
    Row("linear_attn.in_proj_qkvz.weight", "attn.in_proj_qkvz.kernel", DENSE),  # [hk * (2dk + 2r dv), embed]
    Row("linear_attn.in_proj_ba.weight", "attn.in_proj_ba.kernel", DENSE),  # [hk * 2r, embed]
)


def separate_linear_rows(key_dim: int) -> tuple[Row, ...]:
    return (
        # [C, embed] <-> [embed, hk, 2 dk + r dv]: grouped per query/key head as Qwen3-Next's packed projection.
        Row("linear_attn.in_proj_qkv.weight", "attn.in_proj_qkv.kernel", PerKeyHead(key_dim, dense=True)),
        Row("linear_attn.in_proj_z.weight", "attn.in_proj_z.kernel", DENSE),  # [hv * dv, embed]
        Row("linear_attn.in_proj_b.weight", "attn.in_proj_b.kernel", DENSE),
        Row("linear_attn.in_proj_a.weight", "attn.in_proj_a.kernel", DENSE),
    )
DENSE_MLP_ROWS = tuple(r for r in dense_hf.LAYER_TABLE if r.hf.startswith("mlp."))
MOE_ROWS = expert_rows("mlp", "gate_proj", "up_proj", "down_proj") + (
    Row("mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.gate.kernel", DENSE),
    Row("mlp.shared_expert.up_proj.weight", "mlp.shared_experts.up.kernel", DENSE),
    Row("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.down.kernel", DENSE),
    Row("mlp.shared_expert_gate.weight", "mlp.shared_gate", DENSE),  # [1, embed] <-> [embed, 1]
)
IGNORED = (r"^mtp\.",)  # the multi-token-prediction weights of a model built without them
MTP_ROWS = (
    Row("mtp.pre_fc_norm_embedding.weight", "mtp.embed_norm.scale"),
    Row("mtp.pre_fc_norm_hidden.weight", "mtp.hidden_norm.scale"),
    Row("mtp.fc.weight", "mtp.fc.kernel", DENSE),  # [embed, 2 * embed]: the embedding's columns, then the hidden's
    Row("mtp.norm.weight", "mtp.norm.scale"),
)


def key_table(config: MoEDecoderConfig, *, packed: bool = True, aliases: tuple[tuple[str, str], ...] = (),
              ignored: tuple[str, ...] = (), source: str = "nnx_zoo/models/qwen3_next/hf.py") -> KeyTable:
    """The HF key table of a model of this line: one ``Stack`` per layer kind (``config.layer_stacks()``), the
    linear layers' projections ``packed`` (Qwen3-Next) or separate (Qwen3.5); ``aliases`` / ``ignored`` for
    another layout of the same checkpoint (a multimodal one's text model)."""
    dk = config.linear_key_head_dim  # type: ignore[attr-defined]
    linear = (PACKED_LINEAR_ROWS if packed else separate_linear_rows(dk)) + _linear_common(dk)
    layers = [(name, "model.layers.{i}.", kind, indices) for name, kind, indices in config.layer_stacks()]
    mtp = config.mtp_num_hidden_layers  # type: ignore[attr-defined]
    if mtp:
        layers.append(("mtp.layers", "mtp.layers.{i}.", config.mtp_layer_kind(), range(mtp)))  # type: ignore[attr-defined]
    stacks = []
    for name, prefix, kind, indices in layers:
        rows = NORM_ROWS + (linear if kind.attention == "linear" else FULL_ROWS)
        if kind.moe:
            stacks.append(Stack(name, prefix, indices, rows + MOE_ROWS, FUSED_EXPERTS))
        else:
            stacks.append(Stack(name, prefix, indices, rows + DENSE_MLP_ROWS))
    tied = (r"^lm_head\.weight$",) if config.tie_word_embeddings else ()
    return KeyTable(top=dense_hf.TOP_TABLE + (MTP_ROWS if mtp else ()), stacks=tuple(stacks),
                    ignored=tied + (() if mtp else IGNORED) + ignored, aliases=aliases, source=source)
