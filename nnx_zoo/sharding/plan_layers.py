"""The memory plan's shapes and per-layer formulas (``nnx_zoo.sharding.plan`` puts them together).

``DecoderShapes`` (the sizes read from a config, DeepSeek-V4's ``V4Shapes`` among them), ``Local`` (their
per-device split), and the formulas of what each kind of layer keeps for its backward pass, the gathered weights
and the phases of the backward. ``nnx_zoo.sharding.plan``'s docstring states the formulas and what they were
measured against; every name here is importable from there too. DeepSeek-V4's own formulas are in
``nnx_zoo.sharding.plan_deepseek4``, linear attention's in ``nnx_zoo.sharding.plan_linear``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from nnx_zoo.sharding.axes import STACK_AXES, placed_like
from nnx_zoo.sharding.plan_linear import (
    LinearShapes,
    linear_chunk_scratch_bytes,
    linear_description,
    linear_layer_bytes,
)
from nnx_zoo.sharding.report import ShardingReport
from nnx_zoo.sharding.resolve import ShardingError, axes_tuple, logical_to_mesh_axes
from nnx_zoo.sharding.rules import Rules

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
    """A schedule as the models scan it: ``(pattern, repeats)`` segments, the one rule
    (``nnx_zoo.layers.scan.periodic_runs`` calls this; a segment of one repeat is no loop once compiled)."""
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


def cast_once_bytes(report: ShardingReport, s: DecoderShapes) -> int:
    """The compute-dtype copy of the looped stacks' routed expert weights (``[layers, exp, ...]`` with a
    ``moe_mlp`` dim) that a layer scan casts once a step and keeps through it (``nnx_zoo.layers.scan.cast_once``),
    as each device holds them; 0 when the parameters are in the compute dtype already. The CPU's ``gmm`` without a
    mesh (``tiled``, which reads the stored weights) casts nothing; a plan always has a mesh."""
    total = 0
    for r in report.params:
        itemsize = jnp.dtype(r.dtype).itemsize
        looped = r.names and r.names[0] in STACK_AXES and r.shape[0] > 1
        if looped and "exp" in r.names and "moe_mlp" in r.names and s.dtype_bytes < itemsize:
            total += r.bytes_per_device // itemsize * s.dtype_bytes
    return total


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
    "per-layer inputs": "held", "expert weights, cast once": "held",
}



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


# ---- DeepSeek-V4's shapes (``nnx_zoo.models.deepseek4``; its formulas: ``plan_deepseek4``) ----
# Here, not there, because ``DecoderShapes.from_config`` reads them and ``plan_deepseek4`` imports this module.

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

