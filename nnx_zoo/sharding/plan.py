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
Compared with XLA's buffer assignment in ``tests/sharding/test_sharding_plan.py`` (and README's sharding section).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from nnx_zoo.sharding.axes import STACK_AXES, placed_like
from nnx_zoo.sharding.plan_linear import (
    LinearShapes,
    linear_chunk_scratch_bytes,
    linear_description,
    linear_layer_bytes,
)
from nnx_zoo.sharding.report import ShardingReport, _human, sharding_report
from nnx_zoo.sharding.resolve import ShardingError, axes_tuple, logical_to_mesh_axes
from nnx_zoo.sharding.rules import Rules, get_rules

REMATS = ("none", "full")
SPARSE = "sparse-top"  # the attention kernel's name for top-k sparse attention: 'sparse-top2048'


@dataclasses.dataclass(frozen=True)
class DecoderShapes:
    """The sizes the activation estimate needs, read from any config with Hugging Face field names.

    >>> shapes = DecoderShapes.from_config(config)   # hidden_size, num_attention_heads, kv_lora_rank, ...
    """

    hidden: int
    vocab: int
    heads: int
    dense_layers: int
    moe_layers: int
    mtp_layers: int
    intermediate: int  # dense MLP width
    dtype_bytes: int
    # attention: MLA when kv_lora > 0, else grouped-query attention with kv_heads x head_dim
    kv_lora: int = 0
    q_lora: int = 0
    nope: int = 0
    rope: int = 0
    v_head: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False  # grouped-query attention RMS-normalizes each query and key head (Qwen3)
    # MoE
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    moe_impl: str = "gmm"  # the MoE path: 'gmm' (dropless grouped matmul), 'dense' or 'ep'
    # Expert parallelism's dropless computation on a device's own experts (``nnx_zoo.layers.moe``'s
    # ``_ep_dropless``, the platform's default path): 'gmm' (a grouped matmul) or 'dense' (every local expert).
    ep_local: str = "gmm"
    # What the MoE path gathers of its expert weights while a layer runs (EXPERT_GATHERS).
    expert_gather: str = "all"
    # The attention kernel: 'xla' materializes the scores; 'blockwise', 'cudnn' and 'tokamax' do not;
    # 'sparse-top<k>': DeepSeek-V3.2's sparse attention (each query's top-k keys by a lightning indexer).
    attention: str = "xla"
    # The sparse attention's lightning indexer (``index_n_heads`` x ``index_head_dim``, the config's
    # ``index_topk``), and whether its own loss trains it (``indexer_training='sparse'``: its tensors are kept).
    index_topk: int = 0
    index_heads: int = 0
    index_dim: int = 0
    indexer_trained: bool = False
    grouped_matmul: str = "kernel"  # 'tiled': the portable grouped matmul (per-tile weight copies); else a kernel
    loss_chunk_tokens: int | None = None  # tokens whose logits the loss holds at once per device; None: all
    swiglu_clamped: bool = False  # the SwiGLUs clamp their pre-activations (``swiglu_limit``): more residuals
    gate_activation: str = "silu"  # the gated MLPs' activation (``config.gate_activation``; GATE_EXTRA_KEPT)
    v4: V4Shapes | None = None  # DeepSeek-V4's own parts (``V4Shapes``); None for every other family
    # Several layer kinds (local attention, NoPE, shared K/V, interleaved MoE): each kind's own sizes and the stack
    # of each layer in model order (``KindShapes``, ``kind_schedule``); empty for one kind of layer per stack.
    kinds: tuple[KindShapes, ...] = ()
    schedule: tuple[str, ...] = ()
    # Per-layer inputs (HF ``hidden_size_per_layer_input``, Gemma 3n / 4): a ``[layers x width]`` input per token,
    # made once from a second embedding table and a projection, gated into each layer; 0: none.
    per_layer_input: int = 0

    @classmethod
    def from_config(cls, config: Any, kernels: dict[str, str] | None = None,
                    loss_chunk_tokens: int | None = None) -> DecoderShapes:
        """From a model config with HF names (a dense decoder or an MLA/MoE one). ``kernels``: the implementations
        that will run (``nnx_zoo.layers.kernel_choices.kernel_choices``); without them the config's settings, where
        ``auto`` counts as ``xla`` attention (scores materialized: the upper bound) and the ``gmm`` MoE path."""
        get = lambda name, default=0: getattr(config, name, default) or default  # noqa: E731
        layers = get("num_hidden_layers")
        # The MoE questions every MoE family's config answers (the causal-LM contract's names, not HF's, which
        # differ by family: Mixtral's experts are `num_local_experts` wide `intermediate_size`).
        experts = get("num_routed_experts")
        moe_layers = get("num_moe_layers") if experts else 0
        kernels = kernels or {}
        impl = kernels.get("moe") or get("moe_impl", "gmm")
        v4 = V4Shapes.from_config(config)
        attention = kernels.get("attention") or get("attention_impl", "xla")
        if v4 is not None:  # V4 runs its own attention kernel by its own attention_impl (V4Shapes.impl), not these
            attention = v4.attention
        topk = int(attention[len(SPARSE):]) if attention.startswith(SPARSE) else 0
        return cls(
            hidden=config.hidden_size, vocab=config.vocab_size, heads=config.num_attention_heads,
            dense_layers=layers - moe_layers, moe_layers=moe_layers, mtp_layers=get("num_nextn_predict_layers"),
            intermediate=get("intermediate_size"), dtype_bytes=jnp.dtype(get("dtype", "float32")).itemsize,
            kv_lora=get("kv_lora_rank"), q_lora=get("q_lora_rank"), nope=get("qk_nope_head_dim"),
            rope=get("qk_rope_head_dim"), v_head=get("v_head_dim"),
            kv_heads=get("num_key_value_heads", config.num_attention_heads),
            head_dim=get("head_dim") or config.hidden_size // config.num_attention_heads,
            qk_norm=bool(getattr(config, "qk_norm", False)) and not get("kv_lora_rank"),
            experts=experts, top_k=get("num_experts_per_tok"), moe_intermediate=get("expert_intermediate_size"),
            shared_intermediate=get("shared_expert_intermediate_size"),
            moe_impl="gmm" if impl == "auto" else impl,
            # kernel_choices names the grouped matmul for ep where its local path runs one (GPU/TPU), not on CPU.
            ep_local="gmm" if "grouped_matmul" in kernels or "moe" not in kernels else "dense",
            expert_gather={"dense": "fsdp", "ep": "all-but-exp"}.get(impl, "all"),
            attention="xla" if attention == "auto" else attention, loss_chunk_tokens=loss_chunk_tokens,
            grouped_matmul=kernels.get("grouped_matmul") or get("grouped_matmul_impl", "kernel"),
            index_topk=topk, index_heads=get("index_n_heads") if topk else 0,
            index_dim=get("index_head_dim") if topk else 0,
            indexer_trained=bool(topk) and get("indexer_training", "off") == "sparse",
            swiglu_clamped=getattr(config, "swiglu_limit", None) is not None, v4=v4,
            gate_activation=getattr(config, "gate_activation", None) or "silu",
            per_layer_input=get("hidden_size_per_layer_input"),
            **kind_schedule(config, kernels, "xla" if attention == "auto" else attention),
        )


LOCAL_ATTENTION = ("full", "sliding", "chunked")  # the attention kinds the shared decoder layers run


@dataclasses.dataclass(frozen=True)
class KindShapes:
    """One layer kind's own sizes (``config.layer_kinds()``), read through the config's per-kind answers:
    ``attention_options(kind)`` (window, chunk, sinks), ``head_dims(kind)`` where widths differ by kind (Gemma 4's
    global layers), ``mlp_width(kind)`` (0: no dense MLP), and the kind's own fields ``rope`` (False: NoPE) and
    ``kv`` (``"shared"``: no key/value projections, another layer's keys and values).

    >>> [k.stack for k in DecoderShapes.from_config(config).kinds]   # GPT-OSS
    ['sliding_layers', 'layers']
    """

    stack: str
    attention: str  # 'full' | 'sliding' | 'chunked'
    kernel: str  # the attention kernel its layers run (kernels' ``attention_<kind>``, else ``attention``)
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int  # dense MLP width (0: none)
    moe: bool
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False
    rope: bool = True
    kv: bool = True  # computes its own keys and values
    l2_qk_norm: bool = False  # a weightless per-head norm of queries and keys (Llama 4's rope layers)
    temperature: bool = False  # queries scaled by their slot in float32 (Llama 4's NoPE layers)
    norms: int = 2  # RMSNorms of the hidden width in a layer (input and post-attention: 2; Gemma's sandwich: 4)
    output_gate: bool = False  # the attention output scaled by a sigmoid gate from the input (Qwen3-Next)
    linear: LinearShapes | None = None  # a linear-attention kind (the gated delta rule; ``plan_linear``)

    @property
    def span(self) -> int | None:
        """Keys a query sees at most (its window or chunk; None: every earlier one)."""
        spans = [v for v in (self.window, self.chunk) if v is not None]
        return min(spans) if spans else None


