"""DeepSeek-V3: decoder layers, multi-token-prediction heads, and the causal LM.

Layers ``< first_k_dense_replace`` have a dense SwiGLU MLP and live in the ``dense_layers`` stack; the rest have
the MoE block and live in ``moe_layers``; the MTP heads (``num_nextn_predict_layers``) live in ``mtp_layers``.
Each stack is one set of stacked Variables (leading logical axis named after the stack), applied with a scan.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.layers.attention import causal_mask
from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import rope_cos_sin, rope_frequencies
from nnx_zoo.layers.scan import batch_split, create_stack, run_stack
from nnx_zoo.models.deepseek.cache import MLACache
from nnx_zoo.models.deepseek.config import DeepSeekV3Config
from nnx_zoo.models.deepseek.mla import MLA
from nnx_zoo.models.deepseek.moe import DeepSeekMoE
from nnx_zoo.sharding import create_sharded, get_rules, shard, use_rules
from nnx_zoo.sharding.rules import Rules

_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLV = ("activation_batch", "activation_length", "activation_vocab")


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


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + MLA(norm(x))``, then ``+ MLP(norm(.))`` (dense SwiGLU, or the MoE block)."""

    def __init__(self, config: DeepSeekV3Config, *, moe: bool, rngs: nnx.Rngs):
        c = config
        self.input_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.attn = MLA(c, rngs=rngs)
        self.post_attn_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        if moe:
            self.mlp = DeepSeekMoE(c, rngs=rngs)
        else:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, kernel_init=nnx.initializers.normal(
                c.initializer_range), rngs=rngs, **_dtypes(c))
        self.is_moe = moe

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array | None
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array] | None]:
        """``(output [batch, seq, embed], aux)``: for an MoE layer ``aux = (chosen experts [batch, seq, k],
        (token, expert) pairs dropped over capacity (int32 scalar), sequence-wise balance loss [batch])``, for a
        dense layer None. The balance loss is None when ``seq_aux_loss_alpha`` is 0."""
        x = shard(x + self.attn(self.input_norm(x), cos, sin, mask), _BLE)
        seq = x.shape[1]
        # A token is real (not padding) when it may attend to itself.
        token_mask = (jnp.ones((1, seq), bool) if mask is None
                      else jnp.any(mask[:, 0] & jnp.eye(seq, dtype=bool), axis=-1))
        return self._feed_forward(x, token_mask)

    def _feed_forward(self, x: jax.Array, token_mask: jax.Array
                      ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array] | None]:
        if self.is_moe:
            mlp_out, expert_idx, dropped, balance = self.mlp(self.post_attn_norm(x), return_dropped=True,
                                                             token_mask=token_mask)
            aux = (expert_idx, dropped, balance)
        else:
            mlp_out, aux = self.mlp(self.post_attn_norm(x)), None
        return shard(x + mlp_out, _BLE), aux

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, latent_cache: jax.Array, rope_cache: jax.Array,
               start: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The layer on ``t`` new tokens against this layer's cache (``MLA.decode``): ``(output, latent_cache,
        rope_cache)`` with the new tokens written at slots ``start .. start + t``."""
        attn, latent_cache, rope_cache = self.attn.decode(self.input_norm(x), cos, sin, latent_cache, rope_cache,
                                                          start, mask)
        x, _ = self._feed_forward(shard(x + attn, _BLE), jnp.ones((1, x.shape[1]), bool))  # new tokens are real
        return x, latent_cache, rope_cache

    def batch_split(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array | None, factor: int
                    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``self(x, cos, sin, mask)`` as ``factor`` micro-batches (``nnx_zoo.layers.batch_split``): same output
        (dropless), with exactly ``x``'s sharding."""
        return batch_split(lambda h, m: self(h, cos, sin, m), x, mask, factor=factor)


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
                 mask: jax.Array | None) -> jax.Array:
        joined = jnp.concatenate([self.enorm(token_embeddings), self.hnorm(previous_hidden)], axis=-1)
        hidden, _ = self.layer.batch_split(self.eh_proj(joined, _BLE), cos, sin, mask, self.batch_split_factor)
        return self.final_norm(hidden)


