"""The causal-LM contract every family meets, and the dense model the Llama 3 and Qwen3 families share.

The contract (written out in ``docs/causal_lm.md``): ``CausalLMBase`` gives every family ``create``,
``__call__`` (logits, always), ``generate`` and the cache protocol's ``prefill`` / ``decode_step``;
a family adds ``forward`` (one ``CausalLMOutput``, whatever it was asked for), ``init_cache``, ``_extend``,
``from_pretrained`` / ``save_pretrained`` and its ``lora_targets``.

Reading order of the dense model, top down: ``CausalLM.forward`` embeds the tokens (``Embed``), runs the
scanned stacks of ``DecoderLayer``s (``run_stack``), normalizes (``RMSNorm``) and projects to the vocabulary
(``lm_head``, or the embedding table when tied). Each ``DecoderLayer`` is pre-norm: ``x + Attention(norm(x))``,
then ``+ SwiGLU(norm(.))``; ``nnx_zoo.layers.attention`` holds the einsums. Generation (``nnx_zoo.generate``) drives
``init_cache`` / ``prefill`` / ``decode_step`` over a ``StackedKVCache``.

Layers come in kinds (``config.layer_kinds()``: full or local attention, dense or MoE MLP), one stack per kind
(``config.layer_stacks()``: Llama's one ``layers``; GPT-OSS's ``sliding_layers`` and ``layers``). The forward
pass runs them in model order as segments (``nnx_zoo.layers.scan.segments``): a repeating pattern of kinds is one
scan whose body runs one layer of each (Gemma 3's five sliding layers and a full one: one scan of six-layer
steps). A window or chunk layer's cache is a ring of its span (``nnx_zoo.layers.kv_cache.ring_slots``).

A family is a subclass naming its config class and its HF key table (``nnx_zoo.models.llama``,
``nnx_zoo.models.qwen3``); checkpoint I/O is ``nnx_zoo.hf``'s.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nnx_zoo.generate import generate
from nnx_zoo.hf import CheckpointFormatError, KeyTable, SafetensorsCheckpoint, load_module, save_module
from nnx_zoo.hf.config_io import config_json_path, read_json_object
from nnx_zoo.layers.attention import Attention, AttentionMask, causal_mask
from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.kv_cache import StackedKVCache, ring_slots
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.mlp import SwiGLU
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.pipeline import (
    STAGE_AXIS,
    pipeline_1f1b_value_and_grad,
    pipeline_stack,
    resolve_schedule,
    run_unpipelined,
    stage_count,
)
from nnx_zoo.layers.rope import rope_cos_sin, rope_frequencies
from nnx_zoo.layers.scan import Segment, create_stack, gathered_over_fsdp, model_order, run_stack, segments
from nnx_zoo.layers.spec import resolve_activation
from nnx_zoo.models.decoder_config import FULL, DecoderConfig
from nnx_zoo.models.inputs import check_forward_inputs
from nnx_zoo.models.inputs import check_ids_fit as check_ids_fit  # re-exported: its old home
from nnx_zoo.sharding import abstract_module, axes_tuple, create_sharded, get_rules, shard, use_rules
from nnx_zoo.sharding.axes import UNPIPELINED_STACK
from nnx_zoo.sharding.rules import Rules, outside_pipeline

_BLE = ("activation_batch", "activation_length", "activation_embed")
# Outside the pipeline (the embedding's output, the final hidden state, the logits): the batch split over 'stage'
# too, so the stages share that work rather than each doing it whole; the same as _BLE / _BLV without 'stage'.
_OUT_BLE = ("activation_embed_and_logits_batch", "activation_length", "activation_embed")
_BLV = ("activation_embed_and_logits_batch", "activation_length", "activation_vocab")
STACK_AXIS = "layers"  # logical name of the decoder stack's leading (layer) dim

M = TypeVar("M", bound="CausalLMBase")
C = TypeVar("C")  # a family's decoding cache (a pytree with ``max_len``)


def _dtypes(c: DecoderConfig) -> dict[str, Any]:
    return dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``h = x + attn(input_norm(x))``, then ``h + mlp(post_attn_norm(h))``.

    >>> layer = DecoderLayer(Llama3Config.preset("llama3-tiny"), rngs=nnx.Rngs(0))
    >>> cos, sin = rope_cos_sin(jnp.arange(8)[None], rope_frequencies(layer.attn.head_dim, 5e5)[0])
    >>> layer(jnp.ones((2, 8, 128)), cos, sin, causal_mask(8)).shape
    (2, 8, 128)
    """

    # The attention module, built with ``config.attention_options(kind)``'s keywords (a family's subclass of
    # ``Attention`` takes its own ones there too).
    attention_class: ClassVar[type[Attention]] = Attention

    def __init__(self, config: DecoderConfig, *, kind: Any = FULL, rngs: nnx.Rngs):
        c = config
        init = nnx.initializers.normal(c.initializer_range)
        self.input_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.attn = self.attention_class(
            c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
            use_bias=c.attention_bias, o_bias=c.attention_output_bias, qk_norm=c.qk_norm, norm_eps=c.rms_norm_eps,
            attention_impl=c.attention_impl, kernel_init=init, rngs=rngs, **c.attention_options(kind), **_dtypes(c))
        if c.qk_norm and c.qk_norm_full_width:
            # Attention norms each head; this norm takes the same place (q/k [b, s, heads, head_dim] before rope)
            # with one statistic and scale over all heads of the projection.
            heads = {"q_norm": c.num_attention_heads, "k_norm": c.num_key_value_heads}
            for name, n in heads.items():
                setattr(self.attn, name, RMSNorm(n * c.head_dim, eps=c.rms_norm_eps, axes=2, **_dtypes(c)))
        self.post_attn_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.mlp = self._make_mlp(c, init, rngs)

    def _make_mlp(self, c: DecoderConfig, init: nnx.initializers.Initializer, rngs: nnx.Rngs) -> nnx.Module:
        """The feed-forward block: a SwiGLU here (``MoEDecoderLayer`` makes a sparse MoE block)."""
        return SwiGLU(c.hidden_size, c.intermediate_size, kernel_init=init, rngs=rngs, **_dtypes(c))

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask | None) -> jax.Array:
        """``x [batch, seq, embed]`` -> same shape; ``mask``: ``causal_mask``'s."""
        h = shard(x + self.attn(self.input_norm(x), cos, sin, mask), _BLE)
        return shard(h + self.mlp(self.post_attn_norm(h)), _BLE)

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               start: jax.Array, mask: AttentionMask) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The layer on ``t`` new tokens against this layer's cache (``Attention.decode``): ``(output, k_cache,
        v_cache)`` with the new keys and values written at slots ``start .. start + t``."""
        attn, k_cache, v_cache = self.attn.decode(self.input_norm(x), cos, sin, k_cache, v_cache, start, mask)
        h = shard(x + attn, _BLE)
        return shard(h + self.mlp(self.post_attn_norm(h)), _BLE), k_cache, v_cache


class CausalLMOutput(NamedTuple):
    """What ``model.forward(...)`` returns, for every family: always these fields, in this order; a field the call
    did not compute (not asked for, or the model has no such part) is None.

    ``logits [batch, seq, vocab]``. ``hidden_states [num_hidden_layers + 1, batch, seq, embed]`` (with
    ``with_hidden_states``; HF's ``output_hidden_states`` stacked): the embeddings, each layer's output, and last
    the final normed hidden state in place of the last layer's raw output. ``mtp_logits [depth, batch, seq,
    vocab]`` (``with_mtp``): depth ``k`` (from 0) at position ``i`` predicts token ``i + k + 2``.
    ``expert_indices [moe_layers, batch, seq, k]`` int32 (``with_routing``): each MoE layer's chosen experts.
    ``expert_load [moe_layers, experts]`` float32 (``with_expert_load``): (token, expert) pairs each routed
    expert received; ``dropped_tokens [moe_layers]`` int32 (``with_expert_load``): pairs dropped over capacity.
    ``aux_loss`` (scalar): the model's own training loss term (e.g. a sequence-wise balance loss, already
    weighted, a mean over the sequences holding a real token), computed whenever the config turns it on.
    ``final_hidden [batch, seq, embed]``: the final normed hidden state, the output head's input, always.
    ``mtp_hidden [depth, batch, seq, embed]`` (``with_mtp``): each MTP depth's normed hidden state, the head's
    input for ``mtp_logits``. With ``with_logits=False`` ``logits`` and ``mtp_logits`` are None (not computed):
    a trainer applies ``model.output_head()`` to these in chunks (``nnx_zoo.train.loss``). ``indexer_loss``
    (scalar): a sparse-attention indexer's own loss (DeepSeek-V3.2's KL), weighted, a mean over the sequences
    holding a real token like ``aux_loss``; its gradient reaches the indexer alone; computed when the config
    trains the indexer. ``loss_sum`` (scalar, with ``loss_targets``): the masked token cross-entropy summed, which a
    pipeline schedule that runs the head and loss on its last stage (1F1B) computes inside the model (with MTP
    heads or a balance loss, given ``loss_scale``: its gradient is the whole loss's, the MTP and aux terms
    weighted as the trainer weighs them). ``mtp_loss_sums [depth]`` (there, with ``with_mtp``): each MTP depth's
    summed cross-entropy, a value without gradient (``loss_sum`` carries it).

    >>> out = model.forward(ids, mask, with_hidden_states=True)
    >>> out.logits.shape, out.hidden_states.shape, out.mtp_logits
    ((2, 16, 256), (3, 2, 16, 128), None)
    >>> model.forward(ids, mask, with_logits=False).final_hidden.shape
    (2, 16, 128)
    """

    logits: jax.Array | None
    hidden_states: jax.Array | None = None
    mtp_logits: jax.Array | None = None
    expert_indices: jax.Array | None = None
    expert_load: jax.Array | None = None
    dropped_tokens: jax.Array | None = None
    aux_loss: jax.Array | None = None
    final_hidden: jax.Array | None = None
    mtp_hidden: jax.Array | None = None
    indexer_loss: jax.Array | None = None
    loss_sum: jax.Array | None = None
    mtp_loss_sums: jax.Array | None = None


def _subclasses(cls: type) -> list[type]:
    """``cls``'s subclasses that have a config class, each before its own subclasses."""
    out = []
    for sub in cls.__subclasses__():
        out += ([sub] if "config_class" in vars(sub) else []) + _subclasses(sub)
    return out


