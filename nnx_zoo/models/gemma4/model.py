"""Gemma 4 (text): the shared dense decoder with Gemma 4's layer (``nnx_zoo.models.gemma4.layers``), its per-layer
inputs and its K/V sharing.

What ``Gemma4`` adds to the core (``nnx_zoo.models.causal_lm.CausalLM``), and why it has its own ``forward`` and
``_extend``:
- per-layer inputs: ``embed_per_layer`` (scaled by ``sqrt(width)``) mixed with ``per_layer_proj`` of the scaled
  embeddings (normed), ``[layers, batch, seq, width]``; each scanned segment takes its layers' slices as the scan's
  inputs;
- K/V sharing: the storing layers (a stack of one each, ``store_layers`` / ``store_sliding_layers``) hand their keys
  and values to the shared layers of their type (``shared_layers`` / ``shared_sliding_layers``), which come after
  them; when decoding, only the storing layer caches them (the shared stacks have no cache), and each step's
  shared layers attend to what it attended to;
- two ropes: ``proportional`` on the global layers' wider heads, the default one on the sliding layers;
- the logits soft-capped by ``final_logit_softcapping``; the MoE block's choices in ``expert_indices``.

Pipelined (a ``stage`` mesh axis; every schedule of ``nnx_zoo.layers.pipeline``) through the core's one pipeline
walk (``_pipeline_parts``, ``_pipelined_layers``, ``_one_f_one_b_loss``, a ``pipeline_layers`` prefix by
``_unpipelined_prefix``), with Gemma 4's layer in its per-layer hook (``_pipeline_layer``). The per-layer inputs
ride beside the hidden state in what the pipeline hands on (``_pipeline_carry``: ``[batch, seq, hidden + layers *
width]``): each layer takes the first ``width`` of them and moves its own to the back, so every chunk, on whichever
stage, finds its layers' inputs first, and their gradients flow back with the hidden state's (1F1B differentiates
only the stacks, the head and the pipeline's input). The cost: the stage links and each stage's saved inputs carry
``layers * width`` more per token. K/V sharing does not pipeline (``pipeline_problem``); the MoE block has no loss
term of its own, so it runs as any layer (its expert loads and choices are not reported from a pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.layers.attention import causal_mask
from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.kv_cache import StackedKVCache, ring_mask, ring_slots
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.pipeline import resolve_schedule, stage_count
from nnx_zoo.layers.rope import proportional_rope_frequencies, rope_cos_sin, rope_frequencies
from nnx_zoo.layers.scan import Segment, model_order, run_stack
from nnx_zoo.layers.softcap import soft_cap
from nnx_zoo.layers.spec import explicit_spec
from nnx_zoo.models.causal_lm import _BLE, _OUT_BLE, CausalLM, CausalLMOutput, _dtypes, stack_hidden_states
from nnx_zoo.models.gemma3.model import warn_if_multimodal
from nnx_zoo.models.gemma4 import hf
from nnx_zoo.models.gemma4.config import Gemma4Config
from nnx_zoo.models.gemma4.layers import Gemma4DecoderLayer, SharedKV, gemma4_norm
from nnx_zoo.models.inputs import check_forward_inputs
from nnx_zoo.sharding import shard, use_rules
from nnx_zoo.sharding.rules import Rules

_BL = ("activation_batch", "activation_length")
_PER_LAYER = _BL + (None, None)  # [batch, seq, layers, width]
_CARRY = _BL + (None,)  # the pipeline's carry: [batch, seq, hidden + layers * width], whole along its last dim
_OUT_CARRY = ("activation_embed_and_logits_batch",) + _CARRY[1:]  # the same outside the pipeline (split over stage)


class Gemma4(CausalLM):
    """Gemma 4 causal language model, the text model (exact against HF ``Gemma4ForCausalLM``, and the text part
    of ``Gemma4ForConditionalGeneration``).

    >>> config = Gemma4Config.preset("gemma4-tiny")
    >>> model = Gemma4.create(config, mesh=make_mesh({"fsdp": 8}))        # or Gemma4(config, rngs=nnx.Rngs(0))
    >>> out = model.forward(jnp.zeros((2, 16), jnp.int32), with_routing=True)
    >>> out.logits.shape, out.expert_indices.shape                       # [2, 16, vocab]; the MoE block's top 2
    ((2, 16, 32000), (4, 2, 16, 2))
    >>> model = Gemma4.from_pretrained("/path/to/gemma-4-E2B-it")         # a gemma4 checkpoint: its text model

    Parameters: ``embed.embedding`` (also the output head), ``embed_per_layer``, ``per_layer_proj``,
    ``per_layer_norm`` (per-layer inputs), the layer stacks by kind (``config.layer_stacks()``), ``norm.scale``;
    each layer's ``layer_scalar`` is a ``LayerScalar`` (a buffer, not trained).
    """

    config_class: ClassVar[type[Gemma4Config]] = Gemma4Config
    key_table = staticmethod(hf.key_table)

    def __init__(self, config: Gemma4Config, *, rngs: nnx.Rngs, rules: Rules | str = "default",
                 allow_partial: bool | None = None):
        super().__init__(config, rngs=rngs, rules=rules, allow_partial=allow_partial)
        c = config
        self.embed.scale = float(c.hidden_size**0.5)  # the core's plain table and norm, made Gemma 4's
        self.norm = gemma4_norm(c.hidden_size, c)
        p, n = c.hidden_size_per_layer_input, c.num_hidden_layers
        if p:
            init = nnx.initializers.normal(c.initializer_range)
            self.embed_per_layer = Embed(c.vocab_size_per_layer_input, n * p, scale=float(p**0.5),
                                         embedding_init=init, rngs=rngs, **_dtypes(c))
            self.per_layer_proj = Linear(c.hidden_size, (n, p), kernel_names=("embed", None, None),
                                         kernel_init=init, rngs=rngs, **_dtypes(c))
            self.per_layer_norm = gemma4_norm(p, c)
        else:
            self.embed_per_layer = self.per_layer_proj = self.per_layer_norm = None
        sliding = rope_frequencies(c.head_dim, c.sliding_rope_theta)[0]
        if c.global_rope_type == "proportional":
            full = proportional_rope_frequencies(c.global_head_dim, c.rope_theta, c.global_partial_rotary_factor,
                                                 c.global_rope_factor)
        else:
            full = rope_frequencies(c.global_head_dim, c.rope_theta)[0]
        self.local_rope_inv_freq = tuple(float(f) for f in sliding)
        self.rope_inv_freq, self.rope_attention_factor = tuple(float(f) for f in full), 1.0

    def layer_class(self, kind: Any) -> type[nnx.Module]:
        del kind
        return Gemma4DecoderLayer

    def _layer_rope(self, kind: Any, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Sliding layers: the default rope at ``sliding_rope_theta``; global ones: ``rope_theta``'s over their
        wider heads (``proportional``: the trailing frequencies 0)."""
        inv_freq = self.local_rope_inv_freq if kind.attention == "sliding" else self.rope_inv_freq
        return rope_cos_sin(positions, jnp.asarray(inv_freq, jnp.float32))

    def _logits(self, hidden: jax.Array, head: Embed | Linear | None = None) -> jax.Array:
        return soft_cap(super()._logits(hidden, head=head), self.config.final_logit_softcapping)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                        dtype: Any = None, allow_partial: bool = False, **config_overrides: Any) -> Gemma4:
        """``CausalLM.from_pretrained``; a multimodal checkpoint (``model_type`` ``gemma4``) gives its text model,
        with a warning that its vision and audio towers are left out."""
        warn_if_multimodal(cls, path)
        return super().from_pretrained(path, mesh=mesh, rules=rules, dtype=dtype, allow_partial=allow_partial,
                                       **config_overrides)

    # ---- per-layer inputs ----
    def _per_layer_inputs(self, input_ids: jax.Array, embeddings: jax.Array) -> jax.Array | None:
        """``[layers, batch, seq, width]``: ``(norm(per_layer_proj(embeddings) / sqrt(hidden)) +
        embed_per_layer(ids)) / sqrt(2)`` (None without per-layer inputs)."""
        if self.embed_per_layer is None:
            return None
        c = self.config
        shape = (*input_ids.shape, c.num_hidden_layers, c.hidden_size_per_layer_input)
        table = shard(self.embed_per_layer(input_ids), _BL + (None,))
        table = jnp.reshape(table, shape, out_sharding=explicit_spec(_PER_LAYER, shape))
        projected = self.per_layer_proj(embeddings, _PER_LAYER) * jnp.asarray(c.hidden_size**-0.5, embeddings.dtype)
        mixed = (self.per_layer_norm(projected) + table) * jnp.asarray(2.0**-0.5, embeddings.dtype)
        return jnp.moveaxis(shard(mixed, _PER_LAYER), 2, 0)

    def _pipeline_carry(self, h: jax.Array, per_layer: jax.Array | None) -> jax.Array:
        """What the pipeline hands from layer to layer: ``h`` and, with per-layer inputs (``[layers, batch, seq,
        width]``), those beside it, layer 0's first: ``[batch, seq, hidden + layers * width]``; laid out as the
        embeddings, the batch split over ``stage`` too (a ``pipeline_layers`` prefix runs on it so; the pipeline
        gathers it)."""
        if per_layer is None:
            return h
        batch, seq = h.shape[:2]
        shape = (batch, seq, per_layer.shape[0] * per_layer.shape[-1])
        flat = jnp.reshape(shard(jnp.moveaxis(per_layer, 0, 2), _PER_LAYER), shape,
                           out_sharding=explicit_spec(_CARRY, shape))
        return jnp.concatenate([shard(h, _OUT_CARRY), shard(flat, _OUT_CARRY)], axis=-1)

    def _pipeline_hidden(self, carry: jax.Array) -> jax.Array:
        return carry if self.embed_per_layer is None else carry[..., :self.config.hidden_size]

    def _pipeline_layer(self, layer: nnx.Module, carry: jax.Array, cos: jax.Array, sin: jax.Array, mask: Any, *,
                        with_expert_load: bool) -> tuple[jax.Array, dict[str, Any]]:
        """Gemma 4's layer on the pipeline's carry (``_pipeline_carry``): it reads the first ``width`` per-layer
        inputs, its own, and moves them to the back (after every layer the inputs are back in their order, and each
        chunk's first layer, or the first pipelined layer after a ``pipeline_layers`` prefix, finds its own first).
        No stats: the expert loads are refused from a pipeline (``forward``)."""
        del with_expert_load
        if self.embed_per_layer is None:
            return layer(carry, cos, sin, mask)[0], {}
        hidden, width = self.config.hidden_size, self.config.hidden_size_per_layer_input
        carry = shard(carry, _CARRY)  # under the rules in force (a prefix's split the batch over stage too)
        h, inputs = carry[..., :hidden], carry[..., hidden:]
        h = layer(h, cos, sin, mask, per_layer_input=inputs[..., :width])[0]
        return jnp.concatenate([shard(h, _CARRY), inputs[..., width:], inputs[..., :width]], axis=-1), {}

    @classmethod
    def pipeline_problem(cls, config: Gemma4Config) -> str | None:
        """K/V sharing: a shared layer attends to the keys and values of its type's storing layer, which the
        pipeline cannot hand across stages (it hands on only the hidden state), and the storing layers are kinds of
        one layer each, so the layer sequence never splits into the identical chunks a pipeline needs."""
        n = config.num_kv_shared_layers
        if not n:
            return None
        kinds = config.layer_kinds()
        stores = ", ".join(f"{i} ({kind.attention})" for i, kind in enumerate(kinds) if kind.kv == "store")
        return (f"Gemma 4 with K/V sharing (num_kv_shared_layers={n}: layers {len(kinds) - n}..{len(kinds) - 1} "
                f"attend to the keys and values of layers {stores}) does not run pipelined: a pipeline splits the "
                "layers into identical chunks, one per stage (and virtual stage), and hands only the hidden state "
                "from stage to stage, while the shared layers need the keys and values of one earlier storing layer "
                "per attention type (a layer kind of its own, so no split into identical chunks exists, and its "
                "readers would run on later stages). The edge presets (gemma4-e2b, gemma4-e4b) share K/V: train "
                "them on a mesh without 'stage' (e.g. --mesh fsdp=-1); configs without sharing "
                "(num_kv_shared_layers=0: gemma4-26b-a4b, gemma4-31b) pipeline")

    def _segment_inputs(self, segment: Segment, per_layer: jax.Array | None) -> tuple[jax.Array | None, ...]:
        """Per pattern position of ``segment``, its layers' per-layer inputs ``[repeats, batch, seq, width]``."""
        if per_layer is None:
            return (None,) * len(segment.pattern)
        layers = {name: indices for name, _, indices in self.config.layer_stacks()}
        out = []
        for name, first, stride in zip(segment.pattern, segment.starts, segment.strides):
            indices = layers[name][first:first + stride * (segment.repeats - 1) + 1:stride]
            step = indices[1] - indices[0] if len(indices) > 1 else 1
            assert list(indices) == list(range(indices[0], indices[-1] + 1, step)), indices  # periodic segments
            out.append(jax.lax.slice_in_dim(per_layer, indices[0], indices[-1] + 1, step, axis=0))
        return tuple(out)

    # ---- the forward pass ----
    def forward(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                segment_ids: jax.Array | None = None, position_ids: jax.Array | None = None,
                with_hidden_states: bool = False, with_mtp: bool = False, with_expert_load: bool = False,
                with_routing: bool = False, with_logits: bool = True, pipeline_microbatches: int = 1,
                pipeline_schedule: str = "gpipe", pipeline_virtual_stages: int | None = None,
                loss_targets: tuple[jax.Array, jax.Array] | None = None) -> CausalLMOutput:
        """``CausalLM.forward``'s outputs plus, with the MoE block, ``expert_indices [layers, batch, seq, k]``
        (``with_routing``), ``expert_load [layers, experts]`` and ``dropped_tokens`` (``with_expert_load``; padding
        counted, as routed). No aux loss: transformers' Gemma 4 has none.

        On a mesh with a ``stage`` axis the layers run pipelined as ``CausalLM.forward``'s (the pipeline keywords
        and ``loss_targets`` mean the same), the per-layer inputs carried beside the hidden state; K/V sharing is
        refused (``pipeline_problem``), and so are ``with_hidden_states`` and, with the MoE block, ``with_routing``
        and ``with_expert_load``."""
        check_forward_inputs(input_ids, attention_mask, segment_ids, position_ids, config=self.config)
        if with_mtp:
            raise ValueError(f"with_mtp=True but {type(self).__name__} has no MTP heads (multi-token prediction)")
        c = self.config
        want_routing = c.enable_moe_block and (with_routing or with_expert_load)
        with use_rules(self.rules, allow_partial=self.allow_partial), self._parameter_mesh():
            seq_len = input_ids.shape[1]
            positions = jnp.arange(seq_len)[None, :] if position_ids is None else position_ids
            kinds = self._kinds_by_stack()
            ropes = {name: self._layer_rope(kind, positions) for name, kind in kinds.items()}
            mask = causal_mask(seq_len, attention_mask, segment_ids)
            embeddings = h = self.embed(input_ids)
            per_layer = self._per_layer_inputs(input_ids, embeddings)
            if stage_count() > 1:  # pipelined over the mesh's stage axis
                problem = self.pipeline_problem(c)
                if problem is not None:
                    raise ValueError(problem)
                if with_hidden_states or want_routing:
                    raise ValueError("with_hidden_states, and with the MoE block with_routing / with_expert_load, "
                                     "are not supported on a mesh with a 'stage' axis (the pipeline hands on only "
                                     "the last layer's output); run it without 'stage'")
                schedule = resolve_schedule(pipeline_schedule, pipeline_virtual_stages)
                c.check_pipeline(stage_count(), schedule.virtual_stages)  # says which pipeline_layers fit
                # config.pipeline_layers: the layers before the pipeline run outside it, on the carry too.
                carry, _ = self._unpipelined_prefix(self._pipeline_carry(h, per_layer), ropes, mask)
                whole = _BLE if per_layer is None else _CARRY  # the pipeline's input whole over stage
                if schedule.loss_inside:
                    if loss_targets is None:
                        raise ValueError(f"pipeline_schedule={pipeline_schedule!r} runs the loss on the last stage: "
                                         "pass loss_targets=(targets, loss_mask), or use pipeline_schedule='gpipe'")
                    loss, _ = self._one_f_one_b_loss(shard(carry, whole), ropes, mask, loss_targets,
                                                     pipeline_microbatches, schedule.virtual_stages)
                    return CausalLMOutput(logits=None, loss_sum=loss)
                # Out split over stage again: the final norm and the head run on each stage's share of the batch.
                carry, _ = self._pipelined_layers(shard(carry, whole), ropes, mask, pipeline_microbatches,
                                                  pipeline_schedule)
                final_hidden = self.norm(shard(self._pipeline_hidden(carry), _OUT_BLE))
                return CausalLMOutput(logits=self._logits(final_hidden) if with_logits else None,
                                      final_hidden=final_hidden)
            shared: dict[str, SharedKV] = {}  # attention type -> the storing layer's keys and values

            def segment_body(pattern: tuple[str, ...]) -> Any:
                def body(group: nnx.List, h: jax.Array, xs: tuple[jax.Array | None, ...]) -> tuple[jax.Array, list]:
                    records = []
                    for name, layer, per_layer_input in zip(pattern, group, xs):
                        kind = kinds[name]
                        h, kv, routing = layer(h, *ropes[name], mask, per_layer_input=per_layer_input,
                                               shared_kv=shared.get(kind.attention) if kind.kv == "shared" else None)
                        records.append((h if with_hidden_states else None,
                                        (kv.k, kv.v) if kind.kv == "store" else None,
                                        routing.expert_indices if want_routing else None))
                    return h, records
                return body

            hidden, chosen = [], []
            for segment in self.layer_segments():
                h, records = run_stack(segment.group, segment_body(segment.pattern), h,
                                       self._segment_inputs(segment, per_layer), scan=c.scan_layers,
                                       remat_policy=c.remat_policy)
                for name, (_, kv, _) in zip(segment.pattern, records):
                    if kv is not None:  # a storing layer (a stack of one): its keys and values
                        shared[kinds[name].attention] = SharedKV(kv[0][-1], kv[1][-1])
                hidden.append(model_order([r[0] for r in records]))
                chosen.append(model_order([r[2] for r in records]))
            final_hidden = self.norm(h)
            hidden_states = (stack_hidden_states(embeddings, jnp.concatenate(hidden), final_hidden)
                             if with_hidden_states else None)
            indices = jnp.concatenate(chosen) if want_routing else None
            load = dropped = None
            if with_expert_load and indices is not None:
                load = jnp.sum(jax.nn.one_hot(indices, c.num_experts, dtype=jnp.float32), axis=(1, 2, 3))
                dropped = jnp.zeros((c.num_hidden_layers,), jnp.int32)  # every path here is dropless
            return CausalLMOutput(logits=self._logits(final_hidden) if with_logits else None,
                                  hidden_states=hidden_states, expert_indices=indices if with_routing else None,
                                  expert_load=load, dropped_tokens=dropped, final_hidden=final_hidden)

    # ---- generation: rings for sliding layers, nothing for shared ones ----
    def init_cache(self, batch: int, max_len: int) -> StackedKVCache:
        """An empty decoding cache: per stack that computes keys and values, ``max_len`` slots for global layers and
        a ring of ``sliding_window - 1`` for sliding ones (at each layer's own head width); the shared-K/V stacks
        keep none (they attend to their storing layer's)."""
        c = self.config
        stacks = {}
        for name, kind, indices in c.layer_stacks():
            if kind.kv == "shared":
                continue
            head_dim, kv_heads = c.head_dims(kind)
            stacks[name] = (len(indices), ring_slots(max_len, c.attention_options(kind).get("window"), None),
                            kv_heads, head_dim)
        with use_rules(self._decoding_rules(), allow_partial=self.allow_partial), self._parameter_mesh():
            return StackedKVCache.zeros(stacks, batch=batch, max_len=max_len, dtype=jnp.dtype(c.dtype))

    def _extend(self, input_ids: jax.Array, token_mask: jax.Array, cache: StackedKVCache
                ) -> tuple[jax.Array, StackedKVCache]:
        start = cache.length
        positions, mask, cache = cache.advance(token_mask)
        kinds = self._kinds_by_stack()
        ropes = {name: self._layer_rope(kind, positions) for name, kind in kinds.items()}
        embeddings = self.embed(input_ids)
        per_layer = self._per_layer_inputs(input_ids, embeddings)
        shared: dict[str, SharedKV] = {}

        def segment_body(segment: Segment) -> Any:
            def body(group: nnx.List, carry: Any, xs: Any) -> tuple[Any, list]:
                (h, k, v), (repeat, inputs) = carry, xs
                stored = []
                for name, layer, first, stride, per_layer_input in zip(segment.pattern, group, segment.starts,
                                                                       segment.strides, inputs):
                    kind = kinds[name]
                    if kind.kv == "shared":
                        h, _, _, kv = layer.decode(h, *ropes[name], None, None, start, mask,
                                                   per_layer_input=per_layer_input, shared_kv=shared[kind.attention])
                    else:
                        index = first + stride * repeat
                        h, k_layer, v_layer, kv = layer.decode(
                            h, *ropes[name], jax.lax.dynamic_index_in_dim(k[name], index, keepdims=False),
                            jax.lax.dynamic_index_in_dim(v[name], index, keepdims=False), start, mask,
                            per_layer_input=per_layer_input)
                        k = {**k, name: jax.lax.dynamic_update_index_in_dim(k[name], k_layer, index, 0)}
                        v = {**v, name: jax.lax.dynamic_update_index_in_dim(v[name], v_layer, index, 0)}
                    stored.append((kv.k, kv.v) if kind.kv == "store" else None)
                return (h, k, v), stored
            return body

        carry = (embeddings, cache.k, cache.v)
        for segment in self.layer_segments():
            xs = (jnp.arange(segment.repeats), self._segment_inputs(segment, per_layer))
            carry, stored = run_stack(segment.group, segment_body(segment), carry, xs, scan=self.config.scan_layers)
            for name, kv in zip(segment.pattern, stored):
                if kv is not None:  # what the storing layer attended to, and the mask it used over those keys
                    ring = cache.k[name].shape[2]
                    step_mask = mask if ring >= cache.max_len else ring_mask(mask, ring, start, input_ids.shape[1])
                    shared[kinds[name].attention] = SharedKV(kv[0][-1], kv[1][-1], step_mask)
        h, k, v = carry
        logits = shard(self._logits(self.norm(h)), ("activation_batch", "activation_length", None))
        return logits, cache._replace(k=k, v=v)