class DeepSeekV3Output(NamedTuple):
    """What ``model(..., return_aux=True)`` returns (a pytree; fields are None when not computed).

    ``embeddings`` [b, s, e]; ``layer_outputs`` [num_hidden_layers, b, s, e] (each decoder layer's output,
    before the final norm); ``final_hidden`` [b, s, e] (after it); ``expert_indices`` [num_moe_layers, b, s, k];
    ``mtp_logits`` [num_nextn_predict_layers, b, s, vocab], where depth ``k`` at position ``i`` predicts token
    ``i + k + 1``; ``dropped_tokens`` [num_moe_layers] int32: (token, expert) pairs each MoE layer dropped over
    capacity (``moe_impl='ep'`` with ``moe_capacity_factor``; zeros when dropless); ``expert_load``
    [num_moe_layers, n_routed_experts] float32: how many (token, expert) pairs each routed expert received;
    ``aux_loss`` (scalar, when ``seq_aux_loss_alpha > 0``): the sequence-wise balance loss, averaged over the
    sequences that hold a real token and summed over the MoE layers (MTP heads excluded).
    """

    logits: jax.Array
    embeddings: jax.Array | None = None
    layer_outputs: jax.Array | None = None
    final_hidden: jax.Array | None = None
    expert_indices: jax.Array | None = None
    mtp_logits: jax.Array | None = None
    dropped_tokens: jax.Array | None = None
    expert_load: jax.Array | None = None
    aux_loss: jax.Array | None = None


