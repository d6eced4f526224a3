"""Glm5Config: GLM-5 hyper-parameters (HF ``model_type`` ``glm_moe_dsa``), named as in ``config.json``, plus presets.

GLM-5 is DeepSeek-V3.2's model (MLA, a lightning indexer choosing each query's ``index_topk`` keys, MoE routed by
sigmoid scores with a selection bias and ``routed_scaling_factor``) at its own sizes, so the config is a
``DeepSeekV3Config`` with GLM-5's defaults and what transformers' ``GlmMoeDsaConfig`` adds:
- the indexer ropes its first ``qk_rope_head_dim`` dims as consecutive pairs (``index_rope_interleave``; V3.2's
  rotates halves);
- ``indexer_types``: per layer ``"full"`` (runs its indexer) or ``"shared"`` (no indexer: attends to the keys the
  previous full layer chose). None means transformers' schedule, layer ``i`` full when
  ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0`` (every layer with the defaults);
- ``mlp_layer_types``: per layer ``"dense"`` or ``"sparse"`` (None: ``first_k_dense_replace`` dense, then sparse).
The class defaults are GLM-5's published shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_zoo.layers.rope import YarnScaling
from nnx_zoo.models.deepseek.config import PRESETS as DEEPSEEK_PRESETS
from nnx_zoo.models.deepseek.config import DeepSeekV3Config

INDEXER_TYPES = ("full", "shared")
MLP_LAYER_TYPES = ("dense", "sparse")
# transformers' GlmMoeDsaForCausalLM: keys a config.json may leave out where its defaults differ from ours (its
# rope_theta defaults to 10000; it has no MTP layers), and what it cannot express.
_HF = {"glm_moe_dsa": dict(
    name="GlmMoeDsaForCausalLM", defaults=dict(rope_theta=10000.0, num_nextn_predict_layers=0),
    fixed=dict(topk_method="noaux_tc", rope_interleave=True, index_rope_interleave=True), routers=("noaux_tc",),
    head_dim_null=False)}  # its config class type-checks head_dim (an int; the rope width, whatever the file says)


def _tuple_or_none(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def indexer_schedule(layers: int, freq: int = 1, offset: int = 2) -> tuple[str, ...]:
    """transformers' per-layer indexer kinds from ``index_topk_freq`` / ``index_skip_topk_offset``: layer ``i``
    is ``'full'`` when ``max(i - offset + 1, 0) % freq == 0``, else ``'shared'``."""
    return tuple("full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(layers))


@dataclasses.dataclass(frozen=True)
class Glm5Config(DeepSeekV3Config):
    """GLM-5 hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = Glm5Config.preset("glm5-744b")
    >>> cfg = Glm5Config.from_hf("/path/to/GLM-5")                 # a directory with config.json, or its dict
    >>> cfg = Glm5Config.preset("glm5-tiny", num_hidden_layers=2)  # layer 0 runs the indexer, layer 1 reuses it
    >>> [cfg.reuses_topk(i) for i in range(2)]
    [False, True]
    """

    HF_ARCHITECTURES: ClassVar[dict[str, dict[str, Any]]] = _HF

    # GLM-5 (zai-org/GLM-5): transformers' GlmMoeDsaConfig defaults, which are the checkpoint's, with its rope_theta.
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    first_k_dense_replace: int = 3
    num_attention_heads: int = 64
    q_lora_rank: int | None = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int | None = 1
    topk_group: int | None = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 202752
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_rope_interleave: bool = True
    # ---- GLM-5's own (written to config.json) ----
    indexer_types: tuple[str, ...] | None = None  # per layer 'full' | 'shared'; None: the freq / offset schedule
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    mlp_layer_types: tuple[str, ...] | None = None  # per layer 'dense' | 'sparse'; None: first_k_dense_replace

    def __post_init__(self) -> None:
        object.__setattr__(self, "indexer_types", _tuple_or_none(self.indexer_types))  # JSON gives lists
        object.__setattr__(self, "mlp_layer_types", _tuple_or_none(self.mlp_layer_types))
        super().__post_init__()

    def _problems(self) -> list[str]:
        p: list[str] = []
        layers = self.num_hidden_layers
        for name, allowed in (("indexer_types", INDEXER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            kinds = getattr(self, name)
            if kinds is not None and (not isinstance(kinds, tuple) or len(kinds) != layers
                                      or any(k not in allowed for k in kinds)):
                p.append(f"{name} must be None or {layers} (num_hidden_layers) values each one of {allowed}, got "
                         f"{kinds!r}")
        if not isinstance(self.index_topk, int) or isinstance(self.index_topk, bool) or self.index_topk <= 0:
            # transformers' GLM-5 attention always runs the indexer: top-0 would leave every key masked
            p.append(f"index_topk must be a positive integer (GLM-5's attention is always sparse), got "
                     f"{self.index_topk!r}")
        for name in ("index_topk_freq", "index_skip_topk_offset"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                p.append(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        return p or super()._problems()  # the layer kinds must be readable before the rest is checked

    # ---- per-layer structure ----
    def layer_indexer_types(self) -> tuple[str, ...]:
        """Each layer's indexer kind, ``'full'`` or ``'shared'`` (``indexer_types``, or transformers' schedule)."""
        if self.indexer_types is not None:
            return self.indexer_types
        return indexer_schedule(self.num_hidden_layers, self.index_topk_freq, self.index_skip_topk_offset)

    def layer_mlp_types(self) -> tuple[str, ...]:
        """Each layer's MLP, ``'dense'`` or ``'sparse'`` (``mlp_layer_types``, or ``first_k_dense_replace``)."""
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types
        dense = min(self.first_k_dense_replace, self.num_hidden_layers)
        return ("dense",) * dense + ("sparse",) * (self.num_hidden_layers - dense)

    def is_moe_layer(self, index: int) -> bool:
        return self.layer_mlp_types()[index] == "sparse"

    def reuses_topk(self, index: int) -> bool:
        return self.layer_indexer_types()[index] == "shared"

    @property
    def hf_model_type(self) -> str:
        return "glm_moe_dsa"

    # ---- Hugging Face config.json ----
    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Glm5Config:
        d = dict(d)
        if d.get("num_experts") is not None:  # transformers' backward-compatible name
            d["n_routed_experts"] = d["num_experts"]
        layers = d.get("num_hidden_layers", cls.num_hidden_layers)
        pattern = d.get("index_topk_pattern")
        if d.get("indexer_types") is None and pattern is not None:  # "FSSF..." (or a list), as transformers reads it
            d["indexer_types"] = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        written = d.get("indexer_types")
        if isinstance(written, list) and isinstance(layers, int) and tuple(written) == indexer_schedule(
                layers, d.get("index_topk_freq", 1), d.get("index_skip_topk_offset", 2)):
            d["indexer_types"] = None  # transformers writes its schedule out: keep it as the schedule
        mlp = d.get("mlp_layer_types")
        if isinstance(mlp, list) and isinstance(layers, int):
            leading = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
            if mlp == ["dense"] * leading + ["sparse"] * (len(mlp) - leading):  # first_k_dense_replace's pattern
                d["mlp_layer_types"], d["first_k_dense_replace"] = None, leading
            else:  # transformers builds from mlp_layer_types alone; first_k_dense_replace only derives it
                d["first_k_dense_replace"] = min(d.get("first_k_dense_replace", cls.first_k_dense_replace), layers)
        return super()._from_hf_dict(d, overrides)  # type: ignore[return-value]

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers' ``GlmMoeDsaConfig`` dict: DeepSeek's keys, the layer kinds written out (transformers
        reads ``indexer_types`` and ``mlp_layer_types`` before its schedules), and the schedule's knobs."""
        d = super().to_hf_dict()
        d.update(indexer_types=list(self.layer_indexer_types()), index_topk_freq=self.index_topk_freq,
                 index_skip_topk_offset=self.index_skip_topk_offset, mlp_layer_types=list(self.layer_mlp_types()))
        return d


