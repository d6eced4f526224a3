"""Hugging Face ``KimiLinearForCausalLM`` checkpoints <-> ``KimiLinear``.

Written as the hub files are (and as transformers' ``save_pretrained`` writes them), per layer
``model.layers.{i}.``: the two RMSNorms; a KDA layer's ``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d.weight [C, 1,
K]``, ``f_a_proj`` / ``f_b_proj``, ``dt_bias [C]``, ``A_log [1, 1, heads, 1]``, ``b_proj``, ``g_a_proj`` /
``g_b_proj``, ``o_norm`` and ``o_proj``; an MLA layer's ``self_attn.*`` as DeepSeek-V3's (no indexer); an MoE
layer's ``block_sparse_moe.gate.weight`` and ``.gate.e_score_correction_bias``, per-expert
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down) and ``block_sparse_moe.shared_experts.*``;
the dense layer's ``mlp.{gate,up,down}_proj``, which transformers' own save names ``block_sparse_moe.*_proj``
(read too).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from nnx_zoo.hf import DENSE, Dense, KeyTable, Row, Stack
from nnx_zoo.models import dense_hf
from nnx_zoo.models.deepseek import hf as deepseek_hf
from nnx_zoo.models.kimi_linear.config import KimiLinearConfig
from nnx_zoo.models.moe_causal_lm import expert_rows
from nnx_zoo.models.qwen3_next.hf import DENSE_MLP_ROWS, NORM_ROWS


@dataclasses.dataclass(frozen=True)
class HeadConv:
    """``nn.Conv1d`` depthwise weight ``[h * d, 1, K]`` <-> our per-head ``ShortConv.weight [h, d, K]``."""

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (ours[0] * ours[1], 1, ours[2])

    def to_ours(self, a: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        return a[:, 0, :].reshape(ours)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(-1, 1, a.shape[-1])


@dataclasses.dataclass(frozen=True)
class Padded:
    """Our array flattened, between ``lead`` and ``trail`` size-1 dims: ``dt_bias [heads, d]`` <-> ``[heads * d]``
    (``Padded()``), ``A_log [heads]`` <-> ``[1, 1, heads, 1]`` (``Padded(2, 1)``)."""

    lead: int = 0
    trail: int = 0

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        return (1,) * self.lead + (math.prod(ours),) + (1,) * self.trail

    def to_ours(self, a: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        return a.reshape(ours)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(self.hf_shape(a.shape))


KDA_ROWS = tuple(Row(f"self_attn.{name}_proj.weight", f"attn.{name}_proj.kernel", DENSE)
                 for name in ("q", "k", "v", "f_a", "f_b", "b", "g_a", "g_b")) + tuple(
    Row(f"self_attn.{name}_conv1d.weight", f"attn.{name}_conv.weight", HeadConv()) for name in "qkv") + (
    Row("self_attn.dt_bias", "attn.dt_bias", Padded()),
    Row("self_attn.A_log", "attn.A_log", Padded(2, 1)),
    Row("self_attn.o_norm.weight", "attn.o_norm.scale"),
    Row("self_attn.o_proj.weight", "attn.o_proj.kernel", Dense(n_in=2)),
)
MLA_ROWS = tuple(r for r in deepseek_hf.LAYER_TABLE if r.hf.startswith("self_attn."))
MOE_ROWS = expert_rows("block_sparse_moe", "w1", "w3", "w2") + (
    Row("block_sparse_moe.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),
    Row("block_sparse_moe.shared_experts.gate_proj.weight", "mlp.shared_experts.gate.kernel", DENSE),
    Row("block_sparse_moe.shared_experts.up_proj.weight", "mlp.shared_experts.up.kernel", DENSE),
    Row("block_sparse_moe.shared_experts.down_proj.weight", "mlp.shared_experts.down.kernel", DENSE),
)
# transformers' save renames every ``.mlp.`` to ``.block_sparse_moe.``, the dense layer's too.
ALIASES = ((r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj."),)


def key_table(config: KimiLinearConfig) -> KeyTable:
    """The HF key table of a Kimi Linear model: one ``Stack`` per layer kind (``config.layer_stacks()``)."""
    stacks = []
    for name, kind, indices in config.layer_stacks():
        rows = NORM_ROWS + (KDA_ROWS if kind.attention == "linear" else MLA_ROWS)
        stacks.append(Stack(name, "model.layers.{i}.", indices, rows + (MOE_ROWS if kind.moe else DENSE_MLP_ROWS)))
    tied = (r"^lm_head\.weight$",) if config.tie_word_embeddings else ()
    return KeyTable(top=dense_hf.TOP_TABLE, stacks=tuple(stacks), ignored=tied, aliases=ALIASES,
                    source="nnx_zoo/models/kimi_linear/hf.py")