class DeepSeekV3(nnx.Module):
    """DeepSeek-V3 causal language model (exact against HF ``DeepseekV3ForCausalLM``).

    >>> config = DeepSeekV3Config.preset("deepseek3-mini")
    >>> model = DeepSeekV3(config, rngs=nnx.Rngs(0))                       # or DeepSeekV3.create(config, mesh=mesh)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                      # [2, 16, vocab]
    >>> model = DeepSeekV3.from_pretrained("/path/to/hf_checkpoint", mesh=mesh)
    >>> model.save_pretrained("/tmp/out")                                  # loadable by transformers

    ``rules`` (a rule-set name or tuple) is stored on the model and used by every ``shard`` inside ``__call__``.
    """

    def __init__(self, config: DeepSeekV3Config, *, rngs: nnx.Rngs, rules: Rules | str = "default"):
        c = config
        self.config = c
        self.rules = get_rules(rules)
        init = nnx.initializers.normal(c.initializer_range)
        self.embed = Embed(c.vocab_size, c.hidden_size, embedding_init=init, rngs=rngs, **_dtypes(c))
        self.dense_layers = self._stack(lambda r: DecoderLayer(c, moe=False, rngs=r), c.num_dense_layers, rngs,
                                        "dense_layers")
        self.moe_layers = self._stack(lambda r: DecoderLayer(c, moe=True, rngs=r), c.num_moe_layers, rngs,
                                      "moe_layers")
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, kernel_names=("embed", "vocab"), kernel_init=init, rngs=rngs, **_dtypes(c))
        self.mtp_layers = self._stack(lambda r: MTPHead(c, rngs=r), c.num_nextn_predict_layers, rngs, "mtp_layers")
        inv_freq, self.rope_attention_factor = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
        self.rope_inv_freq = tuple(float(f) for f in inv_freq)  # static and hashable: part of the graph definition

    @staticmethod
    def _stack(make: Any, count: int, rngs: nnx.Rngs, axis_name: str) -> nnx.Module | None:
        return create_stack(make, count, rngs, axis_name) if count else None

    @classmethod
    def create(cls, config: DeepSeekV3Config, *, mesh: Mesh | None = None, rules: Rules | str = "default",
               seed: int = 0) -> DeepSeekV3:
        """A randomly initialized model; with ``mesh``, every parameter is born on its resolved sharding."""
        def make() -> DeepSeekV3:
            return cls(config, rngs=nnx.Rngs(seed), rules=rules)

        return make() if mesh is None else create_sharded(make, mesh, rules)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                        dtype: Any = None, **config_overrides: Any) -> DeepSeekV3:
        """Load an HF DeepSeek-V3 checkpoint directory (see ``nnx_zoo.models.deepseek.hf.load_pretrained``)."""
        from nnx_zoo.models.deepseek.hf import load_pretrained

        return load_pretrained(cls, path, mesh=mesh, rules=rules, dtype=dtype, **config_overrides)

    def save_pretrained(self, path: str | Path, *, max_shard_bytes: int = 4 * 2**30) -> None:
        """Write an HF checkpoint (config.json, safetensors shards + index) that transformers can load."""
        from nnx_zoo.models.deepseek.hf import save_pretrained

        save_pretrained(self, path, max_shard_bytes=max_shard_bytes)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *, return_aux: bool = False,
                 with_mtp: bool = False, segment_ids: jax.Array | None = None,
                 with_expert_load: bool = False, position_ids: jax.Array | None = None
                 ) -> jax.Array | DeepSeekV3Output:
        """Logits ``[batch, seq, vocab]`` for ``input_ids [batch, seq]``; ``attention_mask [batch, seq]`` (1 =
        token, 0 = padding) may mark left padding. Positions are ``0..seq-1`` whatever the padding, as in HF's
        forward, unless ``position_ids [batch, seq]`` are given (generation uses ``cumsum(attention_mask) - 1``,
        as HF's ``generate`` does). ``return_aux`` returns a ``DeepSeekV3Output`` (per-layer hidden states,
        chosen experts); ``with_mtp`` also runs the MTP heads (``mtp_logits``). ``segment_ids [batch, seq]``
        (packed training data) keep attention inside each document. ``with_expert_load`` adds each MoE layer's
        per-expert token counts (``expert_load``), which ``update_routing_bias`` turns into DeepSeek's
        aux-loss-free balancing. With ``config.seq_aux_loss_alpha > 0`` the call returns a ``DeepSeekV3Output``
        carrying ``aux_loss``."""
        with use_rules(self.rules), self._parameter_mesh():
            return self._forward(input_ids, attention_mask, segment_ids, return_aux=return_aux, with_mtp=with_mtp,
                                 with_expert_load=with_expert_load, position_ids=position_ids)

    # ---- generation: a fixed-size MLA cache (nnx_zoo.models.deepseek.cache), driven by nnx_zoo.generate ----

    def generate(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, **kwargs: Any) -> Any:
        """``nnx_zoo.generate(self, input_ids, attention_mask, **kwargs)``: sampled or greedy continuations."""
        from nnx_zoo.generate import generate

        return generate(self, input_ids, attention_mask, **kwargs)

    def init_cache(self, batch: int, max_len: int) -> MLACache:
        """An empty decoding cache for ``batch`` rows of up to ``max_len`` tokens (prompt and generated)."""
        c = self.config
        with use_rules(self._decoding_rules()), self._parameter_mesh():
            return MLACache.zeros(num_layers=c.num_hidden_layers, batch=batch, max_len=max_len,
                                  kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim, dtype=jnp.dtype(c.dtype))

    def prefill(self, input_ids: jax.Array, attention_mask: jax.Array | None, cache: MLACache
                ) -> tuple[jax.Array, MLACache]:
        """Run a (left-padded) prompt ``[batch, t]`` into ``cache``: ``(logits [batch, t, vocab], cache)``.
        Token ``i`` of a row sits at rope position ``cumsum(attention_mask)[i] - 1``; padding is never attended
        to. Logits come whole along the vocabulary (ready for sampling)."""
        if input_ids.shape[1] > cache.max_len:
            raise ValueError(f"a prompt of {input_ids.shape[1]} tokens does not fit a cache of {cache.max_len} "
                             "slots; create the cache with max_len >= prompt length + tokens to generate")
        token_mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask
        with use_rules(self._decoding_rules()), self._parameter_mesh():
            return self._extend(input_ids, token_mask, cache)

    def decode_step(self, tokens: jax.Array, cache: MLACache) -> tuple[jax.Array, MLACache]:
        """One new token per row ``tokens [batch]`` into the next cache slot: ``(logits [batch, vocab], cache)``.
        The cache must have a free slot (``cache.length < cache.max_len``; a full cache overwrites its last)."""
        with use_rules(self._decoding_rules()), self._parameter_mesh():
            logits, cache = self._extend(tokens[:, None], jnp.ones((tokens.shape[0], 1), bool), cache)
        return logits[:, 0], cache

    def _decoding_rules(self) -> Rules:
        """The model's rules with the new tokens' sequence dim unsplit: one decoded token cannot be divided
        over context-parallel devices (the first rule for a name wins, so this one overrides)."""
        return (("activation_length", None), *self.rules)

    def _extend(self, input_ids: jax.Array, token_mask: jax.Array, cache: MLACache) -> tuple[jax.Array, MLACache]:
        """Write ``t`` new tokens per row into the next ``t`` cache slots, attending to everything cached."""
        c = self.config
        start = cache.length
        positions, mask, cache = cache.advance(token_mask)
        cos, sin = self._rope(positions)

        def layer_body(layer: DecoderLayer, carry: Any, index: jax.Array) -> tuple[Any, None]:
            h, latent, k_rope = carry
            h, layer_latent, layer_rope = layer.decode(
                h, cos, sin, jax.lax.dynamic_index_in_dim(latent, index, keepdims=False),
                jax.lax.dynamic_index_in_dim(k_rope, index, keepdims=False), start, mask)
            latent = jax.lax.dynamic_update_index_in_dim(latent, layer_latent, index, 0)
            k_rope = jax.lax.dynamic_update_index_in_dim(k_rope, layer_rope, index, 0)
            return (h, latent, k_rope), None

        carry, first_layer = (self.embed(input_ids), cache.latent, cache.k_rope), 0
        for stack, count in ((self.dense_layers, c.num_dense_layers), (self.moe_layers, c.num_moe_layers)):
            if stack is not None:  # the cache's layer axis runs over the dense layers, then the MoE layers
                layer_index = jnp.arange(first_layer, first_layer + count)
                carry, _ = run_stack(stack, layer_body, carry, layer_index, scan=c.scan_layers)
                first_layer += count
        h, latent, k_rope = carry
        logits = shard(self._logits(self.norm(h)), ("activation_batch", "activation_length", None))
        return logits, cache._replace(latent=latent, k_rope=k_rope)

    def _parameter_mesh(self) -> Any:
        """With no ambient mesh, the mesh the parameters live on (so ``model(ids)`` works without
        ``jax.set_mesh``); otherwise nothing."""
        if not jax.sharding.get_abstract_mesh().empty:
            return contextlib.nullcontext()
        table = self.embed.embedding[...]
        sharding = jax.typeof(table).sharding if isinstance(table, jax.core.Tracer) else table.sharding
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or mesh.empty or mesh.size == 1:
            return contextlib.nullcontext()
        if isinstance(mesh, Mesh):
            return jax.set_mesh(mesh)
        return jax.sharding.use_abstract_mesh(mesh)  # while tracing: parameters carry an abstract mesh

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rope_cos_sin(positions, jnp.asarray(self.rope_inv_freq, jnp.float32), self.rope_attention_factor)

    def _logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return self.embed.attend(hidden)
        return self.lm_head(hidden, _BLV)

    def _forward(self, input_ids: jax.Array, attention_mask: jax.Array | None, segment_ids: jax.Array | None, *,
                 return_aux: bool, with_mtp: bool, with_expert_load: bool = False,
                 position_ids: jax.Array | None = None) -> jax.Array | DeepSeekV3Output:
        c = self.config
        seq_len = input_ids.shape[1]
        positions = jnp.arange(seq_len)[None, :] if position_ids is None else position_ids
        cos, sin = self._rope(positions)
        mask = causal_mask(seq_len, attention_mask, segment_ids)
        embeddings = self.embed(input_ids)
        run = dict(scan=c.scan_layers, remat_policy=c.remat_policy)

        def layer_body(layer: DecoderLayer, h: jax.Array, _: Any) -> tuple[jax.Array, Any]:
            if layer.is_moe and c.batch_split_factor > 1:
                h, aux = layer.batch_split(h, cos, sin, mask, c.batch_split_factor)
            else:
                h, aux = layer(h, cos, sin, mask)
            if return_aux:
                return h, (h, aux)
            if aux is None:
                return h, (None, None)
            expert_idx, _, balance = aux
            load = jnp.sum(jax.nn.one_hot(expert_idx, c.n_routed_experts, dtype=jnp.float32), axis=(0, 1, 2))
            return h, (load if with_expert_load else None, balance if c.seq_aux_loss_alpha > 0 else None)

        h, per_layer, moe_outs = embeddings, [], None
        for stack in (self.dense_layers, self.moe_layers):
            if stack is not None:
                h, outs = run_stack(stack, layer_body, h, **run)
                per_layer.append(outs)
                moe_outs = outs if stack is self.moe_layers else None
        final_hidden = self.norm(h)
        logits = self._logits(final_hidden)
        mtp_logits = (self._mtp(input_ids, attention_mask, segment_ids, final_hidden, run, positions) if with_mtp
                      else None)
        if not return_aux:
            load, balance = moe_outs if moe_outs is not None else (None, None)
            aux_loss = None if balance is None else _mean_over_sequences(balance, attention_mask)
            if mtp_logits is None and load is None and aux_loss is None:
                return logits
            return DeepSeekV3Output(logits=logits, mtp_logits=mtp_logits, expert_load=load, aux_loss=aux_loss)
        layer_outputs = jnp.concatenate([outs[0] for outs in per_layer], axis=0) if per_layer else None
        expert_indices, dropped, balance = moe_outs[1] if moe_outs is not None else (None, None, None)
        aux_loss = None if balance is None or c.seq_aux_loss_alpha == 0 else _mean_over_sequences(
            balance, attention_mask)
        return DeepSeekV3Output(logits=logits, embeddings=embeddings, layer_outputs=layer_outputs,
                                final_hidden=final_hidden, expert_indices=expert_indices, mtp_logits=mtp_logits,
                                dropped_tokens=dropped, aux_loss=aux_loss)

    def update_routing_bias(self, expert_load: jax.Array, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free balancing, after an optimizer step: each MoE layer's selection bias moves
        by ``rate`` toward balance, ``bias += rate * sign(mean load - load)`` (``expert_load [layers, experts]``
        from ``model(..., with_expert_load=True)``). The bias only affects which experts are chosen."""
        if self.moe_layers is None:
            return
        bias = self.moe_layers.mlp.e_score_correction_bias
        load = expert_load.astype(jnp.float32)
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        bias[...] = bias[...] + step.astype(bias[...].dtype)

    def _mtp(self, input_ids: jax.Array, attention_mask: jax.Array | None, segment_ids: jax.Array | None,
             final_hidden: jax.Array, run: dict[str, Any], positions: jax.Array) -> jax.Array:
        """Logits of every MTP depth. Depth ``k`` reads the tokens shifted left by ``k`` (at their own
        positions), and the previous depth's hidden state (depth 1: the main model's final, normed one). With
        packed documents, position ``i`` attends within the document of position ``i``."""
        if self.mtp_layers is None:
            raise ValueError("with_mtp=True but the model has no MTP heads (num_nextn_predict_layers=0)")
        depth = self.config.num_nextn_predict_layers
        seq_len = input_ids.shape[1]
        # Shifting slices the sequence dim, which cannot stay split over devices (context parallelism under an
        # Explicit mesh): the shifts are taken from copies whole along it; the embeddings are laid out again.
        whole_sequence = ("activation_batch", None)
        input_ids = shard(input_ids, whole_sequence)
        attention_mask = None if attention_mask is None else shard(attention_mask, whole_sequence)
        shifted_ids, shifted_masks, cos_sin = [], [], []
        for k in range(1, depth + 1):
            shifted_ids.append(jnp.pad(input_ids[:, k:], ((0, 0), (0, min(k, seq_len)))))
            if attention_mask is not None:
                shifted_masks.append(jnp.pad(attention_mask[:, k:], ((0, 0), (0, min(k, seq_len)))))
            cos_sin.append(self._rope(positions + k))
        xs = (jnp.stack([self.embed(ids) for ids in shifted_ids]), jax.tree.map(lambda *a: jnp.stack(a), *cos_sin),
              jnp.stack(shifted_masks) if shifted_masks else None)

        def head_body(head: MTPHead, h: jax.Array, x: Any) -> tuple[jax.Array, jax.Array]:
            token_embeddings, (cos, sin), pad_mask = x
            h = head(token_embeddings, h, cos, sin, causal_mask(seq_len, pad_mask, segment_ids))
            return h, self._logits(h)

        _, logits = run_stack(self.mtp_layers, head_body, final_hidden, xs, **run)
        return logits
