"""The memory plan: what one device holds to train a model on a mesh, before renting the mesh.

``memory_plan`` adds to the sharding report (parameters per device, with the divisibility fallbacks it took) the
gradients, the optimizer state and an estimate of the activations that the backward pass keeps, for a per-device
batch and a sequence length, with and without rematerialization. Nothing is allocated.

Assumptions, each stated in the printed plan:
- Parameters and gradients in the model's ``param_dtype``, sharded like the parameters; AdamW's two moments in
  float32 (``2 x 4`` bytes per parameter, sharded like it).
- Activations in the compute ``dtype``; router logits and scores, the softmax probabilities and everything of the
  cross-entropy in float32. The attention kernel (``kernels["attention"]``): ``xla`` materializes its
  ``[batch, heads, q, k]`` scores; the others (``blockwise``, ``cudnn``, ``tokamax``) keep only the output and a
  float32 log-sum-exp per query and head (their tiles are small and short-lived); ``sparse-top<k>`` (DeepSeek-V3.2)
  attends each query to its ``k`` keys that a lightning indexer chooses, one block of queries at a time: no
  ``[q, k]`` scores are kept, the chosen keys' indices are, and one block's indexer scores are the transient. All
  keys are local (context parallelism splits queries only).
- The loss: the whole batch's logits at once, or (``loss_chunk_tokens``, as the trainer's chunked head +
  cross-entropy does) that many tokens' logits at a time per device.
- ``remat='none'`` keeps every intermediate of every layer for the backward pass; ``remat='full'`` keeps only each
  layer's input and recomputes one layer at a time, so its peak adds one layer's intermediates once, and the
  cotangents of its MLP's backward, which runs while they are all live (``mlp_cotangent_bytes``). The other
  policies (``dots_saveable``, ...) lie between; the plan shows the two ends. A stack of one layer is no loop once
  compiled: XLA merges its recomputation with its forward, so it keeps that layer whole even under ``'full'``.

What it estimates: the peak of the gradient computation's temporaries on one device (XLA's
``memory_analysis().temp_size_in_bytes`` of ``jax.jit(jax.grad(loss))``; parameters are its arguments and the
sharded gradients its outputs, counted apart). The optimizer update adds no temporaries of its own beyond the
gradients it consumes (XLA fuses the float32 AdamW update elementwise). Measured on deepseek3-mini, 8-way FSDP, a
step of gradient + ``clip_by_global_norm`` + AdamW: not donated (as the trainer runs it) 0.81-0.95x this temp;
with its state donated, this temp + the gradients (their own line) within -4% / +8%. The backward pass holds
some parts throughout and runs
the rest in two phases that do not overlap in time, so the peak is ``held + max(output head, one layer)``
(``PART_PHASES``, ``activation_peak``):
- held: the saved activations (every layer under ``'none'``; layer inputs and the one-layer stacks under
  ``'full'``), the MTP heads, and the embedding tables' gradients (a table of the parameter's per-device size
  that the token gradients scatter-add into; XLA allocates it before the backward starts).
- output head: the loss, logits and final norm (below), the output head's weight gathered, and the gathered
  weights of the one-layer stacks (gathered once, kept from their forward to their backward). The head's own
  gradient at gathered size comes after the float32 log-softmax is freed and is smaller, so it is not added.
- one layer: its recomputation (``'full'``), its weights gathered, and the gradient of its largest weight at
  gathered size: each weight's gradient is reduce-scattered (or all-reduced) back to its shard as soon as it is
  computed, so one is whole at a time (measured on XLA's buffer assignment: adding every weight's gathered
  gradient of the layer overshoots by the layer's weight size); with sparse attention, one query block's scratch.
  Under ``'full'``, the MLP's (or MoE's) cotangents beside the recomputed layer (below), less two of the layer's
  largest gathered weight: they peak once the down projection's gathered weight (as large as the gate's and up's,
  which stay) and its gradient are gone (measured on XLA's buffer assignment, FSDP 4 x EP 2: neither is live there).

Per-layer formulas (``T`` tokens on the device = per-device batch ``b`` x local sequence ``s``; ``a`` bytes of
the compute dtype; ``H`` heads, ``V`` vocab, ``e`` width, widths after their tensor-parallel split):
- MLA attention: ``T*a*(3e + 3*q_lora + 3*kv_lora + 2*H*(nope+rope) + 2*H*v) + scores``: three RMSNorms keeping
  3 of their width each (input norm, query latent, kv latent); the concatenated roped query and key; values and
  the attention output.
- MLA with DeepSeek-V3.2's sparse attention (``sparse-top<k>``; ``nnx_zoo.models.deepseek.dsa``, in MLA's
  absorbed form: no per-head keys, values or scores are kept): ``T*a*(3e + 3*q_lora + 3*kv_lora + H*(nope+rope) +
  rope + 2*H*kv_lora + H*v) + T*4*k``: the three norms; ``q_nope`` and the roped query; the shared rope key; the
  absorbed queries ``[H, kv_lora]`` and the context ``[H, kv_lora]`` (the weighted sum of chosen latents); the
  values; the chosen keys' int32 indices ``[T, k]`` (saved by name, ``dsa_chosen``). When the indexer's own loss
  trains it (``indexer_training='sparse'``; ``I`` indexer heads of width ``D``): ``+ T*(a*(I*D + 4D) + 4I)``, its
  queries, its key's LayerNorm and roped key, its float32 head weights (``+ T*4e`` for the float32 copy of a
  bfloat16 input its weights read). These are what autodiff saves, term for term (the test compares them).
  Scratch, one layer at a time (the one-layer phase), per block of ``r`` query rows (``sparse_block_rows``, dsa's
  rule: at most 512, the block's estimated scratch under 64 MiB) against ``S`` keys: the larger of the block's
  forward ``4*b*r*S*(2I + 1)`` (the indexer's float32 products per head and their relu, and the weighted scores;
  the backward recomputes it under remat) and its backward ``4*b*r*k*(3*kv_lora + 2*rope [+ D])`` (the chosen
  keys' gathered latents and rope keys with their cotangents, the gathered index keys when trained), plus the
  blocks' copy of the indexer's queries ``T*(a*I*D + 4I)`` (three when trained: their float32 cotangents).
- GQA attention: ``T*a*(3e + 2*H*d + 4*K*d + H*d) + scores`` (``K`` key/value heads of width ``d``): queries and
  keys before and after rope, values, attention output; with a per-head query and key RMSNorm (``qk_norm``,
  Qwen3) ``+ T*a*3*(H + K)*d``, each keeping 3 of its width like the layer's norms.
- scores: ``xla``: ``b*H*s*S*(a + 10)`` over ``S`` keys: the scores (compute dtype), their float32
  probabilities and the backward's float32 score gradients (measured on XLA's buffers at float32, seq 1024-2048:
  11.9-15.8 bytes per score; ``a + 10`` is the middle);
  the flash-style kernels: ``b*H*s*4``, the float32 log-sum-exp per query row.
- dense SwiGLU MLP: ``T*a*(3e + w*I)``: the norm's 3; ``w = 6`` in a looped stack under ``'none'`` (gate, up,
  sigmoid(gate), 1 - sigmoid(gate), silu(gate), product: every residual autodiff saves is a stacked buffer),
  ``w = 4`` in a layer compiled whole (XLA fuses the sigmoid terms): ``SWIGLU_KEPT``. Its backward under
  ``'full'`` (one layer at a time) adds ``T*a*4*I`` beside those: the product's, up's and gate's cotangents and
  a transposed copy of the gate's for its weight gradient's matmul (``SWIGLU_COTANGENTS`` + 1; measured on XLA's
  buffer assignment: 8 ``[T, I]`` live at the backward's peak, where 4 were counted).
- MoE: ``T*a*3e + T*4*(2E + 2k)`` (float32 router logits and scores, top-k ids and weights) plus the experts:
  dropless grouped matmul (``gmm``/``ep``) ``T*k*a*(2e + w*I)`` (the dispatched copy of each token, expert
  outputs, the SwiGLU), or the dense reference path ``T*(E*a*(w+1)*I + a*e + 4*k*E + a*E)`` (the SwiGLU and
  the combine-weighted product over every expert, the flattened tokens, the one-hot top-k weights, the combine
  weights); shared experts ``T*a*(e + w*I_s)``. Expert parallelism (``ep``) runs a device's ``E_l`` experts
  whole on the tokens of the ``g`` devices its EP axes split them over (all-gathered: ``g*T*(2*a*e + 8k)`` with
  the partial sums), by the platform's dropless path: the grouped matmul's term for ``g*T`` tokens (GPU/TPU), or
  the dense path's over the ``E_l`` local experts (CPU). Under ``'none'`` a looped MoE stack also keeps every layer's
  gathered gate/up expert weights (``kept_expert_weight_bytes``), and the one-layer phase adds one layer's
  cotangents (their own buffers: the intermediates they would reuse sit in the stacked residuals). Under
  ``'full'`` the experts' backward adds their SwiGLU cotangents: ``T*E*a*3*I`` on the dense path (batched
  einsums, no transposed copy), ``T*k*a*4*I`` with ``gmm``, with ``ep`` the same over its ``g*T`` tokens
  (``g*T*E_l*a*3*I`` by its dense local path), shared experts ``T*a*4*I_s``.
- embeddings and output: ``T*a*3e`` (embedding, final norm in and out) + ``L*V*(a + 8 [+4 when a != 4])``: the
  logits of ``L`` tokens (all ``T``, or one chunk of ``loss_chunk_tokens``), their float32 log-softmax and its
  gradient (and the float32 copy of bf16 logits). An MTP head adds a MoE layer, ``T*a*4e`` for its inputs and its
  own logits term.
- gathered weights: each weight all-gathered is a new buffer of its gathered block (the shard stays in the
  parameter's own buffer): one layer of the largest looped stack, the largest other parameter, and every
  one-layer stack. The routed experts' weights go as the MoE path gathers them: ``gmm`` all of a layer's experts
  whole on every device (``3*E*e*I`` elements), ``ep`` this device's ``E / n_ep`` experts whole, ``dense`` their
  FSDP dims only (``EXPERT_GATHERS``). Gathered gradients: the layer's largest weight, at the same size.
- several layer kinds (``config.layer_kinds()``: sliding or chunked attention, NoPE, shared K/V, interleaved MoE;
  ``KindShapes``): each kind's layer by the formulas above with its own heads, widths, norms and attention kernel
  (``kernels["attention_<kind>"]``; a window or chunk changes no kept bytes: ``xla`` masks its full scores,
  the flash-style kernels keep a log-sum-exp per row), run as the model scans them (``kind_segments``: a step of
  a looped pattern, one layer of each of its kinds, is the recomputed unit; a segment of one repeat is kept whole).
  A kind's layer may hold a dense MLP and a MoE block beside it (Gemma 4): both are counted, the MoE read by the
  names every MoE config answers (``num_routed_experts``, ``expert_intermediate_size``, ``num_moe_layers``).
  Per-layer inputs (``hidden_size_per_layer_input`` ``p``, Gemma 4): ``T*a*6*L*p`` held before the layers (the
  second table's rows, the projection, its norm's 3, the mix: ``PER_LAYER_INPUTS_KEPT``) and ``T*a*4*p`` per layer
  (the gate, its GELU, the product: ``PER_LAYER_INPUT_KEPT``).
  Linear-attention kinds (the gated delta rule of Qwen3-Next, Qwen3.5, Kimi Linear, where the config answers
  ``linear_attention_shapes()``): ``nnx_zoo.sharding.plan_linear`` (the state kept at chunk boundaries, the
  projections, convolution and gated norm, one chunk's scratch in the one-layer phase); their full layers beside
  them by the formulas above (MLA where ``kv_lora_rank`` is set, a sigmoid output gate ``+ T*a*2*H*d``).
  A decoding cache for the same rows at ``seq_len`` slots is reported beside the training total, not in it
  (``kv_cache_bytes``: rings of ``span - 1`` for windowed and chunked layers, none for shared K/V; exactly
  ``init_cache``'s keys and values per device, tested). MLA's, DeepSeek-V4's and linear attention's are not modelled.
- expert weights cast once: under ``'full'``, a compute dtype narrower than the parameters' holds the looped stacks'
  routed expert weights cast once for the step (``cast_once_bytes``: each device's shard, at ``a`` bytes).
Compared with XLA's buffer assignment in ``tests/sharding/test_sharding_plan.py`` (and README's sharding section).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from nnx_zoo.sharding.plan_deepseek4 import (
    V4_BLOCK_SCORE_BYTES,
    V4_SCORE_GRAD_BYTES,
    hyper_connection_bytes,
    v4_activation_breakdown,
    v4_attention_bytes,
    v4_attention_scratch_bytes,
    v4_description,
    v4_layer_bytes,
    v4_score_bytes,
    v4_score_part,
    v4_stack_name,
    v4_weight_parts,
)
from nnx_zoo.sharding.plan_layers import (
    EXPERT_GATHERS,
    GATE_EXTRA_KEPT,
    GATHERED_NAMES,
    KIND_MAX_PERIOD,
    LOCAL_ATTENTION,
    PART_PHASES,
    PER_LAYER_INPUT_KEPT,
    PER_LAYER_INPUTS_KEPT,
    PHASES,
    REMATS,
    SPARSE,
    SPARSE_BLOCK_BYTES,
    SPARSE_MAX_ROWS,
    SWIGLU_CLAMP_KEPT,
    SWIGLU_COTANGENTS,
    SWIGLU_KEPT,
    V4_BLOCK,
    V4_CSA,
    V4_HASH,
    V4_HCA,
    V4_SLIDING,
    V4_XLA_MAX_SCORES,
    DecoderShapes,
    GatheredWeights,
    KindShapes,
    Local,
    V4Shapes,
    _shards,
    activation_peak,
    attention_bytes,
    cast_once_bytes,
    compressed_block_rows,
    embedding_gradient_bytes,
    ep_expert_bytes,
    gathered_weight_bytes,
    gathered_weights,
    kept_expert_weight_bytes,
    kind_activation_breakdown,
    kind_attention_bytes,
    kind_cotangent_bytes,
    kind_description,
    kind_layer_bytes,
    kind_local,
    kind_schedule,
    kind_segments,
    kind_weight_parts,
    kv_cache_bytes,
    local_sizes,
    mlp_bytes,
    mlp_cotangent_bytes,
    moe_bytes,
    output_bytes,
    periodic_runs,
    sparse_attention_bytes,
    sparse_block_rows,
    sparse_row_bytes,
    sparse_scratch_bytes,
    stack_gathered,
    stack_norms,
    swiglu_kept,
    tiled_grouped_matmul_bytes,
    weight_parts,
)
from nnx_zoo.sharding.report import ShardingReport, _human, sharding_report
from nnx_zoo.sharding.rules import Rules, get_rules

# The shapes and formulas live in plan_layers and plan_deepseek4 (split out of this module); every public name
# of theirs stays importable from here.
__all__ = [
    "activation_breakdown",
    "activation_peak",
    "attention_bytes",
    "cast_once_bytes",
    "compressed_block_rows",
    "DecoderShapes",
    "embedding_gradient_bytes",
    "ep_expert_bytes",
    "EXPERT_GATHERS",
    "GATE_EXTRA_KEPT",
    "GATHERED_NAMES",
    "gathered_weight_bytes",
    "gathered_weights",
    "GatheredWeights",
    "hyper_connection_bytes",
    "kept_expert_weight_bytes",
    "kind_activation_breakdown",
    "kind_attention_bytes",
    "kind_cotangent_bytes",
    "kind_description",
    "kind_layer_bytes",
    "kind_local",
    "KIND_MAX_PERIOD",
    "kind_schedule",
    "kind_segments",
    "kind_weight_parts",
    "KindShapes",
    "kv_cache_bytes",
    "Local",
    "LOCAL_ATTENTION",
    "local_sizes",
    "memory_plan",
    "MemoryPlan",
    "mlp_bytes",
    "mlp_cotangent_bytes",
    "moe_bytes",
    "output_bytes",
    "PART_PHASES",
    "PER_LAYER_INPUT_KEPT",
    "PER_LAYER_INPUTS_KEPT",
    "periodic_runs",
    "PHASES",
    "REMATS",
    "SPARSE",
    "sparse_attention_bytes",
    "SPARSE_BLOCK_BYTES",
    "sparse_block_rows",
    "SPARSE_MAX_ROWS",
    "sparse_row_bytes",
    "sparse_scratch_bytes",
    "stack_gathered",
    "stack_norms",
    "SWIGLU_CLAMP_KEPT",
    "SWIGLU_COTANGENTS",
    "swiglu_kept",
    "SWIGLU_KEPT",
    "tiled_grouped_matmul_bytes",
    "v4_activation_breakdown",
    "v4_attention_bytes",
    "v4_attention_scratch_bytes",
    "V4_BLOCK",
    "V4_BLOCK_SCORE_BYTES",
    "V4_CSA",
    "v4_description",
    "V4_HASH",
    "V4_HCA",
    "v4_layer_bytes",
    "v4_score_bytes",
    "V4_SCORE_GRAD_BYTES",
    "v4_score_part",
    "V4_SLIDING",
    "v4_stack_name",
    "v4_weight_parts",
    "V4_XLA_MAX_SCORES",
    "V4Shapes",
    "weight_parts",
]


def activation_breakdown(s: DecoderShapes, n: Local, remat: str) -> dict[str, int]:
    """Bytes per device by part of the activations for ``remat`` 'none' or 'full' (module docstring); the
    weight and gradient parts come from the sharding report (``memory_plan``)."""
    if remat not in REMATS:
        raise ValueError(f"the estimate covers remat 'none' and 'full', got {remat!r}")
    if s.v4 is not None:
        return v4_activation_breakdown(s, n, remat)
    if s.kinds:
        return kind_activation_breakdown(s, n, remat)
    # A layer of a looped stack under 'none' stores its residuals across the loop; one compiled whole (no loop,
    # or recomputed inside the backward's loop body) keeps fewer (SWIGLU_KEPT).
    def dense_layer(looped: bool) -> int:
        return attention_bytes(s, n) + mlp_bytes(s, n, looped)

    def moe_layer(looped: bool) -> int:
        return attention_bytes(s, n) + moe_bytes(s, n, looped)

    layer_input = n.tokens * s.dtype_bytes * s.hidden
    # An MTP head: its inputs (embedding, hidden, their norms), one MoE layer (remat like the stacks) and logits.
    mtp = 0
    if s.mtp_layers:
        mtp_layer = moe_layer(False) if remat == "none" or s.mtp_layers == 1 else layer_input
        mtp = s.mtp_layers * (mtp_layer + n.tokens * s.dtype_bytes * 4 * s.hidden + output_bytes(s, n))
    if remat == "none":
        layers = {"dense layers": s.dense_layers * dense_layer(s.dense_layers > 1),
                  "moe layers": s.moe_layers * moe_layer(s.moe_layers > 1)}
        if s.moe_layers > 1:  # a looped stack keeps every layer's gathered experts (a one-layer stack's: below)
            layers["expert weights, every layer"] = s.moe_layers * kept_expert_weight_bytes(s, n)
        # The backward of a looped layer makes a cotangent for each intermediate it reads, at its size. The
        # intermediates sit in the stacked residuals, so one layer's cotangents (a layer compiled whole: XLA
        # fuses the elementwise ones) need room of their own (measured: the one-layer phase, not the per-layer
        # slope, was short by this). Under 'full' the MLP's cotangents too (mlp_cotangent_bytes, below).
        looped = [size(False) for count, size in ((s.dense_layers, dense_layer), (s.moe_layers, moe_layer))
                  if count > 1]
        layers["cotangents, one layer"] = max(looped, default=0)
    else:
        # A stack of one layer is no loop once compiled: XLA merges its recomputation with the forward (CSE), so
        # it keeps that layer's intermediates as if remat were off.
        stacks = [(s.dense_layers, dense_layer(False), mlp_cotangent_bytes(s, n, False)),
                  (s.moe_layers, moe_layer(False), mlp_cotangent_bytes(s, n, True))]
        looped = [(count, size, cot) for count, size, cot in stacks if count > 1]
        _, size, cot = max(looped, key=lambda stack: stack[1] + stack[2], default=(0, 0, 0))
        layers = {"layer inputs": sum(count for count, _, _ in looped) * layer_input,
                  "one layer recomputed": size, "cotangents, one layer": cot,
                  "one-layer stacks, kept whole": sum(size for count, size, _ in stacks if count == 1)}
    # The sparse attention's scratch is live while one layer's attention runs (its blocks, recomputed in the
    # backward); a layer at a time, under either remat.
    scratch = sparse_scratch_bytes(s, n)
    return {**layers, **({"sparse attention, one block": scratch} if scratch else {}),
            "embeddings and logits": output_bytes(s, n), **({"mtp heads": mtp} if mtp else {})}



@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory of a training run: ``print(plan.table())``, ``plan.to_dict()``."""

    report: ShardingReport
    shapes: DecoderShapes
    local: Local
    global_batch: int
    seq_len: int
    activations: dict[str, dict[str, int]]  # remat -> part -> bytes
    # A decoding cache for the global batch at seq_len slots (``kv_cache_bytes``); None where not modelled.
    cache_bytes: int | None = None

    @property
    def param_bytes(self) -> int:
        return self.report.param_bytes_per_device

    @property
    def optimizer_bytes(self) -> int:
        """AdamW: two float32 moments per parameter, sharded like it."""
        return sum(8 * math.prod(r.per_device_shape) for r in self.report.params)

    def activation_bytes(self, remat: str) -> int:
        """The estimated peak of the backward's temporaries (``activation_peak``)."""
        return activation_peak(self.activations[remat])

    @property
    def buffer_bytes(self) -> int:
        """The Variables that are not parameters (no gradient, no optimizer state): routers' selection biases,
        DeepSeek-V4's hash-routing tables (``[vocab, k]`` int32 per hash layer, replicated)."""
        return self.report.bytes_per_device - self.param_bytes

    def total(self, remat: str) -> int:
        """Parameters + gradients (same size) + optimizer state + buffers + the activations' peak."""
        return 2 * self.param_bytes + self.optimizer_bytes + self.buffer_bytes + self.activation_bytes(remat)

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": self.report.mesh_shape, "global_batch": self.global_batch, "seq_len": self.seq_len,
                "local": dataclasses.asdict(self.local), "param_bytes_per_device": self.param_bytes,
                "gradient_bytes_per_device": self.param_bytes, "adamw_bytes_per_device": self.optimizer_bytes,
                "activations": self.activations,
                "activation_peak_bytes_per_device": {r: self.activation_bytes(r) for r in REMATS},
                "buffer_bytes_per_device": self.buffer_bytes,
                "total_bytes_per_device": {r: self.total(r) for r in REMATS},
                "fallback_bytes_per_device": self.report.fallback_bytes_per_device,
                "decoding_cache_bytes_per_device": self.cache_bytes}

    def table(self) -> str:
        s, n = self.shapes, self.local
        dtype = {4: "float32", 2: "bfloat16"}.get(s.dtype_bytes, f"{s.dtype_bytes}-byte")
        attention = f"attention {s.attention} " + (
            "(scores materialized)" if s.attention == "xla" else
            f"(each query's {s.index_topk} chosen keys, the indexer's scores a block of queries at a time)"
            if s.index_topk else "(no score matrix)")
        if s.v4 is not None:
            attention = v4_description(s.v4, n.keys)
        lines = [
            f"memory plan per device: {n.batch} row(s) x {n.seq} positions (global batch {self.global_batch} x "
            f"sequence {self.seq_len}); activations in {dtype}, "
            + (f"MoE path {s.moe_impl}, " if s.experts else "")  # a dense model has no MoE path to name
            + f"{attention}, logits of "
            + (f"{min(n.tokens, s.loss_chunk_tokens)} tokens at a time" if s.loss_chunk_tokens else "every token"),
            *([f"  {kind_description(s)}"] if s.kinds else []),
            f"  parameters                  {_human(self.param_bytes)}",
            f"  gradients                   {_human(self.param_bytes)}  (parameter dtype, sharded like them)",
            f"  AdamW state                 {_human(self.optimizer_bytes)}  (2 moments in float32)",
        ]
        if self.buffer_bytes:
            lines.append(f"  buffers                     {_human(self.buffer_bytes)}  (not trained: routing biases, "
                         "hash-routing tables)")
        for remat in REMATS:
            parts = self.activations[remat]
            lines.append(f"  activations, remat {remat:<5}   {_human(self.activation_bytes(remat))}  (peak: what the "
                         "backward holds throughout + the larger of its output-head and one-layer phases)")
            for phase in PHASES:
                lines += [f"    {phase + ':':<13}{k:<38}{_human(v)}" for k, v in parts.items()
                          if PART_PHASES[k] == phase and v]
        lines.append("  total                       " + ", ".join(
            f"remat {r}: {_human(self.total(r))}" for r in REMATS))
        if self.cache_bytes is not None:
            rings = sorted({k.span for k in s.kinds if k.span and k.kv})
            lines.append(f"  decoding cache              {_human(self.cache_bytes)}  (not in the total: keys and "
                         f"values of {self.global_batch} row(s) x {self.seq_len} slots"
                         + (f", rings of span - 1 for the {'/'.join(map(str, rings))}-token layers" if rings else "")
                         + ")")
        if self.report.fallbacks:
            lines.append(f"  (parameters include {_human(self.report.fallback_bytes_per_device)} per device "
                         "replicated by divisibility fallbacks; see above)")
        return "\n".join(lines)