def kind_schedule(config: Any, kernels: dict[str, str], attention: str) -> dict[str, Any]:
    """``DecoderShapes``' ``kinds`` and ``schedule`` of a config with several layer kinds on the shared decoder
    layers (``layer_kinds``, ``attention_options``, ``stack_name``); empty for one kind (the plain path counts
    it) and for DeepSeek's own configs. Linear-attention kinds (``attention == "linear"``) are counted where the
    config answers ``linear_attention_shapes()`` (``plan_linear``)."""
    kinds_of = getattr(config, "layer_kinds", None)
    if kinds_of is None or not hasattr(config, "attention_options") or not hasattr(config, "stack_name"):
        return {}
    kinds = tuple(kinds_of())
    linear = LinearShapes.from_config(config)
    known = LOCAL_ATTENTION + (("linear",) if linear is not None else ())
    if len(set(kinds)) < 2 or any(k.attention not in known for k in kinds):
        return {}
    out = []
    for kind in dict.fromkeys(kinds):
        if kind.attention == "linear":
            out.append(KindShapes(stack=config.stack_name(kind), attention="linear", kernel="delta rule", heads=0,
                                  kv_heads=0, head_dim=0, mlp=config.mlp_width(kind) if hasattr(config, "mlp_width")
                                  else (0 if kind.moe else config.intermediate_size), moe=bool(kind.moe),
                                  linear=linear))
            continue
        options = config.attention_options(kind)
        head_dim, kv_heads = (config.head_dims(kind) if hasattr(config, "head_dims")
                              else (config.head_dim, config.num_key_value_heads))
        kernel = kernels.get(f"attention_{kind.attention}") or attention
        out.append(KindShapes(
            stack=config.stack_name(kind), attention=kind.attention, kernel="xla" if kernel == "auto" else kernel,
            heads=config.num_attention_heads, kv_heads=kv_heads, head_dim=head_dim,
            mlp=config.mlp_width(kind) if hasattr(config, "mlp_width") else (0 if kind.moe else
                                                                              config.intermediate_size),
            moe=bool(kind.moe), window=options.get("window"), chunk=options.get("chunk"),
            sinks=bool(options.get("sinks")), rope=bool(getattr(kind, "rope", True)),
            kv=getattr(kind, "kv", "own") != "shared", l2_qk_norm=bool(options.get("l2_qk_norm")),
            temperature=options.get("temperature") is not None,
            output_gate=bool(getattr(config, "ATTENTION_OUTPUT_GATE", False))))
    name = {kind: config.stack_name(kind) for kind in set(kinds)}
    return {"kinds": tuple(out), "schedule": tuple(name[k] for k in kinds)}


def periodic_runs(kinds: list[Any] | tuple[Any, ...], max_period: int) -> list[tuple[tuple[Any, ...], int]]:
    """A schedule as the models scan it: ``(pattern, repeats)`` segments (``nnx_zoo.layers.scan.periodic_runs``'s
    rule; a segment of one repeat is no loop once compiled)."""
    kinds, out, i = list(kinds), [], 0
    while i < len(kinds):
        best, cover = (tuple(kinds[i:i + 1]), 1), 1
        for period in range(1, max_period + 1):
            pattern = kinds[i:i + period]
            if len(pattern) < period:
                break
            repeats = 1
            while kinds[i + repeats * period:i + (repeats + 1) * period] == pattern:
                repeats += 1
            if repeats > 1 and repeats * period > cover:
                best, cover = (tuple(pattern), repeats), repeats * period
        out.append(best)
        i += cover
    return out


KIND_MAX_PERIOD = 8  # nnx_zoo.layers.scan.segments' max_period: the shared decoder's scan patterns


@dataclasses.dataclass(frozen=True)
class Local:
    """Per-device sizes after the activation rules split them: batch rows, query positions, keys, widths."""

    batch: int
    seq: int
    keys: int
    heads: int
    kv_heads: int
    mlp: int
    moe_mlp: int
    vocab: int
    experts: int  # the dense MoE path's [tokens, experts, width] split (the tokens' axes come first)
    shared_mlp: int
    ep_experts: int = 0  # experts on each device under expert parallelism (the weights' ``exp`` rule)
    # Expert parallelism gathers the tokens over the EP axes that split them (batch or sequence): each device
    # computes its experts on this many devices' tokens.
    ep_token_gather: int = 1
    # Shards of the heads, key/value heads and MLP width (each layer kind's widths split by them: ``kind_local``).
    head_shards: int = 1
    kv_head_shards: int = 1
    mlp_shards: int = 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def _shards(name: str, rules: Rules, mesh: Mesh | AbstractMesh) -> int:
    axes = axes_tuple(logical_to_mesh_axes((name,), rules, mesh)[0])
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return math.prod(sizes[a] for a in axes)


def _joint_shards(names: tuple[str, ...], dim: int, rules: Rules, mesh: Mesh | AbstractMesh) -> int:
    """Shards of dim ``dim`` of an array with logical ``names``: an axis an earlier dim takes is not reused."""
    axes = axes_tuple(logical_to_mesh_axes(names, rules, mesh)[dim])
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return math.prod(sizes[a] for a in axes)


def _ep_token_gather(rules: Rules, mesh: Mesh | AbstractMesh) -> int:
    """Shards of the EP axes (``exp``'s) that also split the tokens (``activation_batch``, ``activation_length``):
    what ``ep`` all-gathers the tokens over (``nnx_zoo.layers.moe._ep_shard``)."""
    ep = axes_tuple(logical_to_mesh_axes(("exp",), rules, mesh)[0])
    tokens = [a for spec in logical_to_mesh_axes(("activation_batch", "activation_length"), rules, mesh)
              for a in axes_tuple(spec)]
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return math.prod(sizes[a] for a in ep if a in tokens)


