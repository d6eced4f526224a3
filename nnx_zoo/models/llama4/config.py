"""Llama4Config: Llama 4's text model (HF ``model_type`` ``llama4_text``, and the ``text_config`` of a multimodal
``llama4`` checkpoint), named as in ``config.json``, plus presets.

The class defaults are Llama 4 Scout's text model. Shared fields, validation and HF mapping live in
``nnx_zoo.models.moe_decoder_config``; what is Llama 4's own, as transformers' ``Llama4TextConfig`` resolves it:

- Rope layers and NoPE layers: ``no_rope_layers[i]`` is 1 where layer ``i`` ropes (None or empty: every
  ``no_rope_layer_interval``-th layer is NoPE). Rope rotates consecutive pairs (transformers' complex-number rope).
- Chunked attention: ``layer_types`` (None: ``chunked_attention`` on rope layers when ``attention_chunk_size`` is set,
  else ``full_attention``); a chunked layer sees its own chunk of ``attention_chunk_size`` slots, counted from the
  row's first real token.
- The weightless L2 query/key norm (``use_qk_norm``, eps ``rms_norm_eps``) on rope layers only.
- Temperature tuning on NoPE layers (``attn_temperature_tuning``): queries times
  ``1 + attn_scale * log1p(floor((slot + 1) / floor_scale))``, ``slot`` the query's index in the sequence (cache
  slot; transformers counts the row's left padding too, as here).
- MoE layers: ``moe_layers`` (None: every ``interleave_moe_layer_step``-th layer, the last of each step); each has
  ``num_local_experts`` experts of width ``intermediate_size``, a top-``num_experts_per_tok`` sigmoid router whose
  score scales the chosen expert's input (not its output), and one shared expert of width ``intermediate_size``.
  Dense layers are a SwiGLU of width ``intermediate_size_mlp``. transformers computes no auxiliary loss for Llama 4,
  so ``output_router_logits`` is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

from nnx_zoo.layers.rope import Llama3Scaling
from nnx_zoo.models.decoder_config import ParameterCount, cpu_presets
from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig


class Llama4LayerKind(NamedTuple):
    """A Llama 4 layer's kind: ``LayerKind``'s ``attention`` (``"full"`` / ``"chunked"``) and ``moe``, plus ``rope``
    (False: a NoPE layer, with temperature tuning and no query/key norm).

    >>> Llama4LayerKind("chunked", moe=True, rope=True)
    Llama4LayerKind(attention='chunked', moe=True, rope=True)
    """

    attention: str = "full"
    moe: bool = False
    rope: bool = True


# Scout's rope (its published config.json): the llama3 schedule, factor 16, both band factors 1, over 8192 tokens.
SCOUT_ROPE = Llama3Scaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                           original_max_position_embeddings=8192)
# Llama 4 Scout (17B-16E) text model, the class defaults (published config.json values).
SCOUT: dict[str, Any] = dict(
    vocab_size=202048, hidden_size=5120, intermediate_size=8192, num_hidden_layers=48, num_attention_heads=40,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=SCOUT_ROPE,
    max_position_embeddings=10485760, bos_token_id=200000, eos_token_id=(200001, 200007, 200008),
    num_experts_per_tok=1)
# llama4-tiny / -small: the dense CPU presets with layers alternating dense / MoE (8 experts of width 64 / 128, top-1,
# plus the shared expert), NoPE every fourth layer, chunks of 16 / 64 slots and temperature tuning from slot 16 / 64.
_CPU = cpu_presets("llama4", head_dim=32, rope_theta=500000.0, rope_scaling=Llama3Scaling(16.0, 1.0, 1.0, 1024),
                   num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2)
PRESETS: dict[str, dict[str, Any]] = {
    "llama4-scout": {},  # 17B active, 109B total with the vision tower; the text model alone is 107.8B
    # Maverick (17B-128E): 128 experts on every second layer, no query/key norm, no rope scaling, a 1M context.
    "llama4-maverick": dict(num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False, rope_scaling=None,
                            max_position_embeddings=1048576),
    "llama4-tiny": {**_CPU["llama4-tiny"], "intermediate_size": 64, "intermediate_size_mlp": 384,
                    "attention_chunk_size": 16, "floor_scale": 16},
    "llama4-small": {**_CPU["llama4-small"], "intermediate_size": 128, "intermediate_size_mlp": 768,
                     "attention_chunk_size": 64, "floor_scale": 64},
}
# transformers' Llama4TextConfig defaults where they differ from Scout's published values (what a config.json
# that leaves the key out means).
_HF_DEFAULTS = dict(max_position_embeddings=4096 * 32, bos_token_id=1, eos_token_id=2)
ATTENTION_TYPES = {"full_attention": "full", "chunked_attention": "chunked"}


@dataclasses.dataclass(frozen=True)
class Llama4Config(MoEDecoderConfig, model_type="llama4_text", architecture="Llama4ForCausalLM", qk_norm=False,
                   presets=PRESETS, defaults=SCOUT, hf_extras={"attention_dropout": 0.0, "router_jitter_noise": 0.0},
                   experts=ExpertFields("num_local_experts", "intermediate_size", False)):
    """Llama 4 text-model hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Llama4Config.preset("llama4-maverick")
    >>> cfg = Llama4Config.from_hf("/path/to/Llama-4-Scout-17B-16E")   # llama4 or llama4_text config.json
    >>> [k.rope for k in cfg.layer_kinds()[:4]], [k.moe for k in cfg.layer_kinds()[:4]]
    ([True, True, True, False], [False, True, False, True])
    >>> round(cfg.num_parameters().total / 1e9, 1), round(cfg.num_parameters().active / 1e9, 1)
    (400.7, 17.2)
    """

    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 8  # transformers' Llama4TextConfig default
    HF_HEAD_DIM_IF_ABSENT: ClassVar[int | None] = 128  # its default
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False  # its strict config class refuses "head_dim": null

    num_local_experts: int = 16
    intermediate_size_mlp: int = 16384
    moe_layers: tuple[int, ...] | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: tuple[str, ...] | None = None
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        for name in ("moe_layers", "no_rope_layers", "layer_types"):  # JSON gives lists
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        # The hub files write 4 here; transformers only asks whether it is set.
        object.__setattr__(self, "attn_temperature_tuning", bool(self.attn_temperature_tuning))
        super().__post_init__()

    # ---- the layer schedule, as transformers' Llama4TextConfig resolves it ----
    def rope_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it ropes (False: NoPE)."""
        if self.no_rope_layers:
            return tuple(bool(r) for r in self.no_rope_layers[: self.num_hidden_layers])
        return tuple((i + 1) % self.no_rope_layer_interval != 0 for i in range(self.num_hidden_layers))

    def attention_types(self) -> tuple[str, ...]:
        """Per layer: ``"chunked"`` or ``"full"``."""
        if self.layer_types is not None:
            return tuple(ATTENTION_TYPES.get(t, t) for t in self.layer_types[: self.num_hidden_layers])
        chunked = self.attention_chunk_size is not None
        return tuple("chunked" if rope and chunked else "full" for rope in self.rope_layers())

    def is_moe_layer(self, index: int) -> bool:
        if self.moe_layers is not None:
            return index in self.moe_layers
        return (index + 1) % self.interleave_moe_layer_step == 0

    def layer_kinds(self) -> tuple[Llama4LayerKind, ...]:
        return tuple(Llama4LayerKind(attention, self.is_moe_layer(i), rope) for i, (attention, rope)
                     in enumerate(zip(self.attention_types(), self.rope_layers())))

    def attention_options(self, kind: Any) -> dict[str, Any]:
        """``Llama4Attention``'s keywords for a layer of ``kind``: pair rope or none, the chunk, the L2 query/key
        norm (rope layers) and the temperature tuning (NoPE layers)."""
        options: dict[str, Any] = {"rope": "pairs" if kind.rope else None,
                                   "l2_qk_norm": kind.rope and self.use_qk_norm}
        if kind.attention == "chunked":
            options["chunk"] = self.attention_chunk_size
        if not kind.rope and self.attn_temperature_tuning:
            options["temperature"] = (self.floor_scale, self.attn_scale)
        return options

    def mlp_width(self, kind: Any) -> int:
        """Dense layers: a SwiGLU of width ``intermediate_size_mlp``; MoE layers: none (the sparse block)."""
        return 0 if kind.moe else self.intermediate_size_mlp

    def stack_name(self, kind: Any) -> str:
        """``DecoderConfig.stack_name``'s, prefixed ``nope_`` for NoPE layers (Scout: ``chunked_layers`` and
        ``nope_layers``; Maverick also ``chunked_dense_layers`` and ``nope_dense_layers``)."""
        return ("" if kind.rope else "nope_") + super().stack_name(kind)

    # ---- MoE answers ----
    @property
    def router_kind(self) -> str:
        return "sigmoid"

    @property
    def router_options(self) -> dict[str, Any]:
        return {"scale_inputs": True}  # the score scales the expert's input, not its output

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.intermediate_size

    def _problems(self) -> list[str]:
        p = super()._problems()
        if p:
            return p
        layers = self.num_hidden_layers
        chunk = self.attention_chunk_size
        if chunk is not None and not (isinstance(chunk, int) and chunk > 0):
            p.append(f"attention_chunk_size must be a positive integer or None, got {chunk!r}")
        if not (isinstance(self.intermediate_size_mlp, int) and self.intermediate_size_mlp > 0):
            p.append(f"intermediate_size_mlp must be a positive integer, got {self.intermediate_size_mlp!r}")
        if not (isinstance(self.interleave_moe_layer_step, int) and self.interleave_moe_layer_step > 0):
            p.append(f"interleave_moe_layer_step must be a positive integer, got {self.interleave_moe_layer_step!r}")
        if not (isinstance(self.no_rope_layer_interval, int) and self.no_rope_layer_interval > 0):
            p.append(f"no_rope_layer_interval must be a positive integer, got {self.no_rope_layer_interval!r}")
        if not (isinstance(self.floor_scale, (int, float)) and self.floor_scale > 0):
            p.append(f"floor_scale must be positive, got {self.floor_scale!r}")
        if self.no_rope_layers and len(self.no_rope_layers) < layers:
            p.append(f"no_rope_layers has {len(self.no_rope_layers)} entries for {layers} layers (one 0/1 per layer)")
        if self.layer_types is not None:
            if len(self.layer_types) < layers:
                p.append(f"layer_types has {len(self.layer_types)} entries for {layers} layers")
            bad = sorted(set(self.layer_types) - set(ATTENTION_TYPES))
            if bad:
                p.append(f"layer_types {bad} are not Llama 4's; use {sorted(ATTENTION_TYPES)}")
        if p:
            return p
        kinds = self.layer_kinds()
        if chunk is None and any(k.attention == "chunked" for k in kinds):
            p.append("layer_types has chunked_attention layers but attention_chunk_size is None")
        nope_chunked = [i for i, k in enumerate(kinds) if k.attention == "chunked" and not k.rope]
        if nope_chunked:
            p.append(f"layers {nope_chunked} are NoPE (no_rope_layers 0) with chunked attention: not supported here "
                     "(transformers' own schedule keeps NoPE layers global); make them full_attention")
        if self.output_router_logits:
            p.append("output_router_logits=True: transformers computes no auxiliary loss for Llama 4, nor does this "
                     "model; leave it False")
        return p

    @classmethod
    def _with_required(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
        return super()._with_required(_text_model(d), overrides)

    @classmethod
    def hf_model_types(cls) -> tuple[str, ...]:
        return (cls.MODEL_TYPE, "llama4")  # llama4: the multimodal file, whose text_config is read

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Llama4Config:
        d = _text_model(d)
        # transformers' defaults for keys the file leaves out; output_router_logits only records logits there.
        d = {**_HF_DEFAULTS, **d, "model_type": cls.MODEL_TYPE, "output_router_logits": False}
        return super()._from_hf_dict(d, overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        if isinstance(d.get("eos_token_id"), tuple):  # transformers' strict config takes a list, not a tuple
            d["eos_token_id"] = list(d["eos_token_id"])
        return d

    # ---- sizes and cost ----
    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """Parameter counts of the text model (the multimodal checkpoint's vision tower and projector are not
        here): ``active`` counts the router, ``num_experts_per_tok`` routed experts and the shared expert of each
        MoE layer; dense layers are SwiGLUs of width ``intermediate_size_mlp``. The L2 query/key norm has no
        weights."""
        del include_mtp
        h, v = self.hidden_size, self.vocab_size
        heads, kv, hd = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attention = 2 * h * heads * hd + 2 * h * kv * hd + 2 * h  # q/k/v/o and the two layer norms
        if self.attention_bias:
            attention += heads * hd + 2 * kv * hd + h
        experts, k, width = self.num_local_experts, self.num_experts_per_tok, self.intermediate_size
        total = active = v * h + (0 if self.tie_word_embeddings else v * h) + h
        for i in range(self.num_hidden_layers):
            if self.is_moe_layer(i):
                shared_and_router = 3 * h * width + h * experts
                total += attention + shared_and_router + 3 * experts * h * width
                active += attention + shared_and_router + 3 * k * h * width
            else:
                total += attention + 3 * h * self.intermediate_size_mlp
                active += attention + 3 * h * self.intermediate_size_mlp
        return ParameterCount(total=total, active=active, embedding=v * h)

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """``DecoderConfig``'s formula with each chunked layer's attention over at most ``attention_chunk_size``
        keys (a query sees its own chunk, on average half of it, as a causal one sees half the sequence)."""
        counts = self.num_parameters(include_mtp=include_mtp)
        matmul = counts.active - (0 if self.tie_word_embeddings else counts.embedding)
        spans = [min(seq_len, self.attention_chunk_size) if kind.attention == "chunked" else seq_len
                 for kind in self.layer_kinds()]
        attention = 3 * self.num_attention_heads * 2 * self.head_dim * sum(spans)
        return float(6 * matmul + attention)


def _text_model(d: dict[str, Any]) -> dict[str, Any]:
    """A ``config.json`` dict's text model: a multimodal ``llama4`` file's ``text_config`` (as ``llama4_text``), any
    other dict itself."""
    if d.get("model_type") != "llama4":
        return d
    return {**(d.get("text_config") or {}), "model_type": Llama4Config.MODEL_TYPE}