class CausalLMBase(nnx.Module):
    """What every family's causal LM shares: ``create``, ``__call__`` (logits), generation over a cache.

    A family subclass sets ``config_class`` and ``lora_targets`` and defines ``forward`` (-> ``CausalLMOutput``),
    ``init_cache`` and ``_extend`` (new tokens through the layers into the cache), plus ``from_pretrained`` /
    ``save_pretrained``; it keeps its ``embed`` (an ``Embed``), ``norm``, ``lm_head`` (None when tied), ``rules``,
    ``rope_inv_freq`` and ``rope_attention_factor``.

    >>> model = Qwen3.create(Qwen3Config.preset("qwen3-tiny"), seed=0)
    >>> logits = model(ids)                                     # [batch, seq, vocab], every family, always
    >>> out = model.forward(ids, with_hidden_states=True)       # a CausalLMOutput
    """

    config_class: ClassVar[type]
    # Regex over '/'-joined module paths: the projections ``apply_lora(model)`` adapts when given no pattern.
    lora_targets: ClassVar[str]
    config: Any
    rules: Rules
    # True: activations fall back like weights placed with allow_partial (Explicit meshes; ``use_rules``); None:
    # the enclosing ``use_rules`` block decides (strict outside one, e.g. the trainer's TrainConfig.allow_partial).
    allow_partial: bool | None = None
    embed: Embed
    lm_head: Linear | None
    rope_inv_freq: tuple[float, ...]
    rope_attention_factor: float

    @classmethod
    def config_from_hf(cls, directory: Path, overrides: dict[str, Any]) -> Any:
        """This family's config of checkpoint ``directory``; a ``config.json`` another loaded family reads raises
        ``CheckpointFormatError`` naming that family's class."""
        try:
            return cls.config_class.from_hf(directory, **overrides)
        except CheckpointFormatError as err:
            try:
                model_type = read_json_object(config_json_path(directory), "model config").get("model_type")
            except CheckpointFormatError:
                raise err from None
            if model_type in cls.config_class.hf_model_types():
                raise
            readers = [c for c in _subclasses(CausalLMBase) if model_type in c.config_class.hf_model_types()]
            if not readers:
                raise
            name = readers[0].__name__
            raise CheckpointFormatError(f"{err}. It is a {name} checkpoint: load it with {name}.from_pretrained "
                                        "(or nnx_zoo.AutoModelForCausalLM.from_pretrained)") from err

    @classmethod
    def create(cls: type[M], config: Any, *, mesh: Mesh | None = None, rules: Rules | str = "default",
               seed: int = 0, allow_partial: bool = False) -> M:
        """A randomly initialized model; with ``mesh``, every parameter is born on its resolved sharding.

        ``allow_partial=True``: a dimension that does not divide over its rule's mesh axes goes on the longest
        dividing prefix of them (``create_sharded``), and so do the model's activations under Explicit meshes.
        """
        cls._check_pipelinable(config, mesh)

        def make() -> M:
            return cls(config, rngs=nnx.Rngs(seed), rules=rules, allow_partial=allow_partial or None)

        return make() if mesh is None else create_sharded(make, mesh, rules, allow_partial=allow_partial)

    @classmethod
    def pipeline_problem(cls, config: Any) -> str | None:
        """Why a model of ``config`` cannot run pipelined over a ``stage`` mesh axis (a sentence saying what to do
        instead), or None when it can (as far as its layer kinds go; the stage count is checked where it is known).
        The recipe asks before it builds anything; ``create`` and ``from_pretrained`` on a mesh with stages too.
        Here: a forward without the pipeline keywords."""
        del config
        if "pipeline_microbatches" not in inspect.signature(cls.forward).parameters:
            return (f"{cls.__name__} does not run pipelined yet (its forward takes no pipeline_microbatches); "
                    f"use a mesh without '{STAGE_AXIS}'")
        return None

    @classmethod
    def _check_pipelinable(cls, config: Any, mesh: Mesh | None) -> None:
        """On a mesh with a ``stage`` axis of size > 1: ``pipeline_problem`` as an error, then the config's
        ``check_pipeline(stages)`` (its layer sequence splits into the stages' identical chunks, or an error naming
        the ``pipeline_layers`` that fit), before the resolver refuses a stack that does not divide with less to
        go on."""
        stages = 1 if mesh is None else dict(mesh.shape).get(STAGE_AXIS, 1)
        if stages <= 1:
            return
        problem = cls.pipeline_problem(config)
        if problem is not None:
            raise ValueError(problem)
        check = getattr(config, "check_pipeline", None)
        if check is not None:
            check(stages)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                 segment_ids: jax.Array | None = None, position_ids: jax.Array | None = None) -> jax.Array:
        """Logits ``[batch, seq, vocab]`` for ``input_ids [batch, seq]``, always (``forward`` gives the rest).

        ``attention_mask [batch, seq]`` (1 = token, 0 = padding) may mark left padding: padding is never attended
        to. Positions are ``0..seq-1`` whatever the padding, as in HF's forward, unless ``position_ids [batch,
        seq]`` are given. ``segment_ids [batch, seq]`` (packed training data) keep attention inside each document.
        """
        return self.forward(input_ids, attention_mask, segment_ids=segment_ids, position_ids=position_ids).logits

    def forward(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                segment_ids: jax.Array | None = None, position_ids: jax.Array | None = None,
                with_hidden_states: bool = False, with_mtp: bool = False, with_expert_load: bool = False,
                with_routing: bool = False, with_logits: bool = True) -> CausalLMOutput:
        """The forward pass with the outputs asked for, as one ``CausalLMOutput`` (see there for each field).
        ``with_logits=False``: no output head (``logits``, ``mtp_logits`` None); ``final_hidden`` (and
        ``mtp_hidden``) are its inputs, for ``output_head()``."""
        raise NotImplementedError(f"{type(self).__name__} must define forward")

    def trainable(self) -> nnx.filterlib.Filter:
        """Which Variables a trainer updates (the optimizer's ``wrt``; ``nnx_zoo.train`` asks for it): every
        ``nnx.Param`` here. A family narrows it for a stage that trains part of the model with the rest frozen
        (DeepSeek-V3.2's indexer warm-up: only the indexer). Buffers that are not ``nnx.Param`` (a router's
        balancing bias) are never in it.

        >>> optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=model.trainable())
        >>> frozen = nnx.state(model, nnx.All(nnx.Param, nnx.Not(model.trainable())))  # what stays as it is
        """
        return nnx.Param

    @contextlib.contextmanager
    def sharding_scope(self) -> Iterator[None]:
        """The model's rules (and, with no ambient mesh, its parameters' mesh) in force, as inside ``forward``:
        for code that lays out the model's activations outside ``forward`` (the trainer's chunked loss).

        >>> with model.sharding_scope():
        ...     spec = resolve_activation(("activation_batch", "activation_length"), (8, 128))
        """
        with use_rules(self.rules, allow_partial=self.allow_partial), self._parameter_mesh():
            yield

    def output_head(self) -> Callable[[jax.Array], jax.Array]:
        """The output head as a function ``hidden [..., batch, seq, embed] -> logits [..., batch, seq, vocab]``
        (``forward``'s ``final_hidden`` / ``mtp_hidden`` in, its ``logits`` / ``mtp_logits`` out), the weight
        gathered over its FSDP axes once here: call ``output_head()`` once per step and apply the function to as
        many token chunks as you like (one gather, and under Explicit meshes one gradient reduction, for all).

        >>> out = model.forward(ids, with_logits=False)
        >>> head = model.output_head()
        >>> logits = head(out.final_hidden[:, :64])   # the first 64 positions' logits
        """
        with self.sharding_scope():
            # Tied: the embedding table (``Embed.attend``); gathered like the untied head (see ``_logits``).
            head = gathered_over_fsdp(self.embed if self.lm_head is None else self.lm_head)

        def apply(hidden: jax.Array) -> jax.Array:
            with self.sharding_scope():
                return self._logits(hidden, head=head)

        return apply

    def _rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rope_cos_sin(positions, jnp.asarray(self.rope_inv_freq, jnp.float32), self.rope_attention_factor)

    def _layer_rope(self, kind: Any, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The rope tables of a layer of ``kind`` (one for every kind here; a family whose local and global
        layers rope differently answers per kind)."""
        del kind
        return self._rope(positions)

    def _logits(self, hidden: jax.Array, head: Embed | Linear | None = None) -> jax.Array:
        """The output head's logits for ``hidden [..., batch, seq, embed]`` (leading dims, e.g. the main model and
        its MTP depths stacked, share one head matmul). ``head``: the head module already gathered
        (``output_head``); by default ``lm_head`` gathered here, or the embedding table when tied."""
        if head is None and self.lm_head is None:
            return self.embed.attend(hidden)
        if isinstance(head, Embed):
            return head.attend(hidden)
        # Gathered over its FSDP axes once and, under Explicit meshes, typed reduced over the token axes: its
        # gradient is reduced over all of them in one step (a reduce-scatter over the gathered axes). Reduced by
        # the dot, it was all-reduced whole over the axes it is not stored on first (ep-as-cp: the sequence's).
        head = gathered_over_fsdp(self.lm_head) if head is None else head
        return head(hidden, (None,) * (hidden.ndim - 3) + _BLV)

    def _outside_pipeline_rules(self, batch: int) -> Rules:
        """The rules of layers that run outside the pipeline (a dense prefix before it, MTP heads after it) on a
        batch of ``batch`` rows, under the model's rules and mesh: ``outside_pipeline(rules)`` (the batch split over
        ``stage`` too, each stage its share) where the batch splits over ``stage``, else the model's rules (that
        batch stays whole over it, as the embedding's)."""
        placed = resolve_activation(("activation_embed_and_logits_batch",), (batch,))[0]
        return outside_pipeline(self.rules) if STAGE_AXIS in axes_tuple(placed) else self.rules

    def _parameter_mesh(self) -> contextlib.AbstractContextManager[Any]:
        """With no ambient mesh, the mesh the parameters live on (so ``model(ids)`` works without
        ``jax.set_mesh``); otherwise nothing."""
        return parameter_mesh(self.embed.embedding[...])

    # ---- generation: a fixed-size cache, driven by nnx_zoo.generate ----
    def generate(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, **kwargs: Any) -> Any:
        """``nnx_zoo.generate(self, input_ids, attention_mask, **kwargs)``: sampled or greedy continuations."""
        return generate(self, input_ids, attention_mask, **kwargs)

    def init_cache(self, batch: int, max_len: int) -> Any:
        """An empty decoding cache for ``batch`` rows of up to ``max_len`` tokens (prompt and generated)."""
        raise NotImplementedError(f"{type(self).__name__} must define init_cache")

    def prefill(self, input_ids: jax.Array, attention_mask: jax.Array | None, cache: C) -> tuple[jax.Array, C]:
        """Run a (left-padded) prompt ``[batch, t]`` into ``cache``: ``(logits [batch, t, vocab], cache)``.
        Token ``i`` of a row sits at rope position ``cumsum(attention_mask)[i] - 1``; padding is never attended
        to. Logits come whole along the vocabulary (ready for sampling)."""
        if input_ids.shape[1] > cache.max_len:
            raise ValueError(f"a prompt of {input_ids.shape[1]} tokens does not fit a cache of {cache.max_len} "
                             "slots; create the cache with max_len >= prompt length + tokens to generate")
        token_mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask
        with use_rules(self._decoding_rules(), allow_partial=self.allow_partial), self._parameter_mesh():
            return self._extend(input_ids, token_mask, cache)

    def decode_step(self, tokens: jax.Array, cache: C) -> tuple[jax.Array, C]:
        """One new token per row ``tokens [batch]`` into the next cache slot: ``(logits [batch, vocab], cache)``.
        The cache must have a free slot (``cache.length < cache.max_len``; a full cache overwrites its last)."""
        with use_rules(self._decoding_rules(), allow_partial=self.allow_partial), self._parameter_mesh():
            logits, cache = self._extend(tokens[:, None], jnp.ones((tokens.shape[0], 1), bool), cache)
        return logits[:, 0], cache

    def _decoding_rules(self) -> Rules:
        """The model's rules with the new tokens' sequence dim unsplit (one decoded token cannot be divided over
        context-parallel devices; the first rule for a name wins, so this one overrides)."""
        return (("activation_length", None), *self.rules)

    def _extend(self, input_ids: jax.Array, token_mask: jax.Array, cache: C) -> tuple[jax.Array, C]:
        """Write ``t`` new tokens per row into the next ``t`` cache slots, attending to everything cached:
        ``(logits [batch, t, vocab] whole along the vocabulary, cache)``."""
        raise NotImplementedError(f"{type(self).__name__} must define _extend")