# The CPU presets: deepseek3-mini's / -small's dims with GLM-5's routing (no group limit, routed scaling 2.5), a
# value head wider than the nope part (as GLM-5's 256 over 192), a 4 x 32 (8 x 32) indexer keeping 32 (64) keys,
# and every second layer reusing the previous layer's top-k (index_topk_freq 2, offset 1: full, shared, ...).
_CPU = dict(n_group=1, topk_group=1, routed_scaling_factor=2.5, rope_theta=1000000.0, index_topk_freq=2,
            index_skip_topk_offset=1)
PRESETS: dict[str, dict[str, Any]] = {
    # GLM-5 (zai-org/GLM-5, Feb 2026; GLM-5.1 has the same shape): transformers' GlmMoeDsaConfig defaults (its
    # docstring names that checkpoint) and rope_theta 1e6 without YaRN (TensorRT-LLM's GLM-5 serving notes); one
    # MTP layer (the GLM-5 report's table: 3 dense + 75 MoE layers, 1 MTP layer, 64 heads, an indexer of 32 x
    # 128). 743.8B parameters, 40.3B active; 753.9B with the MTP layer (the hub's "754B"); the report: 744B / 40B.
    "glm5-744b": dict(num_nextn_predict_layers=1),
    "glm5-tiny": dict({k: v for k, v in DEEPSEEK_PRESETS["deepseek3-mini"].items()}, v_head_dim=48, index_topk=32,
                      index_n_heads=4, index_head_dim=32, **_CPU),
    "glm5-small": dict({k: v for k, v in DEEPSEEK_PRESETS["deepseek3-small"].items()}, v_head_dim=48,
                       index_topk=64, index_n_heads=8, index_head_dim=32, **_CPU),
}
Glm5Config.PRESETS = PRESETS
