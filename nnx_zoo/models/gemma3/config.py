"""Gemma3Config: Gemma 3 text-model hyper-parameters (HF ``model_type`` ``gemma3_text``; the ``text_config`` of a
``gemma3`` multimodal checkpoint), named as in ``config.json``, plus presets.

What is Gemma 3's own, beside the dense decoder's fields (``nnx_zoo.models.decoder_config``):
- local and global layers: ``layer_types`` (``sliding_attention`` / ``full_attention``; when absent, every
  ``sliding_window_pattern``-th layer is global, the rest slide over ``sliding_window`` tokens);
- two rope bases: ``rope_local_base_freq`` for the sliding layers (never scaled), ``rope_theta`` with
  ``rope_scaling`` (linear, factor 8 in the 4B-27B releases) for the global ones;
- ``query_pre_attn_scalar``: the softmax scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- ``attn_logit_softcapping`` / ``final_logit_softcapping``: soft caps of the attention scores and of the output
  logits (None in every published Gemma 3 config, honoured when set).
The class defaults are Gemma 3 27B's text model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.layers.rope import LinearScaling, rope_to_hf
from nnx_zoo.models.decoder_config import DecoderConfig, LayerKind, _positive_int, cpu_presets

LAYER_TYPES = ("sliding_attention", "full_attention")
# HF hidden_activation -> nnx_zoo.layers.mlp gate activation.
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}
GEMMA3_ROPE = LinearScaling(factor=8.0)  # the 4B, 12B and 27B releases' global rope

# Gemma 3 27B's text model, the class defaults (published config.json values, as every preset's sizes).
GEMMA3_27B: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
    num_key_value_heads=16, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_scaling=GEMMA3_ROPE,
    max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)
_SMALL = dict(vocab_size=262144, num_key_value_heads=1, head_dim=256, sliding_window=512, rope_scaling=None,
              max_position_embeddings=32768, query_pre_attn_scalar=256)
PRESETS: dict[str, dict[str, Any]] = {
    "gemma3-270m": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, **_SMALL),
    "gemma3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, **_SMALL),
    "gemma3-4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),
    "gemma3-12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "gemma3-27b": {},
    # gemma3-tiny (4 layers: sliding, global, sliding, global; a 16-token window) and gemma3-small (6 layers, two
    # sliding then a global one, twice; a 32-token window): the test and quick-recipe sizes, with the 4B-27B
    # releases' linear rope scaling on the global layers.
    **{name: {**fields, "sliding_window": window, "sliding_window_pattern": pattern, "query_pre_attn_scalar": 32}
       for (name, fields), window, pattern in zip(
           cpu_presets("gemma3", head_dim=32, rope_theta=1_000_000.0, rope_scaling=GEMMA3_ROPE).items(),
           (16, 32), (2, 3))},
}

# What transformers' Gemma3TextConfig makes of a config.json key that is absent (its class defaults): a hub
# gemma3 checkpoint's text_config leaves most of them out (the 4B's names six keys).
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    initializer_range=0.02, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
    final_logit_softcapping=None, attn_logit_softcapping=None, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    sliding_window_pattern=6)


def _int_if_whole(value: float) -> int | float:
    """``value`` as an int when it is one (transformers' Gemma configs type ``query_pre_attn_scalar`` as int)."""
    return int(value) if float(value).is_integer() else value


def pattern_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """transformers' rule for a config without ``layer_types``: layer ``i`` is global when ``(i + 1) % pattern ==
    0``, sliding otherwise (pattern 6: five sliding layers, then a global one)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))


def layer_types_problems(kinds: tuple[str, ...], num_layers: int) -> list[str]:
    """What is wrong with a Gemma ``layer_types`` schedule: unknown entries, or not one entry per layer."""
    p = []
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        p.append(f"layer_types holds {unknown}; each entry must be one of {LAYER_TYPES}")
    if len(kinds) != num_layers:
        p.append(f"layer_types has {len(kinds)} entries but num_hidden_layers={num_layers}; give one per layer (or "
                 "leave layer_types out: every sliding_window_pattern-th layer is global)")
    return p


def text_config_of(d: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The text model's config dict of a multimodal checkpoint's ``config.json`` (its ``text_config``, given
    ``model_type``), or ``d`` itself when it is a text model's."""
    if d.get("model_type") != model_type:
        return dict(d)
    text = d.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"a {model_type!r} config.json needs a text_config object (the language model's "
                         f"settings), got {text!r}")
    text = dict(text)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    return text


