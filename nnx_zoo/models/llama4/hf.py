"""Hugging Face ``Llama4ForCausalLM`` checkpoints <-> ``Llama4``, and the text model of a multimodal
``Llama4ForConditionalGeneration`` checkpoint.

Per layer ``model.layers.{i}.``: Llama's norms and attention rows; ``feed_forward.{gate,up,down}_proj.weight`` in
dense layers; in MoE layers ``feed_forward.router.weight``, ``feed_forward.shared_expert.{gate,up,down}_proj.weight``
and the routed experts fused as transformers stores them, ``feed_forward.experts.gate_up_proj [E, embed, 2 * I]``
(gate columns, then up columns) and ``feed_forward.experts.down_proj [E, I, embed]`` (written so; per-expert
``nn.Linear`` keys ``feed_forward.experts.{e}.{gate,up,down}_proj.weight``, as unfused copies carry them, are read
too). A multimodal checkpoint's ``language_model.model.*`` / ``language_model.lm_head.weight`` are read as the text
model's keys; its vision tower and projector are skipped.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from nnx_zoo.hf import DENSE, SAME, KeyTable, Row, Stack
from nnx_zoo.models import dense_hf
from nnx_zoo.models.llama4.config import Llama4Config


@dataclasses.dataclass(frozen=True)
class GateUpColumns:
    """``experts.gate_up_proj [E, embed, 2I]`` (gate in columns ``:I``, up in ``I:``) <-> our gate (``half`` 0) or
    up (``half`` 1) kernel ``[E, embed, I]``; the two halves join on the last dim when written."""

    half: int
    join_axis: ClassVar[int] = -1  # the writer concatenates the halves here

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        experts, hidden, inner = ours
        return (experts, hidden, 2 * inner)

    def to_ours(self, a: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        inner = ours[2]
        return a[:, :, self.half * inner:(self.half + 1) * inner]

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a


ATTENTION_ROWS = tuple(r for r in dense_hf.LAYER_TABLE if not r.hf.startswith("mlp."))
DENSE_ROWS = ATTENTION_ROWS + (
    Row("feed_forward.gate_proj.weight", "mlp.gate.kernel", DENSE),
    Row("feed_forward.up_proj.weight", "mlp.up.kernel", DENSE),
    Row("feed_forward.down_proj.weight", "mlp.down.kernel", DENSE),
)
MOE_ROWS = ATTENTION_ROWS + (
    Row("feed_forward.router.weight", "mlp.router", DENSE),
    Row("feed_forward.shared_expert.gate_proj.weight", "mlp.shared_experts.gate.kernel", DENSE),
    Row("feed_forward.shared_expert.up_proj.weight", "mlp.shared_experts.up.kernel", DENSE),
    Row("feed_forward.shared_expert.down_proj.weight", "mlp.shared_experts.down.kernel", DENSE),
    Row("feed_forward.experts.{e}.gate_proj.weight", "mlp.experts.wi_gate", DENSE),
    Row("feed_forward.experts.{e}.up_proj.weight", "mlp.experts.wi_up", DENSE),
    Row("feed_forward.experts.{e}.down_proj.weight", "mlp.experts.wo", DENSE),
)
FUSED_EXPERTS = {
    "feed_forward.experts.gate_up_proj": (("mlp.experts.wi_gate", GateUpColumns(0)),
                                          ("mlp.experts.wi_up", GateUpColumns(1))),
    "feed_forward.experts.down_proj": (("mlp.experts.wo", SAME),),
}
# The multimodal checkpoint's text model under its own prefix, and the parts of it that are not the text model.
MULTIMODAL_ALIASES = ((r"^language_model\.model\.", "model."), (r"^language_model\.lm_head\.", "lm_head."))
MULTIMODAL_IGNORED = (r"^vision_model\.", r"^multi_modal_projector\.")


def key_table(config: Llama4Config) -> KeyTable:
    """The HF key table of a Llama 4 text model with this config: one ``Stack`` per layer kind
    (``config.layer_stacks()``), MoE stacks with the fused expert layout (read and written)."""
    stacks = []
    for name, kind, indices in config.layer_stacks():
        if kind.moe:
            stacks.append(Stack(name, "model.layers.{i}.", indices, MOE_ROWS, FUSED_EXPERTS, export_alternates=True))
        else:
            stacks.append(Stack(name, "model.layers.{i}.", indices, DENSE_ROWS))
    tied = (r"^lm_head\.weight$",) if config.tie_word_embeddings else ()
    return KeyTable(top=dense_hf.TOP_TABLE, stacks=tuple(stacks), ignored=tied + MULTIMODAL_IGNORED,
                    aliases=MULTIMODAL_ALIASES, source="nnx_zoo/models/llama4/hf.py")
