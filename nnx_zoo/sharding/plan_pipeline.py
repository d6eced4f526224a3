"""Per-stage memory of a pipelined run (a mesh with a ``stage`` axis): ``pipeline_memory_plan``.

A rule set places every layer stack's leading dim on ``stage``, so a device of stage ``s`` holds the non-stack
parameters (embedding, final norm, head; they run on every stage) at their sharding over the other axes, and its
stage's share of every stack. Where a stack's ``L`` layers do not divide the ``S`` stages the plan counts the
fullest stage, ``ceil(L / S)`` layers (what an uneven split such as Megatron's holds at most); nnx_zoo's pipeline
itself needs an even split, and the table says so. With ``pipeline_layers`` (the model config's: only the last
layers pipelined) the layers before them are on unpipelined stacks: counted whole on every stage, their
activations as the dense prefix's (run before the pipeline on the stage's share of the rows). Gradients and AdamW's
two float32 moments follow the parameters.

Activations of the fullest stage by schedule, ``M`` micro-batches of ``m`` rows (each batch shard's rows over
``M``), ``S`` stages, ``V`` virtual stages; ``keep(m)``: what the stage's layers keep for the backward for one
micro-batch (``plan.activation_breakdown``, remat ``none``: every intermediate, ``full``: the layer inputs), the
one-layer phase (one layer's recomputation, its weights gathered) at ``m`` rows:
- ``gpipe`` (``nnx_zoo.layers.pipeline.pipeline_stack`` differentiated): a scan over ``M + S - 1`` time steps
  keeps every step's residuals, the bubble's too: ``(M + S - 1) * keep(m)``; the micro-batched input and the
  finished outputs of the whole batch; the embedding, head and loss outside the pipeline on the stage's share
  of the batch (``1 / S`` of its rows: ``activation_embed_and_logits_batch``), as a dense prefix before it.
- ``1f1b``: a ring of ``2S - 1`` stage inputs ``[m, seq, hidden]`` whatever ``M``, one micro-batch's stage
  recomputed for its backward (``keep(m)``), the input gradients of the whole batch; head and loss per micro-batch.
- ``interleaved`` (``V`` chunks of ``ceil(layers / V)`` layers per stage): ``(V + 1) S - 1`` chunk inputs (the
  saved-input slots of ``nnx_zoo.layers.pipeline.pipeline_order``) and one chunk recomputed, otherwise as 1F1B.
Weights: a stage runs the same layers on every tick, so XLA hoists their all-gathers out of the tick loop and
the stage's layers stay gathered through the forward and the backward (held), where the un-pipelined scan
gathers one layer at a time. The peak is, as in ``plan``: what the backward holds throughout + the larger of the
output-head and one-layer phases.

Checked against XLA (``tests/sharding/test_plan_pipeline.py``, the trainer's pipelined step compiled on stage 2 x
fsdp 4, Auto, remat none): the arguments equal the parameters + AdamW moments + buffers to the byte (with the
step counters and the batch); the temporaries are the gradients + the activation peak within 0.85-1.10 (a tiny
Llama and DeepSeek-V3, GPipe and 1F1B: 0.89-1.06).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from nnx_zoo.sharding.axes import STACK_AXES, UNPIPELINED_STACK, placed_like
from nnx_zoo.sharding.mesh import make_abstract_mesh
from nnx_zoo.sharding.plan import (
    PART_PHASES,
    REMATS,
    MemoryPlan,
    activation_breakdown,
    memory_plan,
    output_bytes,
    stack_gathered,
)
from nnx_zoo.sharding.report import _human
from nnx_zoo.sharding.rules import Rules

STAGE = "stage"
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
_OUTSIDE = ("embeddings and logits", "mtp heads", "embedding gradient")  # not per-stage layer activations


def _fullest(layers: int, stages: int) -> int:
    return -(-layers // stages)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Per-device memory of the fullest pipeline stage: ``print(plan.table())``.

    >>> plan = pipeline_memory_plan(make, config, make_abstract_mesh({"stage": 16, "expert": 64}), "default",
    ...                             seq_len=4096, global_batch=256, microbatches=32, schedule="1f1b")
    >>> plan.total("full")  # bytes per device of the fullest stage
    """

    base: MemoryPlan  # the un-pipelined plan on the mesh without ``stage`` (every stack whole)
    stages: int
    microbatches: int
    schedule: str
    virtual_stages: int
    stacks: dict[str, tuple[int, int]]  # stack path prefix -> (layers on the fullest stage, layers in the stack)
    param_bytes: int
    buffer_bytes: int
    optimizer_bytes: int
    activations: dict[str, dict[str, dict[str, int]]]  # schedule -> remat -> part -> bytes
    phases: dict[str, str]  # part -> "held" / "output head" / "one layer"

    @property
    def even(self) -> bool:
        """Whether every stack divides the stages (nnx_zoo's pipeline trains only then)."""
        return all(total % self.stages == 0 for _, total in self.stacks.values())

    def activation_bytes(self, remat: str, schedule: str | None = None) -> int:
        parts = self.activations[schedule or self.schedule][remat]
        by = {p: sum(v for k, v in parts.items() if self.phases[k] == p) for p in ("held", "output head", "one layer")}
        return by["held"] + max(by["output head"], by["one layer"])

    def total(self, remat: str, schedule: str | None = None) -> int:
        """Parameters + gradients + AdamW state + buffers + the schedule's activation peak, per device."""
        return (2 * self.param_bytes + self.optimizer_bytes + self.buffer_bytes
                + self.activation_bytes(remat, schedule))

    def table(self) -> str:
        b = self.base.local.batch
        m = b // self.microbatches
        v = f", {self.virtual_stages} virtual stages" if self.schedule == "interleaved" else ""
        held = ", ".join(f"{mine} of {total} ({name})" for name, (mine, total) in self.stacks.items())
        lines = [f"pipeline plan per device of the fullest stage: {self.stages} stages, {self.microbatches} "
                 f"micro-batches of {m} row(s) (of {b} per batch shard) x {self.base.local.seq} positions, schedule "
                 f"{self.schedule}{v}",
                 f"  stage layers                {held}"]
        if not self.even:
            lines.append("  (a stack above does not divide the stages: this counts the fullest stage of an uneven "
                         "split; nnx_zoo's pipeline trains only with a 'stage' size that divides every stack: "
                         "--model.pipeline_layers pipelines only the last layers, the rest before the pipeline)")
        lines += [f"  parameters                  {_human(self.param_bytes)}  (the stage's layers + every stage's "
                  "embedding, norm and head)",
                  f"  gradients                   {_human(self.param_bytes)}",
                  f"  AdamW state                 {_human(self.optimizer_bytes)}  (2 moments in float32)"]
        if self.buffer_bytes:
            lines.append(f"  buffers                     {_human(self.buffer_bytes)}")
        for remat in REMATS:
            parts = self.activations[self.schedule][remat]
            lines.append(f"  activations, remat {remat:<5}   {_human(self.activation_bytes(remat))}")
            for phase in ("held", "output head", "one layer"):
                lines += [f"    {phase + ':':<13}{k:<38}{_human(val)}" for k, val in parts.items()
                          if self.phases[k] == phase and val]
        lines.append("  total                       " + ", ".join(
            f"remat {r}: {_human(self.total(r))}" for r in REMATS))
        lines.append("  by schedule (activations / total per device):")
        for schedule in self.activations:
            name = f"interleaved, V={self.virtual_stages}" if schedule == "interleaved" else schedule
            lines.append(f"    {name:<17}" + "; ".join(
                f"remat {r}: {_human(self.activation_bytes(r, schedule))} / {_human(self.total(r, schedule))}"
                for r in REMATS))
        return "\n".join(lines)