@dataclasses.dataclass(frozen=True)
class Gemma3Config(DecoderConfig, model_type="gemma3_text", architecture="Gemma3ForCausalLM", qk_norm=True,
                   presets=PRESETS, defaults=GEMMA3_27B, hf_extras={"attention_dropout": 0.0}):
    """Gemma 3 text-model hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Gemma3Config.preset("gemma3-1b")
    >>> cfg = Gemma3Config.from_hf("/path/to/gemma-3-4b-it")     # gemma3_text, or a gemma3 file's text_config
    >>> cfg.resolved_layer_types[:6], cfg.sliding_window
    (('sliding_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention',
      'full_attention'), 1024)
    >>> cfg.num_parameters().total
    3880263168

    ``layer_types`` None means every ``sliding_window_pattern``-th layer is global (``resolved_layer_types``
    answers the list either way); ``rope_theta`` / ``rope_scaling`` are the global layers' rope,
    ``rope_local_base_freq`` the sliding layers' base.
    """

    REQUIRED_HF_FIELDS: ClassVar[tuple[str, ...]] = ()  # transformers fills every absent key (HF_DEFAULTS)
    MULTIMODAL_MODEL_TYPE: ClassVar[str] = "gemma3"  # the image-text checkpoint whose text model this reads
    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 4
    HF_HEAD_DIM_IF_ABSENT: ClassVar[int | None] = 256
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False  # Gemma3TextConfig's head_dim is an int

    sliding_window: int | None = 1024
    sliding_window_pattern: int = 6
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: int | float = 168
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    pad_token_id: int | None = 0

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        super().__post_init__()

    def _problems(self) -> list[str]:
        p = super()._problems()
        kinds = self.resolved_layer_types
        if kinds is not None:
            p += layer_types_problems(kinds, self.num_hidden_layers)
            if "sliding_attention" in kinds and not _positive_int(self.sliding_window):
                p.append(f"sliding layers need a positive integer sliding_window, got {self.sliding_window!r}")
        if not _positive_int(self.sliding_window_pattern):
            p.append(f"sliding_window_pattern must be a positive integer, got {self.sliding_window_pattern!r}")
        for name in ("rope_local_base_freq", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                p.append(f"{name} must be a positive number, got {value!r}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                p.append(f"{name} must be a positive number or None, got {value!r}")
        if self.hidden_activation not in ACTIVATIONS:
            p.append(f"hidden_activation {self.hidden_activation!r} is not supported; use one of {sorted(ACTIVATIONS)}")
        return p

    @property
    def resolved_layer_types(self) -> tuple[str, ...] | None:
        """Each layer's type: ``layer_types``, or the pattern's when it is None (None while the sizes are invalid)."""
        if self.layer_types is not None:
            return self.layer_types
        if _positive_int(self.num_hidden_layers) and _positive_int(self.sliding_window_pattern):
            return pattern_layer_types(self.num_hidden_layers, self.sliding_window_pattern)
        return None

    @property
    def attention_scale(self) -> float:
        """The softmax scale, ``query_pre_attn_scalar ** -0.5``."""
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def gate_activation(self) -> str:
        """The MLP's gate activation (``nnx_zoo.layers.mlp.GATE_ACTIVATIONS``)."""
        return ACTIVATIONS[self.hidden_activation]

    # ---- the layer schedule ----
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(LayerKind("sliding" if t == "sliding_attention" else "full")
                     for t in self.resolved_layer_types)

    def attention_options(self, kind: Any) -> dict[str, Any]:
        options: dict[str, Any] = {"softcap": self.attn_logit_softcapping}
        if kind.attention == "sliding":
            options["window"] = self.sliding_window
        elif kind.attention != "full":
            raise NotImplementedError(f"{type(self).__name__} has no {kind.attention!r} attention layers")
        return options

    # ---- Hugging Face config.json ----
    @classmethod
    def hf_model_types(cls) -> tuple[str, ...]:
        return (cls.MODEL_TYPE, cls.MULTIMODAL_MODEL_TYPE)  # gemma3: the multimodal file, whose text_config is read

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Gemma3Config:
        d = text_config_of(d, cls.MULTIMODAL_MODEL_TYPE)
        problems = []
        if d.get("use_bidirectional_attention"):
            problems.append("use_bidirectional_attention=true (EmbeddingGemma's encoder attention) is not supported: "
                            "this is a causal language model")
        if problems:
            raise ValueError("unsupported config:\n  - " + "\n  - ".join(problems))
        d = {**HF_DEFAULTS, **{k: v for k, v in d.items() if k != "hidden_act"}}  # hidden_act: not Gemma's key
        rope = d.get("rope_parameters")
        if isinstance(rope, Mapping) and set(rope) & set(LAYER_TYPES):  # transformers 5: one rope per layer type
            local = dict(rope.get("sliding_attention") or {})
            if local.get("rope_type", local.get("type", "default")) != "default" or local.get(
                    "partial_rotary_factor", 1.0) != 1.0:
                raise ValueError(f"sliding layers' rope {local} is not supported: Gemma 3 ropes them with the "
                                 "default schedule (rope_type 'default', a rope_theta)")
            d["rope_local_base_freq"] = local.get("rope_theta", d["rope_local_base_freq"])
            d["rope_parameters"] = rope.get("full_attention") or {"rope_type": "default"}
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
            pattern = d.get("sliding_window_pattern")
            if _positive_int(pattern) and d["layer_types"] == pattern_layer_types(len(d["layer_types"]), pattern):
                d["layer_types"] = None  # the pattern's: kept as the pattern, so a layer-count override still fits
        return super()._from_hf_dict(d, overrides)  # type: ignore[return-value]

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict of a ``gemma3_text`` model (transformers-5 rope form: one entry per layer
        type)."""
        d = super().to_hf_dict()
        for key in ("rope_theta", "rope_scaling", "hidden_act"):
            d.pop(key, None)
        full = rope_to_hf(self.rope_theta, self.rope_scaling)
        d["rope_parameters"] = {
            "full_attention": {"rope_type": "default", **(full["rope_scaling"] or {}), "rope_theta": self.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": float(self.rope_local_base_freq)}}
        d.update(layer_types=list(self.resolved_layer_types), sliding_window=self.sliding_window,
                 sliding_window_pattern=self.sliding_window_pattern,
                 query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar),
                 attn_logit_softcapping=self.attn_logit_softcapping,
                 final_logit_softcapping=self.final_logit_softcapping, hidden_activation=self.hidden_activation,
                 pad_token_id=self.pad_token_id, use_bidirectional_attention=False)
        return d

    # ---- sizes and cost ----
    def _layer_params(self) -> int:
        return super()._layer_params() + 2 * self.hidden_size  # pre- and post-feed-forward norms

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """``DecoderConfig``'s formula with each sliding layer's attention over the keys its window leaves: on
        average ``w - w**2 / (2 * seq_len)`` per query for a window ``w <= seq_len`` (``seq_len / 2`` for a global
        layer, as the dense formula counts)."""
        counts = self.num_parameters(include_mtp=include_mtp)
        matmul = counts.active - (0 if self.tie_word_embeddings else counts.embedding)
        keys = 0.0
        for kind in self.layer_kinds():
            span = seq_len if kind.attention == "full" else min(seq_len, self.sliding_window)
            keys += span - span * span / (2 * seq_len)
        return float(6 * matmul + 12 * keys * self.num_attention_heads * self.head_dim)

