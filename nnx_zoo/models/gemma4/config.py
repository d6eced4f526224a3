"""Gemma4Config: Gemma 4 text-model hyper-parameters (HF ``model_type`` ``gemma4_text``; the ``text_config`` of a
``gemma4`` multimodal checkpoint), named as in ``config.json``, plus presets.

What is Gemma 4's own, beside the dense decoder's fields (``nnx_zoo.models.decoder_config``):
- local and global layers as Gemma 3's (``layer_types``, else every sixth layer global; the last layer is always
  global, as transformers forces it), but with their own shapes: global layers have heads ``global_head_dim`` wide
  and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` key heads whose values are the keys' projection
  (no ``v_proj``); they rope with transformers' ``proportional`` rope (``global_partial_rotary_factor`` of each
  head's frequencies, over the whole head), the sliding layers with the default one;
- per-layer inputs (``hidden_size_per_layer_input`` > 0): a second embedding table, ``vocab_size_per_layer_input``
  rows of ``num_hidden_layers * hidden_size_per_layer_input``, mixed with a projection of the embeddings and fed
  into each layer through a gate;
- K/V shared across the last ``num_kv_shared_layers`` layers: each attends to the keys and values of the last
  earlier layer of its type, and has no key or value projection (with ``use_double_wide_mlp``, its MLP is twice as
  wide);
- a sparse MoE block beside the dense MLP in every layer (``enable_moe_block``: ``num_experts``, ``top_k_experts``,
  ``moe_intermediate_size``);
- the attention scale is 1 (queries and keys are RMS-normed), values are RMS-normed too, and
  ``final_logit_softcapping`` caps the logits.
The class defaults are Gemma 4 31B's text model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

from nnx_zoo.models.decoder_config import DecoderConfig, ParameterCount, _positive_int
from nnx_zoo.models.gemma3.config import (
    ACTIVATIONS,
    LAYER_TYPES,
    layer_types_problems,
    pattern_layer_types,
    text_config_of,
)

KV_MODES = ("own", "store", "shared")
GLOBAL_ROPE_TYPES = ("proportional", "default")


class Gemma4LayerKind(NamedTuple):
    """What sets a Gemma 4 layer apart: ``attention`` (``"sliding"`` / ``"full"``), ``moe`` (the MoE block beside
    the MLP; every layer or none) and ``kv``: ``"own"`` (its own keys and values), ``"store"`` (its own, which the
    shared layers of its type reuse: the last layer of its type before them) or ``"shared"`` (no key/value
    projections: the store layer's).

    >>> Gemma4Config.preset("gemma4-e2b").layer_kinds()[13:16]
    (Gemma4LayerKind(attention='sliding', moe=False, kv='store'), Gemma4LayerKind(attention='full', moe=False,
     kv='store'), Gemma4LayerKind(attention='sliding', moe=False, kv='shared'))
    """

    attention: str = "full"
    moe: bool = False
    kv: str = "own"


# Gemma 4 31B's text model, the class defaults (published config.json values, as every preset's sizes).
GEMMA4_31B: dict[str, Any] = dict(
    vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
    num_key_value_heads=16, head_dim=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=262144,
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)
_EDGE = dict(vocab_size=262144, head_dim=256, max_position_embeddings=131072, sliding_window=512,
             hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, attention_k_eq_v=False,
             num_global_key_value_heads=None)
PRESETS: dict[str, dict[str, Any]] = {
    # E2B: 35 layers, four sliding then a global one; the last 20 share K/V; double-wide MLPs there.
    "gemma4-e2b": dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                       num_key_value_heads=1, sliding_window_pattern=5, num_kv_shared_layers=20,
                       use_double_wide_mlp=True, **_EDGE),
    "gemma4-e4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
                       num_key_value_heads=2, num_kv_shared_layers=18, **_EDGE),
    # 26B-A4B: 128 experts, top 8, beside a 2112-wide dense MLP in every layer.
    "gemma4-26b-a4b": dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                           num_key_value_heads=8, num_global_key_value_heads=2, enable_moe_block=True, num_experts=128,
                           top_k_experts=8, moe_intermediate_size=704),
    "gemma4-31b": {},
    # CPU presets. gemma4-tiny (4 layers: sliding, global, twice; 16-token window): per-layer inputs, global K = V
    # heads, the MoE block (8 experts, top 2). gemma4-small (6 layers: two sliding then a global one, twice; 32-token
    # window): per-layer inputs, the last three layers share K/V (double-wide MLPs), no MoE.
    "gemma4-tiny": dict(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                        num_global_key_value_heads=1, sliding_window=16, sliding_window_pattern=2,
                        hidden_size_per_layer_input=16, vocab_size_per_layer_input=32000, enable_moe_block=True,
                        num_experts=8, top_k_experts=2, moe_intermediate_size=64, max_position_embeddings=4096,
                        bos_token_id=None, eos_token_id=None),
    "gemma4-small": dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                         attention_k_eq_v=False, num_global_key_value_heads=None, sliding_window=32,
                         sliding_window_pattern=3, hidden_size_per_layer_input=32, vocab_size_per_layer_input=32000,
                         num_kv_shared_layers=3, use_double_wide_mlp=True, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None),
}

# What transformers' Gemma4TextConfig makes of a config.json key that is absent (its class defaults).
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    initializer_range=0.02, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, attention_bias=False, sliding_window=512, final_logit_softcapping=None,
    vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
    num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, num_experts=None, top_k_experts=None,
    moe_intermediate_size=None, global_head_dim=512, num_global_key_value_heads=None)
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


@dataclasses.dataclass(frozen=True)
class Gemma4Config(DecoderConfig, model_type="gemma4_text", architecture="Gemma4ForCausalLM", qk_norm=True,
                   presets=PRESETS, defaults=GEMMA4_31B, hf_extras={"attention_dropout": 0.0}):
    """Gemma 4 text-model hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Gemma4Config.preset("gemma4-e2b")
    >>> cfg = Gemma4Config.from_hf("/path/to/gemma-4-E2B-it")   # gemma4_text, or a gemma4 file's text_config
    >>> [k.kv for k in cfg.layer_kinds()].count("shared"), cfg.global_kv_heads
    (20, 1)

    ``head_dim`` / ``num_key_value_heads`` are the sliding layers'; the global layers' are ``global_head_dim`` and
    ``global_kv_heads``. ``rope_theta`` is the global layers' base (``global_rope_type``: ``proportional`` with
    ``global_partial_rotary_factor`` and ``global_rope_factor``, or ``default``), ``sliding_rope_theta`` the
    sliding layers'. ``hidden_size_per_layer_input=0`` turns the per-layer inputs off.
    """

    REQUIRED_HF_FIELDS: ClassVar[tuple[str, ...]] = ()  # transformers fills every absent key (HF_DEFAULTS)
    MULTIMODAL_MODEL_TYPE: ClassVar[str] = "gemma4"
    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 4
    HF_HEAD_DIM_IF_ABSENT: ClassVar[int | None] = 256
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False  # Gemma4TextConfig's head_dim is an int
    NNX_ONLY: ClassVar[frozenset[str]] = frozenset({"moe_impl", "grouped_matmul_impl"})

    sliding_window: int = 1024
    sliding_window_pattern: int = 6  # used when layer_types is None (transformers always takes 6 then)
    layer_types: tuple[str, ...] | None = None
    sliding_rope_theta: float = 10_000.0
    global_rope_type: str = "proportional"
    global_partial_rotary_factor: float = 0.25
    global_rope_factor: float = 1.0
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = 4
    attention_k_eq_v: bool = True
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 262144
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    final_logit_softcapping: float | None = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    pad_token_id: int | None = 0
    # ---- nnx_zoo only ----
    moe_impl: str = "auto"  # the MoE block's expert path: 'auto' | 'dense' | 'gmm' | 'ep' (nnx_zoo.layers.moe)
    grouped_matmul_impl: str = "auto"  # the gmm path's kernel (nnx_zoo.layers.grouped_matmul)

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()

    def _problems(self) -> list[str]:
        p = super()._problems()
        kinds = self.resolved_layer_types
        if kinds is not None:
            schedule = layer_types_problems(kinds, self.num_hidden_layers)
            p += schedule or self._sharing_problems(kinds)
        for name in ("sliding_window", "sliding_window_pattern", "global_head_dim", "vocab_size_per_layer_input"):
            if not _positive_int(getattr(self, name)):
                p.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if _positive_int(self.global_head_dim) and self.global_head_dim % 2:
            p.append(f"global_head_dim must be even (rope rotates pairs), got {self.global_head_dim}")
        if self.num_global_key_value_heads is not None and not (
                _positive_int(self.num_global_key_value_heads)
                and self.num_attention_heads % self.num_global_key_value_heads == 0):
            p.append(f"num_global_key_value_heads={self.num_global_key_value_heads!r} must be None or a positive "
                     f"divisor of num_attention_heads={self.num_attention_heads}")
        for name in ("num_kv_shared_layers", "hidden_size_per_layer_input"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                p.append(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("sliding_rope_theta", "global_rope_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                p.append(f"{name} must be a positive number, got {value!r}")
        if self.global_rope_type not in GLOBAL_ROPE_TYPES:
            p.append(f"global_rope_type must be one of {GLOBAL_ROPE_TYPES}, got {self.global_rope_type!r}")
        if not (isinstance(self.global_partial_rotary_factor, (int, float))
                and 0 < self.global_partial_rotary_factor <= 1):
            p.append(f"global_partial_rotary_factor must be in (0, 1], got {self.global_partial_rotary_factor!r}")
        if self.rope_scaling is not None:
            p.append(f"rope_scaling={self.rope_scaling!r}: Gemma 4's global layers rope by global_rope_type "
                     "('proportional' or 'default'); other schedules are not supported")
        if self.enable_moe_block:
            for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
                if not _positive_int(getattr(self, name)):
                    p.append(f"enable_moe_block needs a positive integer {name}, got {getattr(self, name)!r}")
            if _positive_int(self.num_experts) and _positive_int(self.top_k_experts) and (
                    self.top_k_experts > self.num_experts):
                p.append(f"top_k_experts={self.top_k_experts} exceeds num_experts={self.num_experts}")
        if self.final_logit_softcapping is not None and not (
                isinstance(self.final_logit_softcapping, (int, float)) and self.final_logit_softcapping > 0):
            p.append(f"final_logit_softcapping must be a positive number or None, got {self.final_logit_softcapping!r}")
        if self.hidden_activation not in ACTIVATIONS:
            p.append(f"hidden_activation {self.hidden_activation!r} is not supported; use one of {sorted(ACTIVATIONS)}")
        return p

    def _sharing_problems(self, kinds: tuple[str, ...]) -> list[str]:
        n = self.num_kv_shared_layers
        if not isinstance(n, int) or n <= 0:
            return []
        if n >= self.num_hidden_layers:
            return [f"num_kv_shared_layers={n} leaves no layer computing keys and values "
                    f"(num_hidden_layers={self.num_hidden_layers}); use at most {self.num_hidden_layers - 1}"]
        missing = sorted(set(kinds[-n:]) - set(kinds[:-n]))
        if missing:
            return [f"the last {n} layers share K/V, but no earlier layer of type {missing} computes them"]
        return []

    # ---- derived shapes ----
    @property
    def resolved_layer_types(self) -> tuple[str, ...] | None:
        """Each layer's type (``layer_types`` or the pattern's), the last one global as transformers forces it;
        None while the sizes are invalid."""
        if self.layer_types is not None:
            kinds = self.layer_types
        elif _positive_int(self.num_hidden_layers) and _positive_int(self.sliding_window_pattern):
            kinds = pattern_layer_types(self.num_hidden_layers, self.sliding_window_pattern)
        else:
            return None
        return kinds[:-1] + ("full_attention",) if kinds else kinds

    @property
    def global_kv_heads(self) -> int:
        """Key/value heads of the global layers: ``num_global_key_value_heads`` when keys are values
        (``attention_k_eq_v``), else ``num_key_value_heads`` (as transformers reads them)."""
        if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    @property
    def gate_activation(self) -> str:
        return ACTIVATIONS[self.hidden_activation]

    # The MoE questions every MoE family's config answers (``MoEDecoderConfig``'s names; the memory plan, kernel
    # choices and the trainer read these, not Gemma 4's HF fields). Without the MoE block: no experts, no MoE layers.
    @property
    def num_routed_experts(self) -> int:
        return self.num_experts if self.enable_moe_block else 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size if self.enable_moe_block else 0

    @property
    def num_experts_per_tok(self) -> int:
        return self.top_k_experts if self.enable_moe_block else 0

    @property
    def num_moe_layers(self) -> int:
        """Layers with the MoE block beside their MLP: every layer with ``enable_moe_block``, else none."""
        return self.num_hidden_layers if self.enable_moe_block else 0

    def head_dims(self, kind: Any) -> tuple[int, int]:
        """``(head width, key/value heads)`` of a layer of ``kind``."""
        if kind.attention == "full":
            return self.global_head_dim, self.global_kv_heads
        return self.head_dim, self.num_key_value_heads

    def mlp_width(self, kind: Any) -> int:
        """The dense MLP's width: doubled on shared-K/V layers with ``use_double_wide_mlp``."""
        return self.intermediate_size * (2 if self.use_double_wide_mlp and kind.kv == "shared" else 1)

    # ---- the layer schedule ----
    def layer_kinds(self) -> tuple[Gemma4LayerKind, ...]:
        types = self.resolved_layer_types
        n = self.num_kv_shared_layers if self.num_kv_shared_layers and self.num_kv_shared_layers > 0 else 0
        first_shared = len(types) - n
        store = {t: max(i for i in range(first_shared) if types[i] == t) for t in set(types[first_shared:])}
        kinds = []
        for i, t in enumerate(types):
            kv = "shared" if i >= first_shared else "store" if store.get(t) == i else "own"
            kinds.append(Gemma4LayerKind("sliding" if t == "sliding_attention" else "full",
                                         bool(self.enable_moe_block), kv))
        return tuple(kinds)

    def attention_options(self, kind: Any) -> dict[str, Any]:
        return {"window": self.sliding_window} if kind.attention == "sliding" else {}

    def stack_name(self, kind: Any) -> str:
        """``layers`` / ``sliding_layers``, prefixed ``store_`` or ``shared_`` for the K/V-sharing layers
        (``shared_sliding_layers``, ...)."""
        return ("" if kind.kv == "own" else f"{kind.kv}_") + (
            "sliding_" if kind.attention == "sliding" else "") + "layers"

    # ---- Hugging Face config.json ----
    @classmethod
    def hf_model_types(cls) -> tuple[str, ...]:
        return (cls.MODEL_TYPE, cls.MULTIMODAL_MODEL_TYPE)  # gemma4: the multimodal file, whose text_config is read

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Gemma4Config:
        d = text_config_of(d, cls.MULTIMODAL_MODEL_TYPE)
        if d.get("use_bidirectional_attention") == "all":
            raise ValueError("unsupported config:\n  - use_bidirectional_attention='all' (every token attends both "
                             "ways) is not supported: this is a causal language model")
        d = {**HF_DEFAULTS, **{k: v for k, v in d.items() if k not in ("hidden_act", "use_bidirectional_attention")}}
        if d.get("hidden_size_per_layer_input") is None:  # null read as 0: no per-layer inputs
            d["hidden_size_per_layer_input"] = 0
        rope = d.pop("rope_parameters", None) or DEFAULT_ROPE
        if not isinstance(rope, Mapping) or not set(rope) <= set(LAYER_TYPES):
            raise ValueError(f"rope_parameters must hold one entry per layer type ({LAYER_TYPES}), got {rope!r}")
        local = dict(rope.get("sliding_attention") or DEFAULT_ROPE["sliding_attention"])
        full = dict(rope.get("full_attention") or DEFAULT_ROPE["full_attention"])
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"sliding layers' rope {local} is not supported (Gemma 4 ropes them with 'default')")
        if full.get("rope_type", "default") not in GLOBAL_ROPE_TYPES:
            raise ValueError(f"global layers' rope type {full.get('rope_type')!r} is not supported; Gemma 4's are "
                             f"{GLOBAL_ROPE_TYPES}")
        d.update(sliding_rope_theta=local.get("rope_theta", 10_000.0), rope_theta=full.get("rope_theta", 1e6),
                 global_rope_type=full.get("rope_type", "default"),
                 global_partial_rotary_factor=full.get("partial_rotary_factor", 1.0),
                 global_rope_factor=full.get("factor", 1.0))
        if d["global_rope_type"] == "default":  # transformers' default rope rotates whole heads
            d["global_partial_rotary_factor"] = 1.0
        d.update(_per_layer_config(d))
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        else:
            d["layer_types"], d["sliding_window_pattern"] = None, 6  # transformers' rule, whatever the file says
        if d["layer_types"] is not None and _positive_int(d.get("sliding_window_pattern")):
            pattern = pattern_layer_types(len(d["layer_types"]), d["sliding_window_pattern"])
            if d["layer_types"] == pattern[:-1] + ("full_attention",):
                d["layer_types"] = None  # the pattern's: kept as the pattern, so a layer-count override still fits
        d = {k: v for k, v in d.items() if k not in cls.NNX_ONLY and k not in ("rope_scaling", "per_layer_config")}
        return super()._from_hf_dict(d, overrides)  # type: ignore[return-value]

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict of a ``gemma4_text`` model (the global layers' shape as the hub files
        write it: ``global_head_dim``, ``num_global_key_value_heads``)."""
        d = super().to_hf_dict()
        for key in ("rope_theta", "rope_scaling", "hidden_act", "partial_rotary_factor"):
            d.pop(key, None)
        full: dict[str, Any] = {"rope_type": self.global_rope_type, "rope_theta": self.rope_theta}
        if self.global_rope_type == "proportional":
            full["partial_rotary_factor"] = self.global_partial_rotary_factor
            if self.global_rope_factor != 1.0:
                full["factor"] = self.global_rope_factor
        d["rope_parameters"] = {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": self.sliding_rope_theta}}
        for f in dataclasses.fields(self):
            if f.name not in DecoderConfig.__dataclass_fields__ and f.name not in self.NNX_ONLY and f.name not in (
                    "layer_types", "sliding_rope_theta", "global_rope_type", "global_partial_rotary_factor",
                    "global_rope_factor"):
                d[f.name] = getattr(self, f.name)
        d["layer_types"] = list(self.resolved_layer_types)
        return d

    # ---- sizes and cost ----
    def _attention_params(self, kind: Gemma4LayerKind) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        hd, kv = self.head_dims(kind)
        n = 2 * h * heads * hd + hd  # q, o, q_norm
        bias = heads * hd + (h if self.attention_output_bias else 0) if self.attention_bias else 0
        if kind.kv != "shared":
            values = 0 if (kind.attention == "full" and self.attention_k_eq_v) else 1
            n += (1 + values) * h * kv * hd + hd  # k (and v), k_norm; the value norm has no weight
            bias += (1 + values) * kv * hd if self.attention_bias else 0
        return n + bias

    def _moe_params(self, *, active: bool) -> int:
        if not self.enable_moe_block:
            return 0
        h, e = self.hidden_size, self.num_experts
        experts = (self.top_k_experts if active else e) * 3 * h * self.moe_intermediate_size
        return experts + h * e + h + e + 3 * h  # router proj, scale, per-expert scale; three more norms

    def _layer_params(self, kind: Gemma4LayerKind, *, active: bool = False) -> int:
        h, p = self.hidden_size, self.hidden_size_per_layer_input
        per_layer = 2 * h * p + h if p else 0
        return (self._attention_params(kind) + 3 * h * self.mlp_width(kind) + 4 * h + per_layer
                + self._moe_params(active=active))

    def per_layer_embedding_params(self) -> int:
        """The per-layer input table's entries (``vocab_size_per_layer_input x layers x width``; 0 when off)."""
        return self.vocab_size_per_layer_input * self.num_hidden_layers * self.hidden_size_per_layer_input

    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """``total`` (every ``nnx.Param``: the layer scalars are buffers, as in transformers), ``active`` (k of the
        experts per layer), ``embedding``: the token table plus the per-layer input table (both lookups)."""
        del include_mtp
        h, v, p, n = self.hidden_size, self.vocab_size, self.hidden_size_per_layer_input, self.num_hidden_layers
        top = v * h + (0 if self.tie_word_embeddings else v * h) + h
        top += self.per_layer_embedding_params() + (h * n * p + p if p else 0)  # table, projection, its norm
        kinds = self.layer_kinds()
        total = top + sum(self._layer_params(k) for k in kinds)
        active = top + sum(self._layer_params(k, active=True) for k in kinds)
        return ParameterCount(total=total, active=active, embedding=v * h + self.per_layer_embedding_params())

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """``6 * (active matmul parameters) + attention``: the lookups (the token table unless it is the tied
        head, the per-layer input table) are not matmuls; each layer's attention covers the keys its window
        leaves (``Gemma3Config.train_flops_per_token``), at its own head width."""
        counts = self.num_parameters(include_mtp=include_mtp)
        lookups = self.per_layer_embedding_params() + (0 if self.tie_word_embeddings
                                                       else self.vocab_size * self.hidden_size)
        attention = 0.0
        for kind in self.layer_kinds():
            span = seq_len if kind.attention == "full" else min(seq_len, self.sliding_window)
            keys = span - span * span / (2 * seq_len)
            attention += 12 * keys * self.num_attention_heads * self.head_dims(kind)[0]
        return float(6 * (counts.active - lookups) + attention)


def _per_layer_config(d: Mapping[str, Any]) -> dict[str, Any]:
    """``global_head_dim`` / ``num_global_key_value_heads`` from the ``per_layer_config`` transformers 5 writes in
    their place (an entry per global layer index: ``head_dim`` and, with K = V, ``num_key_value_heads``); nothing
    when the file has none. Anything else in it is refused."""
    per_layer = d.get("per_layer_config")
    if not per_layer:
        return {}
    entries = {tuple(sorted(v.items())) for v in per_layer.values()}
    keys = {k for v in per_layer.values() for k in v}
    if len(entries) != 1 or not keys <= {"head_dim", "num_key_value_heads"} or "head_dim" not in keys:
        raise ValueError(f"per_layer_config {dict(per_layer)} is not Gemma 4's (the same head_dim, and with "
                         "attention_k_eq_v num_key_value_heads, on every global layer)")
    entry = dict(next(iter(entries)))
    out = {"global_head_dim": entry["head_dim"]}
    if "num_key_value_heads" in entry:
        out["num_global_key_value_heads"] = entry["num_key_value_heads"]
    return out