def stage_parameters(plan: MemoryPlan, stages: int) -> tuple[dict[str, tuple[int, int]], int, int, int]:
    """``(stacks, parameter bytes, buffer bytes, AdamW bytes)`` per device of the fullest stage, from the plan of
    the mesh without ``stage``: a stacked Variable of a pipelined stack (leading name a stack axis other than
    those placed like ``unpipelined_layers``: DeepSeek's dense prefix and MTP heads run outside the pipeline,
    whole on every stage) keeps ``ceil(L / S)`` of its ``L`` layers, every other Variable all of its bytes."""
    stacks: dict[str, tuple[int, int]] = {}
    params = buffers = adam = 0
    for row in plan.report.rows:
        share = 1.0
        if row.names and row.names[0] in STACK_AXES and placed_like(row.names[0]) != UNPIPELINED_STACK:
            layers = row.shape[0]
            stacks.setdefault(row.path.split(".")[0], (_fullest(layers, stages), layers))
            share = _fullest(layers, stages) / layers
        if row.is_param:
            params += round(row.bytes_per_device * share)
            adam += round(8 * math.prod(row.per_device_shape) * share)
        else:
            buffers += round(row.bytes_per_device * share)
    return stacks, params, buffers, adam


def _stage_activations(base: MemoryPlan, stages: int, microbatches: int, virtual: int,
                       stacks: dict[str, tuple[int, int]]) -> dict[str, dict[str, dict[str, int]]]:
    s, b = base.shapes, base.local.batch
    m = b // microbatches
    micro = dataclasses.replace(base.local, batch=m)
    # Outside the pipeline (embedding, dense prefix, GPipe's head, loss and MTP heads) each stage runs its share of
    # the rows (activation_embed_and_logits_batch: the batch over 'stage' too; rows that do not divide stay whole).
    share = dataclasses.replace(base.local, batch=b // stages if b % stages == 0 else b)
    fullest = lambda n: _fullest(n, stages)  # noqa: E731
    # Layers outside the pipeline (a dense prefix, and with pipeline_layers the MoE layers before the pipelined
    # ones, on unpipelined stacks): run before it on this stage's rows. A pipelined stack with experts is MoE.
    moe_stacks = {r.path.split(".")[0] for r in base.report.rows if r.names and "exp" in r.names}
    piped_moe = sum(total for name, (_, total) in stacks.items() if name in moe_stacks)
    piped_dense = sum(total for _, total in stacks.values()) - piped_moe
    prefix_dense, prefix_moe = max(0, s.dense_layers - piped_dense), max(0, s.moe_layers - piped_moe)
    prefix = prefix_dense + prefix_moe

    def stage_shapes(chunks: int) -> Any:
        return dataclasses.replace(s, dense_layers=_fullest(fullest(piped_dense), chunks),
                                   moe_layers=_fullest(fullest(piped_moe), chunks), mtp_layers=0)

    def prefix_keep(remat: str) -> int:
        parts = activation_breakdown(dataclasses.replace(s, dense_layers=prefix_dense, moe_layers=prefix_moe,
                                                         mtp_layers=0), share, remat)
        return sum(v for k, v in parts.items() if PART_PHASES[k] == "held" and k not in _OUTSIDE)

    row_input = micro.seq * s.dtype_bytes * s.hidden  # one row's [seq, hidden] in the compute dtype
    per_layer, _ = stack_gathered(base.report, s.expert_gather if s.moe_layers else "fsdp", set(stacks))
    stage_layers = sum(mine for mine, _ in stacks.values())
    stage_gathered = sum(per_layer.get(name, 0) * mine for name, (mine, _) in stacks.items())
    out = {}
    for schedule in PIPELINE_SCHEDULES:
        chunks = virtual if schedule == "interleaved" else 1
        by_remat = {}
        for remat in REMATS:
            layer_parts = activation_breakdown(stage_shapes(chunks), micro, remat)
            keep = sum(v for k, v in layer_parts.items() if PART_PHASES[k] == "held" and k not in _OUTSIDE)
            one_layer = {k: v for k, v in layer_parts.items() if PART_PHASES[k] == "one layer"}
            weights = {k: base.activations[remat][k] for k in base.activations[remat]
                       if k.startswith("gathered") or k in ("embedding gradient", "expert weights, cast once")}
            # A stage runs the same layers every tick, so XLA hoists their all-gathers out of the tick loop: the
            # stage's layers stay gathered through the forward and the backward (XLA's buffer assignment), where
            # the un-pipelined scan gathers one layer at a time.
            weights.pop("gathered weights, one layer", None)
            weights[f"gathered weights, stage's {stage_layers} layers"] = stage_gathered
            if remat == "full":  # as memory_plan: the MLP's cotangents take the down projection's two buffers
                one_layer["cotangents, one layer"] = max(0, one_layer.get("cotangents, one layer", 0)
                                                         - 2 * weights["gathered gradient, one weight"])
            whole = base.activations[remat]  # the un-pipelined plan's outside parts: the whole batch shard
            if schedule == "gpipe":
                parts = {f"{microbatches + stages - 1} time steps' saved activations": (
                             (microbatches + stages - 1) * keep),
                         "micro-batched input, finished outputs": 2 * b * row_input,
                         "embeddings and logits": output_bytes(s, share),
                         **({"mtp heads": whole["mtp heads"] * share.batch // b} if "mtp heads" in whole else {})}
            else:
                ring = (chunks + 1) * stages - 1  # pipeline_order's saved-input slots (2S - 1 for 1F1B)
                unit = "chunk" if chunks > 1 else "stage"
                parts = {f"{ring} {unit} inputs in flight": ring * m * row_input,
                         f"one micro-batch's {unit} recomputed": keep,
                         "input gradients, whole batch": b * row_input,
                         "embeddings and logits": output_bytes(s, micro)}
                if "mtp heads" in whole:  # per micro-batch, with the head
                    parts["mtp heads"] = whole["mtp heads"] * m // b
            if prefix:
                rows = "whole batch" if share.batch == b else f"1/{stages} rows"
                what = (f"dense prefix ({prefix} layers)" if not prefix_moe else
                        f"prefix ({prefix_dense} dense + {prefix_moe} MoE)")
                parts[f"{what}, {rows}"] = prefix_keep(remat)
            by_remat[remat] = {**parts, **one_layer, **weights}
        out[schedule] = by_remat
    return out


def _phases(activations: dict[str, dict[str, dict[str, int]]]) -> dict[str, str]:
    """Each part's phase: the un-pipelined plan's (``PART_PHASES``); the schedules' own parts are held."""
    return {k: PART_PHASES.get(k, "held") for by_remat in activations.values() for parts in by_remat.values()
            for k in parts}


def pipeline_memory_plan(
    model: nnx.Module | Callable[[], nnx.Module],
    config: Any,
    mesh: Mesh | AbstractMesh,
    rules: Rules | str = "default",
    *,
    seq_len: int,
    microbatches: int | None = None,
    schedule: str = "gpipe",
    virtual_stages: int = 2,
    batch_per_device: int | None = None,
    global_batch: int | None = None,
    **kwargs: Any,
) -> PipelinePlan:
    """The per-device memory of the fullest stage of training ``model`` pipelined over ``mesh``'s ``stage`` axis
    (module docstring): the ``memory_plan`` of the same mesh without ``stage`` (its other arguments in
    ``kwargs``), split into stages, with the activations of ``schedule`` (and the others, for comparison).
    ``microbatches`` (default: the stages) must divide each batch shard's rows."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    stages = sizes.pop(STAGE, 1)
    if stages < 2:
        raise ValueError(f"pipeline_memory_plan needs a mesh with a '{STAGE}' axis of size > 1, got {dict(mesh.shape)}"
                         "; use memory_plan for an un-pipelined mesh")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {PIPELINE_SCHEDULES}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    base = memory_plan(model, config, make_abstract_mesh({k: v for k, v in sizes.items() if v > 1}), rules,
                       seq_len=seq_len, batch_per_device=batch_per_device, global_batch=global_batch, **kwargs)
    if base.shapes.kinds or base.shapes.v4 is not None:
        raise ValueError("the per-stage plan covers decoders whose stacks hold one kind of layer each (dense and "
                         "MoE stacks); this model's layer kinds are planned only un-pipelined (memory_plan)")
    micro = stages if microbatches is None else microbatches
    rows = base.local.batch
    if micro < 1 or rows % micro:
        raise ValueError(f"{micro} micro-batches do not divide the {rows} row(s) of each batch shard; choose a "
                         f"--microbatches that divides {rows}, or a larger batch")
    stacks, params, buffers, adam = stage_parameters(base, stages)
    activations = _stage_activations(base, stages, micro, virtual_stages, stacks)
    return PipelinePlan(base=base, stages=stages, microbatches=micro, schedule=schedule,
                        virtual_stages=virtual_stages, stacks=stacks, param_bytes=params, buffer_bytes=buffers,
                        optimizer_bytes=adam, activations=activations, phases=_phases(activations))
