"""DeepSeek-V4's decoding cache: a ring of the window's keys, the compressed entries, and each compressor's
incomplete window.

Per layer, and row: ``ring [window - 1, head_dim]`` holds the shared key-values of the row's last ``window - 1``
real tokens (slot ``rank % (window - 1)``; a new token attends to them and to itself), so its memory does not grow
with the context. A compressed layer adds ``entries [max_len // rate, head_dim]`` (written in order as windows
close) and the compressor's pending state: the projections ``kv``/``gate`` of the tokens of the window being
filled (``pending_*``, slot ``rank % rate``) and, with CSA's overlap, of the last complete window
(``previous_*``), from which the next entry is pooled the moment its window closes. A CSA layer keeps the same
for its indexer's entries (``index_*``). ``rank [batch]`` counts each row's real tokens (a token's rank in its
document); ``valid`` / ``next_position`` / ``length`` are the slot bookkeeping every cache shares
(``nnx_zoo.layers.kv_cache``): ``max_len`` bounds the tokens, prompt included.

``prefill`` runs a (left-padded) prompt into an empty cache: the layers run as in the forward pass, and each
layer's state is read off its tokens. ``decode_step`` adds one real token per row: its projections enter the
pending window, a window that closes pools one entry (visible to the token that closed it, as in the forward
pass), and the token attends to its ring, itself and its entries (CSA: the ``index_topk`` its indexer picks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.layers.hyper_connection import widen
from nnx_zoo.layers.kv_cache import advance_slots, empty_slots
from nnx_zoo.layers.rope import rope_cos_sin
from nnx_zoo.layers.scan import run_stack
from nnx_zoo.models.deepseek.dsa import index_scores
from nnx_zoo.models.deepseek4 import kernel
from nnx_zoo.models.deepseek4.attention import Rope, V4Attention
from nnx_zoo.models.deepseek4.config import CSA, HCA, SLIDING, DeepSeekV4Config, kind_name
from nnx_zoo.sharding import shard

if TYPE_CHECKING:  # the model drives this module (init_cache, _extend); its types only name what it passes
    from nnx_zoo.models.deepseek4.model import DecoderLayer, DeepSeekV4

_MIN = float(jnp.finfo(jnp.float32).min)


class LayerState(NamedTuple):
    """One layer's cache (see the module docstring); a kind's stack adds a leading layer dim to each array.
    Fields a layer type does not use are None."""

    ring: jax.Array
    entries: jax.Array | None = None
    pending_kv: jax.Array | None = None
    pending_gate: jax.Array | None = None
    previous_kv: jax.Array | None = None
    previous_gate: jax.Array | None = None
    index_entries: jax.Array | None = None
    index_pending_kv: jax.Array | None = None
    index_pending_gate: jax.Array | None = None
    index_previous_kv: jax.Array | None = None
    index_previous_gate: jax.Array | None = None


class V4Cache(NamedTuple):
    """DeepSeek-V4's fixed-size decoding cache (a pytree; pass it through ``jax.jit`` and loops).

    >>> cache = model.init_cache(batch=2, max_len=256)
    >>> logits, cache = model.prefill(prompt_ids, attention_mask, cache)
    >>> logits, cache = model.decode_step(next_tokens, cache)
    """

    layers: tuple[LayerState, ...]  # one per layer kind, in ``DeepSeekV4.kinds`` order
    rank: jax.Array  # [batch] real tokens so far
    valid: jax.Array
    next_position: jax.Array
    length: jax.Array

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    @classmethod
    def zeros(cls, config: DeepSeekV4Config, kinds: tuple[tuple[str, str], ...], *, batch: int, max_len: int,
              dtype: jnp.dtype) -> V4Cache:
        """An empty cache for ``batch`` rows of up to ``max_len`` tokens."""
        c = config
        slots = empty_slots(batch, max_len)
        layers = []
        for kind in kinds:
            count = c.layer_kinds.count(kind)
            zeros = lambda *shape, count=count: jnp.zeros((count, batch, *shape), dtype)  # noqa: E731
            state: dict[str, Any] = dict(ring=zeros(c.sliding_window - 1, c.head_dim))
            layer_type = kind[0]
            if layer_type != SLIDING:
                rate = c.compress_rate(layer_type)
                width = (2 if layer_type == CSA else 1) * c.head_dim
                state.update(entries=zeros(max_len // rate, c.head_dim), pending_kv=zeros(rate, width),
                             pending_gate=zeros(rate, width))
                if layer_type == CSA:
                    index = 2 * c.index_head_dim
                    state.update(previous_kv=zeros(rate, width), previous_gate=zeros(rate, width),
                                 index_entries=zeros(max_len // rate, c.index_head_dim),
                                 index_pending_kv=zeros(rate, index), index_pending_gate=zeros(rate, index),
                                 index_previous_kv=zeros(rate, index), index_previous_gate=zeros(rate, index))
            layers.append(LayerState(**state))
        return cls(tuple(layers), jnp.zeros((batch,), jnp.int32), **slots)


# ------------------------------------------------------------------------------------------- prefill: a prompt
def _by_rank(values: jax.Array, keep: jax.Array, slot: jax.Array, slots: int) -> jax.Array:
    """``[b, slots, ...]``: ``values [b, t, ...]`` of the tokens where ``keep``, written at ``slot`` (others
    dropped); empty slots are 0."""
    rows = jnp.arange(values.shape[0])[:, None]
    target = jnp.where(keep, slot, slots)
    return jnp.zeros((values.shape[0], slots, *values.shape[2:]), values.dtype).at[rows, target].set(
        values, mode="drop")


def _window_state(kv: jax.Array, gate: jax.Array, rank: jax.Array, total: jax.Array, rate: int, overlap: bool
                  ) -> dict[str, jax.Array]:
    """The pending (and previous, with ``overlap``) window projections after a prompt: tokens of rank at or past
    ``(total // rate) * rate`` are pending, the ``rate`` before them the previous window."""
    base = (total // rate * rate)[:, None]
    out = dict(pending_kv=_by_rank(kv, rank >= base, rank - base, rate),
               pending_gate=_by_rank(gate, rank >= base, rank - base, rate))
    if overlap:
        before = (rank >= base - rate) & (rank < base)
        out.update(previous_kv=_by_rank(kv, before, rank - base + rate, rate),
                   previous_gate=_by_rank(gate, before, rank - base + rate, rate))
    return out


def prefill_state(attn: V4Attention, x: jax.Array, ctx: Any, rank: jax.Array, total: jax.Array, max_len: int
                  ) -> LayerState:
    """A layer's cache after a prompt ``x [b, t, embed]`` (the layer's attention input): ``rank [b, t]`` each
    token's rank (-1 for padding), ``total [b]`` the real tokens."""
    c = attn.config
    rope = ctx.main if attn.layer_type == SLIDING else ctx.compress
    kv = attn.keys(x, rope)
    window = c.sliding_window - 1
    real = rank >= 0
    state: dict[str, Any] = dict(ring=_by_rank(kv, real & (rank >= total[:, None] - window),
                                               rank % max(window, 1), window))
    if attn.compressor is None:
        return LayerState(**state)
    where = ctx.csa if attn.layer_type == CSA else ctx.hca
    rate = attn.compressor.rate
    slots = max_len // rate

    def entries(compressor: Any) -> jax.Array:
        found = compressor(x, where, rope.inv_freq, rope.attention_factor)
        return jnp.pad(found, ((0, 0), (0, slots - found.shape[1]), (0, 0)))

    state["entries"] = entries(attn.compressor)
    state.update(_window_state(*attn.compressor.project(x), rank, total, rate, attn.layer_type == CSA))
    if attn.indexer is not None:
        state["index_entries"] = entries(attn.indexer.compressor)
        index = _window_state(*attn.indexer.compressor.project(x), rank, total, rate, True)
        state.update({f"index_{k}": v for k, v in index.items()})
    return LayerState(**state)


# -------------------------------------------------------------------------------------- decode: one token a row
def _close_window(compressor: Any, kv: jax.Array, gate: jax.Array, state: dict[str, jax.Array], prefix: str,
                  entries_name: str, rank: jax.Array, position: jax.Array, inv_freq: jax.Array,
                  attention_factor: float) -> dict[str, jax.Array]:
    """One new token's projections ``kv``/``gate [b, C]`` into the pending window; where it closes the window
    (its rank is ``rate - 1`` past a multiple), the entry is pooled and written, and the window becomes the
    previous one."""
    rate = compressor.rate
    rows = jnp.arange(kv.shape[0])
    slot = rank % rate
    pending_kv = state[f"{prefix}pending_kv"].at[rows, slot].set(kv.astype(state[f"{prefix}pending_kv"].dtype))
    pending_gate = state[f"{prefix}pending_gate"].at[rows, slot].set(gate.astype(state[f"{prefix}pending_gate"].dtype))
    closes = slot == rate - 1
    start = position - (rate - 1)  # the window's first token's position
    overlap = compressor.overlap
    prev_kv = state.get(f"{prefix}previous_kv")
    prev_gate = state.get(f"{prefix}previous_gate")
    entry = compressor.pool(pending_kv, pending_gate, prev_kv, prev_gate, rank + 1 >= 2 * rate, start, inv_freq,
                            attention_factor)
    count = (rank + 1) // rate
    table = state[entries_name]
    written = table.at[rows, jnp.maximum(count - 1, 0)].set(entry.astype(table.dtype))
    out = {**state, f"{prefix}pending_kv": pending_kv, f"{prefix}pending_gate": pending_gate,
           entries_name: jnp.where(closes[:, None, None], written, table)}
    if overlap:
        out[f"{prefix}previous_kv"] = jnp.where(closes[:, None, None], pending_kv, prev_kv)
        out[f"{prefix}previous_gate"] = jnp.where(closes[:, None, None], pending_gate, prev_gate)
    return out


def decode_attention(attn: V4Attention, x: jax.Array, rope: Rope, rank: jax.Array, position: jax.Array,
                     state: LayerState) -> tuple[jax.Array, LayerState]:
    """One new token per row ``x [b, 1, embed]`` (rank ``rank [b]``, rope position ``position [b]``) through the
    layer's attention against its cache: ``(output [b, 1, embed], state)``."""
    c = attn.config
    q, q_latent = attn.queries(x, rope)
    kv = attn.keys(x, rope)  # [b, 1, d]
    window = c.sliding_window - 1
    fields = state._asdict()
    parts, values = [], []
    if window:
        ring_valid = jnp.arange(window)[None, :] < jnp.minimum(rank, window)[:, None]
        parts.append(jnp.where(ring_valid[:, None, None, :],
                               jnp.einsum("bshd,bkd->bhsk", q, fields["ring"].astype(q.dtype)), _MIN))
        values.append(fields["ring"].astype(q.dtype))
    parts.append(jnp.einsum("bshd,bkd->bhsk", q, kv))
    values.append(kv)
    if attn.compressor is not None:
        comp_kv, comp_gate = attn.compressor.project(x)
        fields = _close_window(attn.compressor, comp_kv[:, 0], comp_gate[:, 0], fields, "", "entries", rank,
                               position, rope.inv_freq, rope.attention_factor)
        entries = fields["entries"].astype(q.dtype)
        visible = jnp.arange(entries.shape[1])[None, :] < ((rank + 1) // attn.compressor.rate)[:, None]
        if attn.indexer is not None:
            ix = attn.indexer
            index_kv, index_gate = ix.compressor.project(x)
            fields = _close_window(ix.compressor, index_kv[:, 0], index_gate[:, 0], fields, "index_", "index_entries",
                                   rank, position, rope.inv_freq, rope.attention_factor)
            inputs = ix.inputs(x, q_latent, None, rope.cos, rope.sin, rope.inv_freq, rope.attention_factor,
                               keys=fields["index_entries"].astype(q.dtype))
            scores = jnp.where(visible[:, None], index_scores(inputs.q, inputs.w, inputs.keys), -jnp.inf)
            _, idx = jax.lax.top_k(scores, min(ix.topk, scores.shape[-1]))
            visible = kernel.picked(idx, jnp.take_along_axis(visible[:, None], idx, axis=-1), entries.shape[1])[:, 0]
        parts.append(jnp.where(visible[:, None, None, :], jnp.einsum("bshd,bkd->bhsk", q, entries), _MIN))
        values.append(entries)
    scale = jnp.asarray(attn.scale, q.dtype)
    probs = kernel.softmax_with_sink([p * scale for p in parts], attn.sinks[...])
    out = sum(jnp.einsum("bhsk,bkd->bshd", p.astype(v.dtype), v) for p, v in zip(probs, values, strict=True))
    if window:
        rows = jnp.arange(x.shape[0])
        fields["ring"] = fields["ring"].at[rows, rank % window].set(kv[:, 0].astype(fields["ring"].dtype))
    return attn.output(attn.unrotate(out, rope)), LayerState(**fields)


# ------------------------------------------------------------------------------------------ the model's _extend
def extend(model: DeepSeekV4, input_ids: jax.Array, token_mask: jax.Array, cache: V4Cache
           ) -> tuple[jax.Array, V4Cache]:
    """``CausalLMBase._extend`` for DeepSeek-V4: a prompt (``t > 1``) into an empty cache, or one token per row.

    A prompt goes into an empty cache only (its layers run as the forward pass does, then each layer's state is
    read off its tokens); more tokens after that go one at a time (``decode_step``)."""
    if input_ids.shape[1] > 1 and not isinstance(cache.length, jax.core.Tracer) and int(cache.length):
        raise ValueError(f"DeepSeek-V4's prefill runs a prompt into an empty cache, and this one holds "
                         f"{int(cache.length)} tokens: feed further tokens one at a time with decode_step, or start "
                         "from model.init_cache(...)")
    rank_before = cache.rank
    positions, _, valid, next_position, length = advance_slots(cache.valid, cache.next_position, cache.length,
                                                               token_mask)
    token_mask = token_mask.astype(bool)
    t = input_ids.shape[1]
    if t == 1:
        step = _decode_step(model, input_ids, positions, rank_before, cache)
        h, layers = step
        rank = rank_before + token_mask[:, 0].astype(jnp.int32)
    else:
        h, layers = _prefill(model, input_ids, token_mask, positions, cache)
        rank = jnp.sum(token_mask, axis=1, dtype=jnp.int32)
    logits = shard(model._logits(model.norm(model.head_hc(h))), ("activation_batch", "activation_length", None))
    return logits, V4Cache(layers, rank, valid, next_position, length)


def _segments_with_offsets(model: DeepSeekV4) -> list[tuple[Any, tuple[tuple[str, str], ...], int, list[int]]]:
    """``model._segments()`` with, per pattern position, the first layer of its kind's stack the segment uses."""
    taken = dict.fromkeys(model.kinds, 0)
    out = []
    for group, pattern, repeats in model._segments():
        starts = []
        for kind in pattern:
            starts.append(taken[kind])
            taken[kind] += repeats
        out.append((group, pattern, repeats, starts))
    return out


def _run_layers(model: DeepSeekV4, h: jax.Array, layers: tuple[LayerState, ...], step: Any) -> tuple[Any, ...]:
    """Every layer in model order through ``step(layer, h, state) -> (h, state)``, each layer's state read from and
    written back to its kind's stack of states."""
    kinds = list(model.kinds)

    def body_of(meta: list[tuple[tuple[str, str], int]]) -> Any:
        def body(group: nnx.List, carry: Any, rep: jax.Array) -> tuple[Any, None]:
            h, states = carry
            states = list(states)
            for layer, (kind, start) in zip(group, meta, strict=True):
                k = kinds.index(kind)
                index = start + rep
                state = jax.tree.map(lambda a, i=index: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                                     states[k])
                h, state = step(layer, h, state)
                states[k] = jax.tree.map(lambda a, new, i=index: jax.lax.dynamic_update_index_in_dim(a, new, i, 0),
                                         states[k], state)
            return (h, tuple(states)), None

        return body

    carry = (h, layers)
    for group, pattern, repeats, starts in _segments_with_offsets(model):
        body = body_of(list(zip(pattern, starts, strict=True)))
        carry, _ = run_stack(group, body, carry, jnp.arange(repeats), scan=model.config.scan_layers)
    return carry


def _prefill(model: DeepSeekV4, input_ids: jax.Array, token_mask: jax.Array, positions: jax.Array,
             cache: V4Cache) -> tuple[jax.Array, tuple[LayerState, ...]]:
    c = model.config
    ctx = model._context(positions, token_mask, None)
    rank = jnp.where(token_mask, jnp.cumsum(token_mask, axis=1, dtype=jnp.int32) - 1, -1)
    total = jnp.sum(token_mask, axis=1, dtype=jnp.int32)

    def step(layer: DecoderLayer, h: jax.Array, state: LayerState) -> tuple[jax.Array, LayerState]:
        x, post, comb = layer.attn_hc(h)
        normed = layer.input_norm(x)
        state = prefill_state(layer.attn, normed, ctx, rank, total, cache.max_len)
        h = layer.attn_hc.expand(h, layer.attn(normed, ctx).output, post, comb)
        x, post, comb = layer.ffn_hc(h)
        moe = layer.mlp(layer.post_attn_norm(x), token_mask=token_mask, input_ids=input_ids)
        return layer.ffn_hc.expand(h, moe.output, post, comb), state

    return _run_layers(model, widen(model.embed(input_ids), c.hc_mult), cache.layers, step)


def _decode_step(model: DeepSeekV4, input_ids: jax.Array, positions: jax.Array, rank: jax.Array, cache: V4Cache
                 ) -> tuple[jax.Array, tuple[LayerState, ...]]:
    c = model.config
    main_freq = jnp.asarray(model.rope_inv_freq, jnp.float32)
    compress_freq = jnp.asarray(model.compress_inv_freq, jnp.float32)
    ropes = {SLIDING: Rope(*rope_cos_sin(positions, main_freq, model.rope_attention_factor), main_freq,
                           model.rope_attention_factor)}
    ropes[CSA] = ropes[HCA] = Rope(*rope_cos_sin(positions, compress_freq, model.compress_attention_factor),
                                   compress_freq, model.compress_attention_factor)
    position = positions[:, 0]
    token_mask = jnp.ones(input_ids.shape, bool)

    def step(layer: DecoderLayer, h: jax.Array, state: LayerState) -> tuple[jax.Array, LayerState]:
        x, post, comb = layer.attn_hc(h)
        out, state = decode_attention(layer.attn, layer.input_norm(x), ropes[layer.attn.layer_type], rank, position,
                                      state)
        h = layer.attn_hc.expand(h, out, post, comb)
        x, post, comb = layer.ffn_hc(h)
        moe = layer.mlp(layer.post_attn_norm(x), token_mask=token_mask, input_ids=input_ids)
        return layer.ffn_hc.expand(h, moe.output, post, comb), state

    return _run_layers(model, widen(model.embed(input_ids), c.hc_mult), cache.layers, step)


__all__ = ["LayerState", "V4Cache", "decode_attention", "extend", "kind_name", "prefill_state"]