class CausalLM(CausalLMBase):
    """A dense decoder-only language model; families subclass it (``Llama3``, ``Qwen3``).

    >>> model = Llama3(Llama3Config.preset("llama3-tiny"), rngs=nnx.Rngs(0))   # or Llama3.create(config, mesh=)
    >>> logits = model(jnp.zeros((2, 16), jnp.int32))                         # [2, 16, vocab]
    >>> model = Qwen3.from_pretrained("/path/to/hf_checkpoint", mesh=mesh)
    >>> model.save_pretrained("/tmp/out")                                     # loadable by transformers

    Parameters: ``embed.embedding [vocab, embed]``, ``layers.*`` (every Variable stacked on a leading ``layers``
    dim), ``norm.scale``, ``lm_head.kernel [embed, vocab]`` (None when ``tie_word_embeddings``). ``rules`` (a
    rule-set name or tuple) is stored on the model and used by every ``shard`` inside ``__call__``.
    """

    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig
    # Attention's q/k/v/o and the SwiGLU's gate/up/down in every layer (the usual LoRA targets of Llama and Qwen).
    lora_targets: ClassVar[str] = r"(^|/)attn/(q|k|v|o)_proj$|(^|/)mlp/(gate|up|down)$"
    # The family's HF key table: config -> KeyTable (a staticmethod in each family).
    key_table: ClassVar[Callable[[Any], KeyTable]]

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, rules: Rules | str = "default",
                 allow_partial: bool | None = None):
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got "
                            f"{type(config).__name__}; use nnx_zoo.AutoModelForCausalLM.create(config) to pick the "
                            "class from the config")
        c = self.config = config
        self.rules = get_rules(rules)
        self.allow_partial = allow_partial
        init = nnx.initializers.normal(c.initializer_range)
        self.embed = Embed(c.vocab_size, c.hidden_size, embedding_init=init, rngs=rngs, **_dtypes(c))
        self._init_layers(c, rngs)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, **_dtypes(c))
        self.lm_head = None if c.tie_word_embeddings else Linear(
            c.hidden_size, c.vocab_size, kernel_names=("embed", "vocab"), kernel_init=init, rngs=rngs, **_dtypes(c))
        inv_freq, self.rope_attention_factor = rope_frequencies(c.rotary_dim, c.rope_theta, c.rope_scaling)
        self.rope_inv_freq = tuple(float(f) for f in inv_freq)  # static and hashable: part of the graph definition

    def _init_layers(self, c: DecoderConfig, rngs: nnx.Rngs) -> None:
        """One scanned stack per layer kind, named by ``config.layer_stacks()`` (a plain dense model: ``layers``);
        the stacks of the layers before ``pipeline_layers`` on ``unpipelined_layers`` (whole on every stage)."""
        for name, kind, indices in c.layer_stacks():
            layer_class = self.layer_class(kind)
            axis = UNPIPELINED_STACK if indices[0] < c.unpipelined_layers else STACK_AXIS
            setattr(self, name, create_stack(lambda r, cls=layer_class, kind=kind: cls(c, kind=kind, rngs=r),
                                             len(indices), rngs, axis))

    def layer_class(self, kind: Any) -> type[nnx.Module]:
        """The module of a layer of ``kind``, built as ``cls(config, kind=kind, rngs=rngs)``."""
        del kind
        return DecoderLayer

    def layer_stacks(self) -> dict[str, nnx.Module]:
        """Stack name -> the stacked layers of that kind."""
        return {name: getattr(self, name) for name, _, _ in self.config.layer_stacks()}

    def layer_segments(self) -> list[Segment]:
        """The layers in model order as scan segments (``nnx_zoo.layers.scan.segments``)."""
        return segments(self.config.layer_stack_names(), self.layer_stacks())

    def _kinds_by_stack(self) -> dict[str, Any]:
        return {name: kind for name, kind, _ in self.config.layer_stacks()}

    # ---- checkpoints ----
    @classmethod
    def from_pretrained(cls: type[M], path: str | Path, *, mesh: Mesh | None = None,
                        rules: Rules | str | None = None, dtype: Any = None, allow_partial: bool = False,
                        **config_overrides: Any) -> M:
        """Load an HF checkpoint directory of this family (``config.json`` + safetensors), each tensor read onto
        its shards of ``mesh``. ``dtype`` sets the parameter and compute dtype (default: the config's, float32);
        ``config_overrides`` set any config field (``scan_layers=False``, ...). ``allow_partial`` as in ``create``.

        A ``config.json`` of another ``model_type`` raises ``nnx_zoo.hf.CheckpointFormatError`` naming the class
        that reads it; files that do not fit the model (an untied model without ``lm_head.weight``, a missing
        layer, a wrong shape) raise ``nnx_zoo.hf.CheckpointMismatchError`` listing every problem.
        """
        directory = Path(path)
        overrides = pretrained_overrides(dtype, config_overrides)
        rules = get_rules(rules if rules is not None else "default")
        config = cls.config_from_hf(directory, overrides)
        cls._check_pipelinable(config, mesh)
        with SafetensorsCheckpoint(directory) as ckpt:
            abstract = abstract_module(lambda: cls(config, rngs=nnx.Rngs(0), rules=rules,
                                                   allow_partial=allow_partial or None))
            return load_module(ckpt, cls.key_table(config), abstract, mesh=mesh, rules=rules,
                               allow_partial=allow_partial)

    def save_pretrained(self, path: str | Path, *, max_shard_bytes: int = 4 * 2**30) -> None:
        """Write an HF checkpoint (``config.json``, safetensors shards of at most ``max_shard_bytes`` and their
        index) that transformers' ``from_pretrained`` loads."""
        save_module(self, path, self.key_table(self.config), self.config.to_hf_dict(),
                    max_shard_bytes=max_shard_bytes)

    # ---- the forward pass ----
    def forward(self, input_ids: jax.Array, attention_mask: jax.Array | None = None, *,
                segment_ids: jax.Array | None = None, position_ids: jax.Array | None = None,
                with_hidden_states: bool = False, with_mtp: bool = False, with_expert_load: bool = False,
                with_routing: bool = False, with_logits: bool = True, pipeline_microbatches: int = 1,
                pipeline_schedule: str = "gpipe", pipeline_virtual_stages: int | None = None,
                loss_targets: tuple[jax.Array, jax.Array] | None = None) -> CausalLMOutput:
        """``CausalLMOutput`` for ``input_ids [batch, seq]`` (inputs as in ``__call__``): ``logits`` (None with
        ``with_logits=False``), ``final_hidden``, and ``hidden_states`` with ``with_hidden_states``. A dense model
        has no experts (``expert_load``, ``dropped_tokens``, ``expert_indices`` stay None) and no aux loss;
        ``with_mtp`` is an error (no MTP heads).

        On a mesh with a ``stage`` axis the layers run pipelined (``nnx_zoo.layers.pipeline.pipeline_stack``):
        ``pipeline_microbatches`` micro-batches through the stages in ``pipeline_schedule`` order
        (``nnx_zoo.layers.pipeline.SCHEDULES``). GPipe: the embedding, the final norm and the head run outside the
        pipeline on each stage's share of the batch (``activation_embed_and_logits_batch``: the batch split over
        ``stage`` too), the pipeline's input gathered whole over ``stage`` and its output split again. The
        schedules that run the loss inside (``1f1b``, and ``interleaved`` with ``pipeline_virtual_stages`` chunks
        per stage, default 2; the embedding split over ``stage`` as GPipe's) need ``loss_targets=(targets, loss_mask)``
        (``[batch, seq]`` each): the final norm, head and cross-entropy run on the last stage, each micro-batch's
        backward right after its forward, and the output carries only ``loss_sum`` (its gradient computed in the
        same program). Without a ``stage`` axis these are ignored. With ``config.pipeline_layers`` only the last
        layers are pipelined; the ones before run ahead of the pipeline (``_unpipelined_prefix``), on each stage's
        share of the batch.
        """
        check_forward_inputs(input_ids, attention_mask, segment_ids, position_ids, config=self.config)
        if with_mtp:
            raise ValueError(f"with_mtp=True but {type(self).__name__} has no MTP heads (multi-token prediction)")
        c = self.config
        with use_rules(self.rules, allow_partial=self.allow_partial), self._parameter_mesh():
            seq_len = input_ids.shape[1]
            positions = jnp.arange(seq_len)[None, :] if position_ids is None else position_ids
            kinds = self._kinds_by_stack()
            ropes = {name: self._layer_rope(kind, positions) for name, kind in kinds.items()}
            mask = causal_mask(seq_len, attention_mask, segment_ids)

            def segment_body(pattern: tuple[str, ...]) -> Any:
                def body(group: nnx.List, h: jax.Array, _: Any) -> tuple[jax.Array, list[jax.Array | None]]:
                    outputs = []
                    for name, layer in zip(pattern, group):
                        h = layer(h, *ropes[name], mask)
                        outputs.append(h if with_hidden_states else None)
                    return h, outputs
                return body

            embeddings = h = self.embed(input_ids)
            layer_outputs = []
            aux: dict[str, Any] = {}  # pipelined: the layers' stats as output fields (_pipeline_outputs)
            if stage_count() > 1:  # pipelined over the mesh's stage axis
                if with_hidden_states or with_routing:
                    raise ValueError("with_hidden_states / with_routing are not supported on a mesh with a 'stage' "
                                     "axis (the pipeline hands on only the last layer's output and per-layer sums); "
                                     "run it without 'stage'")
                schedule = resolve_schedule(pipeline_schedule, pipeline_virtual_stages)
                c.check_pipeline(stage_count(), schedule.virtual_stages)  # says which pipeline_layers fit
                # config.pipeline_layers: the layers before the pipeline, outside it; their stats join its own.
                h, prefix_stats = self._unpipelined_prefix(h, ropes, mask, with_expert_load)
                if schedule.loss_inside:
                    if loss_targets is None:
                        raise ValueError(f"pipeline_schedule={pipeline_schedule!r} runs the loss on the last stage: "
                                         "pass loss_targets=(targets, loss_mask), or use pipeline_schedule='gpipe'")
                    # The pipeline's input whole over stage (each stage holds the micro-batches it may take).
                    loss, stats = self._one_f_one_b_loss(shard(h, _BLE), ropes, mask, loss_targets,
                                                         pipeline_microbatches, schedule.virtual_stages,
                                                         with_expert_load)
                    return CausalLMOutput(logits=None, loss_sum=loss,
                                          **self._pipeline_outputs({**prefix_stats, **stats}))
                # In whole over stage (the embedding's rows gathered), out split over it again: the final norm
                # and the head run on each stage's share of the batch.
                h, stats = self._pipelined_layers(shard(h, _BLE), ropes, mask, pipeline_microbatches,
                                                  pipeline_schedule, with_expert_load)
                aux = self._pipeline_outputs({**prefix_stats, **stats})
                h = shard(h, _OUT_BLE)
            for segment in self.layer_segments() if stage_count() == 1 else ():
                h, outputs = run_stack(segment.group, segment_body(segment.pattern), h, scan=c.scan_layers,
                                       remat_policy=c.remat_policy)
                layer_outputs.append(model_order(outputs))
            final_hidden = self.norm(h)
            hidden_states = (stack_hidden_states(embeddings, jnp.concatenate(layer_outputs), final_hidden)
                             if with_hidden_states else None)
            return CausalLMOutput(logits=self._logits(final_hidden) if with_logits else None,
                                  hidden_states=hidden_states, final_hidden=final_hidden, **aux)

    # ---- pipeline parallelism over the mesh's 'stage' axis: one walk for dense and MoE layers ----
    def _pipeline_layer(self, layer: nnx.Module, h: jax.Array, cos: jax.Array, sin: jax.Array,
                        mask: AttentionMask, *, with_expert_load: bool) -> tuple[jax.Array, dict[str, Any]]:
        """One layer inside a pipeline (any schedule): its output and its stats, each a sum over the micro-batch's
        rows that the pipeline adds up over the micro-batches (``MoECausalLM``: expert load, balance sums). A dense
        layer has none."""
        del with_expert_load
        return layer(h, cos, sin, mask), {}

    def _pipeline_outputs(self, stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """``CausalLMOutput`` fields made of the pipelined layers' stats (``stats[name]``: stack ``name``'s
        ``_pipeline_layer`` stats, each leaf ``[its layers, ...]`` in model order, summed over the micro-batches):
        none here."""
        del stats
        return {}

    def _pipeline_parts(self, with_expert_load: bool = False
                        ) -> tuple[dict[str, nnx.Module], tuple[str, ...], Callable[..., Any]]:
        """What the pipeline runs: the pipelined layer stacks by name (all but those of the ``pipeline_layers``
        prefix), the stack name of each of their layers in model order (the pipeline splits that sequence into
        identical chunks, one per stage and virtual stage, or says which chunk counts fit), and ``layer_fn(name,
        layer, h, ropes, mask) -> (h, stats)``, one layer of stack ``name`` (``_pipeline_layer``)."""
        c = self.config
        names = c.layer_stack_names()[c.unpipelined_layers:]

        def layer_fn(name: str, layer: nnx.Module, h: jax.Array, ropes: dict[str, Any], mask: AttentionMask
                     ) -> tuple[jax.Array, dict[str, Any]]:
            return self._pipeline_layer(layer, h, *ropes[name], mask, with_expert_load=with_expert_load)

        return {name: self.layer_stacks()[name] for name in dict.fromkeys(names)}, names, layer_fn

    def _unpipelined_prefix(self, h: jax.Array, ropes: dict[str, Any], mask: AttentionMask,
                            with_expert_load: bool = False) -> tuple[jax.Array, dict[str, Any]]:
        """The layers before the pipeline (``config.pipeline_layers``: the first ``unpipelined_layers``) on ``h``,
        outside it: their weights whole on every stage, their batch split over ``stage`` where it divides
        (``outside_pipeline``: each stage computes its share, as the embedding does). Returns ``(h, stats)``, their
        ``_pipeline_layer`` stats by stack (in model order), to join the pipelined layers' (``_pipeline_outputs``)."""
        c = self.config
        split = c.unpipelined_layers
        if not split:
            return h, {}
        names = c.layer_stack_names()[:split]
        stacks = self.layer_stacks()
        placed = resolve_activation(("activation_embed_and_logits_batch",), h.shape[:1])[0]
        rules = outside_pipeline(self.rules) if STAGE_AXIS in axes_tuple(placed) else self.rules

        def layer_fn(name: str, layer: nnx.Module, h: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
            return self._pipeline_layer(layer, h, *ropes[name], mask, with_expert_load=with_expert_load)

        with use_rules(rules, allow_partial=self.allow_partial):
            return run_unpipelined({name: stacks[name] for name in dict.fromkeys(names)}, layer_fn, h,
                                   layer_stacks=names, scan=c.scan_layers, remat_policy=c.remat_policy)

    def _pipeline_hidden(self, carry: jax.Array) -> jax.Array:
        """The hidden state in what the pipeline hands from layer to layer (``_pipeline_parts``' ``h``): all of it
        here; a family that carries per-layer inputs beside it (Gemma 4) takes its part."""
        return carry

    def _pipelined_layers(self, h: jax.Array, ropes: dict[str, Any], mask: AttentionMask, microbatches: int,
                          schedule: str, with_expert_load: bool = False) -> tuple[jax.Array, dict[str, Any]]:
        """Every layer on ``h``, pipelined over the ``stage`` axis (``pipeline_stack``): stage ``s`` runs the
        ``s``-th of ``S`` identical chunks of the layer sequence, its own block of every stack, as that chunk's scan
        segments (Llama's one stack: one segment; Gemma 3's five sliding layers and a global one: two). Returns
        ``(h, stats)``: the layers' ``_pipeline_layer`` stats by stack, summed over the micro-batches."""
        stacks, layer_stacks, layer_fn = self._pipeline_parts(with_expert_load)
        return pipeline_stack(stacks, layer_fn, h, ropes, mask, microbatches=microbatches, schedule=schedule,
                              scan=self.config.scan_layers, remat_policy=self.config.remat_policy,
                              layer_stacks=layer_stacks, with_aux=True)

    def _one_f_one_b_loss(self, h: jax.Array, ropes: dict[str, Any], mask: AttentionMask,
                          loss_targets: tuple[jax.Array, jax.Array], microbatches: int,
                          virtual_stages: int = 1, with_expert_load: bool = False
                          ) -> tuple[jax.Array, dict[str, Any]]:
        """The summed masked cross-entropy of the layers, final norm and head on ``h``, in 1F1B order (interleaved
        with ``virtual_stages`` > 1; ``pipeline_1f1b_value_and_grad``, the layers split into chunks as in
        ``_pipelined_layers``), as a function autodiff can differentiate: its gradients (layers, norm and head,
        ``h``) come from the same program, so the trainer's ``value_and_grad`` works unchanged. Returns ``(loss,
        stats)``, the layers' stats as ``_pipelined_layers``' (values without gradient: no loss term reads them)."""
        stacks, layer_stacks, stats_fn = self._pipeline_parts(with_expert_load)
        head_module = nnx.List([self.norm, self.embed if self.lm_head is None else self.lm_head])
        head_graph, head_state = nnx.split(head_module)
        stack_graphs = {name: nnx.graphdef(stack) for name, stack in stacks.items()}
        stack_state = {name: nnx.state(stack) for name, stack in stacks.items()}

        def layer_fn(*args: Any) -> tuple[jax.Array, Any]:
            h, stats = stats_fn(*args)
            return h, (jnp.zeros((), jnp.float32), stats)  # no loss term of the layers' own

        def head_fn(head_state: Any, h: jax.Array, targets_and_mask: tuple[jax.Array, jax.Array]) -> Any:
            norm, head = nnx.merge(head_graph, head_state)
            logits = self._logits(norm(self._pipeline_hidden(h)), head=head).astype(jnp.float32)
            targets, loss_mask = targets_and_mask
            vocab_ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
            target_logit = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
            per_token = jax.nn.logsumexp(logits, axis=-1) - target_logit
            return jnp.sum(per_token * loss_mask.astype(jnp.float32)), None

        def run(stack_state: Any, head_state: Any, h: jax.Array) -> tuple[Any, Any]:
            loss, d_stack, d_head, d_h, stats, _ = pipeline_1f1b_value_and_grad(
                {name: nnx.merge(stack_graphs[name], state) for name, state in stack_state.items()}, layer_fn,
                head_fn, head_state, h, loss_targets, ropes, mask, microbatches=microbatches,
                virtual_stages=virtual_stages, layer_stacks=layer_stacks, with_aux=True)
            return (loss, stats), (d_stack, d_head, d_h)

        @jax.custom_vjp
        def loss_of(stack_state: Any, head_state: Any, h: jax.Array) -> Any:
            return run(stack_state, head_state, h)[0]

        def backward(grads: Any, g: Any) -> Any:
            return jax.tree.map(lambda d: (g[0] * d).astype(d.dtype), grads)  # only the loss is differentiated

        loss_of.defvjp(run, backward)
        loss, stats = loss_of(stack_state, head_state, h)
        return loss, jax.lax.stop_gradient(stats)

    # ---- generation: a fixed-size cache, rings for local layers ----
    def init_cache(self, batch: int, max_len: int) -> StackedKVCache:
        """An empty decoding cache for ``batch`` rows of up to ``max_len`` tokens (prompt and generated): per
        stack, ``max_len`` slots for full attention, a ring of its span for a window or chunk layer."""
        c = self.config
        stacks = {}
        for name, kind, indices in c.layer_stacks():
            options = c.attention_options(kind)
            kv_heads, head_dim = self._cache_dims(kind)
            stacks[name] = (len(indices), ring_slots(max_len, options.get("window"), options.get("chunk")), kv_heads,
                            head_dim)
        with use_rules(self._decoding_rules(), allow_partial=self.allow_partial), self._parameter_mesh():
            return StackedKVCache.zeros(stacks, batch=batch, max_len=max_len, dtype=jnp.dtype(c.dtype))

    def _cache_dims(self, kind: Any) -> tuple[int, int]:
        """``(kv heads, head dim)`` a layer of ``kind`` caches."""
        del kind
        return self.config.num_key_value_heads, self.config.head_dim

    def _extend(self, input_ids: jax.Array, token_mask: jax.Array, cache: StackedKVCache
                ) -> tuple[jax.Array, StackedKVCache]:
        """Write ``t`` new tokens per row into the next ``t`` cache slots, attending to everything cached."""
        start = cache.length
        positions, mask, cache = cache.advance(token_mask)
        ropes = {name: self._layer_rope(kind, positions) for name, kind in self._kinds_by_stack().items()}

        def segment_body(segment: Segment) -> Any:
            def body(group: nnx.List, carry: Any, repeat: jax.Array) -> tuple[Any, None]:
                h, k, v = carry  # per stack [layers, batch, slots, kv_heads, head_dim], one layer updated at a time
                for name, layer, first, stride in zip(segment.pattern, group, segment.starts, segment.strides):
                    index = first + stride * repeat
                    h, k_layer, v_layer = layer.decode(
                        h, *ropes[name], jax.lax.dynamic_index_in_dim(k[name], index, keepdims=False),
                        jax.lax.dynamic_index_in_dim(v[name], index, keepdims=False), start, mask)
                    k = {**k, name: jax.lax.dynamic_update_index_in_dim(k[name], k_layer, index, 0)}
                    v = {**v, name: jax.lax.dynamic_update_index_in_dim(v[name], v_layer, index, 0)}
                return (h, k, v), None
            return body

        carry = (self.embed(input_ids), cache.k, cache.v)
        for segment in self.layer_segments():
            carry, _ = run_stack(segment.group, segment_body(segment), carry, jnp.arange(segment.repeats),
                                 scan=self.config.scan_layers)
        h, k, v = carry
        logits = shard(self._logits(self.norm(h)), ("activation_batch", "activation_length", None))
        return logits, cache._replace(k=k, v=v)


def shifted_by_depth(input_ids: jax.Array, attention_mask: jax.Array | None,
                      depth: int) -> tuple[jax.Array, jax.Array | None]:
    """``input_ids`` and its copies shifted left by ``1 .. depth`` (the MTP depths' tokens, padded with 0 at the
    end), stacked: ``[1 + depth, batch, seq]``; the attention mask likewise (None stays None). The inputs of the
    multi-token-prediction depths of any family.

    >>> ids, masks = shifted_by_depth(jnp.array([[5, 6, 7]]), None, 1)
    >>> ids.tolist(), masks
    ([[[5, 6, 7]], [[6, 7, 0]]], None)
    """
    if depth == 0:
        return input_ids[None], None if attention_mask is None else attention_mask[None]
    # Shifting slices the sequence dim, which cannot stay split over devices (context parallelism under an
    # Explicit mesh): the shifts are taken from copies whole along it.
    whole_sequence = ("activation_batch", None)
    seq_len = input_ids.shape[1]

    def shifted(a: jax.Array) -> jax.Array:
        a = shard(a, whole_sequence)
        return jnp.stack([a] + [jnp.pad(a[:, k:], ((0, 0), (0, min(k, seq_len)))) for k in range(1, depth + 1)])

    return shifted(input_ids), None if attention_mask is None else shifted(attention_mask)


def stack_hidden_states(embeddings: jax.Array, layer_outputs: jax.Array, final_hidden: jax.Array) -> jax.Array:
    """``[layers + 1, batch, seq, embed]`` as HF's ``output_hidden_states``: the embeddings, the outputs of all
    layers but the last (``layer_outputs [layers, batch, seq, embed]``), then the final normed hidden state."""
    return jnp.concatenate([embeddings[None], layer_outputs[:-1], final_hidden[None]], axis=0)


def pretrained_overrides(dtype: Any, config_overrides: dict[str, Any]) -> dict[str, Any]:
    """The config overrides of ``from_pretrained(..., dtype=, **config_overrides)``: ``dtype`` sets both the
    compute and the parameter dtype unless an override names them itself."""
    overrides = dict(config_overrides)
    if dtype is not None:
        overrides.setdefault("dtype", dtype)
        overrides.setdefault("param_dtype", dtype)
    return overrides


def parameter_mesh(parameter: jax.Array) -> contextlib.AbstractContextManager[Any]:
    """``jax.set_mesh`` of the mesh ``parameter`` lives on when no mesh is ambient and it spans devices (so a
    sharded model can be called without a mesh context); otherwise a context that does nothing."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    sharding = (jax.typeof(parameter).sharding if isinstance(parameter, jax.core.Tracer)
                else getattr(parameter, "sharding", None))
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size == 1:
        return contextlib.nullcontext()
    if isinstance(mesh, Mesh):
        return jax.set_mesh(mesh)
    return jax.sharding.use_abstract_mesh(mesh)  # while tracing: parameters carry an abstract mesh
