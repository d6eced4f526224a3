"""DeepSeek-V3: decoder layers, multi-token-prediction heads, and the causal LM.

Layers ``< first_k_dense_replace`` (``config.is_moe_layer``) have a dense SwiGLU MLP and live in the
``dense_layers`` stack; the rest have the MoE block and live in ``moe_layers``; the MTP heads
(``num_nextn_predict_layers``) live in ``mtp_layers``. Each stack is one set of stacked Variables (leading logical
axis named after the stack), applied with a scan. Layers that reuse an earlier layer's top-k keys
(``config.reuses_topk``, GLM-5's "shared" indexer layers) have no indexer, so they live apart, in
``shared_topk_dense_layers`` / ``shared_topk_moe_layers``. The forward pass applies the layers in model order as
runs of consecutive layers of one stack, each run a scan over a slice of its stack (``layer_runs``: two runs for
DeepSeek-V3, dense then MoE); the scan's carry hands the last chosen top-k on to the layers that reuse it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.layers.attention import AttentionMask, causal_mask, token_mask_of
from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.pipeline import (
    Schedule,
    pipeline_1f1b_value_and_grad,
    pipeline_stack,
    resolve_schedule,
    stage_count,
)
from nnx_zoo.layers.rope import rope_frequencies
from nnx_zoo.layers.scan import batch_split, create_stack, gathered_over_fsdp, run_stack
from nnx_zoo.models.causal_lm import (
    CausalLMBase,
    CausalLMOutput,
    check_forward_inputs,
    shifted_by_depth,
    stack_hidden_states,
)
from nnx_zoo.models.deepseek.cache import MLACache
from nnx_zoo.models.deepseek.config import LAYER_STACKS, DeepSeekV3Config
from nnx_zoo.models.deepseek.dsa import mean_over_real_queries
from nnx_zoo.models.deepseek.mla import MLA
from nnx_zoo.models.deepseek.moe import DeepSeekMoE, MoEOutput
from nnx_zoo.sharding import get_rules, shard, use_rules
from nnx_zoo.sharding.rules import Rules

_BLE = ("activation_batch", "activation_length", "activation_embed")
# The pipeline's output, and what runs after it: the batch split over 'stage' too (activation_batch's without it).
_OUT_BLE = ("activation_embed_and_logits_batch", "activation_length", "activation_embed")
_BL_TOPK = ("activation_batch", "activation_length", None)  # each query's chosen keys [batch, seq, index_topk]
_PIPELINED_STACKS = ("moe_layers", "shared_topk_moe_layers")  # the stacks a pipeline runs (after the prefix)


def _dtypes(c: DeepSeekV3Config) -> dict[str, Any]:
    return dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))


def _mean_over_sequences(balance: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
    """Per-layer, per-sequence balance losses ``[layers, batch]`` -> their sum over layers (as DeepSeek's own
    code adds each MoE layer's loss), averaged over the sequences holding at least one real token."""
    per_sequence = jnp.sum(balance, axis=0)
    if attention_mask is None:
        return jnp.mean(per_sequence)
    has_tokens = jnp.any(attention_mask.astype(bool), axis=-1).astype(jnp.float32)
    return jnp.sum(per_sequence * has_tokens) / jnp.maximum(jnp.sum(has_tokens), 1.0)


class LayerOutput(NamedTuple):
    """What a ``DecoderLayer`` returns, whatever the layer: ``hidden [batch, seq, embed]``, and for an MoE layer
    its ``MoEOutput`` fields ``expert_indices [batch, seq, k]``, ``dropped_tokens`` (int32 scalar) and
    ``balance_loss [batch]`` (None when ``seq_aux_loss_alpha`` is 0); for a dense layer those three are None.
    ``indexer_loss [batch]``: DeepSeek-V3.2's indexer KL, each sequence's mean over its real tokens (None unless
    ``indexer_training`` trains the indexer). ``topk_indices [batch, seq, index_topk]``: the keys the layer's
    sparse attention chose or reused, for later layers reusing them (None unless ``config.shares_topk``)."""

    hidden: jax.Array
    expert_indices: jax.Array | None = None
    dropped_tokens: jax.Array | None = None
    balance_loss: jax.Array | None = None
    indexer_loss: jax.Array | None = None
    topk_indices: jax.Array | None = None


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + MLA(norm(x))``, then ``+ MLP(norm(.))`` (dense SwiGLU, or the MoE block).

    >>> config = DeepSeekV3Config.preset("deepseek3-mini")
    >>> layer = DecoderLayer(config, moe=True, rngs=nnx.Rngs(0))
    >>> cos, sin = rope_cos_sin(jnp.arange(8)[None], rope_frequencies(config.qk_rope_head_dim, 1e4)[0])
    >>> out = layer(jnp.ones((2, 8, 128)), cos, sin, causal_mask(8))
    >>> out.hidden.shape, out.expert_indices.shape
    ((2, 8, 128), (2, 8, 2))
    """

    def __init__(self, config: DeepSeekV3Config, *, moe: bool, rngs: nnx.Rngs, reuses_topk: bool = False):
        """``reuses_topk``: the layer runs no indexer and attends to the keys an earlier layer chose."""
        c = config
        self.input_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.attn = MLA(c, rngs=rngs, indexer=False if reuses_topk else None)
        self.post_attn_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        if moe:
            self.mlp = DeepSeekMoE(c, rngs=rngs)
        else:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, kernel_init=nnx.initializers.normal(
                c.initializer_range), rngs=rngs, **_dtypes(c))
        self.is_moe = moe

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | None, *,
                 query_scale: jax.Array | None = None, topk_indices: jax.Array | None = None) -> LayerOutput:
        """``LayerOutput`` for ``x [batch, seq, embed]``; ``mask``: ``causal_mask``'s; ``query_scale`` and
        ``topk_indices`` (an earlier layer's choice, for a layer reusing it) as ``MLA.attend_indexed``'s."""
        attn, kl, chosen = self.attn.attend_indexed(self.input_norm(x), cos, sin, mask, query_scale=query_scale,
                                                    topk_indices=topk_indices)
        x = shard(x + attn, _BLE)
        # A token is real (not padding) when it may attend to itself.
        token_mask = token_mask_of(mask, x.shape[1])
        out = self._feed_forward(x, token_mask)
        if chosen is not None:
            out = out._replace(topk_indices=shard(chosen, _BL_TOPK))
        return out if kl is None else out._replace(indexer_loss=mean_over_real_queries(kl, token_mask))

    def _feed_forward(self, x: jax.Array, token_mask: jax.Array) -> LayerOutput:
        if not self.is_moe:
            return LayerOutput(shard(x + self.mlp(self.post_attn_norm(x)), _BLE))
        moe: MoEOutput = self.mlp(self.post_attn_norm(x), token_mask=token_mask)
        return LayerOutput(shard(x + moe.output, _BLE), moe.expert_indices, moe.dropped_tokens, moe.balance_loss)

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, caches: tuple[jax.Array, ...],
               start: jax.Array, mask: AttentionMask, *, query_scale: jax.Array | None = None,
               topk_indices: jax.Array | None = None
               ) -> tuple[jax.Array, tuple[jax.Array, ...], jax.Array | None]:
        """The layer on ``t`` new tokens against this layer's cache (``MLA.decode``): ``caches`` are its
        ``(latent, k_rope)`` slices, plus the indexer's keys with an indexer; returns ``(output, caches,
        topk_indices)`` with the new tokens written at slots ``start .. start + t`` (``topk_indices`` as
        ``MLA.decode``'s)."""
        attn, *caches, chosen = self.attn.decode(self.input_norm(x), cos, sin, *caches[:2], start, mask,
                                                 *caches[2:], query_scale=query_scale, topk_indices=topk_indices)
        out = self._feed_forward(shard(x + attn, _BLE), jnp.ones((1, x.shape[1]), bool))  # new tokens are real
        return out.hidden, tuple(c for c in caches if c is not None), chosen

    def batch_split(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | None, factor: int,
                    *, query_scale: jax.Array | None = None, topk_indices: jax.Array | None = None
                    ) -> LayerOutput:
        """``self(x, cos, sin, mask, ...)`` as ``factor`` micro-batches (``nnx_zoo.layers.batch_split``): same
        output (dropless), the hidden state with exactly ``x``'s sharding; dropped pairs are summed over
        micro-batches."""
        layer = gathered_over_fsdp(self) if factor > 1 else self  # one gather for all micro-batches

        def run(h: jax.Array, m: AttentionMask | None, scale: jax.Array | None, topk: jax.Array | None
                ) -> tuple[jax.Array, tuple[Any, ...]]:
            out = layer(h, cos, sin, m, query_scale=scale, topk_indices=topk)
            return out.hidden, tuple(out[1:])

        hidden, rest = batch_split(run, x, mask, query_scale, topk_indices, factor=factor)
        return LayerOutput(hidden, *rest)


class MTPHead(nnx.Module):
    """One multi-token-prediction depth: ``h_k = norm(layer(eh_proj([enorm(emb(t_{i+k})) | hnorm(h_{k-1})])))``.

    HF checkpoint keys live under ``model.layers.{num_hidden_layers + k - 1}``: ``enorm``, ``hnorm``,
    ``eh_proj``, a full (MoE) decoder layer and ``shared_head.norm``; the embedding and output head are the main
    model's.
    """

    def __init__(self, config: DeepSeekV3Config, *, rngs: nnx.Rngs):
        c = config
        h = c.hidden_size
        self.enorm = RMSNorm(h, eps=c.rms_norm_eps, **_dtypes(c))
        self.hnorm = RMSNorm(h, eps=c.rms_norm_eps, **_dtypes(c))
        self.eh_proj = Linear(2 * h, h, kernel_names=("mtp_embed", "embed"),
                              kernel_init=nnx.initializers.normal(c.initializer_range), rngs=rngs, **_dtypes(c))
        self.layer = DecoderLayer(c, moe=True, rngs=rngs)
        self.batch_split_factor = c.batch_split_factor  # its MoE layer splits the batch like the main stack's
        self.final_norm = RMSNorm(h, eps=c.rms_norm_eps, **_dtypes(c))

    def __call__(self, token_embeddings: jax.Array, previous_hidden: jax.Array, cos: jax.Array, sin: jax.Array,
                 mask: AttentionMask | None, *, query_scale: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
        """``(normed hidden [batch, seq, embed], indexer_loss [batch] or None)`` (its layer's indexer KL)."""
        joined = jnp.concatenate([self.enorm(token_embeddings), self.hnorm(previous_hidden)], axis=-1)
        out = self.layer.batch_split(self.eh_proj(joined, _BLE), cos, sin, mask, self.batch_split_factor,
                                     query_scale=query_scale)
        return self.final_norm(out.hidden), out.indexer_loss


class _LayerRecord(NamedTuple):
    """What the layer scan keeps per layer (None where not asked for, or for dense layers)."""

    hidden: jax.Array | None
    expert_indices: jax.Array | None
    expert_load: jax.Array | None
    dropped_tokens: jax.Array | None
    balance_loss: jax.Array | None
    indexer_loss: jax.Array | None = None


class DeepSeekV3(CausalLMBase):
    """DeepSeek-V3 causal language model (exact against HF ``DeepseekV3ForCausalLM``), and DeepSeek-V2 /
    V2-Lite when ``config.topk_method`` names a V2 router (exact against HF ``DeepseekV2ForCausalLM``).

    >>> config = DeepSeekV3Config.preset("deepseek3-mini")
    >>> model = DeepSeekV3(config, rngs=nnx.Rngs(0))                       # or DeepSeekV3.create(config, mesh=mesh)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                      # [2, 16, vocab]
    >>> out = model.forward(jnp.zeros((2, 16), jnp.int32), with_mtp=True)  # CausalLMOutput: out.mtp_logits, ...
    >>> model = DeepSeekV3.from_pretrained("/path/to/hf_checkpoint", mesh=mesh)
    >>> model.save_pretrained("/tmp/out")                                  # loadable by transformers
    >>> v2_lite = DeepSeekV3(DeepSeekV3Config.preset("deepseek2-tiny"), rngs=nnx.Rngs(0))  # V2 softmax routing

    ``rules`` (a rule-set name or tuple) is stored on the model and used by every ``shard`` inside ``forward``.
    """

    config_class: ClassVar[type[DeepSeekV3Config]] = DeepSeekV3Config
    # MLA's projections (queries, the key/value down- and up-projections, the output) in every decoder layer,
    # multi-token-prediction heads included; add ``nnx_zoo.layers.lora.EXPERTS_PATTERN`` for the routed experts.
    lora_targets: ClassVar[str] = r"(^|/)attn/(q|q_a|q_b|kv_a|kv_b|o)_proj$"

    def __init__(self, config: DeepSeekV3Config, *, rngs: nnx.Rngs, rules: Rules | str = "default",
                 allow_partial: bool | None = None):
        c = config
        self.config = c
        self.rules = get_rules(rules)
        self.allow_partial = allow_partial  # CausalLMBase.allow_partial
        init = nnx.initializers.normal(c.initializer_range)
        self.embed = Embed(c.vocab_size, c.hidden_size, embedding_init=init, rngs=rngs, **_dtypes(c))
        stacks = c.layer_stacks()

        def stack(name: str) -> nnx.Module | None:
            moe, reuses = LAYER_STACKS[name]
            axis = "prefix_moe_layers" if name == "prefix_moe_layers" else "moe_layers" if moe else "dense_layers"
            return self._stack(lambda r: DecoderLayer(c, moe=moe, reuses_topk=reuses, rngs=r), len(stacks[name]),
                               rngs, axis)

        self.dense_layers = stack("dense_layers")
        self.prefix_moe_layers = stack("prefix_moe_layers")  # None unless config.pipeline_layers leaves some out
        self.moe_layers = stack("moe_layers")
        self.shared_topk_dense_layers = stack("shared_topk_dense_layers")  # None unless layers reuse a top-k
        self.shared_topk_moe_layers = stack("shared_topk_moe_layers")
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, kernel_names=("embed", "vocab"), kernel_init=init, rngs=rngs, **_dtypes(c))
        self.mtp_layers = self._stack(lambda r: MTPHead(c, rngs=r), c.num_nextn_predict_layers, rngs, "mtp_layers")
        inv_freq, self.rope_attention_factor = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
        self.rope_inv_freq = tuple(float(f) for f in inv_freq)  # static and hashable: part of the graph definition

    @staticmethod
    def _stack(make: Any, count: int, rngs: nnx.Rngs, axis_name: str) -> nnx.Module | None:
        return create_stack(make, count, rngs, axis_name) if count else None

    def layer_runs(self, unsliced: tuple[str, ...] = ()) -> list[tuple[str, nnx.Module, tuple[int, ...]]]:
        """``(stack name, stack or a slice of it, layer indices)`` per run of consecutive decoder layers of one
        stack, in model order: DeepSeek-V3's dense layers then its MoE layers (two runs, whole stacks); with
        layers reusing a top-k, one run per change of kind. The stacks named in ``unsliced`` come whole in every
        run (a pipeline runs them whole; slicing their layer dim, on 'stage', fails under Explicit meshes)."""
        stacks = self.config.layer_stacks()
        owner = {i: name for name, layers in stacks.items() for i in layers}
        runs = []
        for name, group in itertools.groupby(range(self.config.num_hidden_layers), key=owner.__getitem__):
            indices = tuple(group)
            stack, start = getattr(self, name), stacks[name].index(indices[0])
            if len(indices) != len(stacks[name]) and name not in unsliced:
                stack = _slice_stack(stack, start, start + len(indices))
            runs.append((name, stack, indices))
        return runs

    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                        dtype: Any = None, allow_partial: bool = False, **config_overrides: Any) -> DeepSeekV3:
        """Load an HF DeepSeek-V3 checkpoint directory (see ``nnx_zoo.models.deepseek.hf.load_pretrained``)."""
        from nnx_zoo.models.deepseek.hf import load_pretrained

        return load_pretrained(cls, path, mesh=mesh, rules=rules, dtype=dtype, allow_partial=allow_partial,
                               **config_overrides)

    def save_pretrained(self, path: str | Path, *, max_shard_bytes: int = 4 * 2**30) -> None:
        """Write an HF checkpoint (config.json, safetensors shards + index) that transformers can load."""
        from nnx_zoo.models.deepseek.hf import save_pretrained

        save_pretrained(self, path, max_shard_bytes=max_shard_bytes)

    def forward(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                segment_ids: jax.Array | None = None, position_ids: jax.Array | None = None,
                with_hidden_states: bool = False, with_mtp: bool = False, with_expert_load: bool = False,
                with_routing: bool = False, with_logits: bool = True, pipeline_microbatches: int = 1,
                pipeline_schedule: str = "gpipe", pipeline_virtual_stages: int | None = None,
                loss_targets: tuple[jax.Array, jax.Array] | None = None, loss_scale: tuple[float, Any] | None = None
                ) -> CausalLMOutput:
        """``CausalLMOutput`` for ``input_ids [batch, seq]`` (inputs as in ``__call__``; generation passes
        ``position_ids = cumsum(attention_mask) - 1``, as HF's ``generate`` does).

        ``with_hidden_states``: ``hidden_states`` (HF's layout). ``with_mtp``: the MTP heads' ``mtp_logits``.
        ``with_expert_load``: each MoE layer's per-expert ``expert_load`` (which ``update_routing_bias`` turns
        into DeepSeek's aux-loss-free balancing) and ``dropped_tokens``. ``with_routing``: ``expert_indices``.
        ``aux_loss`` is there whenever ``config.seq_aux_loss_alpha > 0``: the sequence-wise balance loss summed
        over the MoE layers (MTP heads excluded), averaged over the sequences holding a real token.
        ``with_logits=False``: no output head; ``final_hidden`` (and with ``with_mtp`` ``mtp_hidden``) are its
        inputs, for ``output_head()``.

        On a mesh with a ``stage`` axis the MoE layers run pipelined: ``pipeline_microbatches`` micro-batches in
        ``pipeline_schedule`` order. The embedding and the dense prefix (``first_k_dense_replace`` layers) run
        before the pipeline, their weights whole on every stage (their stacks' axes are ``unpipelined_layers``,
        never on ``stage``: 3 of V3's 61 layers, little memory) and their batch split over ``stage`` too (each stage
        computes its share: ``outside_pipeline``'s rules); the pipeline's input is gathered whole over ``stage`` and
        its output split again. GPipe (``_pipelined_moe``): the final norm, the MTP heads and the output head run
        after it on each stage's share of the batch as well (the trainer's chunked head + loss stays its one path).
        1F1B and interleaved 1F1B (``_one_f_one_b``, with ``pipeline_virtual_stages`` chunks of the MoE stack per
        stage for interleaved, default 2: stage ``s`` runs chunks ``s, S + s, ...``; ``loss_targets=(targets,
        loss_mask)`` and the trainer's ``loss_scale=(mtp_weight, counts)``): the final norm, the MTP heads (their
        shifted tokens handed through the pipeline with each micro-batch, embedded there) and the head run on the
        last stage, and the output carries ``loss_sum`` (valued as the cross-entropy, with the gradient of the whole
        loss: the MTP and balance terms weighted as ``nnx_zoo.train.step.loss_terms`` weighs them),
        ``mtp_loss_sums``, ``aux_loss``, ``expert_load`` and ``dropped_tokens`` (per MoE layer in model order, for
        every schedule: what the routing-bias update reads). DeepSeek-V3.2's indexer loss is summed over the real
        rows in each pipelined layer (``_pipelined_layer``); GLM-5's layers reusing a top-k pipeline beside those
        that choose it, the top-k handed on inside each stage's chunk (``_pipelined_moe``, ``_one_f_one_b``).
        Without a ``stage`` axis the pipeline arguments are ignored.
        """
        check_forward_inputs(input_ids, attention_mask, segment_ids, position_ids, config=self.config)
        if with_mtp and self.mtp_layers is None:
            raise ValueError("with_mtp=True but the model has no MTP heads (num_nextn_predict_layers=0)")
        with use_rules(self.rules, allow_partial=self.allow_partial), self._parameter_mesh():
            pipelined = stage_count() > 1  # the ambient mesh's, or the one the parameters live on
            if pipelined:
                schedule = resolve_schedule(pipeline_schedule, pipeline_virtual_stages)
                self._check_pipelined(schedule, with_hidden_states=with_hidden_states, with_routing=with_routing)
            c = self.config
            seq_len = input_ids.shape[1]
            positions = jnp.arange(seq_len)[None, :] if position_ids is None else position_ids
            cos, sin = self._rope(positions)
            query_scale = c.query_scale(positions)
            mask = causal_mask(seq_len, attention_mask, segment_ids)
            # Layers reusing an earlier layer's top-k take it from the scan's carry (sparse attention only).
            share = c.shares_topk and c.sparse_attention_keys(seq_len) > 0
            depth = c.num_nextn_predict_layers if with_mtp else 0
            # The main model's tokens and every MTP depth's shifted ones in one lookup: the table's gradient is
            # then one scatter-add, reduced over the devices once rather than once per depth.
            ids, masks = shifted_by_depth(input_ids, attention_mask, depth)
            token_embeddings = self.embed(ids)
            embeddings = token_embeddings[0]
            run = dict(scan=c.scan_layers, remat_policy=c.remat_policy)
            # Pipelined: the dense prefix and the MTP heads run outside the pipeline, on each stage's share of the
            # batch (``outside_pipeline``: activation_batch over 'stage' too), as the embedding and the head do.
            # (Only where the batch splits over 'stage': a batch that does not stays whole over it, as the embedding's.)
            outside_rules = self._outside_pipeline_rules(input_ids.shape[0]) if pipelined else self.rules

            def outside() -> Any:
                return use_rules(outside_rules, allow_partial=self.allow_partial)

            def layer_body(layer: DecoderLayer, carry: Any, _: Any) -> tuple[Any, _LayerRecord]:
                h, topk = carry
                kw = dict(query_scale=query_scale, topk_indices=topk)
                if layer.is_moe and c.batch_split_factor > 1:
                    out = layer.batch_split(h, cos, sin, mask, c.batch_split_factor, **kw)
                else:
                    out = layer(h, cos, sin, mask, **kw)
                load = None
                if with_expert_load and out.expert_indices is not None:
                    load = jnp.sum(jax.nn.one_hot(out.expert_indices, c.n_routed_experts, dtype=jnp.float32),
                                   axis=(0, 1, 2))
                topk = shard(out.topk_indices, _BL_TOPK) if share else None
                return (out.hidden, topk), _LayerRecord(
                    hidden=out.hidden if with_hidden_states else None,
                    expert_indices=out.expert_indices if with_routing else None, expert_load=load,
                    dropped_tokens=out.dropped_tokens if with_expert_load else None,
                    balance_loss=out.balance_loss, indexer_loss=out.indexer_loss)

            with outside():  # laid out as the layers before the pipeline hand it on (their batch on 'stage' too)
                carry = (embeddings, self._no_topk(input_ids.shape[0], seq_len) if share else None)
            records, moe_records = [], []
            pipeline_sums = None  # pipelined: the balance and indexer losses summed over its layers and real rows
            pipeline_ran = False
            for name, stack, _ in self.layer_runs(_PIPELINED_STACKS if pipelined else ()):
                if pipelined and name in _PIPELINED_STACKS and pipeline_ran:
                    continue  # GLM-5: the later runs of the pipelined stacks ran in the pipeline
                if pipelined and name in _PIPELINED_STACKS and schedule.loss_inside:  # 1F1B, interleaved
                    prefix = _LayerRecord(*(_cat([getattr(r, f) for r in moe_records]) for f in _LayerRecord._fields))
                    return self._one_f_one_b(  # its input whole over stage, as GPipe's
                        self.moe_layers, shard(carry[0], _BLE), (cos, sin, mask, query_scale), input_ids,
                        attention_mask, segment_ids, positions, depth, loss_targets, loss_scale, with_expert_load,
                        pipeline_microbatches, schedule, prefix,
                        [r.indexer_loss for r in records if r.indexer_loss is not None])
                if pipelined and name in _PIPELINED_STACKS:
                    pipeline_ran = True
                    # In whole over stage (the prefix's rows gathered), out split over it again.
                    h, record, pipeline_sums = self._pipelined_moe(
                        shard(carry[0], _BLE), cos, sin, mask, query_scale, attention_mask, with_expert_load,
                        pipeline_microbatches, share)
                    carry = (shard(h, _OUT_BLE), None)
                    if len(moe_records):  # MoE layers ran before the pipeline: their stats join these, whole
                        record = jax.tree.map(_unsplit, record)
                    records.append(record)
                    moe_records.append(record)
                    continue
                with outside():
                    carry, record = run_stack(stack, layer_body, carry, **run)
                records.append(record)
                if LAYER_STACKS[name][0]:
                    moe_records.append(record)
            final_hidden = self.norm(carry[0])
            moe = _LayerRecord(*(_cat([getattr(r, f) for r in moe_records]) for f in _LayerRecord._fields))
            hidden_states = None
            if with_hidden_states:
                layer_outputs = jnp.concatenate([r.hidden for r in records], axis=0)
                hidden_states = stack_hidden_states(embeddings, layer_outputs, final_hidden)
            mtp_hidden = logits = mtp_logits = None
            indexer = [r.indexer_loss for r in records if r.indexer_loss is not None]
            if with_mtp:
                with outside():
                    mtp_hidden, mtp_indexer = self._mtp(token_embeddings[1:], None if masks is None else masks[1:],
                                                        segment_ids, final_hidden, run, positions)
                indexer += [] if mtp_indexer is None else [mtp_indexer]
            indexer_loss = None
            real = _real_rows(input_ids, attention_mask)
            if pipeline_sums is not None and "indexer" in pipeline_sums:
                # Pipelined: its layers' sum over the real sequences, the other layers' (MTP heads' too) added.
                outside_sum = jnp.sum(jnp.sum(jnp.concatenate(indexer), axis=0) * real) if indexer else 0.0
                indexer_loss = c.indexer_loss_weight * (pipeline_sums["indexer"] + outside_sum) / jnp.maximum(
                    jnp.sum(real), 1.0)
            elif indexer:  # summed over the layers (MTP heads' too), a mean over the sequences holding a real token
                indexer_loss = c.indexer_loss_weight * _mean_over_sequences(jnp.concatenate(indexer),
                                                                            attention_mask)
            if with_logits and with_mtp:  # the main and MTP hidden states share one head matmul: one weight
                logits = self._logits(jnp.concatenate([final_hidden[None], mtp_hidden]))  # gradient to reduce
                logits, mtp_logits = logits[0], logits[1:]
            elif with_logits:
                logits = self._logits(final_hidden)
            aux_loss = None
            if pipeline_sums is not None and "balance" in pipeline_sums:
                # Pipelined: sums over the real sequences, the prefix's MoE layers' added.
                balance_sum = pipeline_sums["balance"]
                if moe.balance_loss is not None:
                    balance_sum = balance_sum + jnp.sum(jnp.sum(moe.balance_loss, axis=0) * real)
                aux_loss = balance_sum / jnp.maximum(jnp.sum(real), 1.0)
            elif moe.balance_loss is not None:
                aux_loss = _mean_over_sequences(moe.balance_loss, attention_mask)
            return CausalLMOutput(
                logits=logits, hidden_states=hidden_states, mtp_logits=mtp_logits,
                expert_indices=moe.expert_indices, expert_load=moe.expert_load, dropped_tokens=moe.dropped_tokens,
                aux_loss=aux_loss,
                final_hidden=final_hidden, mtp_hidden=mtp_hidden, indexer_loss=indexer_loss)

    # ---- pipeline parallelism over the mesh's 'stage' axis ----
    def _check_pipelined(self, schedule: Schedule, *, with_hidden_states: bool, with_routing: bool) -> None:
        """Clear errors for what the pipelined forward does not run, and for an MoE stack that does not split into
        the schedule's equal chunks (``S`` stages, times ``V`` virtual stages when interleaved)."""
        c = self.config
        if with_hidden_states or with_routing:
            raise ValueError("with_hidden_states / with_routing are not supported on a mesh with a 'stage' axis (the "
                             "pipeline hands on only the last layer's output and per-layer sums); run without 'stage'")
        # Only the (last pipeline_layers) MoE layers are on 'stage' (the dense prefix runs before the pipeline): say
        # so, not "the stack", and which pipeline_layers fit.
        c.check_pipeline(stage_count(), schedule.virtual_stages)

    def _pipelined_layer(self, layer: DecoderLayer, h: jax.Array, cos: jax.Array, sin: jax.Array,
                         mask: AttentionMask, query_scale: jax.Array | None, rows: jax.Array,
                         with_expert_load: bool, topk_indices: jax.Array | None = None
                         ) -> tuple[LayerOutput, dict[str, jax.Array]]:
        """One MoE layer inside a pipeline (any schedule): its output and its per-micro-batch stats, each a sum
        the micro-batches add up: ``load`` (tokens per expert) and ``dropped`` with ``with_expert_load``, and
        ``balance`` (the sequence-wise balance loss summed over the real rows ``rows``) where it is on, and
        ``indexer`` (DeepSeek-V3.2's indexer KL, each sequence's mean over its real queries, summed likewise) where
        the indexer trains. ``topk_indices``: an earlier layer's choice, for a layer that reuses it."""
        c = self.config
        kw = dict(query_scale=query_scale, topk_indices=topk_indices)
        if c.batch_split_factor > 1:
            out = layer.batch_split(h, cos, sin, mask, c.batch_split_factor, **kw)
        else:
            out = layer(h, cos, sin, mask, **kw)
        stats = {}
        if with_expert_load:
            stats["load"] = jnp.sum(jax.nn.one_hot(out.expert_indices, c.n_routed_experts, dtype=jnp.float32),
                                    axis=(0, 1, 2))
            stats["dropped"] = out.dropped_tokens
        if out.balance_loss is not None:
            stats["balance"] = jnp.sum(out.balance_loss * rows)
        if out.indexer_loss is not None:  # DeepSeek-V3.2's indexer KL, a per-sequence loss summed as the balance's
            stats["indexer"] = jnp.sum(out.indexer_loss * rows)
        return out, stats

    def _pipelined_moe(self, h: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask,
                       query_scale: jax.Array | None, attention_mask: jax.Array | None, with_expert_load: bool,
                       microbatches: int, share: bool) -> tuple[jax.Array, _LayerRecord, dict[str, jax.Array]]:
        """The MoE stack on ``h``, pipelined over ``stage`` (``pipeline_stack``, GPipe): ``(h, record,
        sums)``. Each layer's aux terms leave the pipeline summed over the micro-batches: ``expert_load
        [layers, experts]`` and ``dropped_tokens [layers]`` (what the whole batch gives; dropping over a capacity
        is per forward, so with a capacity factor it counts per micro-batch, as gradient accumulation does), and
        the sequence-wise balance loss as its sum over the real sequences (each sequence's loss is its own, so the
        micro-batches' sums add up to the whole batch's), divided by the real sequence count by the caller:
        ``sums["balance"]``, and ``sums["indexer"]`` (DeepSeek-V3.2's indexer KL, likewise) where they are on.

        With GLM-5's shared layers among them (``config.pipelined_kinds()``) both MoE stacks pipeline by name, the
        top-k handed from layer to layer inside each stage's chunk (``chunk_carry``; every chunk starts with a layer
        that chooses, ``config.check_pipeline``), when ``share`` (sparse attention at this length); their stats
        come back in model order."""
        c = self.config
        token_rows = shard(_real_rows(h, attention_mask), ("activation_batch",))
        kinds = c.pipelined_kinds()
        run = dict(microbatches=microbatches, scan=c.scan_layers, remat_policy=c.remat_policy, with_aux=True)
        if "shared_topk_moe_layers" not in kinds:
            def layer_fn(layer: DecoderLayer, h: jax.Array, *args: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
                out, stats = self._pipelined_layer(layer, h, *args, with_expert_load)
                return out.hidden, stats

            h, aux = pipeline_stack(self.moe_layers, layer_fn, h, cos, sin, mask, query_scale, token_rows, **run)
        else:
            stacks = {name: getattr(self, name) for name in _PIPELINED_STACKS}
            h, by_stack = pipeline_stack(stacks, self._shared_layer_fn(share, with_expert_load), h, cos, sin, mask,
                                         query_scale, token_rows, layer_stacks=kinds,
                                         chunk_carry=self._no_topk_of if share else None, **run)
            aux = _in_model_order(by_stack, kinds)
        record = _LayerRecord(hidden=None, expert_indices=None, expert_load=aux.get("load"),
                              dropped_tokens=aux.get("dropped"), balance_loss=None)
        return h, record, {key: jnp.sum(aux[key]) for key in ("balance", "indexer") if key in aux}

    def _shared_layer_fn(self, share: bool, with_expert_load: bool) -> Any:
        """``layer_fn(name, layer, carry, cos, sin, mask, query_scale, rows)`` for the MoE stacks by name (GLM-5's
        shared layers among them): with ``share`` the carry is ``(h, top-k)``, the top-k handed on to the layers
        that reuse it (``chunk_carry``); ``(h, stats)`` as ``_pipelined_layer``'s."""
        def layer_fn(name: str, layer: DecoderLayer, carry: Any, *args: Any) -> tuple[Any, Any]:
            h, topk = carry if share else (carry, None)
            out, stats = self._pipelined_layer(layer, h, *args, with_expert_load,
                                               topk_indices=topk if LAYER_STACKS[name][1] else None)
            if not share:
                return out.hidden, stats
            return (out.hidden, topk if out.topk_indices is None else out.topk_indices), stats

        return layer_fn

    def _no_topk_of(self, h: jax.Array) -> jax.Array:
        """A chunk's starting top-k for ``h`` (never read: each chunk's first layer chooses), typed as ``h``."""
        return jnp.broadcast_to(jnp.zeros_like(h[..., :1], dtype=jnp.int32), (*h.shape[:2], self.config.index_topk))

    def _one_f_one_b(self, stack: nnx.Module, h: jax.Array, layer_inputs: tuple[Any, ...], input_ids: jax.Array,
                     attention_mask: jax.Array | None, segment_ids: jax.Array | None, positions: jax.Array,
                     depth: int, loss_targets: tuple[jax.Array, jax.Array] | None,
                     loss_scale: tuple[float, Any] | None, with_expert_load: bool, microbatches: int,
                     schedule: Schedule, prefix: _LayerRecord | None = None,
                     prefix_indexer: list[jax.Array] | None = None) -> CausalLMOutput:
        """The MoE stack, final norm, MTP heads, head and losses on ``h`` (the dense prefix's output) in 1F1B order
        (``pipeline_1f1b_value_and_grad(..., with_aux=True)``), as a function autodiff differentiates: a
        ``custom_vjp`` whose gradients (MoE stack, head modules, ``h``) come from the same program.

        1F1B and interleaved 1F1B run this same code: only ``schedule.virtual_stages`` differs, and what it changes
        (the MoE chunks moved to their stages, ``V`` chunks per stage, the per-layer stats and gradients moved back
        into model order) happens inside ``pipeline_1f1b_value_and_grad``. The MTP heads and the head run with the
        last virtual stage, on the last stage.

        The loss it differentiates is the trainer's (``loss_terms``) share of this micro-batch: the cross-entropy
        sum, plus ``w_k`` times each MTP depth's sum (``w_k = mtp_weight / depth * step tokens / depth k's step
        tokens``), plus ``w_b`` times each MoE layer's balance loss summed over the real sequences (``w_b = step
        tokens / step real sequences``): the MoE layers add theirs in their stage's backward, the head the rest.
        ``loss_scale = (mtp_weight, counts)`` gives them (``counts`` None: this micro-batch is the step). The
        returned ``loss_sum`` is valued as the cross-entropy alone and carries that whole gradient; the trainer adds
        the MTP and aux values (``mtp_loss_sums``, ``aux_loss``, without gradient) with the same weights.

        ``prefix``: the records of the MoE layers that ran before the pipeline (``config.pipeline_layers``), joined
        in front of the pipelined layers' expert loads and dropped counts (model order); their balance loss enters
        ``aux_loss`` with its gradient (the trainer weighs it as the pipelined layers' inside).

        DeepSeek-V3.2's indexer KL (``indexer_training`` on) is weighed as the balance loss (``w_b`` times
        ``indexer_loss_weight`` times its sum over the real rows): the MoE layers add theirs in their stage's
        backward, the MTP heads theirs in the head; ``indexer_loss`` carries their values without gradient, plus
        ``prefix_indexer`` (the per-sequence KLs ``[layers, batch]`` of the layers run before the pipeline) with
        its gradient, over the real sequences."""
        c = self.config
        if loss_targets is None:
            raise ValueError(f"pipeline_schedule={schedule.name!r} runs the loss on the last stage: pass "
                             "loss_targets=(targets, loss_mask) (and loss_scale=(mtp_weight, counts), as "
                             "nnx_zoo.train.step does), or use pipeline_schedule='gpipe'")
        balance_on = c.seq_aux_loss_alpha > 0
        if loss_scale is None and (depth or balance_on or c.indexer_training != "off"):
            raise ValueError(f"pipeline_schedule={schedule.name!r} with MTP heads, a balance loss or an indexer loss "
                             "needs loss_scale=(mtp_weight, counts) to weigh them inside the pipeline "
                             "(nnx_zoo.train.step.loss_terms passes it)")
        rows = shard(_real_rows(h, attention_mask), ("activation_batch",))
        shifted_targets, shifted_masks, w_mtp, w_bal = pipeline_loss_weights(loss_targets, loss_scale, rows, depth)
        ids, id_masks = shifted_by_depth(input_ids, attention_mask, depth)
        batch_first = lambda a: None if a is None else jnp.swapaxes(a, 0, 1)  # noqa: E731  (split by rows)
        head_inputs = (batch_first(shifted_targets), batch_first(shifted_masks), batch_first(ids[1:]),
                       None if id_masks is None else batch_first(id_masks[1:]), segment_ids, positions, w_mtp,
                       rows, w_bal)
        modules = [self.norm, self.embed if self.lm_head is None else self.lm_head]
        head_graph, head_state = nnx.split(nnx.List(modules + ([self.embed, self.mtp_layers] if depth else [])))
        run = dict(scan=c.scan_layers, remat_policy=c.remat_policy)
        kinds = c.pipelined_kinds()
        named = "shared_topk_moe_layers" in kinds  # GLM-5's shared layers: both MoE stacks by name
        share = named and c.sparse_attention_keys(input_ids.shape[1]) > 0
        stacks = {name: getattr(self, name) for name in _PIPELINED_STACKS} if named else {"moe_layers": stack}
        stack_graphs = {name: nnx.graphdef(s) for name, s in stacks.items()}
        stack_state = {name: nnx.state(s) for name, s in stacks.items()}
        shared_fn = self._shared_layer_fn(share, with_expert_load)

        def weighed(stats: dict[str, jax.Array], w_bal: jax.Array) -> jax.Array:
            part = w_bal * stats["balance"] if "balance" in stats else jnp.zeros((), jnp.float32)
            if "indexer" in stats:  # V3.2's indexer KL, weighed as the trainer weighs indexer_loss
                part = part + w_bal * c.indexer_loss_weight * stats["indexer"]
            return part

        def layer_fn(layer: DecoderLayer, h: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask,
                     query_scale: jax.Array | None, rows: jax.Array, w_bal: jax.Array) -> tuple[jax.Array, Any]:
            out, stats = self._pipelined_layer(layer, h, cos, sin, mask, query_scale, rows, with_expert_load)
            return out.hidden, (weighed(stats, w_bal), stats)

        def named_layer_fn(name: str, layer: DecoderLayer, carry: Any, *args: Any) -> tuple[Any, Any]:
            *args, w_bal = args
            carry, stats = shared_fn(name, layer, carry, *args)
            return carry, (weighed(stats, w_bal), stats)

        def head_fn(head_state: Any, h: jax.Array, inputs: Any) -> tuple[jax.Array, Any]:
            norm, head, *mtp = nnx.merge(head_graph, head_state)
            targets, masks, ids, id_masks, segments, positions, w_mtp, rows, w_bal = inputs
            final = norm(h)
            ce = masked_cross_entropy(self._logits(final, head=head), targets[:, 0], masks[:, 0])
            if not depth:
                return ce, (ce, None, None)
            embed, heads = mtp
            hidden, kl = self._mtp(embed(jnp.swapaxes(ids, 0, 1)), batch_first(id_masks), segments, final, run,
                                  positions, heads=heads)
            sums = [masked_cross_entropy(self._logits(hidden[k], head=head), targets[:, k + 1], masks[:, k + 1])
                    for k in range(depth)]
            total = ce + sum(w * s for w, s in zip(w_mtp, sums))
            if kl is None:
                return total, (ce, jnp.stack(sums), None)
            kl_sum = jnp.sum(jnp.sum(kl, axis=0) * rows)  # the MTP heads' indexer KL over the real rows
            return total + w_bal * c.indexer_loss_weight * kl_sum, (ce, jnp.stack(sums), kl_sum)

        def program(stack_state: Any, head_state: Any, h: jax.Array) -> tuple[Any, Any]:
            merged = {name: nnx.merge(stack_graphs[name], state) for name, state in stack_state.items()}
            by_name = dict(layer_stacks=kinds, chunk_carry=self._no_topk_of if share else None) if named else {}
            total, d_stack, d_head, d_h, stats, head_stats = pipeline_1f1b_value_and_grad(
                merged if named else merged["moe_layers"], named_layer_fn if named else layer_fn, head_fn,
                head_state, h, head_inputs, *layer_inputs, rows, w_bal, microbatches=microbatches,
                virtual_stages=schedule.virtual_stages, with_aux=True, **by_name)
            return (total, stats, head_stats), (d_stack if named else {"moe_layers": d_stack}, d_head, d_h)

        total, stats, (ce, mtp_sums, mtp_kl) = differentiated_by(program, stack_state, head_state, h)
        stats, ce, mtp_sums, mtp_kl = jax.lax.stop_gradient((stats, ce, mtp_sums, mtp_kl))
        if named:  # the stacks' stats in model order, their sums added
            stats = _in_model_order(stats, kinds)

        def prefix_sum(per_layer: jax.Array) -> jax.Array:  # a prefix term [layers, batch] over the real rows
            per_sequence = shard(jnp.sum(per_layer, axis=0), ("activation_batch",))  # its rows split over stage
            return jnp.sum(per_sequence * rows)

        indexer_loss = None
        if "indexer" in stats:  # the pipeline's and MTP heads' values (differentiated inside), the prefix's with
            kl_sum = jnp.sum(stats["indexer"]) + (0.0 if mtp_kl is None else mtp_kl)  # its gradient, here
            if prefix_indexer:
                kl_sum = kl_sum + prefix_sum(jnp.concatenate(prefix_indexer))
            indexer_loss = c.indexer_loss_weight * kl_sum / jnp.maximum(jnp.sum(rows), 1.0)
        aux_loss = None
        if balance_on:
            balance = jnp.sum(stats["balance"])
            if prefix is not None and prefix.balance_loss is not None:  # differentiated here, by the trainer
                balance = balance + prefix_sum(prefix.balance_loss)
            aux_loss = balance / jnp.maximum(jnp.sum(rows), 1.0)
        load, dropped = stats.get("load"), stats.get("dropped")
        if prefix is not None and load is not None and prefix.expert_load is not None:  # whole, as the prefix's
            load = jnp.concatenate([jax.lax.stop_gradient(prefix.expert_load), _unsplit(load)])
            dropped = jnp.concatenate([prefix.dropped_tokens, _unsplit(dropped)])
        return CausalLMOutput(logits=None, loss_sum=total - jax.lax.stop_gradient(total - ce),
                              mtp_loss_sums=mtp_sums, expert_load=load, dropped_tokens=dropped, aux_loss=aux_loss,
                              indexer_loss=indexer_loss)

    # ---- generation: a fixed-size MLA cache (nnx_zoo.models.deepseek.cache), driven by nnx_zoo.generate ----
    def init_cache(self, batch: int, max_len: int) -> MLACache:
        """An empty decoding cache for ``batch`` rows of up to ``max_len`` tokens (prompt and generated)."""
        c = self.config
        with use_rules(self._decoding_rules(), allow_partial=self.allow_partial), self._parameter_mesh():
            return MLACache.zeros(num_layers=c.num_hidden_layers, batch=batch, max_len=max_len,
                                  kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim, dtype=jnp.dtype(c.dtype),
                                  index_dim=c.index_head_dim if c.index_topk else 0)

    def _extend(self, input_ids: jax.Array, token_mask: jax.Array, cache: MLACache) -> tuple[jax.Array, MLACache]:
        """Write ``t`` new tokens per row into the next ``t`` cache slots, attending to everything cached."""
        c = self.config
        start = cache.length
        positions, mask, cache = cache.advance(token_mask)
        cos, sin = self._rope(positions)
        query_scale = c.query_scale(positions)
        share = c.shares_topk and c.index_topk < cache.max_len  # sparse: the chosen slots are handed on

        def layer_body(layer: DecoderLayer, carry: Any, index: jax.Array) -> tuple[Any, None]:
            h, topk, *caches = carry  # latent, k_rope (and the indexer's keys), each [layers, ...]
            h, layer_caches, chosen = layer.decode(
                h, cos, sin, tuple(jax.lax.dynamic_index_in_dim(a, index, keepdims=False) for a in caches), start,
                mask, query_scale=query_scale, topk_indices=topk)
            caches = [jax.lax.dynamic_update_index_in_dim(a, new, index, 0) for a, new in zip(caches, layer_caches,
                                                                                                strict=True)]
            return (h, shard(chosen, _BL_TOPK) if share else None, *caches), None

        tables = (cache.latent, cache.k_rope) + (() if cache.index_k is None else (cache.index_k,))
        topk = self._no_topk(*input_ids.shape) if share else None
        carry = (self.embed(input_ids), topk, *tables)
        for _, stack, layers in self.layer_runs():  # the cache's layer axis runs over the layers in model order
            carry, _ = run_stack(stack, layer_body, carry, jnp.asarray(layers), scan=c.scan_layers)
        h, _, latent, k_rope, *index_k = carry
        logits = shard(self._logits(self.norm(h)), ("activation_batch", "activation_length", None))
        return logits, cache._replace(latent=latent, k_rope=k_rope, index_k=index_k[0] if index_k else None)

    def trainable(self) -> nnx.filterlib.Filter:
        """What a trainer updates: every parameter, except with DeepSeek-V3.2's lightning indexers (every
        parameter under an ``indexer`` module), by ``indexer_training``: ``dense_warmup`` trains the indexers
        alone, the rest frozen; ``off`` freezes the indexers (they get no signal: weight decay alone would shrink
        them and move their top-k); ``sparse`` trains everything."""
        stage = self.config.indexer_training
        if not self.config.index_topk or stage == "sparse":
            return nnx.Param
        indexer = nnx.PathContains("indexer")
        return nnx.All(nnx.Param, indexer if stage == "dense_warmup" else nnx.Not(indexer))

    def update_routing_bias(self, expert_load: jax.Array, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free balancing, after an optimizer step: each MoE layer's selection bias moves
        by ``rate`` toward balance, ``bias += rate * sign(mean load - load)`` (``expert_load [layers, experts]``
        from ``model.forward(..., with_expert_load=True)``). The bias only affects which experts are chosen.
        A router without a selection bias (DeepSeek-V2's softmax routers) has nothing to move, and in
        DeepSeek-V3.2's indexer warm-up the routers are frozen with the rest of the model: a no-op."""
        c = self.config
        if not c.routers_train:
            return
        moe_layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
        row = {layer: j for j, layer in enumerate(moe_layers)}  # expert_load's rows: the MoE layers in model order
        for name, layers in c.layer_stacks().items():
            stack = getattr(self, name)
            if stack is None or not LAYER_STACKS[name][0]:
                continue
            rows = [row[i] for i in layers]
            stack.mlp.balance_bias(expert_load if rows == list(range(len(moe_layers))) else
                                   expert_load[jnp.asarray(rows)], rate)

    def _no_topk(self, batch: int, seq: int) -> jax.Array:
        """The scan carry's top-k before the first layer with an indexer has run (never read: layer 0 has one)."""
        return shard(jnp.zeros((batch, seq, self.config.index_topk), jnp.int32), _BL_TOPK)

    def _mtp(self, token_embeddings: jax.Array, masks: jax.Array | None, segment_ids: jax.Array | None,
             final_hidden: jax.Array, run: dict[str, Any], positions: jax.Array, heads: nnx.Module | None = None
             ) -> tuple[jax.Array, jax.Array | None]:
        """Hidden states ``[depth, batch, seq, embed]`` of every MTP depth, and their indexers' KL ``[depth, batch]``
        (None unless the indexers train). Depth ``k`` reads the embeddings of the
        tokens shifted left by ``k`` (``token_embeddings[k - 1]``, at their own positions; ``masks[k - 1]`` their
        padding mask) and the previous depth's hidden state (depth 1: the main model's final, normed one). With
        packed documents, position ``i`` attends within the document of position ``i``. ``heads``: the MTP heads
        to run (default ``self.mtp_layers``; the 1F1B head passes its differentiated copy)."""
        seq_len = token_embeddings.shape[2]
        depth = token_embeddings.shape[0]
        cos_sin = [self._rope(positions + k) for k in range(1, depth + 1)]
        scales = [self.config.query_scale(positions + k) for k in range(1, depth + 1)]
        xs = (token_embeddings, jax.tree.map(lambda *a: jnp.stack(a), *cos_sin),
              masks, None if scales[0] is None else jnp.stack(scales))

        def head_body(head: MTPHead, h: jax.Array, x: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
            embedded, (cos, sin), pad_mask, query_scale = x
            h, indexer_loss = head(embedded, h, cos, sin, causal_mask(seq_len, pad_mask, segment_ids),
                                   query_scale=query_scale)
            return h, (h, indexer_loss)

        _, (hidden, indexer_loss) = run_stack(self.mtp_layers if heads is None else heads, head_body, final_hidden,
                                              xs, **run)
        return hidden, indexer_loss


class PipelineLossWeights(NamedTuple):
    """What a pipeline that runs the loss on its last stage weighs its terms with (``pipeline_loss_weights``):
    the targets and loss masks shifted for each depth ``[1 + depth, batch, seq]``, ``w_k`` per MTP depth, and the
    weight of a per-sequence loss summed over the real sequences (balance, indexer)."""

    targets: jax.Array
    masks: jax.Array
    mtp: tuple[jax.Array, ...]
    sequence: jax.Array


def pipeline_loss_weights(loss_targets: tuple[jax.Array, jax.Array], loss_scale: tuple[float, Any] | None,
                          rows: jax.Array, depth: int) -> PipelineLossWeights:
    """The trainer's weights (``nnx_zoo.train.step.loss_terms``) of this micro-batch's loss terms, for a pipeline
    that differentiates them beside the cross-entropy sum: ``w_k = mtp_weight / depth * step tokens / depth k's
    step tokens`` and ``step tokens / step real sequences`` (``loss_scale = (mtp_weight, counts)``, ``counts``
    None: this micro-batch is the step; ``rows [batch]``: 1 for a row holding a real token)."""
    targets, loss_mask = loss_targets
    mtp_weight, counts = (0.0, None) if loss_scale is None else loss_scale
    shifted_targets, shifted_masks = shifted_by_depth(targets, loss_mask, depth)  # [1 + depth, batch, seq]
    tokens_k = [jnp.sum(m.astype(jnp.float32)) for m in shifted_masks]
    if counts is None:
        step_tokens, step_sequences, head_tokens = tokens_k[0], jnp.sum(rows), tokens_k[1:]
    else:
        step_tokens, step_sequences = counts["tokens"], counts["sequences"]
        head_tokens = [counts[f"mtp{k}_tokens"] for k in range(1, depth + 1)]
    w_mtp = tuple(mtp_weight / depth * step_tokens / jnp.maximum(n, 1.0) for n in head_tokens)
    return PipelineLossWeights(shifted_targets, shifted_masks, w_mtp, step_tokens / jnp.maximum(step_sequences, 1.0))


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """The cross-entropy summed over the tokens where ``mask``, in float32: a comparison with the vocabulary ids,
    not a gather, so vocab-sharded logits stay sharded (inside a pipeline's ``shard_map``)."""
    logits = logits.astype(jnp.float32)
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    target_logit = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - target_logit) * mask.astype(jnp.float32))


def differentiated_by(program: Any, *primals: Any) -> Any:
    """``program(*primals)[0]`` as a function autodiff differentiates with the gradients ``program`` computed
    itself (``program(*primals) -> (outputs, grads)``, ``grads`` one per primal, of ``outputs[0]``: a 1F1B
    pipeline's loss): a ``custom_vjp`` whose backward scales them by the cotangent of ``outputs[0]`` (the other
    outputs are values the caller reads without gradient)."""

    @jax.custom_vjp
    def value(*primals: Any) -> Any:
        return program(*primals)[0]

    def backward(grads: Any, g: Any) -> Any:
        return jax.tree.map(lambda d: (g[0] * d).astype(d.dtype), grads)

    value.defvjp(program, backward)
    return value(*primals)


def _in_model_order(by_stack: dict[str, dict[str, jax.Array]], kinds: tuple[str, ...]) -> dict[str, jax.Array]:
    """The pipelined MoE stacks' stats (per stack name, stacked per layer in the stack's order, on ``stage``) as
    one model's: ``load`` / ``dropped`` per layer in model order (``kinds``: each pipelined layer's stack), whole;
    ``balance`` / ``indexer`` summed over every layer."""
    order = np.argsort([i for name in _PIPELINED_STACKS for i, k in enumerate(kinds) if k == name])
    stats = {key: jnp.concatenate([_unsplit(by_stack[n][key]) for n in _PIPELINED_STACKS])[order]
             for key in ("load", "dropped") if key in by_stack["moe_layers"]}
    return stats | {key: sum(jnp.sum(by_stack[n][key]) for n in _PIPELINED_STACKS if key in by_stack[n])
                    for key in ("balance", "indexer") if any(key in by_stack[n] for n in _PIPELINED_STACKS)}


def _real_rows(x: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
    """``[batch]`` float32: 1 for a row holding a real token, 0 for an all-padding row (every row without a mask)."""
    if attention_mask is None:
        return jnp.ones(x.shape[:1], jnp.float32)
    return jnp.any(attention_mask.astype(bool), axis=-1).astype(jnp.float32)


def _unsplit(a: jax.Array) -> jax.Array:
    """A per-layer stat out of the pipeline (its layer dim on ``stage``) whole, to join those of the layers run
    before it (whole on every stage: one array of one sharding under Explicit meshes)."""
    return shard(a, (None,) * a.ndim)


def _slice_stack(stack: nnx.Module, start: int, stop: int) -> nnx.Module:
    """Layers ``start:stop`` of a stacked module (the same Variables, sliced on the leading layer dim)."""
    graphdef, state = nnx.split(stack)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[start:stop], state))


def _cat(parts: list[Any]) -> Any:
    """Per-layer records of several runs joined along the layer dim (None stays None; one part: itself)."""
    parts = [p for p in parts if p is not None]
    if len(parts) <= 1:
        return parts[0] if parts else None
    return jnp.concatenate(parts, axis=0)
