"""DeepSeek-V4's memory estimate (``nnx_zoo.models.deepseek4``): its own attention (a sliding window plus
compressed entries: CSA chosen by the lightning indexer, HCA all visible), hyper-connection streams and layer
schedule. ``nnx_zoo.sharding.plan.memory_plan`` dispatches here when a config carries ``V4Shapes``
(``DecoderShapes.v4``); every name here is importable from ``nnx_zoo.sharding.plan`` too.
"""

from __future__ import annotations

import dataclasses

from nnx_zoo.sharding.axes import STACK_AXES
from nnx_zoo.sharding.plan_layers import (
    V4_BLOCK,
    V4_CSA,
    V4_HASH,
    V4_HCA,
    V4_SLIDING,
    DecoderShapes,
    Local,
    V4Shapes,
    _gathered_bytes,
    compressed_block_rows,
    embedding_gradient_bytes,
    kept_expert_weight_bytes,
    mlp_cotangent_bytes,
    moe_bytes,
    output_bytes,
)
from nnx_zoo.sharding.report import ShardingReport


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