def memory_plan(
    model: nnx.Module | Callable[[], nnx.Module],
    config: Any,
    mesh: Mesh | AbstractMesh,
    rules: Rules | str = "default",
    *,
    seq_len: int,
    batch_per_device: int | None = None,
    global_batch: int | None = None,
    allow_partial: bool = True,
    kernels: dict[str, str] | None = None,
    loss_chunk_tokens: int | None = None,
) -> MemoryPlan:
    """The per-device memory plan of training ``model`` (built from ``config``) on ``mesh``.

    >>> mesh = make_abstract_mesh({"data": 4, "fsdp": 256, "expert": 8})
    >>> plan = memory_plan(lambda: Model(config, rngs=nnx.Rngs(0)), config, mesh, "default", seq_len=4096)
    >>> print(plan.report.table()); print(plan.table())

    ``batch_per_device`` rows per batch shard (the global batch is that times the mesh's batch shards, those
    of ``activation_batch``), or ``global_batch`` split over them (at least one row each; default one row per
    shard); ``seq_len`` is the whole sequence (context parallelism splits it). Divisibility fallbacks as in
    ``sharding_report`` (``allow_partial``). ``kernels``: the implementations that will run, as
    ``nnx_zoo.layers.kernel_choices.kernel_choices`` gives them for the target platform (``{"attention": "cudnn",
    "moe": "gmm", ...}``; default: the config's settings, ``auto`` counted as materialized attention scores and ``gmm``,
    and a config's sparse attention, ``sparse_attention_keys(seq_len)``, as ``sparse-top<k>``).
    ``loss_chunk_tokens``: the trainer's chunked loss holds that many tokens' logits at a time per device
    (``nnx_zoo.train.loss.default_chunk_tokens``); None: the whole batch's logits at once.
    """
    rules = get_rules(rules)
    # Without a kernel named: a config's sparse attention (DeepSeek-V3.2) runs whatever its attention_impl says,
    # as kernel_choices reports it.
    sparse_keys = getattr(config, "sparse_attention_keys", None)
    if V4Shapes.from_config(config) is not None:  # V4's indexer is part of its own attention (V4Shapes)
        sparse_keys = None
    topk = sparse_keys(seq_len) if sparse_keys is not None and not (kernels or {}).get("attention") else 0
    if topk:
        kernels = {**(kernels or {}), "attention": f"{SPARSE}{topk}"}
    batch_shards = _shards("activation_batch", rules, mesh)
    if batch_per_device is None:
        batch_per_device = max(1, -(-(global_batch or batch_shards) // batch_shards))
    if batch_per_device < 1 or seq_len < 1:
        raise ValueError(f"the batch per device and seq_len must be positive, got {batch_per_device} and {seq_len}")
    report = sharding_report(model, mesh, rules, allow_partial=allow_partial)
    shapes = DecoderShapes.from_config(config, kernels, loss_chunk_tokens)
    if shapes.kinds:  # each kind's norms as its stack holds them
        norms = stack_norms(report, {k.stack for k in shapes.kinds}, shapes.hidden)
        shapes = dataclasses.replace(shapes, kinds=tuple(dataclasses.replace(k, norms=norms[k.stack] or k.norms)
                                                         for k in shapes.kinds))
    local = local_sizes(shapes, batch_per_device, seq_len, rules, mesh)
    if shapes.v4 is not None:
        weights = v4_weight_parts(report, shapes)
    elif shapes.kinds:
        weights = kind_weight_parts(report, shapes)
    else:
        weights = weight_parts(report, shapes.expert_gather if shapes.moe_layers else "fsdp")
    activations = {remat: {**activation_breakdown(shapes, local, remat), **weights} for remat in REMATS}
    # Under 'full' the MLP's cotangents peak after its down projection's gathered weight and gradient are gone
    # (the largest of the layer, like its gate's and up's): they take those two buffers first.
    full = activations["full"]
    full["cotangents, one layer"] = max(0, full["cotangents, one layer"] - 2 * weights["gathered gradient, one weight"])
    cast = cast_once_bytes(report, shapes)
    if cast:  # under 'none' the layers keep their cast weights anyway ("expert weights, every layer")
        full["expert weights, cast once"] = cast
    global_batch = batch_per_device * batch_shards
    kinds = getattr(config, "layer_kinds", ())
    kinds = kinds() if callable(kinds) else kinds
    softmax_only = all(getattr(k, "attention", "full") in LOCAL_ATTENTION for k in kinds)  # no recurrent state
    cache = kv_cache_bytes(shapes, global_batch, seq_len, rules, mesh) if softmax_only else None
    return MemoryPlan(report=report, shapes=shapes, local=local, global_batch=global_batch, seq_len=seq_len,
                      activations=activations, cache_bytes=cache)

