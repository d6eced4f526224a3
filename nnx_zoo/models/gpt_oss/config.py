"""GptOssConfig: GPT-OSS hyper-parameters (HF ``model_type`` ``gpt_oss``), named as in ``config.json``, plus
presets.

The class defaults are gpt-oss-120b (transformers' ``GptOssConfig`` defaults, which are its published
config.json). Shared fields, validation, HF mapping and cost formulas live in
``nnx_zoo.models.moe_decoder_config``; what is GPT-OSS's own:
- ``layer_types``: each layer ``"sliding_attention"`` (a window of ``sliding_window`` tokens, itself included) or
  ``"full_attention"``; None (absent in a file) means they alternate from a sliding layer 0, as transformers fills
  them, and a list equal to that alternation is kept as None (so ``num_hidden_layers`` overrides keep it). Every
  layer
  has learned per-head sinks (an extra softmax logit per head with no value) and q/k/v/o biases
  (``attention_bias``, true unless the file says otherwise).
- YaRN rope: a file without a rope block gets transformers' default (factor 32 over 4,096 positions, betas 32 / 1,
  no truncation) and ``rope_theta`` 150,000.
- Every layer MoE: ``num_local_experts`` experts of width ``intermediate_size``, the router a linear map with a
  bias; routing takes the top-k logits and a softmax over those k (the same numbers as renormalised top-k of the
  softmax: ``nnx_zoo.layers.routers``). The experts have biases and the clamped SwiGLU: ``g = min(gate,
  swiglu_limit)``, ``u = clip(up, -swiglu_limit, swiglu_limit)``, ``(u + 1) * g * sigmoid(swiglu_alpha * g)``
  (``Glu(limit, alpha, up_offset=1)``). ``swiglu_limit=None`` (no clamp) is nnx_zoo's ablation, not a value
  transformers takes.
- ``hidden_act`` is not read (transformers' GPT-OSS never reads it: the experts' activation is the one above).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.layers.rope import YarnScaling
from nnx_zoo.models.decoder_config import LayerKind, ParameterCount, cpu_presets
from nnx_zoo.models.moe_decoder_config import ExpertFields, MoEDecoderConfig

LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}  # HF word -> LayerKind.attention
# transformers' GptOssConfig rope when a file has none (rope_theta 150,000, its default_theta).
HF_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                   "original_max_position_embeddings": 4096}

# gpt-oss-120b, the class defaults (published config.json values, as every preset's sizes).
GPT_OSS_120B: dict[str, Any] = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
    rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False),
    max_position_embeddings=131072, attention_bias=True, tie_word_embeddings=False, eos_token_id=200002,
    num_experts_per_tok=4, router_aux_loss_coef=0.9)
# gpt-oss-tiny / -small: the dense CPU presets with 8 experts of width 64 / 128, top-2, windows of 32 / 64 tokens
# alternating with full layers, and YaRN x4 over 1,024 positions (the release's rope shape at CPU sizes).
_CPU = cpu_presets("gpt-oss", head_dim=32, rope_theta=150000.0, num_local_experts=8, num_experts_per_tok=2,
                   rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=1024, truncate=False))
PRESETS: dict[str, dict[str, Any]] = {
    "gpt-oss-120b": {},
    "gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-tiny": {**_CPU["gpt-oss-tiny"], "intermediate_size": 64, "sliding_window": 32},
    "gpt-oss-small": {**_CPU["gpt-oss-small"], "intermediate_size": 128, "sliding_window": 64},
}


@dataclasses.dataclass(frozen=True)
class GptOssConfig(MoEDecoderConfig, model_type="gpt_oss", architecture="GptOssForCausalLM", qk_norm=False,
                   presets=PRESETS, defaults=GPT_OSS_120B, hf_extras={"attention_dropout": 0.0},
                   experts=ExpertFields("num_local_experts", "intermediate_size", True)):  # softmax over the top k
    """GPT-OSS hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = GptOssConfig.preset("gpt-oss-20b")
    >>> cfg = GptOssConfig.from_hf("/path/to/gpt-oss-20b")        # a directory with config.json, or its dict
    >>> counts = cfg.num_parameters()
    >>> round(counts.total / 1e9, 2), round((counts.active - counts.embedding) / 1e9, 2)   # as published
    (20.91, 3.61)
    >>> [k.attention for k in cfg.layer_kinds()[:3]]
    ['sliding', 'full', 'sliding']
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "gpt_oss": dict(eos_token_id=None, router_aux_loss_coef=0.001),
    }

    HF_KV_HEADS_IF_ABSENT: ClassVar[int | None] = 8  # transformers' GptOssConfig default
    HF_HEAD_DIM_IF_ABSENT: ClassVar[int | None] = 64  # its default head_dim
    HF_HEAD_DIM_NULL_OK: ClassVar[bool] = False  # its strict config refuses "head_dim": null

    num_local_experts: int = 128
    sliding_window: int | None = 128  # None: the sliding layers see the whole context
    layer_types: tuple[str, ...] | None = None  # None: sliding, full, sliding, ... (``attention_types``)
    swiglu_limit: float | None = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        types = None if self.layer_types is None else tuple(self.layer_types)  # JSON gives a list
        object.__setattr__(self, "layer_types", None if types == self._alternating() else types)
        super().__post_init__()

    def _alternating(self) -> tuple[str, ...] | None:
        """transformers' default schedule: sliding, full, sliding, ... from layer 0."""
        if not isinstance(self.num_hidden_layers, int):
            return None
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers))

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Each layer's HF attention type: ``layer_types``, or the default alternation when None."""
        return self._alternating() if self.layer_types is None else self.layer_types

    def _problems(self) -> list[str]:
        p = super()._problems()
        if p:
            return p
        types = self.attention_types
        if len(types) != self.num_hidden_layers:
            p.append(f"layer_types has {len(types)} entries for num_hidden_layers={self.num_hidden_layers}")
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown:
            p.append(f"layer_types {unknown} are not supported; use {sorted(LAYER_TYPES)}")
        window = self.sliding_window
        if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
            p.append(f"sliding_window must be a positive integer or None, got {window!r}")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            p.append(f"swiglu_limit must be positive (or None: no clamp), got {self.swiglu_limit!r}")
        return p

    # ---- the layers ----
    def is_moe_layer(self, index: int) -> bool:
        return True

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(LayerKind(LAYER_TYPES[t], moe=True) for t in self.attention_types)

    def attention_options(self, kind: Any) -> dict[str, Any]:
        """Every layer has sinks; a sliding layer its window."""
        return {"window": self.sliding_window if kind.attention == "sliding" else None, "sinks": True}

    @property
    def router_options(self) -> dict[str, Any]:
        """``SparseMoE``'s keywords beyond softmax top-k: the router's logit bias, the experts' biases and their
        clamped SwiGLU."""
        return dict(router_bias=True, expert_bias=True, swiglu_limit=self.swiglu_limit,
                    swiglu_alpha=self.swiglu_alpha, swiglu_up_offset=1.0)

    # ---- Hugging Face config.json ----
    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> GptOssConfig:
        d = {k: v for k, v in d.items() if k != "hidden_act"}  # transformers' GPT-OSS never reads it
        if d.get("rope_scaling") is None and d.get("rope_parameters") is None:  # transformers' default rope
            d["rope_scaling"] = dict(HF_DEFAULT_ROPE)
        if "num_local_experts" not in d and "num_experts" in d:  # transformers' attribute_map alias
            d["num_local_experts"] = d["num_experts"]
        return super()._from_hf_dict(d, overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """``MoEDecoderConfig.to_hf_dict`` with every layer's type written out, and the default rope said so
        (``rope_scaling: null`` would read as transformers' default for GPT-OSS: YaRN x32)."""
        d = {**super().to_hf_dict(), "layer_types": list(self.attention_types)}
        if self.rope_scaling is None:
            d["rope_scaling"] = {"rope_type": "default"}
        return d

    # ---- sizes and cost ----
    def _layer_params(self) -> int:
        return super()._layer_params() + self.num_attention_heads  # + the sinks

    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """``MoEDecoderConfig``'s counts plus the router bias and the experts' biases (``k`` experts' of them
        active). The published "active" figures leave out the input embedding: ``active - embedding``."""
        counts = super().num_parameters(include_mtp=include_mtp)
        experts, k, width = self.num_local_experts, self.num_experts_per_tok, self.intermediate_size
        h, layers = self.hidden_size, self.num_moe_layers
        return ParameterCount(total=counts.total + layers * (experts + experts * (2 * width + h)),
                              active=counts.active + layers * (experts + k * (2 * width + h)),
                              embedding=counts.embedding)

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """``MoEDecoderConfig``'s, with each sliding layer's attention over its window: a query attends to
        ``min(i + 1, sliding_window)`` keys, not ``seq_len / 2`` on average."""
        flops = super().train_flops_per_token(seq_len, include_mtp=include_mtp)
        window = self.sliding_window
        if window is None or window >= seq_len:
            return flops
        sliding = sum(kind.attention == "sliding" for kind in self.layer_kinds())
        # per token and layer, forward + backward: 3 * 2 * heads * 2 * head_dim * (mean keys per query)
        full_keys = seq_len / 2
        window_keys = (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len
        per_key = 12 * self.num_attention_heads * self.head_dim
        return float(flops - sliding * per_key * (full_keys - window_keys))