def _split(size: int, parts: int) -> int:
    return -(-size // parts)


def local_sizes(shapes: DecoderShapes, batch_per_device: int, seq_len: int, rules: Rules,
                mesh: Mesh | AbstractMesh) -> Local:
    """Per-device activation sizes: the sequence splits over the context-parallel axes (``activation_length``),
    widths over their tensor-parallel axes; ``batch_per_device`` rows per batch shard."""
    cp = _shards("activation_length", rules, mesh)
    if seq_len % cp:
        raise ShardingError(f"sequence length {seq_len} does not divide over the {cp} context-parallel shards of "
                            "this mesh and rule set; choose a multiple of it")
    s = shapes
    return Local(
        batch=batch_per_device, seq=seq_len // cp, keys=seq_len,
        heads=_split(s.heads, _shards("activation_heads", rules, mesh)),
        kv_heads=_split(s.kv_heads, _shards("activation_kv_heads", rules, mesh)),
        mlp=_split(s.intermediate, _shards("activation_mlp", rules, mesh)),
        moe_mlp=_split(s.moe_intermediate, _shards("activation_moe_mlp", rules, mesh)),
        vocab=_split(s.vocab, _shards("activation_vocab", rules, mesh)),
        # Resolved with the tokens: an axis the tokens take (e.g. expert under the default rules) splits no expert.
        experts=_split(s.experts, _joint_shards(("activation_tokens", "activation_exp"), 1, rules, mesh)),
        shared_mlp=_split(s.shared_intermediate, _shards("activation_mlp", rules, mesh)),
        ep_experts=_split(s.experts, _shards("exp", rules, mesh)),
        ep_token_gather=_ep_token_gather(rules, mesh) if s.moe_impl == "ep" else 1,
        head_shards=_shards("activation_heads", rules, mesh),
        kv_head_shards=_shards("activation_kv_heads", rules, mesh), mlp_shards=_shards("activation_mlp", rules, mesh),
    )


def attention_bytes(s: DecoderShapes, n: Local) -> int:
    """What one attention layer keeps for its backward pass (module docstring's formula)."""
    a, t, e, h = s.dtype_bytes, n.tokens, s.hidden, n.heads
    if s.index_topk:
        return sparse_attention_bytes(s, n)
    if s.attention == "xla":  # scores, float32 probabilities, the backward's float32 score gradients
        scores = n.batch * h * n.seq * n.keys * (a + 10)
    else:  # flash-style kernels: the float32 log-sum-exp per query row and head
        scores = n.batch * h * n.seq * 4
    if s.kv_lora:
        # Each RMSNorm keeps 3 of its width (input in float32, normalized, scaled): the layer's input norm, the
        # query latent's and the kv latent's; the concatenated, roped query and key; the values and the attention
        # output. The q_b / kv_b outputs and rope parts before concatenation are not kept (recomputed from these).
        per_token = 3 * e + 3 * s.q_lora + 3 * s.kv_lora + 2 * h * (s.nope + s.rope) + 2 * h * s.v_head
    else:
        d = s.head_dim
        per_token = 3 * e + 2 * h * d + 4 * n.kv_heads * d + h * d
        if s.qk_norm:  # each head's RMSNorm keeps 3 of its width, as the layer's norms do
            per_token += 3 * (h + n.kv_heads) * d
    return t * a * per_token + scores


def sparse_attention_bytes(s: DecoderShapes, n: Local) -> int:
    """What one MLA layer with DeepSeek-V3.2's sparse attention keeps for its backward (``nnx_zoo.models.deepseek.
    dsa``): the three RMSNorms as in MLA; ``q_nope`` (for the gradient of ``kv_b_proj``'s key half), the roped
    query, the absorbed queries ``[H, kv_lora]`` and the context ``[H, kv_lora]`` (the attention-weighted sum of
    latents), the shared rope key and the values (``o_proj``'s input); no per-head keys or values and no scores:
    the blocks recompute those. The chosen keys' indices, int32 ``[T, topk]``, are saved (``dsa_chosen``). When its
    loss trains the indexer: its queries ``[index_heads, index_dim]``, its float32 head weights, its key's LayerNorm
    (3 widths) and roped key, and (a bfloat16 model) the float32 copy of the layer input its weights read."""
    a, t, e, h = s.dtype_bytes, n.tokens, s.hidden, n.heads
    per_token = (3 * e + 3 * s.q_lora + 3 * s.kv_lora + h * (s.nope + s.rope) + s.rope + 2 * h * s.kv_lora
                 + h * s.v_head)
    kept = t * (a * per_token + 4 * s.index_topk)
    if s.indexer_trained:
        indexer = a * (s.index_heads * s.index_dim + 4 * s.index_dim) + 4 * s.index_heads
        kept += t * (indexer + (4 * e if a != 4 else 0))
    return kept


SPARSE_BLOCK_BYTES = 64 * 2**20  # the largest scratch one block of sparse-attention queries may take
SPARSE_MAX_ROWS = 512


def sparse_block_rows(q_len: int, k_len: int, topk: int, heads: int, index_heads: int, width: int, *,
                      max_rows: int = SPARSE_MAX_ROWS) -> int:
    """Query rows per block of the sparse attention, the one rule that ``nnx_zoo.models.deepseek.dsa`` runs and
    the plan counts: the largest power of two up to ``max_rows`` whose scratch (``sparse_row_bytes`` a row) stays
    under ``SPARSE_BLOCK_BYTES``, at least 8."""
    block = max_rows
    while block > 8 and block * sparse_row_bytes(k_len, topk, heads, index_heads, width) > SPARSE_BLOCK_BYTES:
        block //= 2
    return min(block, q_len)


def compressed_block_rows(q_len: int, window: int, entries: int, topk: int, heads: int, index_heads: int,
                          width: int, *, max_rows: int = 128) -> int:
    """Query rows per block of DeepSeek-V4's blockwise attention (``nnx_zoo.models.deepseek4.kernel``), the rule
    its kernel runs and the plan counts: the largest power of two up to ``max_rows`` whose scratch (a row: its
    float32 scores over the window's keys and, without a top-k (HCA), over every entry; with one (CSA), the
    indexer's per-head scores over every entry and the chosen entries gathered) stays under
    ``SPARSE_BLOCK_BYTES``, at least 8."""
    def row_bytes(rows: int) -> int:
        window_scores = heads * (rows + window)
        if not topk:
            return 4 * (window_scores + heads * entries)
        return 4 * (window_scores + index_heads * entries + topk * (width + 2 * heads))

    block = max_rows
    while block > 8 and block * row_bytes(block) > SPARSE_BLOCK_BYTES:
        block //= 2
    return min(block, q_len)


def sparse_row_bytes(k_len: int, topk: int, heads: int, index_heads: int, width: int) -> int:
    """One query row's scratch in a sparse attention block: the indexer's float32 scores per head over all keys,
    the chosen keys' entries (``width = kv_lora + rope``), the scores and probabilities over them, the context."""
    return 4 * (index_heads * k_len + topk * (width + 2 * heads) + heads * width)


def sparse_scratch_bytes(s: DecoderShapes, n: Local) -> int:
    """The sparse attention's largest transient while one layer runs (its one-layer phase), one block of ``rows``
    query rows at a time (``sparse_block_rows``), the larger of two moments:
    - the block's forward (which the backward recomputes under remat): the indexer's float32 ``[b, rows,
      index_heads, S]`` products against all ``S`` keys and their relu (two tiles: XLA does not fuse the relu into
      the matmul), and the head-weighted, masked scores ``[b, rows, S]``;
    - the block's backward: the chosen keys' entries gathered, float32 ``[b, rows, topk, kv_lora + rope]``, and
      their cotangents (the latent's from the scores and from the context, the rope key's), and when the loss
      trains the indexer the chosen keys' gathered index keys ``[b, rows, topk, index_dim]``.
    Beside them the blocks' inputs: the indexer's queries and head weights split into blocks, a copy ``[T,
    index_heads, index_dim]`` (+ float32 ``[T, index_heads]``); when its loss trains the indexer, the backward's
    float32 cotangents of those (the loop's accumulator and its copy) add two more of that size."""
    if not s.index_topk:
        return 0
    a, ih, d, topk = s.dtype_bytes, s.index_heads, s.index_dim, s.index_topk
    rows = n.batch * sparse_block_rows(n.seq, n.keys, topk, n.heads, ih, s.kv_lora + s.rope)
    forward = 4 * rows * n.keys * (2 * ih + 1)
    backward = 4 * rows * topk * (3 * s.kv_lora + 2 * s.rope + (d if s.indexer_trained else 0))
    queries = n.tokens * (a * ih * d + 4 * ih)
    if s.indexer_trained:
        queries += 2 * n.tokens * 4 * ih * (d + 1)
    return max(forward, backward) + queries


# What a SwiGLU ``silu(gate) * up`` keeps per token, in widths. A looped stack (a scan) stores every residual
# autodiff saves, one stacked buffer each: gate, up, sigmoid(gate) and its derivative's factor 1 - sigmoid(gate),
# silu(gate), and the product (the down projection's input). A layer compiled whole (a one-layer stack, or one
# layer's recomputation inside the backward loop) lets XLA fuse the elementwise sigmoid terms into their
# consumers: gate, up, silu(gate) and the product stay.
SWIGLU_KEPT = {True: 6, False: 4}  # looped -> widths kept
# Clamped pre-activations (DeepSeek-V4's ``swiglu_limit``: ``min(gate, limit)``, ``clip(up, -limit, limit)``) add
# their own residuals: the clip's two comparisons and the min's output (looped); compiled whole, XLA fuses them.
SWIGLU_CLAMP_KEPT = {True: 3, False: 1}


# A gate activation other than silu keeps more of its own (autodiff's residuals of one ``[T, I]`` gated MLP: silu 6,
# Gemma's tanh-approximated GELU 8: its tanh and the polynomial inside it).
GATE_EXTRA_KEPT = {"gelu_tanh": 2}


def swiglu_kept(s: DecoderShapes, looped: bool) -> int:
    """Widths of ``[T, I]`` a SwiGLU keeps (``SWIGLU_KEPT``, plus ``SWIGLU_CLAMP_KEPT`` when clamped, plus
    ``GATE_EXTRA_KEPT`` for its activation)."""
    return (SWIGLU_KEPT[looped] + (SWIGLU_CLAMP_KEPT[looped] if s.swiglu_clamped else 0)
            + GATE_EXTRA_KEPT.get(s.gate_activation, 0))


def mlp_bytes(s: DecoderShapes, n: Local, looped: bool = True) -> int:
    """A dense SwiGLU MLP block: its RMSNorm's 3 ``[T, e]`` and the SwiGLU's ``[T, I]`` (``SWIGLU_KEPT``)."""
    return n.tokens * s.dtype_bytes * (3 * s.hidden + swiglu_kept(s, looped) * n.mlp)


# The cotangents that the backward of one recomputed SwiGLU holds beside its recomputed intermediates (remat
# 'full'): the product's, up's and gate's, [T, I] each; a plain [T, e] x [e, I] matmul's weight gradient reads a
# transposed copy of the gate's (one more width); the dense MoE path's batched einsums need none.
SWIGLU_COTANGENTS = 3


def mlp_cotangent_bytes(s: DecoderShapes, n: Local, moe: bool) -> int:
    """What the backward of one recomputed MLP (``moe``: MoE) block holds beside the layer's recomputed
    intermediates under remat 'full' (``SWIGLU_COTANGENTS``, and the transposed copy of a plain matmul's)."""
    a, t, c = s.dtype_bytes, n.tokens, SWIGLU_COTANGENTS
    if not moe:
        return t * a * (c + 1) * n.mlp
    shared = t * a * (c + 1) * n.shared_mlp if s.shared_intermediate else 0
    if s.moe_impl == "ep":  # its local experts, whole, over the gathered tokens (ep_expert_bytes)
        tokens, width = t * n.ep_token_gather, s.moe_intermediate
        if s.ep_local == "dense":
            return tokens * n.ep_experts * a * c * width + shared
        return tokens * s.top_k * a * (c + 1) * width + shared
    if s.moe_impl == "dense":
        return t * n.experts * a * c * n.moe_mlp + shared
    return t * s.top_k * a * (c + 1) * n.moe_mlp + shared


def moe_bytes(s: DecoderShapes, n: Local, looped: bool = True) -> int:
    """A MoE block: router in float32, routed experts (dispatch buffers), shared experts; ``looped`` as for
    ``mlp_bytes`` (``SWIGLU_KEPT``)."""
    swiglu = swiglu_kept(s, looped)
    a, t, e = s.dtype_bytes, n.tokens, s.hidden
    router = t * 4 * (2 * s.experts + 2 * s.top_k)
    if s.moe_impl == "ep":
        experts = ep_expert_bytes(s, n, looped)
    elif s.moe_impl == "dense":
        # Every token through every expert: the SwiGLU's [T, E, I] and the combine-weighted product; the
        # flattened [T, e] tokens, the float32 one-hot of the top-k ids times their weights [T, k, E] and the
        # [T, E] combine weights.
        experts = t * (n.experts * a * (swiglu + 1) * n.moe_mlp + a * e + 4 * s.top_k * s.experts
                       + a * s.experts)
    else:
        experts = t * s.top_k * a * (2 * e + swiglu * n.moe_mlp)
        if s.grouped_matmul == "tiled" and not looped:
            experts += tiled_grouped_matmul_bytes(t * s.top_k, s.experts, e, n.moe_mlp, a)
    shared = t * a * (e + swiglu * n.shared_mlp) if s.shared_intermediate else 0
    return t * a * 3 * e + router + experts + shared


def ep_expert_bytes(s: DecoderShapes, n: Local, looped: bool = True) -> int:
    """Expert parallelism's routed experts on one device: the tokens gathered over the EP axes that split them
    (``g = ep_token_gather`` devices' ``T``), their routing, and the partial sums before the scatter back, then
    its own ``E_l`` experts, whole, over the gathered tokens by the local dropless path (``ep_local``): the
    grouped matmul's ``g*T*k*a*(2e + w*I)`` as ``gmm``, or every local expert's SwiGLU ``g*T*(E_l*a*(w+1)*I +
    4*k*E_l + a*E_l)`` as the dense path."""
    swiglu, a, e, k = swiglu_kept(s, looped), s.dtype_bytes, s.hidden, s.top_k
    tokens = n.tokens * n.ep_token_gather
    gathered = tokens * (2 * a * e + 8 * k) if n.ep_token_gather > 1 else 0
    if s.ep_local == "dense":
        local = tokens * (n.ep_experts * a * (swiglu + 1) * s.moe_intermediate + 4 * k * n.ep_experts
                          + a * n.ep_experts)
    else:
        local = tokens * k * a * (2 * e + swiglu * s.moe_intermediate)
        if s.grouped_matmul == "tiled" and not looped:
            local += tiled_grouped_matmul_bytes(tokens * k, n.ep_experts, e, s.moe_intermediate, a)
    return gathered + local


def tiled_grouped_matmul_bytes(rows: int, groups: int, k: int, n: int, dtype_bytes: int) -> int:
    """What the portable ``tiled`` grouped matmul (``nnx_zoo.layers.grouped_matmul``) adds while one of its
    matmuls runs: one scan step's per-tile weight copies (compute dtype) and their float32 weight-gradient terms,
    and the float32 weight-gradient accumulator ``[groups, k, n]``. Transient (the layer's own phase), so a looped
    stack under remat 'none' does not keep it per layer. The tile and chunk rules are that module's
    (``default_tile`` and its ``_tiled``; ``tests/sharding/test_sharding_plan.py`` checks they agree)."""
    tile = 8
    while tile * 2 <= min(128, rows // (2 * max(groups, 1))):
        tile *= 2
    bound = -(-rows // tile) + groups
    chunk = max(1, min(bound, max(1 << 22, rows * max(k, n)) // (k * n)))
    return chunk * k * n * (dtype_bytes + 4) + groups * k * n * 4


def kept_expert_weight_bytes(s: DecoderShapes, n: Local) -> int:
    """The routed experts' weights that one MoE layer keeps for its backward, as its MoE path gathered them inside
    the layer (the gathered copy is what the backward's matmuls read, so autodiff keeps it; the other weights are
    gathered inside their matmuls and kept as the parameter's shard). In the compute dtype (the path casts them).
    The gate and up projections (their copies feed the input-side matmuls; the down projection's is not kept):
    ``dense`` fused to ``[e, E * I]``, laid out like the ``[T, E, I]`` activations; ``gmm`` every expert whole
    (replicated onto every token shard; seen in JAX's saved residuals, not measured on XLA:CPU); ``ep`` this
    device's experts whole."""
    if s.moe_impl == "dense":
        return 2 * n.experts * s.hidden * n.moe_mlp * s.dtype_bytes
    experts = n.ep_experts if s.expert_gather == "all-but-exp" else s.experts
    return 2 * experts * s.hidden * s.moe_intermediate * s.dtype_bytes


def output_bytes(s: DecoderShapes, n: Local) -> int:
    """Embedding lookup, final norm, and the logits with their float32 log-softmax and gradient."""
    a = s.dtype_bytes
    logits_tokens = min(n.tokens, s.loss_chunk_tokens or n.tokens)
    return n.tokens * a * 3 * s.hidden + logits_tokens * n.vocab * (a + 8 + (4 if a != 4 else 0))


# Logical names of the dimensions that FSDP shards and that are all-gathered when a weight is used (the others,
# tensor-parallel and expert dims, stay split while computing); a family-declared name placed like one of them
# (e.g. an attention latent declared like="embed") is gathered too.
GATHERED_NAMES = frozenset({"embed", "embed_no_exp"})


# What a MoE path gathers of the routed experts' weights ([exp, embed, moe_mlp] per layer) while a layer runs:
# 'fsdp': their FSDP dims only, like every weight (the dense path); 'all': every dim, each device holding all the
# experts whole (gmm: each token shard runs every expert); 'all-but-exp': every dim but the expert one, which
# stays split over the EP axes (ep: each device runs its E / n_ep experts whole).
EXPERT_GATHERS = ("fsdp", "all", "all-but-exp")


def _gathered_dims(names: tuple[str | None, ...], expert_gather: str) -> list[bool]:
    """Which dims of a weight with logical ``names`` are whole on each device while it is in use."""
    placed = [None if n is None else placed_like(n) for n in names]
    experts = "exp" in placed and "moe_mlp" in placed and expert_gather != "fsdp"
    return [p in GATHERED_NAMES or (experts and n not in STACK_AXES and (expert_gather == "all" or p != "exp"))
            for n, p in zip(names, placed, strict=True)]


@dataclasses.dataclass(frozen=True)
class GatheredWeights:
    """Bytes per device of weights while all-gathered (each a new buffer of the gathered shape: the shard stays
    in the parameter's own buffer). ``layer``: one layer of the largest looped stack; ``other``: the largest
    parameter outside the stacks (embedding table or output head); ``unlooped``: every stack of one layer (no
    loop: XLA gathers each weight once and keeps it from the forward to the backward)."""

    layer: int
    other: int
    unlooped: int
    largest_in_layer: int = 0  # the largest single weight of that layer, gathered

    @property
    def total(self) -> int:
        return self.layer + self.other + self.unlooped


def gathered_weights(report: ShardingReport, expert_gather: str = "fsdp") -> GatheredWeights:
    """What the all-gathers hold per device while weights are in use (``GatheredWeights``). A weight counts when
    one of its gathered dims is sharded, at the size of its gathered block: whole over its FSDP dims, and the
    routed experts as the MoE path gathers them (``expert_gather``, one of ``EXPERT_GATHERS``; the gmm path
    gathers all of a layer's experts whole onto every device)."""
    if expert_gather not in EXPERT_GATHERS:
        raise ValueError(f"expert_gather must be one of {EXPERT_GATHERS}, got {expert_gather!r}")
    stacks: dict[str, int] = {}
    largest: dict[str, int] = {}
    depth: dict[str, int] = {}
    others = [0]
    for r in report.params:
        whole = _gathered_bytes(r, expert_gather)
        if whole is None:
            continue  # used where it lies: no gather
        stack = r.names[0] if r.names[0] in STACK_AXES else None
        if stack is None:
            others.append(whole)
        else:
            stacks[stack] = stacks.get(stack, 0) + whole // r.shape[0]
            largest[stack] = max(largest.get(stack, 0), whole // r.shape[0])
            depth[stack] = r.shape[0]
    looped = max((k for k in stacks if depth[k] > 1), key=stacks.__getitem__, default=None)
    return GatheredWeights(layer=stacks.get(looped, 0), other=max(others),
                           unlooped=sum(b for k, b in stacks.items() if depth[k] == 1),
                           largest_in_layer=largest.get(looped, 0))


def gathered_weight_bytes(report: ShardingReport, expert_gather: str = "fsdp") -> int:
    """Bytes per device that the all-gathers add while weights are in use: ``gathered_weights(...).total``."""
    return gathered_weights(report, expert_gather).total


def embedding_gradient_bytes(report: ShardingReport) -> int:
    """The lookup tables' gradients (parameters outside the stacks whose first dim is placed like ``vocab``):
    each a table of the parameter's per-device size that the token gradients scatter-add into."""
    return sum(r.bytes_per_device for r in report.params
               if r.names and r.names[0] not in STACK_AXES and placed_like(r.names[0]) == "vocab")


# When each part of the estimate is live in the backward pass: 'held' throughout it; 'output head' while the
# loss and output head run backward (the logits' float32 buffers); 'one layer' while one layer runs backward.
# The two phases do not overlap in time, so the peak takes the larger (``activation_peak``).
PHASES = ("held", "output head", "one layer")
PART_PHASES = {
    "dense layers": "held", "moe layers": "held", "layer inputs": "held", "mtp heads": "held",
    "embedding gradient": "held", "one-layer stacks, kept whole": "held", "expert weights, every layer": "held",
    "embeddings and logits": "output head", "gathered weights, outside the stacks": "output head",
    "gathered weights, one-layer stacks": "output head",
    "one layer recomputed": "one layer", "cotangents, one layer": "one layer",
    "gathered weights, one layer": "one layer", "gathered gradient, one weight": "one layer",
    "sparse attention, one block": "one layer", "attention scratch, one layer": "one layer",
    "delta rule, one chunk": "one layer",
    "hyper-connection head": "output head", "streams from the embeddings": "held", "mtp layers": "output head",
    "per-layer inputs": "held",
}


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


def weight_parts(report: ShardingReport, expert_gather: str) -> dict[str, int]:
    """The parts of the estimate that the weights add (module docstring): their all-gathered copies, the
    gradient of one layer's largest weight at that gathered size (before the reduce-scatter returns it to its
    shard; one at a time), and the embedding tables' gradients."""
    g = gathered_weights(report, expert_gather)
    return {"gathered weights, one layer": g.layer, "gathered gradient, one weight": g.largest_in_layer,
            "gathered weights, outside the stacks": g.other, "gathered weights, one-layer stacks": g.unlooped,
            "embedding gradient": embedding_gradient_bytes(report)}


def activation_peak(parts: dict[str, int]) -> int:
    """The estimated peak: the parts held throughout the backward plus the larger of its two phases."""
    by_phase = {p: sum(v for k, v in parts.items() if PART_PHASES[k] == p) for p in PHASES}
    return by_phase["held"] + max(by_phase["output head"], by_phase["one layer"])


# ---- several layer kinds on the shared decoder layers: local attention, NoPE, shared K/V, interleaved MoE ----

def kind_local(n: Local, k: KindShapes) -> Local:
    """``n`` with the heads and MLP width of kind ``k``, split as the model's are."""
    return dataclasses.replace(n, heads=_split(k.heads, n.head_shards), kv_heads=_split(k.kv_heads, n.kv_head_shards),
                               mlp=_split(k.mlp, n.mlp_shards))


def kind_attention_bytes(s: DecoderShapes, n: Local, k: KindShapes) -> int:
    """What one attention layer of kind ``k`` keeps for its backward: GQA's ``attention_bytes`` with the kind's
    heads and kernel (``k.kernel``: ``xla`` keeps its scores over every key, a window or chunk only masks them;
    the flash-style kernels a log-sum-exp per row, the window only shortens their loops), a NoPE layer's queries
    and keys once (no roped copies), a shared-K/V layer's no keys or values (the storing layer keeps them)."""
    if s.kv_lora:  # MLA full layers beside linear ones (Kimi Linear): MLA's own formula
        return attention_bytes(s, n)
    a, t, e, h, kv, d = s.dtype_bytes, n.tokens, s.hidden, n.heads, n.kv_heads if k.kv else 0, k.head_dim
    copies = 2 if k.rope else 1  # before and after rope
    per_token = 3 * e + copies * h * d + (copies + 2) * kv * d + h * d + (2 * h * d if k.output_gate else 0)
    if s.qk_norm or k.l2_qk_norm:  # each head's norm keeps 3 of its width, as the layer's norms do
        per_token += 3 * (h + kv) * d
    kept = t * a * per_token + (t * 4 * h * d if k.temperature else 0)  # the float32 scaled queries
    if k.kernel == "xla":
        scores = n.batch * h * n.seq * (n.keys + int(k.sinks)) * (a + 10)
    else:
        scores = n.batch * h * n.seq * 4
    return kept + scores


def kind_layer_bytes(s: DecoderShapes, n: Local, k: KindShapes, looped: bool) -> int:
    """One layer of kind ``k``: its attention, its extra norms (beyond the input and post-attention ones, 3 widths
    each), its dense MLP and its MoE block (either or both)."""
    m = kind_local(n, k)
    mixer = (linear_layer_bytes(k.linear, s.hidden, s.dtype_bytes, n.batch, n.seq, n.head_shards) if k.linear
             else kind_attention_bytes(s, m, k))
    kept = mixer + max(0, k.norms - 2) * 3 * n.tokens * s.dtype_bytes * s.hidden
    # The per-layer input's gate: its projection, the activation's residuals and the gated product, [T, p] each
    # (its output's norm is one of the layer's norms).
    kept += n.tokens * s.dtype_bytes * PER_LAYER_INPUT_KEPT * s.per_layer_input
    if k.mlp:
        kept += mlp_bytes(s, m, looped)
    if k.moe:
        kept += moe_bytes(s, m, looped)
    return kept


def kind_cotangent_bytes(s: DecoderShapes, n: Local, k: KindShapes) -> int:
    """``mlp_cotangent_bytes`` of kind ``k``'s MLP or MoE block; with both (Gemma 4's MoE beside the MLP) the larger:
    their backwards run one after the other."""
    m = kind_local(n, k)
    return max(mlp_cotangent_bytes(s, m, False) if k.mlp else 0, mlp_cotangent_bytes(s, m, True) if k.moe else 0)


def kind_segments(s: DecoderShapes) -> list[tuple[tuple[KindShapes, ...], int]]:
    """The layers as the model scans them: ``(pattern of kinds, repeats)`` (``KIND_MAX_PERIOD``)."""
    by_stack = {k.stack: k for k in s.kinds}
    return [(tuple(by_stack[name] for name in pattern), repeats)
            for pattern, repeats in periodic_runs(s.schedule, KIND_MAX_PERIOD)]


def kind_activation_breakdown(s: DecoderShapes, n: Local, remat: str) -> dict[str, int]:
    """``activation_breakdown`` for several layer kinds: the layers run as the segments of their schedule
    (``kind_segments``), each one scan over a pattern of kinds; under remat 'full' a step of a looped segment (one
    layer of each kind of its pattern) is the recomputed unit, and the scan carries one ``[T, e]`` per step. A
    segment of one repeat is no loop: kept whole under either remat."""
    segments = kind_segments(s)
    layer_input = n.tokens * s.dtype_bytes * s.hidden

    def pattern(kinds: tuple[KindShapes, ...], looped: bool) -> int:
        return sum(kind_layer_bytes(s, n, k, looped) for k in kinds)

    looped = [(kinds, repeats) for kinds, repeats in segments if repeats > 1]
    whole = sum(pattern(kinds, False) for kinds, repeats in segments if repeats == 1)
    if remat == "none":
        layers = {"moe layers": sum(repeats * pattern(kinds, repeats > 1) for kinds, repeats in segments)}
        moe = sum(repeats * sum(k.moe for k in kinds) for kinds, repeats in looped)
        if moe:
            layers["expert weights, every layer"] = moe * kept_expert_weight_bytes(s, n)
        # A step's backward runs its layers one after the other: one layer compiled whole holds its cotangents at a
        # time (as for a plain stack). Counting the step's whole pattern instead: 1.19 / 1.07 on the hybrids'
        # (linear, full) steps (tests/sharding/test_sharding_plan.py).
        layers["cotangents, one layer"] = max((kind_layer_bytes(s, n, k, False) for kinds, _ in looped for k in kinds),
                                              default=0)
    else:
        steps = [(pattern(kinds, False), max(kind_cotangent_bytes(s, n, k) for k in kinds)) for kinds, _ in looped]
        size, cot = max(steps, key=sum, default=(0, 0))
        layers = {"layer inputs": sum(repeats for _, repeats in looped) * layer_input,
                  "one layer recomputed": size, "cotangents, one layer": cot, "one-layer stacks, kept whole": whole}
    # The per-layer inputs of every layer, made once before the layers and read by each one's backward: the table's
    # rows, the projection of the embeddings, its norm's 3 and the mix, [T, layers * p] each.
    per_layer = n.tokens * s.dtype_bytes * PER_LAYER_INPUTS_KEPT * len(s.schedule) * s.per_layer_input
    # One chunk's backward of a linear layer at a time (its body recomputed: jax.checkpoint), under either remat.
    chunk = max((linear_chunk_scratch_bytes(k.linear, n.batch, n.seq, n.head_shards) for k in s.kinds if k.linear),
                default=0)
    return {**layers, **({"delta rule, one chunk": chunk} if chunk else {}),
            "embeddings and logits": output_bytes(s, n), **({"per-layer inputs": per_layer} if per_layer else {})}


# Widths of [T, p] that one layer's per-layer input gate keeps (the gate's projection, its GELU's tanh and output,
# the gated product), and of [T, layers * p] that the per-layer inputs keep before the layers (table rows,
# projection, its norm's 3, the mix).
PER_LAYER_INPUT_KEPT = 4
PER_LAYER_INPUTS_KEPT = 6


def kind_weight_parts(report: ShardingReport, s: DecoderShapes) -> dict[str, int]:
    """``weight_parts`` for several layer kinds: one stack per kind (its parameters under ``<stack>.``), scanned in
    slices by the segments, so one recomputed step gathers one layer of each kind of its pattern, and a segment of
    one repeat keeps its pattern's gathered weights from the forward to the backward (``v4_weight_parts``'s rule)."""
    stacks = {k.stack for k in s.kinds}
    per_layer, largest = stack_gathered(report, s.expert_gather if s.moe_layers else "fsdp", stacks)
    others = per_layer.pop(None, [0])
    segments = periodic_runs(s.schedule, KIND_MAX_PERIOD)
    gathered = lambda names: sum(per_layer.get(name, 0) for name in dict.fromkeys(names))  # noqa: E731
    looped = [names for names, repeats in segments if repeats > 1]
    step = max(looped, key=gathered, default=())
    return {"gathered weights, one layer": gathered(step),
            "gathered gradient, one weight": max((largest.get(name, 0) for name in step), default=0),
            "gathered weights, outside the stacks": max(others),
            "gathered weights, one-layer stacks": sum(gathered(names) for names, repeats in segments if repeats == 1),
            "embedding gradient": embedding_gradient_bytes(report)}


def _gathered_bytes(r: Any, expert_gather: str) -> int | None:
    """The bytes parameter ``r`` takes on a device once its gathered dims are whole (None: nothing is gathered)."""
    if r.names is None:
        return None
    shape = list(r.per_device_shape)
    gathered = _gathered_dims(r.names, expert_gather)
    for dim, axes in enumerate(r.spec):
        if gathered[dim] and axes is not None:
            shape[dim] = r.shape[dim]
    if shape == list(r.per_device_shape):
        return None
    return math.prod(shape) * r.bytes_per_device // max(1, math.prod(r.per_device_shape))


def stack_gathered(report: ShardingReport, expert_gather: str, stacks: set[str]) -> tuple[dict, dict[str, int]]:
    """Per stack of ``stacks`` (by path prefix), one layer's gathered weight bytes and its largest weight's; under
    the key None, the list of the other parameters' gathered sizes."""
    per_layer: dict[Any, Any] = {None: [0]}
    largest: dict[str, int] = {}
    for r in report.params:
        whole = _gathered_bytes(r, expert_gather)
        if whole is None:
            continue
        stack = next((k for k in stacks if r.path.startswith(k + ".")), None)
        if stack is None:
            per_layer[None].append(whole)
            continue
        per_layer[stack] = per_layer.get(stack, 0) + whole // r.shape[0]
        largest[stack] = max(largest.get(stack, 0), whole // r.shape[0])
    return per_layer, largest


def stack_norms(report: ShardingReport, stacks: set[str], hidden: int) -> dict[str, int]:
    """RMSNorms of the hidden width in one layer of each stack: its ``[layers, hidden]`` parameters named
    ``*norm*`` (read from the model, so a family's extra norms count without naming it)."""
    out = dict.fromkeys(stacks, 0)
    for r in report.params:
        stack = next((k for k in stacks if r.path.startswith(k + ".")), None)
        if stack is not None and "norm" in r.path and tuple(r.shape[1:]) == (hidden,):
            out[stack] += 1
    return out


def kv_cache_bytes(s: DecoderShapes, batch: int, max_len: int, rules: Rules, mesh: Mesh | AbstractMesh
                   ) -> int | None:
    """Per-device bytes of the keys and values in a decoding cache (``model.init_cache(batch, max_len)``) laid
    out by the cache's logical names: ``max_len`` slots per full-attention layer, a ring of ``span - 1`` for a
    window or chunk layer (``nnx_zoo.layers.kv_cache.ring_slots``), none for a layer that reads another's keys
    and values (Gemma 4's shared K/V). None where the plan does not model the family's cache (MLA's latents,
    DeepSeek-V4's compressed entries, linear attention's state); the per-slot bookkeeping (a few bytes a token)
    is left out."""
    if s.kv_lora or s.v4 is not None:
        return None
    layers = ([(k.span, k.kv_heads, k.head_dim) for stack in s.schedule for k in s.kinds if k.stack == stack and k.kv]
              if s.kinds else [(None, s.kv_heads, s.head_dim)] * (s.dense_layers + s.moe_layers))
    names = ("activation_stack", "cache_batch", "cache_length", "cache_kv_heads", "cache_kv")
    rows, length, heads = (_joint_shards(names, dim, rules, mesh) for dim in (1, 2, 3))
    total = 0
    for span, kv_heads, head_dim in layers:
        slots = max(1, min(max_len, span - 1)) if span else max_len
        total += 2 * _split(batch, rows) * _split(slots, length) * _split(kv_heads, heads) * head_dim
    return total * s.dtype_bytes


def kind_description(s: DecoderShapes) -> str:
    """The plan's one-line summary of the layer kinds: each stack's layers, attention, span and kernel."""
    parts = []
    for k in s.kinds:
        if k.linear:
            moe = ", MoE" if k.moe else ""
            parts.append(f"{s.schedule.count(k.stack)} {k.stack} (linear: {linear_description(k.linear, 1, 1)}{moe})")
            continue
        span = f" window {k.window}" if k.window else f" chunk {k.chunk}" if k.chunk else ""
        extra = "".join([", sinks" if k.sinks else "", ", NoPE" if not k.rope else "",
                         ", shared K/V" if not k.kv else "", ", MoE" if k.moe else ""])
        parts.append(f"{s.schedule.count(k.stack)} {k.stack} ({k.attention}{span}, {k.kernel}{extra})")
    return "layers: " + "; ".join(parts)


# ---- DeepSeek-V4 (``nnx_zoo.models.deepseek4``): its own attention, hyper-connection streams and layer schedule ----

# Names of V4's config values (``nnx_zoo.models.deepseek4.config``; this package imports no model code, and
# tests/sharding/test_sharding_plan.py checks that these agree with it, with its kernel's rules and its schedule).
V4_SLIDING, V4_CSA, V4_HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
V4_HASH = "hash_moe"
V4_XLA_MAX_SCORES = 512 * 512  # kernel.XLA_MAX_SCORES: 'auto' runs 'xla' while s * (s + entries) fits
V4_BLOCK = 128  # kernel.BLOCK: queries per block of the 'blockwise' path at most (compressed_block_rows)


@dataclasses.dataclass(frozen=True)
class V4Shapes:
    """DeepSeek-V4's sizes beyond a decoder's (``V4Shapes.from_config(config)``; None for other families)."""

    streams: int  # hc_mult: hyper-connection residual streams
    sinkhorn_iters: int
    head_dim: int  # the one shared key = value head's width (queries have ``heads`` of it)
    window: int  # sliding_window
    q_lora: int
    o_groups: int
    o_lora: int
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_dim: int
    index_topk: int
    indexer: str  # indexer_training: 'off' | 'dense_warmup' | 'sparse'
    attention: str  # attention_impl: 'auto' | 'xla' | 'blockwise'
    kinds: tuple[tuple[str, str], ...]  # (attention type, MLP type) of each layer, in order

    @classmethod
    def from_config(cls, config: Any) -> V4Shapes | None:
        if not (hasattr(config, "hc_mult") and hasattr(config, "compress_rate_hca")):
            return None
        c = config
        return cls(streams=c.hc_mult, sinkhorn_iters=c.hc_sinkhorn_iters, head_dim=c.head_dim,
                   window=c.sliding_window, q_lora=c.q_lora_rank, o_groups=c.o_groups, o_lora=c.o_lora_rank,
                   csa_rate=c.compress_rate_csa, hca_rate=c.compress_rate_hca, index_heads=c.index_n_heads,
                   index_dim=c.index_head_dim, index_topk=c.index_topk, indexer=c.indexer_training,
                   attention=c.attention_impl, kinds=tuple(zip(c.layer_types, c.mlp_layer_types, strict=True)))

    def rate(self, layer_type: str) -> int:
        """Tokens per compressed entry of ``layer_type`` (0: sliding only)."""
        return {V4_SLIDING: 0, V4_CSA: self.csa_rate, V4_HCA: self.hca_rate}[layer_type]

    def entries(self, layer_type: str, seq: int) -> int:
        """Compressed entries of a row of ``seq`` tokens (its slots, ``seq // rate``)."""
        rate = self.rate(layer_type)
        return seq // rate if rate else 0

    def impl(self, layer_type: str, seq: int) -> str:
        """The kernel a layer of ``layer_type`` runs on ``seq`` tokens (``kernel.attend``'s 'auto' rule)."""
        if self.attention != "auto":
            return self.attention
        return "xla" if seq * (seq + self.entries(layer_type, seq)) <= V4_XLA_MAX_SCORES else "blockwise"

    def chosen(self, layer_type: str, seq: int) -> int:
        """Compressed entries each query attends to: CSA its indexer's top-k (every visible one in the dense
        warm-up), HCA every one."""
        entries = self.entries(layer_type, seq)
        if layer_type == V4_CSA and self.indexer != "dense_warmup":
            return min(self.index_topk, entries)
        return entries

    def segments(self) -> list[tuple[tuple[tuple[str, str], ...], int]]:
        """The schedule as the model scans it: ``(pattern of kinds, repeats)`` (``nnx_zoo.layers.scan.
        periodic_runs``, period up to 4; a segment of one repeat is no loop once compiled)."""
        return periodic_runs(self.kinds, 4)


def v4_stack_name(kind: tuple[str, str]) -> str:
    """The model's stack of ``kind`` (``deepseek4.model.kind_name``): ``stacks.csa_moe``, ..."""
    short = {V4_SLIDING: "sliding", V4_CSA: "csa", V4_HCA: "hca"}[kind[0]]
    return f"stacks.{short}_{'hash' if kind[1] == V4_HASH else 'moe'}"


def hyper_connection_bytes(s: DecoderShapes, n: Local, looped: bool = True) -> int:
    """What one V4 layer's two hyper-connections keep (``nnx_zoo.layers.hyper_connection``; ``m`` streams):
    - looped (the scan stores what autodiff saves): the streams each reads ``[T, m, e]`` (the layer's input and the
      streams between attention and MoE), each one's RMS-normed streams in float32 (its ``fn`` matmul's input),
      each block's output ``[T, e]``, and the float32 mixing coefficients of each token: the ``2m + m^2`` logits,
      ``pre``, ``post``, the softmax and each Sinkhorn step's matrix and sums (``2 * iters`` normalizations);
    - compiled whole: XLA:CPU materializes the broadcasts that ``expand``'s backward matmuls read (the block's
      output and ``post`` over the streams, ``[T, m, e]`` each), so each ``expand`` keeps up to three ``[T, m, e]``,
      the connections the streams they read and their float32 normed copies, and XLA fuses about half of the
      Sinkhorn chain (measured: 4.5-6 of those ``[T, m, e]`` per ``expand`` at the backward's peak; 3 counted).
    """
    v, a, e, t = s.v4, s.dtype_bytes, s.hidden, n.tokens
    m, it = v.streams, v.sinkhorn_iters
    if looped:
        mix = (2 * it + 2) * m * m + (4 * it + 6) * m + 2
        return 2 * t * (m * e * (a + 4) + a * e + 4 * mix)
    mix = (it + 1) * m * m + (2 * it + 3) * m + 1
    return t * (m * e * (6 * a + 8) + 2 * a * e + 2 * 4 * mix)


def v4_attention_bytes(s: DecoderShapes, n: Local, layer_type: str, looped: bool = True) -> int:
    """What one V4 attention layer of ``layer_type`` keeps for its backward (``nnx_zoo.models.deepseek4``):
    - the input norm and the query latent's (3 widths each, as every RMSNorm); the queries ``[T, H, d]`` before
      and after their unscaled RMSNorm and rope (the roped ones padded to blocks by ``blockwise``, which compiled
      whole keeps both) and that norm's float32 statistics; the shared key-value (its norm's 2 widths, roped); the
      attention output grouped for ``o_a`` ``[T, H, d]`` and its low-rank ``[T, groups, o_lora]``;
    - a compressed layer's pooling: the gathered windows of projected tokens ``[T, w*d]`` (``w = 2``: CSA's two
      overlapping series, 1 on HCA) and the float32 softmax over each window's slots with its weights (``2 w d``;
      compiled whole, one), CSA's masked previous-window gates (``d``, with their mask); the entries' norm and
      rope (``3 d`` per entry);
    - ``xla``: the scores ``[b, H, s, s + n + 1]`` against every token, every entry and the sink
      (``v4_score_bytes``);
    - ``blockwise`` on a CSA layer: the indexer's queries and head weights, padded to blocks (its blocks score
      them again in the backward); the chosen entries' indices are not kept (recomputed per block).
    The indexer's scores and the backward's score gradients are the one-layer scratch
    (``v4_attention_scratch_bytes``)."""
    v, a, e, t, h, d = s.v4, s.dtype_bytes, s.hidden, n.tokens, n.heads, s.v4.head_dim
    groups = max(1, v.o_groups * h // s.heads)  # split as the heads are
    impl = v.impl(layer_type, n.keys)
    queries = 3 if looped or impl == "xla" else 4  # compiled whole, blockwise pads a copy of the roped queries
    per_token = a * (3 * e + 3 * v.q_lora + queries * h * d + 3 * d + groups * v.o_lora) + 8 * h
    rate = v.rate(layer_type)
    if rate:
        w = 2 if layer_type == V4_CSA else 1
        pooled = a * w * d + 4 * (2 if looped else 1) * w * d
        per_token += pooled + (5 * d if w == 2 and looped else 0) + (3 * a * d) // rate
    kept = t * per_token + v4_score_part(s, n, layer_type, looped)
    if impl != "xla" and layer_type == V4_CSA:
        kept += t * (a * v.index_heads * v.index_dim + 4 * v.index_heads)
    return kept


def v4_score_part(s: DecoderShapes, n: Local, layer_type: str, looped: bool) -> int:
    """The ``xla`` path's kept scores in ``v4_attention_bytes`` (0 for ``blockwise``)."""
    v = s.v4
    if v.impl(layer_type, n.keys) != "xla":
        return 0
    return n.batch * n.heads * n.seq * (n.keys + v.entries(layer_type, n.keys) + 1) * v4_score_bytes(
        s.dtype_bytes, looped)


def v4_score_bytes(a: int, looped: bool = True) -> int:
    """Bytes per score that the ``xla`` path keeps. Looped: the masked scores (compute dtype) and their mask, the
    float32 exponentials of the softmax and each part's probabilities, and their cast to a bfloat16 compute dtype.
    Compiled whole: the exponentials and the probabilities (XLA fuses the masks and casts into their users)."""
    if not looped:
        return 8
    return a + 1 + 4 + 4 + (a if a != 4 else 0)


# The backward of a softmax over [b, H, q, K] scores holds float32 gradients of the probabilities and scores beside
# the kept ones: this many bytes per score (measured on XLA's buffers; see the tests).
V4_SCORE_GRAD_BYTES = 8


def v4_attention_scratch_bytes(s: DecoderShapes, n: Local, layer_type: str) -> int:
    """A V4 attention layer's largest transient while it runs (the one-layer phase; recomputed under remat):
    - ``xla``: the score gradients (``V4_SCORE_GRAD_BYTES``) and on a CSA layer the indexer's float32 products
      ``[b, s, index_heads, n]`` with their relu, and its head-weighted scores ``[b, s, n]``;
    - ``blockwise``, one block of ``B`` queries at a time (``compressed_block_rows``: at most ``V4_BLOCK``, fewer
      where a block's scratch would pass ``SPARSE_BLOCK_BYTES``): its window's scores ``[b, H, B, B +
      window - 1]`` and its entries' ``[b, H, B, k]`` (``k`` chosen on CSA, all on HCA) with their softmax and
      gradients (``V4_BLOCK_SCORE_BYTES``); on a CSA layer the block's indexer products ``[b, B, index_heads, n]``
      (two float32 tiles, the product and its relu), its scores and visibility ``[b, B, n]``, and the chosen
      entries gathered ``[b, B, k, d]`` with their cotangent."""
    v, a, b, h, d = s.v4, s.dtype_bytes, n.batch, n.heads, s.v4.head_dim
    entries, chosen = v.entries(layer_type, n.keys), v.chosen(layer_type, n.keys)
    csa = layer_type == V4_CSA
    if v.impl(layer_type, n.keys) == "xla":
        scratch = b * h * n.seq * (n.keys + entries + 1) * V4_SCORE_GRAD_BYTES
        if csa:
            scratch += b * n.seq * entries * (8 * v.index_heads + 9)
        return scratch
    block = compressed_block_rows(n.seq, v.window, entries, v.index_topk if csa else 0, h,
                                  v.index_heads if csa else 0, d, max_rows=V4_BLOCK)
    scratch = b * h * block * (block + v.window - 1 + chosen + 1) * V4_BLOCK_SCORE_BYTES
    if csa:
        scratch += b * block * entries * (8 * v.index_heads + 9)
        if chosen < entries:
            scratch += 2 * b * block * chosen * d * a
    return scratch


V4_BLOCK_SCORE_BYTES = 24  # one block's scores: masked, float32 logits, exponentials, probabilities, 2 gradients


def v4_layer_bytes(s: DecoderShapes, n: Local, layer_type: str, looped: bool, experts: bool = False) -> int:
    """One V4 layer (``DecoderLayer``): its two hyper-connections, its attention of ``layer_type`` and its MoE;
    ``experts``: with the expert weights its MoE keeps (``kept_expert_weight_bytes``: the dense path's fused
    ``[e, E * I]`` copies, which a layer recomputed whole keeps too)."""
    kept = kept_expert_weight_bytes(s, n) if experts else 0
    return (hyper_connection_bytes(s, n, looped) + v4_attention_bytes(s, n, layer_type, looped)
            + moe_bytes(s, n, looped) + kept)


def v4_activation_breakdown(s: DecoderShapes, n: Local, remat: str) -> dict[str, int]:
    """``activation_breakdown`` for DeepSeek-V4: its layers run as the segments of its schedule
    (``V4Shapes.segments``), each one scan over a pattern of kinds; a step of a looped segment is one recomputed
    unit under remat 'full', and between steps the scan carries the ``[T, streams, e]`` hyper-connection streams.
    The MTP layer runs outside the scans: kept whole under either remat."""
    v, a, e, t = s.v4, s.dtype_bytes, s.hidden, n.tokens
    m = v.streams
    segments = v.segments()
    types = sorted({kind[0] for kind in v.kinds})

    # Inside a loop's body the dense MoE path's fused expert weights are a copy that the layer keeps, recomputed
    # or not (compiled whole outside a loop, XLA folds the transpose into the matmuls); the other paths' gathered
    # experts are counted with the gathered weights, except in a looped stack under 'none' (as for V3).
    dense = s.moe_impl == "dense"

    def pattern(kinds: tuple[tuple[str, str], ...], looped: bool, in_loop: bool = False) -> int:
        return sum(v4_layer_bytes(s, n, kind[0], looped, dense and in_loop) for kind in kinds)

    def attention_moments(kinds: tuple[tuple[str, str], ...]) -> list[tuple[int, int]]:
        """(what is live beside it, the scratch) while each layer of a recomputed pattern runs its attention
        backward: the pattern's earlier layers, this layer's connections and attention (its MoE is done)."""
        out, before = [], 0
        for kind in kinds:
            out.append((before + hyper_connection_bytes(s, n, False) + v4_attention_bytes(s, n, kind[0], False),
                        v4_attention_scratch_bytes(s, n, kind[0])))
            before += v4_layer_bytes(s, n, kind[0], False, dense)  # recomputed in a loop's body
        return out

    looped = [(kinds, repeats) for kinds, repeats in segments if repeats > 1]
    whole = sum(pattern(kinds, False) for kinds, repeats in segments if repeats == 1)
    # A layer kept whole (or held under 'none') runs its attention's backward with its scratch on top of what is
    # held; the larger of that and the looped layers' own phase is the one-layer phase (they never overlap).
    held_scratch = max(v4_attention_scratch_bytes(s, n, layer_type) for layer_type in types)
    if remat == "none":
        layers = {"moe layers": sum(repeats * pattern(kinds, repeats > 1) for kinds, repeats in segments)}
        # A step's backward holds about its pattern compiled whole (the step's residuals read from the stacked
        # buffers, one layer's cotangents at a time; measured), its layers' xla scores one layer at a time.
        def step_backward(kinds: tuple[tuple[str, str], ...]) -> int:
            scores = [v4_score_part(s, n, kind[0], False) for kind in kinds]
            return pattern(kinds, False) - sum(scores) + max(scores)

        cotangents = max((step_backward(kinds) for kinds, _ in looped), default=0)
        if looped:
            layers["expert weights, every layer"] = sum(repeats * len(kinds) for kinds, repeats in looped) * (
                kept_expert_weight_bytes(s, n))
        phase = {"cotangents, one layer": cotangents, "attention scratch, one layer": 0}
        if held_scratch > cotangents:
            phase = {"cotangents, one layer": 0, "attention scratch, one layer": held_scratch}
        layers.update(phase)
    else:
        # The largest moment of a recomputed step: the whole pattern with its last MoE's cotangents, or one of its
        # layers' attention backward with the scratch.
        moments = [(0, 0, held_scratch)]
        for kinds, _ in looped:
            moments.append((pattern(kinds, False, True), mlp_cotangent_bytes(s, n, True), 0))
            moments += [(live, 0, scratch) for live, scratch in attention_moments(kinds)]
        base, cotangents, scratch = max(moments, key=sum)
        layers = {"layer inputs": sum(repeats for _, repeats in looped) * t * a * m * e,
                  "one layer recomputed": base, "cotangents, one layer": cotangents,
                  "attention scratch, one layer": scratch, "one-layer stacks, kept whole": whole}
    # The last collapse of the streams (HyperHead: the streams, their float32 RMS-normed copy) before the norm;
    # the embeddings widened to the streams (and XLA:CPU's broadcast copy), read again by the first layer's backward.
    head = t * m * e * (a + 4)
    widened = 2 * t * m * e * a
    mtp = 0
    if s.mtp_layers:  # each depth: enorm, hnorm over the streams, their projections, one sliding layer, its head
        mtp = s.mtp_layers * (v4_layer_bytes(s, n, V4_SLIDING, False) + t * a * (4 * e + 4 * m * e) + head)
    # The MTP depths' hidden states go through the head with the main one's (stacked): their logits share the
    # loss's chunks. Their layers run backward right after the head's, before the main layers': they are part of
    # the output head's phase, not held through the layers' backward.
    logits = dataclasses.replace(n, batch=n.batch * (1 + s.mtp_layers))
    out = output_bytes(s, logits) - s.mtp_layers * t * a * 3 * e
    return {**layers, "embeddings and logits": out, "hyper-connection head": head,
            "streams from the embeddings": widened, **({"mtp layers": mtp} if mtp else {})}


def v4_description(v: V4Shapes, seq: int) -> str:
    """The plan's one-line summary of V4's attention at ``seq`` positions: each layer type's kernel and entries."""
    short = {V4_SLIDING: "sliding", V4_CSA: "CSA", V4_HCA: "HCA"}
    kernels = ", ".join(f"{short[t]} {v.impl(t, seq)}" for t in short if any(k[0] == t for k in v.kinds))
    return (f"V4 attention ({kernels}; window {v.window}, CSA an entry per {v.csa_rate} tokens with "
            f"{v.chosen(V4_CSA, seq)} chosen by the indexer, HCA an entry per {v.hca_rate}), {v.streams} "
            f"hyper-connection streams")


def v4_weight_parts(report: ShardingReport, s: DecoderShapes) -> dict[str, int]:
    """``weight_parts`` for DeepSeek-V4: its stacks are per kind and its segments scan slices of them, so the
    gathered weights of one recomputed unit are those of a step's pattern (one layer of each of its kinds), and a
    segment of one repeat (no loop) keeps its pattern's gathered weights from the forward to the backward."""
    expert_gather = s.expert_gather
    per_layer: dict[str, int] = {}
    largest: dict[str, int] = {}
    others, mtp = [0], 0
    for r in report.params:
        whole = _gathered_bytes(r, expert_gather)
        if whole is None:
            continue
        stack = next((k for k in {v4_stack_name(kind) for kind in s.v4.kinds} if r.path.startswith(k + ".")), None)
        if stack is None and r.names[0] in STACK_AXES:  # the MTP layers: no loop, gathered once and kept
            mtp += whole // r.shape[0]
            continue
        if stack is None:
            others.append(whole)
            continue
        per_layer[stack] = per_layer.get(stack, 0) + whole // r.shape[0]
        largest[stack] = max(largest.get(stack, 0), whole // r.shape[0])
    segments = s.v4.segments()
    gathered = lambda kinds: sum(per_layer.get(v4_stack_name(k), 0) for k in dict.fromkeys(kinds))  # noqa: E731
    looped = [kinds for kinds, repeats in segments if repeats > 1]
    step = max(looped, key=gathered, default=())
    return {"gathered weights, one layer": gathered(step),
            "gathered gradient, one weight": max((largest.get(v4_stack_name(k), 0) for k in step), default=0),
            "gathered weights, outside the stacks": max(others),
            "gathered weights, one-layer stacks": mtp + sum(gathered(kinds) for kinds, repeats in segments
                                                            if repeats == 1),
            "embedding gradient": embedding_gradient_bytes(report)}


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
    global_batch = batch_per_device * batch_shards
    kinds = getattr(config, "layer_kinds", ())
    kinds = kinds() if callable(kinds) else kinds
    softmax_only = all(getattr(k, "attention", "full") in LOCAL_ATTENTION for k in kinds)  # no recurrent state
    cache = kv_cache_bytes(shapes, global_batch, seq_len, rules, mesh) if softmax_only else None
    return MemoryPlan(report=report, shapes=shapes, local=local, global_batch=global_batch, seq_len=seq_len,
                      activations=activations, cache_bytes=cache)
