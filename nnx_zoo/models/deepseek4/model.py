"""DeepSeek-V4: decoder layers on hyper-connection streams, the MTP head, and the causal LM.

Reading order: ``DeepSeekV4.forward`` embeds the tokens and copies them into ``hc_mult`` streams
(``nnx_zoo.layers.hyper_connection``), runs the layers in order, collapses the streams (``HyperHead``), norms, and
projects to the vocabulary. A ``DecoderLayer`` is ``attention`` then ``MoE``, each read from a collapse of the
streams and written back into all of them (``HyperConnection``); the attention is ``V4Attention``
(``nnx_zoo.models.deepseek4.attention``), the MoE the shared ``SparseMoE`` with V4's routers (a token-id table on
``hash_moe`` layers, ``sqrt(softplus)`` scores with a selection bias on ``moe`` layers) and clamped SwiGLUs.

Layers differ by kind (attention type x MLP type), and each kind has its own stack of parameters (``stacks``,
one entry per kind present, in the order kinds first appear). The schedule runs as segments of a repeated pattern
of kinds (``periodic_runs``: V4-Flash is two sliding layers, one CSA layer, then (HCA, CSA) twenty times), each
segment one scan over slices of its kinds' stacks, so a 61-layer model compiles a handful of layer bodies.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.hyper_connection import HyperConnection, HyperHead, widen
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.pipeline import (
    Schedule,
    pipeline_1f1b_value_and_grad,
        pipeline_stack,
    resolve_schedule,
    stage_count,
)
from nnx_zoo.layers.rope import rope_cos_sin, rope_frequencies
from nnx_zoo.layers.scan import create_stack, periodic_runs, run_stack, take_layers
from nnx_zoo.layers.sparse_moe import SparseMoE
from nnx_zoo.models.causal_lm import CausalLMBase, CausalLMOutput, check_forward_inputs, shifted_by_depth
from nnx_zoo.models.deepseek.dsa import mean_over_real_queries
from nnx_zoo.models.deepseek.model import (
    _mean_over_sequences,
    _real_rows,
    differentiated_by,
    masked_cross_entropy,
    pipeline_loss_weights,
)
from nnx_zoo.models.deepseek.moe import sequence_balance_loss
from nnx_zoo.models.deepseek4.attention import Context, Rope, V4Attention
from nnx_zoo.models.deepseek4.axes import HASH_LAYERS
from nnx_zoo.models.deepseek4.cache import V4Cache, extend
from nnx_zoo.models.deepseek4.compressor import windows
from nnx_zoo.models.deepseek4.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, DeepSeekV4Config, kind_name
from nnx_zoo.models.deepseek4.hf import load_pretrained, save_pretrained
from nnx_zoo.sharding import get_rules, shard, use_rules
from nnx_zoo.sharding.rules import Rules

_BLE = ("activation_batch", "activation_length", "activation_embed")
_STREAMS = ("activation_batch", "activation_length", "activation_hc", "activation_embed")
# The pipeline's output, and what runs after it: the batch split over 'stage' too (activation_batch's without it).
_OUT_STREAMS = ("activation_embed_and_logits_batch", "activation_length", "activation_hc", "activation_embed")
STACK_AXIS = "layers"  # the top-k routed layers' stacks: the pipelined ones, split over 'stage'


def stack_axis(kind: tuple[str, str]) -> str:
    """The leading logical axis of ``kind``'s stack: the hash-routed first layers run before the pipeline, whole
    on every stage (``hash_layers``); the top-k routed ones are the pipelined stacks (``layers``)."""
    return HASH_LAYERS if kind[1] == HASH_MOE else STACK_AXIS


def _dtypes(c: DeepSeekV4Config) -> dict[str, Any]:
    return dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))


class LayerResult(NamedTuple):
    """What a layer hands up besides its streams: ``expert_indices [b, s, k]``, ``dropped_tokens`` (int32),
    ``balance_loss [b]`` (the sequence-wise balance loss; None when off) and ``indexer_loss [b]`` (a CSA layer's
    indexer KL, each sequence's mean over its real queries; None unless the indexer trains)."""

    expert_indices: jax.Array
    dropped_tokens: jax.Array
    balance_loss: jax.Array | None = None
    indexer_loss: jax.Array | None = None


class DecoderLayer(nnx.Module):
    """One V4 layer on the streams ``h [b, s, hc_mult, embed]``: ``(h', SparseMoEOutput)``.

    >>> layer = DecoderLayer(DeepSeekV4Config.preset("deepseek4-tiny"), CSA, TOPK_MOE, rngs=nnx.Rngs(0))
    """

    def __init__(self, config: DeepSeekV4Config, layer_type: str, mlp_type: str, *, rngs: nnx.Rngs):
        c = self.config = config
        init = nnx.initializers.normal(c.initializer_range)
        hc = dict(streams=c.hc_mult, sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps, norm_eps=c.rms_norm_eps,
                  kernel_init=init, rngs=rngs)
        self.attn_hc = HyperConnection(c.hidden_size, **hc)
        self.ffn_hc = HyperConnection(c.hidden_size, **hc)
        self.input_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.attn = V4Attention(c, layer_type, rngs=rngs)
        self.post_attn_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.mlp = SparseMoE(
            c.hidden_size, num_experts=c.n_routed_experts, experts_per_token=c.num_experts_per_tok,
            expert_hidden=c.moe_intermediate_size, renormalize=True, shared_hidden=c.moe_intermediate_size,
            router="sqrtsoftplus_hash" if mlp_type == HASH_MOE else "sqrtsoftplus_bias",
            routed_scaling_factor=c.routed_scaling_factor, moe_impl=c.moe_impl,
            grouped_matmul_impl=c.grouped_matmul_impl, capacity_factor=c.moe_capacity_factor,
            swiglu_limit=c.swiglu_limit, vocab_size=c.vocab_size if mlp_type == HASH_MOE else None,
            kernel_init=init, rngs=rngs, **_dtypes(c))

    def __call__(self, h: jax.Array, ctx: Context, input_ids: jax.Array, token_mask: jax.Array
                 ) -> tuple[jax.Array, LayerResult]:
        c = self.config
        x, post, comb = self.attn_hc(h)
        attn = self.attn(self.input_norm(x), ctx)
        h = self.attn_hc.expand(h, attn.output, post, comb)
        x, post, comb = self.ffn_hc(h)
        out, routing, _, dropped = self.mlp.routed(self.post_attn_norm(x), input_ids)
        batch, seq = input_ids.shape
        idx = routing.expert_indices.reshape(batch, seq, -1)
        balance = None if not c.seq_aux_loss_alpha else sequence_balance_loss(
            routing.probs, routing.expert_indices, token_mask, c.seq_aux_loss_alpha)
        kl = None if attn.indexer_kl is None else mean_over_real_queries(attn.indexer_kl, token_mask)
        return self.ffn_hc.expand(h, out, post, comb), LayerResult(idx, dropped, balance, kl)


class MTPHead(nnx.Module):
    """One multi-token-prediction depth (the released checkpoints' ``mtp.{k}``): the next token's embedding and the
    previous depth's streams, ``e_proj(enorm(emb)) + h_proj(hnorm(h))`` per stream, through a sliding-window layer
    with a top-k MoE, collapsed by its own ``HyperHead`` and normed; the embedding and output head are the main
    model's."""

    def __init__(self, config: DeepSeekV4Config, *, rngs: nnx.Rngs):
        c = config
        h = c.hidden_size
        init = nnx.initializers.normal(c.initializer_range)
        self.enorm = RMSNorm(h, eps=c.rms_norm_eps, **_dtypes(c))
        self.hnorm = RMSNorm(h, eps=c.rms_norm_eps, **_dtypes(c))
        self.e_proj = Linear(h, h, kernel_names=("mtp_embed", "embed"), kernel_init=init, rngs=rngs, **_dtypes(c))
        self.h_proj = Linear(h, h, kernel_names=("mtp_embed", "embed"), kernel_init=init, rngs=rngs, **_dtypes(c))
        self.layer = DecoderLayer(c, SLIDING, TOPK_MOE, rngs=rngs)
        self.head = HyperHead(h, streams=c.hc_mult, eps=c.hc_eps, norm_eps=c.rms_norm_eps, kernel_init=init,
                              rngs=rngs)
        self.norm = RMSNorm(h, eps=c.rms_norm_eps, **_dtypes(c))

    def __call__(self, embedded: jax.Array, previous: jax.Array, ctx: Context, input_ids: jax.Array,
                 token_mask: jax.Array) -> tuple[jax.Array, jax.Array, LayerResult]:
        """``(streams, normed hidden [b, s, embed], its layer's result)``."""
        streams = ("activation_batch", "activation_length", "activation_hc", "activation_embed")
        h = self.e_proj(self.enorm(embedded), _BLE)[:, :, None, :] + self.h_proj(self.hnorm(previous), streams)
        h, moe = self.layer(shard(h, streams), ctx, input_ids, token_mask)
        return h, self.norm(self.head(h)), moe


class _Record(NamedTuple):
    """Per layer: its input streams (``with_hidden_states``), its chosen experts (``with_routing``), its expert load
    and dropped pairs (``with_expert_load``)."""

    streams: jax.Array | None = None
    expert_indices: jax.Array | None = None
    expert_load: jax.Array | None = None
    dropped_tokens: jax.Array | None = None
    balance_loss: jax.Array | None = None
    indexer_loss: jax.Array | None = None


class DeepSeekV4(CausalLMBase):
    """DeepSeek-V4 causal language model (exact against HF ``DeepseekV4ForCausalLM``).

    >>> config = DeepSeekV4Config.preset("deepseek4-tiny")
    >>> model = DeepSeekV4.create(config, seed=0)                     # or DeepSeekV4(config, rngs=nnx.Rngs(0))
    >>> logits = model(jnp.zeros((2, 64), jnp.int32))                 # [2, 64, vocab]
    >>> out = model.forward(ids, with_mtp=True, with_expert_load=True)
    >>> model = DeepSeekV4.from_pretrained("/path/to/DeepSeek-V4-Flash", dtype="bfloat16")
    >>> model.save_pretrained("/tmp/out")                             # loadable by transformers

    ``hidden_states`` (``with_hidden_states``) are ``[num_hidden_layers + 1, batch, seq, hc_mult, embed]``: each
    layer's input streams (the first, the embeddings copied into every stream), as transformers records them,
    and last the final normed hidden state (transformers' last entry) repeated over the streams.
    """

    config_class: ClassVar[type[DeepSeekV4Config]] = DeepSeekV4Config
    # The attention's projections (queries, the shared key-value, the grouped output) in every layer, MTP included.
    lora_targets: ClassVar[str] = r"(^|/)attn/(q_a|q_b|kv)_proj$|(^|/)attn/output/o_b$"

    def __init__(self, config: DeepSeekV4Config, *, rngs: nnx.Rngs, rules: Rules | str = "default",
                 allow_partial: bool | None = None):
        if not isinstance(config, DeepSeekV4Config):
            raise TypeError(f"DeepSeekV4 needs a DeepSeekV4Config, got {type(config).__name__}; use "
                            "nnx_zoo.AutoModelForCausalLM.create(config) to pick the class from the config")
        c = self.config = config
        self.rules = get_rules(rules)
        self.allow_partial = allow_partial
        init = nnx.initializers.normal(c.initializer_range)
        self.embed = Embed(c.vocab_size, c.hidden_size, embedding_init=init, rngs=rngs, **_dtypes(c))
        self.kinds = tuple(dict.fromkeys(c.layer_kinds))  # static: part of the graph definition
        self.stacks = nnx.Dict({kind_name(k): create_stack(lambda r, k=k: DecoderLayer(c, *k, rngs=r),
                                                            c.layer_kinds.count(k), rngs, stack_axis(k))
                                for k in self.kinds})
        self.head_hc = HyperHead(c.hidden_size, streams=c.hc_mult, eps=c.hc_eps, norm_eps=c.rms_norm_eps,
                                 kernel_init=init, rngs=rngs)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, kernel_names=("embed", "vocab"), kernel_init=init, rngs=rngs, **_dtypes(c))
        self.mtp_layers = create_stack(lambda r: MTPHead(c, rngs=r), c.num_nextn_predict_layers, rngs,
                                       "mtp_layers") if c.num_nextn_predict_layers else None
        main, self.rope_attention_factor = rope_frequencies(c.qk_rope_head_dim, c.rope_theta)
        compress, self.compress_attention_factor = rope_frequencies(c.qk_rope_head_dim, c.compress_rope_theta,
                                                                    c.rope_scaling)
        self.rope_inv_freq = tuple(float(f) for f in main)  # static and hashable
        self.compress_inv_freq = tuple(float(f) for f in compress)

    # ---- checkpoints ----
    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                        dtype: Any = None, allow_partial: bool = False, **config_overrides: Any) -> DeepSeekV4:
        """Load a DeepSeek-V4 checkpoint directory (``nnx_zoo.models.deepseek4.hf.load_pretrained``): the
        released format (FP8 weights, FP4 experts, MTP) or the one transformers writes."""
        return load_pretrained(cls, path, mesh=mesh, rules=rules, dtype=dtype, allow_partial=allow_partial,
                               **config_overrides)

    def save_pretrained(self, path: str | Path, *, max_shard_bytes: int = 4 * 2**30) -> None:
        """Write ``config.json`` and safetensors in the layout transformers writes (and reloads)."""
        save_pretrained(self, path, max_shard_bytes=max_shard_bytes)

    # ---- the forward pass ----
    def _context(self, positions: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None) -> Context:
        c = self.config
        main_freq = jnp.asarray(self.rope_inv_freq, jnp.float32)
        compress_freq = jnp.asarray(self.compress_inv_freq, jnp.float32)
        main = Rope(*rope_cos_sin(positions, main_freq, self.rope_attention_factor), main_freq,
                    self.rope_attention_factor)
        compress = Rope(*rope_cos_sin(positions, compress_freq, self.compress_attention_factor), compress_freq,
                        self.compress_attention_factor)
        types = set(c.layer_types)
        csa = windows(c.compress_rate_csa, token_mask, positions, segment_ids) if CSA in types else None
        hca = windows(c.compress_rate_hca, token_mask, positions, segment_ids) if HCA in types else None
        return Context(main, compress, token_mask, segment_ids, csa, hca)

    def _segments(self, kinds: tuple[tuple[str, str], ...] | None = None
                  ) -> list[tuple[nnx.Module, tuple[tuple[str, str], ...], int]]:
        """``(group, pattern, repeats)`` per segment of the schedule: ``group`` holds, for each kind of the
        pattern, the slice of its stack the segment's repeats use (``periodic_runs``). ``kinds``: the first layers
        of the schedule only (default: all), e.g. the hash-routed prefix that runs before a pipeline."""
        c = self.config
        taken = dict.fromkeys(self.kinds, 0)
        out = []
        for pattern, repeats in periodic_runs(c.layer_kinds if kinds is None else kinds):
            parts = []
            for kind in pattern:
                stack = self.stacks[kind_name(kind)]
                count = c.layer_kinds.count(kind)
                start = taken[kind]
                taken[kind] += repeats
                parts.append(stack if repeats == count else take_layers(stack, start, start + repeats))
            out.append((nnx.List(parts), pattern, repeats))
        return out

    def forward(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                segment_ids: jax.Array | None = None, position_ids: jax.Array | None = None,
                with_hidden_states: bool = False, with_mtp: bool = False, with_expert_load: bool = False,
                with_routing: bool = False, with_logits: bool = True, pipeline_microbatches: int = 1,
                pipeline_schedule: str = "gpipe", pipeline_virtual_stages: int | None = None,
                loss_targets: tuple[jax.Array, jax.Array] | None = None, loss_scale: tuple[float, Any] | None = None
                ) -> CausalLMOutput:
        """``CausalLMOutput`` for ``input_ids [batch, seq]`` (inputs as in ``__call__``). ``expert_indices`` /
        ``expert_load`` / ``dropped_tokens`` cover every layer (all are MoE layers), in model order;
        ``hidden_states`` as the class docstring says; ``with_mtp``: ``mtp_logits`` / ``mtp_hidden``.

        On a mesh with a ``stage`` axis the top-k routed layers run pipelined: ``pipeline_microbatches``
        micro-batches in ``pipeline_schedule`` order, the streams ``[batch, seq, hc_mult, embed]`` handed from stage
        to stage, each micro-batch's tokens (the hash routers' and the balance loss's) and context split with it.
        The layer sequence after the hash-routed prefix must be ``S V`` identical chunks of layer kinds (each
        stack's contiguous block per stage; ``V`` virtual stages, 1 but for interleaved). The embedding and the
        hash-routed first layers (``num_hash_layers``: their stacks' axis is ``hash_layers``, whole on every stage,
        as DeepSeek-V3's dense prefix) run before the pipeline on each stage's share of the batch
        (``outside_pipeline``). GPipe (``_pipelined``): the stream collapse, final norm, MTP head and output head
        run after it, on each stage's share of the batch as well. 1F1B and interleaved (``_one_f_one_b``;
        ``loss_targets=(targets, loss_mask)`` and the trainer's ``loss_scale=(mtp_weight, counts)``): they run on
        the last stage, and the output carries ``loss_sum`` (valued as the cross-entropy, with the gradient of the
        whole loss), ``mtp_loss_sums``, and the losses below as values. Per-layer ``expert_load`` and
        ``dropped_tokens`` leave the pipeline summed over the micro-batches, in model order (what the routing-bias
        update reads); the balance and indexer losses as sums over the real sequences, divided by their count
        here: both exactly the whole batch's (a capacity factor's dropping counts per micro-batch, as gradient
        accumulation does). Without a ``stage`` axis the pipeline arguments are ignored.
        """
        check_forward_inputs(input_ids, attention_mask, segment_ids, position_ids, config=self.config)
        if with_mtp and self.mtp_layers is None:
            raise ValueError("with_mtp=True but the model has no MTP heads (num_nextn_predict_layers=0)")
        c = self.config
        with use_rules(self.rules, allow_partial=self.allow_partial), self._parameter_mesh():
            pipelined = stage_count() > 1  # the ambient mesh's, or the one the parameters live on
            prefix = len(c.layer_kinds)
            if pipelined:
                schedule = resolve_schedule(pipeline_schedule, pipeline_virtual_stages)
                prefix = self._check_pipelined(schedule, with_hidden_states=with_hidden_states,
                                               with_routing=with_routing)
            # The prefix and what follows the pipeline split the batch over 'stage' too (where it splits).
            outside_rules = self._outside_pipeline_rules(input_ids.shape[0]) if pipelined else self.rules

            def outside() -> Any:
                return use_rules(outside_rules, allow_partial=self.allow_partial)

            seq = input_ids.shape[1]
            positions = jnp.arange(seq)[None, :] if position_ids is None else position_ids
            token_mask = jnp.ones((1, seq), bool) if attention_mask is None else attention_mask.astype(bool)
            with outside():
                ctx = self._context(positions, token_mask, segment_ids)
                embeddings = self.embed(input_ids)
                h = widen(embeddings, c.hc_mult)

            def layer_record(result: LayerResult) -> _Record:
                load = None
                if with_expert_load:
                    load = jnp.sum(jax.nn.one_hot(result.expert_indices, c.n_routed_experts, dtype=jnp.float32),
                                   axis=(0, 1, 2))
                # Layers without an indexer (or with the loss off) hand up zeros, so every record has a shape.
                kl = result.indexer_loss
                if kl is None and c.indexer_training != "off":
                    kl = jnp.zeros((input_ids.shape[0],), jnp.float32)
                if kl is not None:  # one layout for every layer's, so the layers' records concatenate
                    kl = shard(kl, ("activation_batch",))
                return _Record(None, result.expert_indices if with_routing else None, load,
                               result.dropped_tokens if with_expert_load else None, result.balance_loss, kl)

            def body(group: nnx.List, h: jax.Array, _: Any) -> tuple[jax.Array, list[_Record]]:
                records = []
                for layer in group:
                    streams = h
                    h, result = layer(h, ctx, input_ids, token_mask)
                    records.append(layer_record(result)._replace(streams=streams if with_hidden_states else None))
                return h, records

            per_segment = []
            with outside():
                for group, _, _ in self._segments(c.layer_kinds[:prefix]):
                    h, records = run_stack(group, body, h, scan=c.scan_layers, remat_policy=c.remat_policy)
                    # [repeats, ...] per pattern position -> model order: repeat-major, then pattern position
                    per_segment.append(jax.tree.map(lambda *a: jnp.stack(a, axis=1).reshape(-1, *a[0].shape[1:]),
                                                    *records))
            layers = jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *per_segment) if per_segment else _Record()
            rows = sums = losses = None
            if pipelined:
                rows = _real_rows(input_ids, attention_mask)
                if schedule.loss_inside:  # 1F1B, interleaved: the head and losses on the last stage
                    depth = c.num_nextn_predict_layers if with_mtp else 0
                    losses, piped, sums = self._one_f_one_b(
                        h, prefix, positions, token_mask, segment_ids, input_ids, attention_mask, rows, depth,
                        loss_targets, loss_scale, with_expert_load, pipeline_microbatches, schedule)
                else:
                    h, piped, sums = self._pipelined(h, positions, token_mask, segment_ids, input_ids, rows, prefix,
                                                     with_expert_load, pipeline_microbatches)
                    h = shard(h, _OUT_STREAMS)
                if prefix:  # the prefix's per-layer counts (whole, small) before the pipelined layers'
                    piped = piped._replace(**{
                        f: jnp.concatenate([shard(getattr(layers, f), (None,) * getattr(piped, f).ndim),
                                            getattr(piped, f)])
                        for f in ("expert_load", "dropped_tokens") if getattr(piped, f) is not None})
                layers = layers._replace(expert_load=piped.expert_load, dropped_tokens=piped.dropped_tokens)
            if losses is not None:
                return CausalLMOutput(logits=None, loss_sum=losses[0], mtp_loss_sums=losses[1],
                                      expert_load=layers.expert_load, dropped_tokens=layers.dropped_tokens,
                                      **self._sequence_losses(layers, sums, rows, prefix))
            with outside():
                final_hidden = self.norm(self.head_hc(h))
                hidden_states = None
                if with_hidden_states:
                    last = jnp.broadcast_to(final_hidden[:, :, None, :], h.shape)
                    hidden_states = jnp.concatenate([layers.streams, last[None]], axis=0)
                mtp_hidden = None
                if with_mtp:
                    mtp_hidden = self._mtp(input_ids, attention_mask, segment_ids, positions, h)
            logits = mtp_logits = None
            if with_logits and with_mtp:
                both = self._logits(jnp.concatenate([final_hidden[None], mtp_hidden]))
                logits, mtp_logits = both[0], both[1:]
            elif with_logits:
                logits = self._logits(final_hidden)
            if sums is not None:  # pipelined: each loss summed over the layers and the real sequences
                aux = self._sequence_losses(layers, sums, rows, prefix)
            else:  # summed over the layers, a mean over the sequences with a token
                aux = dict(aux_loss=None if layers.balance_loss is None else _mean_over_sequences(
                    layers.balance_loss, attention_mask), indexer_loss=None if layers.indexer_loss is None else
                    c.indexer_loss_weight * _mean_over_sequences(layers.indexer_loss, attention_mask))
            return CausalLMOutput(logits=logits, hidden_states=hidden_states, mtp_logits=mtp_logits,
                                  expert_indices=layers.expert_indices, expert_load=layers.expert_load,
                                  dropped_tokens=layers.dropped_tokens, final_hidden=final_hidden,
                                  mtp_hidden=mtp_hidden, **aux)

    def _sequence_losses(self, prefix_layers: _Record, sums: dict[str, jax.Array], rows: jax.Array, prefix: int
                         ) -> dict[str, jax.Array | None]:
        """Pipelined: ``aux_loss`` (balance) and ``indexer_loss``, each summed over the layers (the hash-routed
        prefix's per-sequence losses ``[layers, batch]``, the pipelined layers' ``sums`` over the real sequences)
        and divided by the real sequence count once, as the un-pipelined ``_mean_over_sequences``."""
        count = jnp.maximum(jnp.sum(rows), 1.0)

        def total(per_sequence: jax.Array | None, key: str) -> jax.Array | None:
            if key not in sums:
                return None
            before = 0.0 if prefix == 0 else jnp.sum(jnp.sum(per_sequence, axis=0) * rows)
            return (before + sums[key]) / count

        indexer = total(prefix_layers.indexer_loss, "indexer")
        return dict(aux_loss=total(prefix_layers.balance_loss, "balance"),
                    indexer_loss=None if indexer is None else self.config.indexer_loss_weight * indexer)

    # ---- pipeline parallelism over the mesh's 'stage' axis ----
    def _check_pipelined(self, schedule: Schedule, *, with_hidden_states: bool, with_routing: bool) -> int:
        """The number of hash-routed prefix layers (run before the pipeline), after clear errors for what the
        pipelined forward does not run: hidden states or routing per layer, hash-routed layers that are not the
        first ones, and pipelined layers that are not ``S V`` identical chunks of kinds."""
        c = self.config
        if with_hidden_states or with_routing:
            raise ValueError("with_hidden_states / with_routing are not supported on a mesh with a 'stage' axis (the "
                             "pipeline hands on only the last layer's streams and per-layer sums); run without "
                             "'stage'")
        c.check_pipeline(stage_count(), schedule.virtual_stages)
        return c.hash_prefix

    def _pipeline_parts(self, prefix: int, with_expert_load: bool
                        ) -> tuple[dict[str, nnx.Module], list[str], Callable[..., Any]]:
        """What the pipeline runs: the stacks of the layers from ``prefix`` on by name, the stack name of each of
        those layers in model order, and ``layer_fn(name, layer, h, ctx, input_ids, token_mask, rows) -> (h,
        stats)``: one layer and its sums over the micro-batch's rows, which the pipeline adds up over the
        micro-batches: ``load`` (tokens per expert) and ``dropped`` with ``with_expert_load``, and the balance
        (``balance``) and indexer (``indexer``) losses summed over the real rows ``rows`` where they are on (each
        sequence's loss is its own). ``ctx`` comes without its frequencies (``_pipeline_context``)."""
        c = self.config
        names = [kind_name(kind) for kind in c.layer_kinds[prefix:]]
        stacks = {name: self.stacks[name] for name in dict.fromkeys(names)}
        indexer_on = c.indexer_training != "off"

        def layer_fn(name: str, layer: DecoderLayer, h: jax.Array, ctx: Context, input_ids: jax.Array,
                     token_mask: jax.Array, rows: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
            ctx = ctx._replace(
                main=ctx.main._replace(inv_freq=jnp.asarray(self.rope_inv_freq, jnp.float32)),
                compress=ctx.compress._replace(inv_freq=jnp.asarray(self.compress_inv_freq, jnp.float32)))
            h, result = layer(h, ctx, input_ids, token_mask)
            stats = {}
            if with_expert_load:
                stats["load"] = jnp.sum(jax.nn.one_hot(result.expert_indices, c.n_routed_experts,
                                                       dtype=jnp.float32), axis=(0, 1, 2))
                stats["dropped"] = result.dropped_tokens
            if result.balance_loss is not None:
                stats["balance"] = jnp.sum(result.balance_loss * rows)
            if indexer_on:
                kl = result.indexer_loss
                stats["indexer"] = jnp.zeros((), jnp.float32) if kl is None else jnp.sum(kl * rows)
            return h, stats

        return stacks, names, layer_fn

    def _pipeline_context(self, positions: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None
                          ) -> Context:
        """The layers' context for the pipeline: its batched arrays are split into micro-batches with the rows; its
        frequencies (whose length could equal the batch's) stay out and ``layer_fn`` puts them back."""
        ctx = self._context(positions, token_mask, segment_ids)
        return ctx._replace(main=ctx.main._replace(inv_freq=None), compress=ctx.compress._replace(inv_freq=None))

    @staticmethod
    def _model_order(stats: dict[str, dict[str, jax.Array]], names: list[str]) -> _Record:
        """Per-layer ``load`` / ``dropped`` stats by stack (each stack's layers in its order, the layer dim on
        'stage') -> ``expert_load`` / ``dropped_tokens`` over the pipelined layers in model order (small per-layer
        sums: gathered whole over 'stage' first)."""
        seen = dict.fromkeys(stats, 0)
        order = []
        for name in names:
            order.append((name, seen[name]))
            seen[name] += 1

        def field(key: str) -> jax.Array | None:
            if key not in next(iter(stats.values())):
                return None
            whole = {name: shard(s[key], (None,) * s[key].ndim) for name, s in stats.items()}
            return jnp.stack([whole[name][i] for name, i in order])

        return _Record(expert_load=field("load"), dropped_tokens=field("dropped"))

    @staticmethod
    def _summed(stats: dict[str, dict[str, jax.Array]], key: str) -> jax.Array | None:
        """``stats``' ``key`` summed over every pipelined layer (None when the layers report none)."""
        if key not in next(iter(stats.values())):
            return None
        return jnp.sum(jnp.stack([jnp.sum(s[key]) for s in stats.values()]))

    def _pipelined(self, h: jax.Array, positions: jax.Array, token_mask: jax.Array, segment_ids: jax.Array | None,
                   input_ids: jax.Array, rows: jax.Array, prefix: int, with_expert_load: bool, microbatches: int
                   ) -> tuple[jax.Array, _Record, dict[str, jax.Array]]:
        """The layers from ``prefix`` on, on the streams ``h``, pipelined over ``stage`` in GPipe order
        (``pipeline_stack`` with the kinds' stacks by name): ``(h, record, sums)``, the record's ``expert_load
        [layers, experts]`` and ``dropped_tokens [layers]`` in model order, summed over the micro-batches, and
        ``sums``: the balance and indexer losses summed over the layers and the real sequences."""
        c = self.config
        stacks, names, layer_fn = self._pipeline_parts(prefix, with_expert_load)
        h, stats = pipeline_stack(stacks, layer_fn, shard(h, _STREAMS),
                                  self._pipeline_context(positions, token_mask, segment_ids), input_ids, token_mask,
                                  shard(rows, ("activation_batch",)), microbatches=microbatches, scan=c.scan_layers,
                                  remat_policy=c.remat_policy, with_aux=True, layer_stacks=names)
        sums = {key: self._summed(stats, key) for key in ("balance", "indexer")}
        return h, self._model_order(stats, names), {k: v for k, v in sums.items() if v is not None}

    def _one_f_one_b(self, h: jax.Array, prefix: int, positions: jax.Array, token_mask: jax.Array,
                     segment_ids: jax.Array | None, input_ids: jax.Array, attention_mask: jax.Array | None,
                     rows: jax.Array, depth: int, loss_targets: tuple[jax.Array, jax.Array] | None,
                     loss_scale: tuple[float, Any] | None, with_expert_load: bool, microbatches: int,
                     schedule: Schedule) -> tuple[Any, _Record, dict[str, jax.Array]]:
        """The layers from ``prefix`` on, the stream collapse, final norm, MTP head, head and losses on the streams
        ``h`` in 1F1B order (interleaved with ``schedule.virtual_stages`` > 1; ``pipeline_1f1b_value_and_grad``),
        as DeepSeek-V3's ``_one_f_one_b`` runs V3's (its weights, cross-entropy and ``custom_vjp``:
        ``pipeline_loss_weights``, ``masked_cross_entropy``, ``differentiated_by``): the loss differentiated is
        the trainer's share of this micro-batch, the cross-entropy sum plus ``w_k`` times each MTP depth's sum plus
        ``step tokens / step real sequences`` times each layer's balance and (weighted) indexer sums, which the
        layers add in their stage's backward. Returns ``(loss_sum, mtp_loss_sums)`` (``loss_sum`` valued as the
        cross-entropy, carrying the whole gradient), the record (loads in model order) and the sums (values)."""
        c = self.config
        if loss_targets is None:
            raise ValueError(f"pipeline_schedule={schedule.name!r} runs the loss on the last stage: pass "
                             "loss_targets=(targets, loss_mask) (and loss_scale=(mtp_weight, counts), as "
                             "nnx_zoo.train.step does), or use pipeline_schedule='gpipe'")
        if loss_scale is None and (depth or c.seq_aux_loss_alpha or c.indexer_training != "off"):
            raise ValueError(f"pipeline_schedule={schedule.name!r} with MTP heads, a balance loss or an indexer loss "
                             "needs loss_scale=(mtp_weight, counts) to weigh them inside the pipeline "
                             "(nnx_zoo.train.step.loss_terms passes it)")
        rows = shard(rows, ("activation_batch",))
        targets, masks, w_mtp, w_seq = pipeline_loss_weights(loss_targets, loss_scale, rows, depth)
        stacks, names, stats_fn = self._pipeline_parts(prefix, with_expert_load)
        batch_first = lambda a: jnp.swapaxes(a, 0, 1)  # noqa: E731  (split by rows)
        head_inputs = (batch_first(targets), batch_first(masks), input_ids, attention_mask, segment_ids, positions,
                       w_mtp)
        modules = [self.head_hc, self.norm, self.embed if self.lm_head is None else self.lm_head]
        head_graph, head_state = nnx.split(nnx.List(modules + ([self.embed, self.mtp_layers] if depth else [])))
        stack_graphs = {name: nnx.graphdef(stack) for name, stack in stacks.items()}
        stack_state = {name: nnx.state(stack) for name, stack in stacks.items()}
        indexer_weight = c.indexer_loss_weight

        def layer_fn(*args: Any) -> tuple[jax.Array, Any]:
            *args, w_seq = args
            h, stats = stats_fn(*args)
            part = stats.get("balance", 0.0) + indexer_weight * stats.get("indexer", 0.0)
            return h, (w_seq * jnp.asarray(part, jnp.float32), stats)

        def head_fn(head_state: Any, h: jax.Array, inputs: Any) -> tuple[jax.Array, Any]:
            hc, norm, head, *mtp = nnx.merge(head_graph, head_state)
            targets, masks, ids, id_mask, segments, positions, w_mtp = inputs
            ce = masked_cross_entropy(self._logits(norm(hc(h)), head=head), targets[:, 0], masks[:, 0])
            if not depth:
                return ce, (ce, None)
            embed, heads = mtp
            hidden = self._mtp(ids, id_mask, segments, positions, h, embed=embed, heads=heads)
            sums = [masked_cross_entropy(self._logits(hidden[k], head=head), targets[:, k + 1], masks[:, k + 1])
                    for k in range(depth)]
            return ce + sum(w * s for w, s in zip(w_mtp, sums)), (ce, jnp.stack(sums))

        def program(stack_state: Any, head_state: Any, h: jax.Array) -> tuple[Any, Any]:
            total, d_stack, d_head, d_h, stats, head_stats = pipeline_1f1b_value_and_grad(
                {name: nnx.merge(stack_graphs[name], state) for name, state in stack_state.items()}, layer_fn,
                head_fn, head_state, h, head_inputs, self._pipeline_context(positions, token_mask, segment_ids),
                input_ids, token_mask, rows, w_seq, microbatches=microbatches,
                virtual_stages=schedule.virtual_stages, layer_stacks=names, with_aux=True)
            return (total, stats, head_stats), (d_stack, d_head, d_h)

        total, stats, (ce, mtp_sums) = differentiated_by(program, stack_state, head_state, shard(h, _STREAMS))
        stats, ce, mtp_sums = jax.lax.stop_gradient((stats, ce, mtp_sums))
        sums = {key: self._summed(stats, key) for key in ("balance", "indexer")}
        return ((total - jax.lax.stop_gradient(total - ce), mtp_sums), self._model_order(stats, names),
                {k: v for k, v in sums.items() if v is not None})

    def _mtp(self, input_ids: jax.Array, attention_mask: jax.Array | None, segment_ids: jax.Array | None,
             positions: jax.Array, streams: jax.Array, *, embed: Embed | None = None,
             heads: nnx.Module | None = None) -> jax.Array:
        """Each MTP depth's normed hidden state ``[depth, b, s, embed]``: depth ``k`` reads the tokens shifted left
        by ``k`` (at their own positions) and the previous depth's streams (depth 1: the main model's last).
        ``embed`` / ``heads``: the modules to run (default the model's; the 1F1B head passes its differentiated
        copies)."""
        c = self.config
        embed = self.embed if embed is None else embed
        heads = self.mtp_layers if heads is None else heads
        depth = c.num_nextn_predict_layers
        ids, masks = shifted_by_depth(input_ids, attention_mask, depth)
        seq = input_ids.shape[1]
        outputs = []
        for k in range(1, depth + 1):
            mask = jnp.ones((1, seq), bool) if masks is None else masks[k].astype(bool)
            ctx = self._context(positions + k, mask, segment_ids)
            graphdef, state = nnx.split(heads)
            head = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], state))
            streams, hidden, _ = head(embed(ids[k]), streams, ctx, ids[k], mask)
            outputs.append(hidden)
        return jnp.stack(outputs)

    def trainable(self) -> nnx.filterlib.Filter:
        """What a trainer updates: every parameter, except the CSA indexers' by ``indexer_training`` (DeepSeek-V3.2's
        stages): ``dense_warmup`` trains the indexers alone, ``off`` freezes them, ``sparse`` trains everything."""
        stage = self.config.indexer_training
        if CSA not in self.config.layer_types or stage == "sparse":
            return nnx.Param
        indexer = nnx.PathContains("indexer")
        return nnx.All(nnx.Param, indexer if stage == "dense_warmup" else nnx.Not(indexer))

    def update_routing_bias(self, expert_load: jax.Array, rate: float) -> None:
        """Aux-loss-free balancing after an optimizer step: each top-k layer's selection bias moves by ``rate``
        toward balance (``expert_load [layers, experts]`` from ``forward(..., with_expert_load=True)``, model
        order); hash-routed layers have nothing to move."""
        if not self.config.routers_train:
            return
        order = list(self.config.layer_kinds)
        for kind in self.kinds:
            if kind[1] == TOPK_MOE:
                rows = jnp.asarray([i for i, k in enumerate(order) if k == kind])
                self.stacks[kind_name(kind)].mlp.balance_bias(expert_load[rows], rate)

    # ---- generation ----
    def init_cache(self, batch: int, max_len: int) -> Any:
        c = self.config
        with use_rules(self._decoding_rules(), allow_partial=self.allow_partial), self._parameter_mesh():
            return V4Cache.zeros(c, self.kinds, batch=batch, max_len=max_len, dtype=jnp.dtype(c.dtype))

    def _extend(self, input_ids: jax.Array, token_mask: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        return extend(self, input_ids, token_mask, cache)
