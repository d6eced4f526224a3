"""The dense core with sparse mixture-of-experts MLPs: ``MoECausalLM``, shared by Qwen3-MoE, Mixtral and GLM-4.5.

A layer is dense (``DecoderLayer``: SwiGLU) or sparse (``MoEDecoderLayer``: ``nnx_zoo.layers.sparse_moe``) as
``config.is_moe_layer(i)`` says (its ``LayerKind.moe``). Parameters: the MoE layers stacked in ``layers`` (so an
all-MoE model such as Mixtral has the dense families' paths), the dense layers of a mixed model in
``dense_layers`` (with local attention kinds too: ``sliding_layers``, ...; ``config.layer_stacks()``). The forward
pass applies the layers in order as segments (``CausalLM.layer_segments``): one scan when every layer is MoE, two
for dense-first-then-MoE (Qwen3-MoE's ``mlp_only_layers=[0]``), one scan of two-layer steps when the kinds
alternate (``decoder_sparse_step=2``). With
``batch_split_factor > 1`` each MoE layer runs on that many micro-batches, its weights gathered once
(``nnx_zoo.layers.batch_split``: same numbers, the balance sums added up), as DeepSeek's MoE layers do.

With ``config.output_router_logits`` the forward's ``aux_loss`` is ``router_aux_loss_coef`` times the Switch
load-balancing loss pooled over the MoE layers and the real tokens (``nnx_zoo.layers.routers``), which is
transformers' ``outputs.aux_loss`` (unweighted there) times the coefficient: what its loss adds. The trainer
(``nnx_zoo.train.step``) adds ``aux_loss`` as a mean over the step's real sequences: with one micro-batch that is
exactly transformers' ``loss``; with gradient accumulation each micro-batch's Switch loss (a product of means
over its own tokens, which does not split into per-token terms) counts by its share of the sequences, as a
PyTorch loop accumulating transformers' per-forward loss would weigh it.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.hf import DENSE, FusedDown, FusedGateUp, KeyTable, Row, Stack
from nnx_zoo.layers.attention import AttentionMask, causal_mask, token_mask_of
from nnx_zoo.layers.pipeline import resolve_schedule, stage_count
from nnx_zoo.layers.routers import BalanceSums, switch_balance_loss
from nnx_zoo.layers.scan import Summed, batch_split, gathered_over_fsdp, model_order, run_stack
from nnx_zoo.layers.sparse_moe import SparseMoE, SparseMoEOutput
from nnx_zoo.models import dense_hf
from nnx_zoo.models.causal_lm import (
    CausalLM,
    CausalLMOutput,
    DecoderLayer,
    _dtypes,
    check_forward_inputs,
    stack_hidden_states,
)
from nnx_zoo.models.moe_decoder_config import MoEDecoderConfig
from nnx_zoo.sharding import shard, use_rules

_BLE = ("activation_batch", "activation_length", "activation_embed")


class MoEDecoderLayer(DecoderLayer):
    """``DecoderLayer`` with a ``SparseMoE`` MLP: ``h = x + attn(norm(x))``, then ``h + moe(norm(h))``; returns
    ``(hidden, SparseMoEOutput)``.

    >>> layer = MoEDecoderLayer(Qwen3MoEConfig.preset("qwen3-moe-tiny"), rngs=nnx.Rngs(0))
    >>> cos, sin = rope_cos_sin(jnp.arange(8)[None], rope_frequencies(layer.attn.head_dim, 1e6)[0])
    >>> h, moe = layer(jnp.ones((2, 8, 128)), cos, sin, causal_mask(8))
    >>> h.shape, moe.expert_indices.shape
    ((2, 8, 128), (2, 8, 2))
    """

    def _make_mlp(self, c: MoEDecoderConfig, init: nnx.initializers.Initializer, rngs: nnx.Rngs) -> nnx.Module:
        return SparseMoE(c.hidden_size, num_experts=c.num_routed_experts, experts_per_token=c.num_experts_per_tok,
                         expert_hidden=c.expert_intermediate_size, renormalize=c.renormalize_topk,
                         shared_hidden=c.shared_expert_intermediate_size, router=c.router_kind, **c.router_options,
                         moe_impl=c.moe_impl, grouped_matmul_impl=c.grouped_matmul_impl,
                         capacity_factor=c.moe_capacity_factor, kernel_init=init, rngs=rngs, **_dtypes(c))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | None, *,  # type: ignore[override]
                 token_mask: jax.Array | None = None, with_balance: bool = False
                 ) -> tuple[jax.Array, SparseMoEOutput]:
        h = shard(x + self.attn(self.input_norm(x), cos, sin, mask), _BLE)
        moe = self.mlp(self.post_attn_norm(h), token_mask=token_mask, with_balance=with_balance)
        return shard(h + moe.output, _BLE), moe

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               start: jax.Array, mask: AttentionMask) -> tuple[jax.Array, jax.Array, jax.Array]:
        attn, k_cache, v_cache = self.attn.decode(self.input_norm(x), cos, sin, k_cache, v_cache, start, mask)
        h = shard(x + attn, _BLE)
        return shard(h + self.mlp(self.post_attn_norm(h)).output, _BLE), k_cache, v_cache


class _Record(NamedTuple):
    """What a layer scan keeps per layer (None where not asked for, or for dense layers)."""

    hidden: jax.Array | None = None
    expert_indices: jax.Array | None = None
    expert_load: jax.Array | None = None
    dropped_tokens: jax.Array | None = None
    balance: BalanceSums | None = None


def _batch_split_layer(layer: MoEDecoderLayer, x: jax.Array, cos: jax.Array, sin: jax.Array,
                       mask: AttentionMask | None, token_mask: jax.Array, with_balance: bool, factor: int
                       ) -> tuple[jax.Array, SparseMoEOutput]:
    """``layer(x, ...)`` on ``factor`` micro-batches (``nnx_zoo.layers.batch_split``), its weights gathered once
    for all of them: the same output, routing and dropped count, and the balance sums added up."""
    gathered = gathered_over_fsdp(layer)

    def run(h: jax.Array, m: AttentionMask | None, tm: jax.Array) -> tuple[jax.Array, Any]:
        h, moe = gathered(h, cos, sin, m, token_mask=tm, with_balance=with_balance)
        return h, (moe.expert_indices, moe.dropped_tokens, Summed(moe.balance))

    h, (indices, dropped, balance) = batch_split(run, x, mask, token_mask, factor=factor)
    return h, SparseMoEOutput(None, indices, dropped, balance.value)


def _cat(parts: list[Any]) -> Any:
    """Per-layer records of several runs joined along the layer dim (None stays None)."""
    parts = [p for p in parts if p is not None]
    return jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *parts) if parts else None


class MoECausalLM(CausalLM):
    """The dense decoder with sparse MoE MLPs by config; families subclass it (``Qwen3MoE``, ``Mixtral``).

    >>> model = Qwen3MoE.create(Qwen3MoEConfig.preset("qwen3-moe-tiny", output_router_logits=True))
    >>> out = model.forward(jnp.zeros((2, 16), jnp.int32), with_expert_load=True)
    >>> out.logits.shape, out.expert_load.shape, out.aux_loss.shape
    ((2, 16, 32000), (4, 8), ())
    """

    config_class: ClassVar[type[MoEDecoderConfig]] = MoEDecoderConfig

    def layer_class(self, kind: Any) -> type[nnx.Module]:
        return MoEDecoderLayer if kind.moe else DecoderLayer

    def update_routing_bias(self, expert_load: jax.Array, rate: float) -> None:
        """Aux-loss-free balancing after an optimizer step: each MoE layer's selection bias moves by ``rate``
        toward balance (``nnx_zoo.layers.routers.balance_routing_bias``), ``expert_load [moe_layers, experts]``
        from ``forward(..., with_expert_load=True)``. A router without a bias (softmax top-k): a no-op."""
        c = self.config
        moe_layers = [i for i, kind in enumerate(c.layer_kinds()) if kind.moe]
        for name, kind, indices in c.layer_stacks():
            if kind.moe:  # this stack's rows of expert_load (model order over the MoE layers)
                rows = jnp.asarray([moe_layers.index(i) for i in indices])
                getattr(self, name).mlp.balance_bias(expert_load[rows], rate)

    def _balance_on(self) -> bool:
        """Whether the forward computes the Switch balance loss (``aux_loss``)."""
        return bool(self.config.output_router_logits and self.config.router_aux_loss_coef)

    def forward(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                segment_ids: jax.Array | None = None, position_ids: jax.Array | None = None,
                with_hidden_states: bool = False, with_mtp: bool = False, with_expert_load: bool = False,
                with_routing: bool = False, with_logits: bool = True, pipeline_microbatches: int = 1,
                pipeline_schedule: str = "gpipe", pipeline_virtual_stages: int | None = None,
                loss_targets: tuple[jax.Array, jax.Array] | None = None) -> CausalLMOutput:
        """``CausalLM.forward`` plus the MoE outputs: ``expert_indices [moe_layers, batch, seq, k]``
        (``with_routing``), ``expert_load [moe_layers, experts]`` and ``dropped_tokens [moe_layers]``
        (``with_expert_load``; padding counted, as routed), and ``aux_loss`` whenever
        ``config.output_router_logits`` (and ``router_aux_loss_coef``) is set: see the module docstring.

        On a mesh with a ``stage`` axis the layers run pipelined as ``CausalLM.forward`` runs them (one walk:
        ``_pipeline_layer`` per layer, ``_pipeline_outputs`` after), every schedule. Each MoE layer's expert load,
        dropped tokens and ``BalanceSums`` come out of the pipeline per layer, summed over the micro-batches: the
        whole batch's (sums over rows), so ``expert_load`` (what the routing-bias update reads) and the Switch loss
        pooled over the layers are the un-pipelined ones (dropping over a capacity counts per micro-batch, as
        gradient accumulation counts it). The Switch loss runs with GPipe only: its gradient weighs every token's
        router probabilities by the whole batch's expert counts, which 1F1B / interleaved do not have when a
        micro-batch's backward starts (a clear error; use ``pipeline_schedule='gpipe'`` or turn the loss off).
        ``with_hidden_states`` / ``with_routing`` are refused there."""
        check_forward_inputs(input_ids, attention_mask, segment_ids, position_ids, config=self.config)
        if with_mtp:
            raise ValueError(f"with_mtp=True but {type(self).__name__} has no MTP heads (multi-token prediction)")
        with self._parameter_mesh():
            pipelined = stage_count() > 1
        if pipelined:
            if resolve_schedule(pipeline_schedule, pipeline_virtual_stages).loss_inside and self._balance_on():
                raise ValueError(
                    f"pipeline_schedule={pipeline_schedule!r} with the Switch balance loss (output_router_logits, "
                    f"router_aux_loss_coef={self.config.router_aux_loss_coef}): its gradient needs the whole batch's "
                    "expert counts before any micro-batch's backward, which 1F1B and interleaved run as they go. "
                    "Use pipeline_schedule='gpipe' (--pipeline-schedule gpipe), or train without the loss "
                    "(output_router_logits=False)")
            return super().forward(input_ids, attention_mask, segment_ids=segment_ids, position_ids=position_ids,
                                   with_hidden_states=with_hidden_states, with_expert_load=with_expert_load,
                                   with_routing=with_routing, with_logits=with_logits,
                                   pipeline_microbatches=pipeline_microbatches, pipeline_schedule=pipeline_schedule,
                                   pipeline_virtual_stages=pipeline_virtual_stages, loss_targets=loss_targets)
        c = self.config
        with_balance = self._balance_on()
        with use_rules(self.rules, allow_partial=self.allow_partial), self._parameter_mesh():
            seq_len = input_ids.shape[1]
            positions = jnp.arange(seq_len)[None, :] if position_ids is None else position_ids
            ropes = {name: self._layer_rope(kind, positions) for name, kind in self._kinds_by_stack().items()}
            mask = causal_mask(seq_len, attention_mask, segment_ids)
            token_mask = token_mask_of(mask, seq_len)  # a real token may attend to itself

            def layer_body(layer: DecoderLayer, h: jax.Array, cos: jax.Array, sin: jax.Array
                           ) -> tuple[jax.Array, _Record]:
                if not isinstance(layer, MoEDecoderLayer):
                    h = layer(h, cos, sin, mask)
                    return h, _Record(hidden=h if with_hidden_states else None)
                if c.batch_split_factor > 1:
                    h, moe = _batch_split_layer(layer, h, cos, sin, mask, token_mask, with_balance,
                                                c.batch_split_factor)
                else:
                    h, moe = layer(h, cos, sin, mask, token_mask=token_mask, with_balance=with_balance)
                load = None
                if with_expert_load:
                    load = jnp.sum(jax.nn.one_hot(moe.expert_indices, c.num_routed_experts, dtype=jnp.float32),
                                   axis=(0, 1, 2))
                return h, _Record(h if with_hidden_states else None, moe.expert_indices if with_routing else None,
                                  load, moe.dropped_tokens if with_expert_load else None, moe.balance)

            def segment_body(pattern: tuple[str, ...]) -> Any:
                def body(group: nnx.List, h: jax.Array, _: Any) -> tuple[jax.Array, list[_Record]]:
                    records = []
                    for name, layer in zip(pattern, group):
                        h, record = layer_body(layer, h, *ropes[name])
                        records.append(record)
                    return h, records
                return body

            embeddings = h = self.embed(input_ids)
            hidden, moe_records = [], []
            for segment in self.layer_segments():
                h, records = run_stack(segment.group, segment_body(segment.pattern), h, scan=c.scan_layers,
                                       remat_policy=c.remat_policy)
                hidden.append(model_order([r.hidden for r in records]))
                moe_positions = [r for r, layer in zip(records, segment.group) if isinstance(layer, MoEDecoderLayer)]
                if moe_positions:  # the MoE layers' records in model order (dense layers keep none)
                    moe_records.append(model_order(moe_positions))
            final_hidden = self.norm(h)
            moe = _Record(*(_cat([getattr(r, f) for r in moe_records]) for f in _Record._fields))
            hidden_states = None
            if with_hidden_states:
                hidden_states = stack_hidden_states(embeddings, jnp.concatenate(hidden, axis=0), final_hidden)
            aux_loss = None
            if moe.balance is not None:
                pooled = BalanceSums(*(jnp.sum(a, axis=0) for a in moe.balance))  # over the MoE layers
                aux_loss = c.router_aux_loss_coef * switch_balance_loss(pooled)
            return CausalLMOutput(logits=self._logits(final_hidden) if with_logits else None,
                                  hidden_states=hidden_states, expert_indices=moe.expert_indices,
                                  expert_load=moe.expert_load, dropped_tokens=moe.dropped_tokens,
                                  aux_loss=aux_loss, final_hidden=final_hidden)


    def _pipeline_layer(self, layer: nnx.Module, h: jax.Array, cos: jax.Array, sin: jax.Array,
                        mask: AttentionMask, *, with_expert_load: bool) -> tuple[jax.Array, dict[str, Any]]:
        """``CausalLM._pipeline_layer`` for a dense or MoE layer: an MoE layer's stats are its ``load`` (tokens
        per expert) and ``dropped`` (with ``with_expert_load``) and its ``balance`` sums (with the Switch loss),
        each a sum over the micro-batch's rows; a dense layer has none."""
        if not isinstance(layer, MoEDecoderLayer):
            return layer(h, cos, sin, mask), {}
        c = self.config
        with_balance = self._balance_on()
        token_mask = token_mask_of(mask, h.shape[1])  # this micro-batch's rows
        if c.batch_split_factor > 1:
            h, moe = _batch_split_layer(layer, h, cos, sin, mask, token_mask, with_balance, c.batch_split_factor)
        else:
            h, moe = layer(h, cos, sin, mask, token_mask=token_mask, with_balance=with_balance)
        stats: dict[str, Any] = {}
        if with_expert_load:
            stats["load"] = jnp.sum(jax.nn.one_hot(moe.expert_indices, c.num_routed_experts, dtype=jnp.float32),
                                    axis=(0, 1, 2))
            stats["dropped"] = moe.dropped_tokens
        if with_balance:
            stats["balance"] = moe.balance
        return h, stats

    def _pipeline_outputs(self, stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The MoE stacks' stats (the stacks that have any) joined in model order over the MoE layers:
        ``expert_load``, ``dropped_tokens`` and the Switch ``aux_loss`` of the balance sums pooled over the layers."""
        moe = [(indices, stats[name]) for name, _, indices in self.config.layer_stacks() if stats.get(name)]
        if not moe:
            return {}
        # Whole on every device first, as un-pipelined (they leave the pipeline split over 'stage' by layer): the
        # stacks' rows are then interleaved into model order, and the routing-bias update picks each stack's.
        whole = jax.tree.map(lambda a: shard(a, (None,) * a.ndim), [layer_stats for _, layer_stats in moe])
        order = np.argsort(np.concatenate([indices for indices, _ in moe]), kind="stable")
        per_layer = jax.tree.map(lambda *a: jnp.take(jnp.concatenate(a), order, axis=0) if len(a) > 1 else a[0],
                                 *whole)
        out = {"expert_load": per_layer.get("load"), "dropped_tokens": per_layer.get("dropped")}
        if "balance" in per_layer:
            pooled = BalanceSums(*(jnp.sum(a, axis=0) for a in per_layer["balance"]))
            out["aux_loss"] = self.config.router_aux_loss_coef * switch_balance_loss(pooled)
        return out


def moe_key_table(config: MoEDecoderConfig, *, attention_rows: tuple[Row, ...], moe_rows: tuple[Row, ...],
                  fused: dict[str, tuple[tuple[str, Any], ...]], source: str) -> KeyTable:
    """The HF key table of an ``MoECausalLM``: each layer's ``attention_rows`` (norms and attention) plus, in the
    MoE stacks (``layers``, ``sliding_layers``, ...), the ``moe_rows`` (router and per-expert ``{e}`` keys) with
    the ``fused`` alternates (transformers-5 fused expert keys, each filling a whole layer), and in the dense stacks
    (``dense_layers``, ...) the SwiGLU rows."""
    dense_rows = attention_rows + tuple(r for r in dense_hf.LAYER_TABLE if r.hf.startswith("mlp."))
    stacks = tuple(Stack(name, "model.layers.{i}.", indices, attention_rows + moe_rows, fused)  # type: ignore[arg-type]
                   if kind.moe else Stack(name, "model.layers.{i}.", indices, dense_rows)  # type: ignore[arg-type]
                   for name, kind, indices in config.layer_stacks())
    return KeyTable(top=dense_hf.TOP_TABLE, stacks=stacks,
                    ignored=(r"^lm_head\.weight$",) if config.tie_word_embeddings else (), source=source)


def expert_rows(module: str, gate: str, up: str, down: str, router: str = "gate") -> tuple[Row, ...]:
    """Rows of a sparse MLP stored as HF module ``module`` (``mlp``, ``block_sparse_moe``): its router
    ``{module}.{router}.weight [E, embed]`` and per-expert ``nn.Linear`` weights named ``gate`` / ``up`` /
    ``down`` (``{module}.experts.{e}.{name}.weight``)."""
    experts = f"{module}.experts.{{e}}."
    return (Row(f"{module}.{router}.weight", "mlp.router", DENSE),
            Row(f"{experts}{gate}.weight", "mlp.experts.wi_gate", DENSE),
            Row(f"{experts}{up}.weight", "mlp.experts.wi_up", DENSE),
            Row(f"{experts}{down}.weight", "mlp.experts.wo", DENSE))


# transformers-5's fused in-memory expert layout (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
# with the router as ``mlp.gate.weight``: each key fills a whole layer.
FUSED_EXPERTS: dict[str, tuple[tuple[str, Any], ...]] = {
    "mlp.gate.weight": (("mlp.router", DENSE),),
    "mlp.experts.gate_up_proj": (("mlp.experts.wi_gate", FusedGateUp(0)), ("mlp.experts.wi_up", FusedGateUp(1))),
    "mlp.experts.down_proj": (("mlp.experts.wo", FusedDown()),),
}
