"""DeepSeekV4Config: DeepSeek-V4's hyper-parameters, named as in Hugging Face ``config.json``, plus presets.

The class defaults are DeepSeek-V4-Flash (284B total, 13B active). What V4 is, per layer: attention over a
sliding window of ``sliding_window`` tokens with per-head sinks, plus, on ``compressed_sparse_attention`` layers,
one pooled entry per ``compress_rate_csa`` tokens (overlapping windows) of which the lightning indexer picks
``index_topk`` per query, or on ``heavily_compressed_attention`` layers one entry per ``compress_rate_hca`` tokens,
all visible; one shared K = V head of ``head_dim``; a grouped low-rank output projection (``o_groups`` x
``o_lora_rank``); ``hc_mult`` hyper-connection residual streams; an MoE MLP in every layer, routed by a frozen
token-id table on ``hash_moe`` layers and by ``sqrt(softplus)`` scores plus a selection bias on ``moe`` layers,
with a shared expert, both with the clamped SwiGLU (``swiglu_limit``). Fields after ``initializer_range`` are
nnx_zoo's own and are not written to HF.

Hub files (DeepSeek's own ``config.json``) give the schedule as ``compress_ratios`` (one ratio per layer, 0 =
sliding only, plus one for the MTP layer) and ``num_hash_layers``, and YaRN as a legacy ``rope_scaling``;
transformers 5 writes ``layer_types``, ``mlp_layer_types``, ``compress_rates`` and nested ``rope_parameters``
(``main`` / ``compress``). Both are read; the second is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from nnx_zoo.layers.pipeline import pipeline_chunk
from nnx_zoo.layers.rope import YarnScaling
from nnx_zoo.models.decoder_config import FamilyConfig, ParameterCount

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, TOPK_MOE = "hash_moe", "moe"
MLP_LAYER_TYPES = (HASH_MOE, TOPK_MOE)
ATTENTION_IMPLS = ("auto", "xla", "blockwise")  # V4's attention kernel (nnx_zoo.models.deepseek4.kernel)
INDEXER_TRAINING = ("off", "dense_warmup", "sparse")

# V4-Flash's YaRN over the compressed layers' rope (hub: rope_scaling, factor 16 over 65,536 positions).
_FLASH_YARN = YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0,
                          attention_factor=1.0)


def flash_schedule(layers: int) -> tuple[str, ...]:
    """V4-Flash's attention schedule: two sliding-only layers, then CSA and HCA alternating (CSA first)."""
    return tuple(SLIDING if i < 2 else (CSA if i % 2 == 0 else HCA) for i in range(layers))


def pro_schedule(layers: int) -> tuple[str, ...]:
    """V4-Pro's (transformers' default): two HCA layers, then HCA and CSA alternating (HCA first)."""
    return tuple(HCA if i < 2 or (i - 2) % 2 == 0 else CSA for i in range(layers))


def hash_schedule(layers: int, hash_layers: int = 3) -> tuple[str, ...]:
    """The MLP schedule: the first ``hash_layers`` layers hash-routed, the rest top-k routed."""
    return tuple(HASH_MOE if i < hash_layers else TOPK_MOE for i in range(layers))


@dataclasses.dataclass(frozen=True)
class DeepSeekV4Config(FamilyConfig):
    """DeepSeek-V4 hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = DeepSeekV4Config.preset("deepseek4-flash")
    >>> round(cfg.num_parameters().total / 1e9), round(cfg.num_parameters().active / 1e9)
    (284, 13)
    >>> cfg = DeepSeekV4Config.from_hf("/path/to/DeepSeek-V4-Flash")   # hub or transformers-5 config.json
    >>> DeepSeekV4Config.preset("deepseek4-tiny").layer_types
    ('sliding_attention', 'compressed_sparse_attention', 'heavily_compressed_attention', ...)
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {"deepseek_v4": {"head_dim": 512}}

    INDEXER_STAGES: ClassVar[tuple[str, ...]] = INDEXER_TRAINING
    KERNEL_OPTIONS: ClassVar[Mapping[str, tuple[str, ...]]] = {"attention_impl": ATTENTION_IMPLS}
    REQUIRED_HF_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
        "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "o_groups", "o_lora_rank")

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64  # the trailing rope part of each head (HF: head_dim * partial_rotary_factor)
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0  # the sliding-only layers' rope base (plain rope)
    compress_rope_theta: float = 160000.0  # the compressed layers' (and their indexers') rope base
    rope_scaling: YarnScaling | None = _FLASH_YARN  # YaRN on the compressed layers' rope; a dict is converted
    layer_types: tuple[str, ...] = flash_schedule(43)
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    mlp_layer_types: tuple[str, ...] = hash_schedule(43)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    initializer_range: float = 0.02
    # ---- nnx_zoo only ----
    dtype: str = "float32"
    param_dtype: str = "float32"
    moe_impl: str = "auto"  # 'auto' | 'dense' | 'gmm' | 'ep' (nnx_zoo.layers.moe)
    grouped_matmul_impl: str = "auto"  # the gmm path's kernel (nnx_zoo.layers.grouped_matmul)
    moe_capacity_factor: float | None = None  # 'ep' only
    scan_layers: bool = True  # scan each run of same-kind layers (one compiled body per kind); False unrolls
    remat_policy: str = "none"
    attention_impl: str = "auto"  # V4 attention: 'xla' (scores over every key, the reference) | 'blockwise'
    # (query blocks over their window and chosen entries: memory linear in the context) | 'auto'
    seq_aux_loss_alpha: float = 0.0  # weight of the sequence-wise balance loss (V3's eq. 17-20); 0 = off
    indexer_training: str = "off"  # the CSA indexer's signal: 'off' | 'dense_warmup' | 'sparse' (V3.2's stages)
    indexer_loss_weight: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _compress_yarn(self.rope_scaling, self.max_position_embeddings))
        for name in ("layer_types", "mlp_layer_types"):
            types = getattr(self, name)
            if isinstance(types, (list, tuple)) and isinstance(self.num_hidden_layers, int):
                # Longer schedules are cut to the layers (as transformers does): a preset with fewer layers keeps
                # the start of its schedule.
                object.__setattr__(self, name, tuple(types)[: self.num_hidden_layers])
        self._canonical_dtypes()
        self._raise_problems()

    @property
    def mtp_depth(self) -> int:
        """``FamilyConfig.mtp_depth``: one depth per MTP head (``num_nextn_predict_layers``)."""
        return self.num_nextn_predict_layers

    def _problems(self) -> list[str]:
        p: list[str] = []
        positive = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "head_dim", "qk_rope_head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts",
                    "max_position_embeddings", "compress_rate_csa", "compress_rate_hca", "hc_mult",
                    "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
                    "index_head_dim", "index_topk")
        for name in positive:
            if not _positive_int(getattr(self, name)):
                p.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if p:
            return p
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            p.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most head_dim={self.head_dim} and "
                     f"index_head_dim={self.index_head_dim} (rope rotates the trailing pairs of both)")
        if self.num_attention_heads % self.o_groups:
            p.append(f"o_groups={self.o_groups} must divide num_attention_heads={self.num_attention_heads} (each "
                     "group projects whole heads)")
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) != self.num_hidden_layers:
                p.append(f"{name} has {len(types)} entries; num_hidden_layers={self.num_hidden_layers} needs one per "
                         "layer")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                p.append(f"{name} entries must be one of {allowed}, got {bad}")
        if self.scoring_func != "sqrtsoftplus":
            p.append(f"scoring_func={self.scoring_func!r} is not supported: DeepSeek-V4 routes on sqrt(softplus) "
                     "scores ('sqrtsoftplus')")
        if self.norm_topk_prob is not True:
            p.append("norm_topk_prob must be true: transformers' DeepSeek-V4 routers always divide the chosen weights "
                     "by their sum")
        if self.n_shared_experts != 1:
            p.append(f"n_shared_experts={self.n_shared_experts!r}: DeepSeek-V4 has exactly one shared expert of width "
                     "moe_intermediate_size (transformers builds one whatever the field says); use 1")
        if self.num_experts_per_tok > self.n_routed_experts:
            p.append(f"num_experts_per_tok={self.num_experts_per_tok} must be <= n_routed_experts="
                     f"{self.n_routed_experts}")
        if not isinstance(self.num_nextn_predict_layers, int) or self.num_nextn_predict_layers < 0:
            p.append(f"num_nextn_predict_layers must be a non-negative integer, got {self.num_nextn_predict_layers!r}")
        for name in ("rms_norm_eps", "rope_theta", "compress_rope_theta", "initializer_range", "routed_scaling_factor",
                     "swiglu_limit", "hc_eps"):
            if not _is_number(getattr(self, name)) or not getattr(self, name) > 0:
                p.append(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            p.append(f"rope_scaling must be None, a YarnScaling or an HF yarn dict, got {self.rope_scaling!r}")
        if self.indexer_training not in INDEXER_TRAINING:
            p.append(f"indexer_training must be one of {INDEXER_TRAINING}, got {self.indexer_training!r}")
        if self.moe_capacity_factor is not None and self.moe_impl != "ep":
            p.append(f"moe_capacity_factor is only used by moe_impl='ep' (got moe_impl={self.moe_impl!r})")
        if not _is_number(self.seq_aux_loss_alpha) or self.seq_aux_loss_alpha < 0:
            p.append(f"seq_aux_loss_alpha must be a number >= 0, got {self.seq_aux_loss_alpha!r}")
        if not _is_number(self.indexer_loss_weight) or self.indexer_loss_weight < 0:
            p.append(f"indexer_loss_weight must be a number >= 0, got {self.indexer_loss_weight!r}")
        if self.indexer_training != "off" and CSA not in self.layer_types:
            p.append(f"indexer_training={self.indexer_training!r} needs a lightning indexer: no layer is "
                     f"{CSA!r}")
        return p

    # ---- derived ----
    def compress_rate(self, layer_type: str) -> int:
        """How many tokens one compressed entry pools on a layer of this type (0: sliding only)."""
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[layer_type]

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        """``(attention type, MLP type)`` of each layer: layers of one kind share a stack of parameters."""
        return tuple(zip(self.layer_types, self.mlp_layer_types, strict=True))

    @property
    def hash_prefix(self) -> int:
        """How many leading layers are hash-routed (``num_hash_layers``): under a ``stage`` axis they run before the
        pipeline, their stacks whole on every stage."""
        return next((i for i, (_, mlp) in enumerate(self.layer_kinds) if mlp != HASH_MOE), self.num_hidden_layers)

    def check_pipeline(self, stages: int, virtual_stages: int = 1) -> tuple[str, ...]:
        """The stack names of one pipeline chunk's layers when the top-k routed layers after the hash-routed prefix
        split into ``stages * virtual_stages`` identical chunks of kinds; else a ``ValueError`` saying how to fix it
        (hash-routed layers that are not the first ones, or a layer sequence that does not split: the chunk counts
        that fit, ``nnx_zoo.layers.pipeline.pipeline_chunk``). The recipe calls it before building the model."""
        prefix = self.hash_prefix
        late = [i for i in range(prefix, self.num_hidden_layers) if self.mlp_layer_types[i] == HASH_MOE]
        if late:
            raise ValueError(f"DeepSeek-V4 runs its hash-routed layers before the pipeline, so they must be the first "
                             f"layers; this config's layers {late} are hash-routed after top-k ones (mlp_layer_types). "
                             "Make them the first ones (as num_hash_layers does), or train on a mesh without 'stage'")
        piped = [kind_name(kind) for kind in self.layer_kinds[prefix:]]
        try:
            return pipeline_chunk(piped, stages, virtual_stages, suffix_advice=False)  # V4 has no pipeline_layers
        except ValueError as e:
            raise ValueError(f"DeepSeek-V4 pipelines its {len(piped)} top-k routed layers (num_hidden_layers "
                             f"{self.num_hidden_layers} after {prefix} hash-routed ones, which run before the "
                             f"pipeline): {e}") from None

    @property
    def num_moe_layers(self) -> int:
        """Every V4 layer is an MoE layer (the trainer's expert load covers them all, in model order)."""
        return self.num_hidden_layers

    @property
    def num_routed_experts(self) -> int:
        return self.n_routed_experts

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def shared_expert_intermediate_size(self) -> int:
        """One shared expert of the routed experts' width (transformers builds one whatever n_shared_experts)."""
        return self.moe_intermediate_size

    @property
    def num_key_value_heads(self) -> int:
        return 1  # one shared key-value head

    @property
    def has_routing_bias(self) -> bool:
        """Whether any layer selects on a bias that aux-loss-free balancing moves (the top-k layers do)."""
        return TOPK_MOE in self.mlp_layer_types or self.num_nextn_predict_layers > 0

    @property
    def routers_train(self) -> bool:
        return self.indexer_training != "dense_warmup"

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        return self.head_dim, self.head_dim

    def sparse_attention_keys(self, seq_len: int) -> int:
        """How many compressed entries a CSA query attends to at most (its top-k), 0 when every entry is chosen
        (the indexer's dense warm-up, or a context with at most ``index_topk`` entries)."""
        entries = seq_len // self.compress_rate_csa
        if CSA in self.layer_types and self.index_topk < entries and self.indexer_training != "dense_warmup":
            return self.index_topk
        return 0

    def training_notes(self, trained: int, total: int, *, pretrained: bool) -> list[str]:
        """What a run trains, for its log: the CSA indexers' stage."""
        if CSA not in self.layer_types:
            return []
        stage = self.indexer_training
        if stage == "dense_warmup":
            return [f"indexer warm-up: every compressed entry attended to, training the CSA indexers only ({trained:,} "
                    f"parameters), the rest frozen ({total - trained:,}); metric indexer_loss"]
        if stage == "sparse":
            return [f"indexer sparse stage: each CSA query attends to its top {self.index_topk} compressed entries; "
                    "the indexers train on their KL over them from detached inputs (metric indexer_loss)"]
        return [f"CSA indexers pick {self.index_topk} compressed entries per query and stay frozen (--indexer-stage "
                "off)"]

    # ---- Hugging Face config.json ----
    @classmethod
    def hf_model_types(cls) -> tuple[str, ...]:
        return ("deepseek_v4",)

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> DeepSeekV4Config:
        model_type = d.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ValueError(f"model_type {model_type!r} is not 'deepseek_v4': DeepSeekV4Config cannot read it")
        problems = []
        if "head_dim" in d and d["head_dim"] is None and "head_dim" not in overrides:  # absent: the default, 512
            problems.append("head_dim is null: transformers' DeepseekV4Config cannot build that model (it needs an "
                            "integer); write the head width (V4-Flash and V4-Pro: 512), or pass head_dim=...")
        if d.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        for flag in ("mlp_bias", "attention_bias"):
            if d.get(flag):
                problems.append(f"{flag}=true is not supported (DeepSeek-V4 has no such biases)")
        if d.get("num_key_value_heads", 1) != 1:
            problems.append(f"num_key_value_heads={d['num_key_value_heads']}: DeepSeek-V4 has one shared K = V head")
        if d.get("output_router_logits"):
            problems.append("output_router_logits=true: transformers would add a Switch loss over softmax router "
                            "probabilities that V4's sqrt(softplus) router does not route by; balance V4 with the "
                            "routing bias (--routing-bias-rate) or seq_aux_loss_alpha instead")
        rates = dict(d.get("compress_rates") or {})
        csa = int(d.get("compress_rate_csa", rates.get(CSA, cls.compress_rate_csa)))
        hca = int(d.get("compress_rate_hca", rates.get(HCA, cls.compress_rate_hca)))
        layers = d.get("num_hidden_layers")
        kwargs: dict[str, Any] = {}
        if d.get("layer_types") is not None:
            kwargs["layer_types"] = tuple(d["layer_types"])[:layers]
        elif d.get("compress_ratios") is not None:
            by_ratio = {0: SLIDING, csa: CSA, hca: HCA}
            unknown = sorted({r for r in d["compress_ratios"] if r not in by_ratio})
            if unknown:
                problems.append(f"compress_ratios holds {unknown}: only 0 (sliding), {csa} (CSA) and {hca} (HCA) are "
                                "layer types")
            else:
                kwargs["layer_types"] = tuple(by_ratio[r] for r in d["compress_ratios"][:layers])
        elif layers is not None:
            kwargs["layer_types"] = pro_schedule(layers)  # transformers' default when the file gives none
        if d.get("mlp_layer_types") is not None:
            kwargs["mlp_layer_types"] = tuple(d["mlp_layer_types"])[:layers]
        elif layers is not None:
            kwargs["mlp_layer_types"] = hash_schedule(layers, int(d.get("num_hash_layers", 3)))
        if problems:
            raise ValueError("unsupported config:\n  - " + "\n  - ".join(problems))
        rope = d.get("rope_parameters") or {}
        if isinstance(rope, Mapping) and isinstance(rope.get("main"), Mapping):
            main, compress = dict(rope["main"]), dict(rope.get("compress") or {})
            if main.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters.main must be the default rope (DeepSeek-V4's sliding layers), got "
                                 f"{main.get('rope_type')!r}")
            kwargs["rope_theta"] = float(main.get("rope_theta", d.get("rope_theta", cls.rope_theta)))
            kwargs["compress_rope_theta"] = float(compress.get("rope_theta", d.get("compress_rope_theta",
                                                                                   cls.compress_rope_theta)))
            factor = main.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        else:  # hub files: a legacy rope_scaling (or flat rope_parameters) describes the compressed layers' YaRN
            compress = dict(d.get("rope_scaling") or rope or {})
            kwargs["rope_theta"] = float(d.get("rope_theta", cls.rope_theta))
            kwargs["compress_rope_theta"] = float(d.get("compress_rope_theta", cls.compress_rope_theta))
            factor = d.get("partial_rotary_factor")
        kind = compress.get("rope_type", compress.get("type", "default"))
        kwargs["rope_scaling"] = None if kind == "default" else {**compress, "rope_type": kind}
        head_dim = d.get("head_dim") or cls.head_dim
        if factor is not None:  # transformers: the factor decides; a legacy qk_rope_head_dim only without one
            kwargs["qk_rope_head_dim"] = int(head_dim * factor)
        elif "qk_rope_head_dim" in d:
            kwargs["qk_rope_head_dim"] = int(d["qk_rope_head_dim"])
        else:
            kwargs["qk_rope_head_dim"] = int(head_dim * 64 / 512)  # transformers' default_partial_rotary_factor
        names = {f.name for f in dataclasses.fields(cls)}
        plain = {k: v for k, v in d.items() if k in names and k not in kwargs and k not in (
            "rope_scaling", "dtype", "compress_rate_csa", "compress_rate_hca")}
        try:
            return cls(**{**plain, **kwargs, "compress_rate_csa": csa, "compress_rate_hca": hca, **overrides})
        except TypeError as err:
            raise ValueError(f"a config value has the wrong type: {err}") from err

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict as transformers 5 writes DeepSeek-V4 (``layer_types``, ``mlp_layer_types``,
        ``compress_rates``, nested ``rope_parameters``)."""
        skip = {"rope_scaling", "compress_rate_csa", "compress_rate_hca", "layer_types", "mlp_layer_types"}
        d: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                d[f.name] = getattr(self, f.name)
            if f.name == "initializer_range":
                break
        factor = self.qk_rope_head_dim / self.head_dim
        compress: dict[str, Any] = {"rope_type": "default"}
        if self.rope_scaling is not None:
            compress = {k: v for k, v in self.rope_scaling.to_dict().items() if k != "type"}
        d.update(layer_types=list(self.layer_types), mlp_layer_types=list(self.mlp_layer_types),
                 compress_rates={CSA: self.compress_rate_csa, HCA: self.compress_rate_hca},
                 partial_rotary_factor=factor, num_key_value_heads=1, hidden_act="silu", attention_bias=False,
                 mlp_bias=False, torch_dtype=self.param_dtype, use_cache=True,
                 rope_parameters={"main": {"rope_type": "default", "rope_theta": self.rope_theta,
                                           "partial_rotary_factor": factor},
                                  "compress": {**compress, "rope_theta": self.compress_rope_theta,
                                               "partial_rotary_factor": factor}})
        return d

    # ---- sizes and cost ----
    def _attention_params(self, layer_type: str) -> int:
        h, heads, d, q = self.hidden_size, self.num_attention_heads, self.head_dim, self.q_lora_rank
        out = h * q + q + q * heads * d + h * d + d + heads * d * self.o_lora_rank
        out += self.o_groups * self.o_lora_rank * h + heads
        rate = self.compress_rate(layer_type)
        if rate:
            width = 2 * d if layer_type == CSA else d  # CSA pools two overlapping series
            out += 2 * h * width + rate * width + d
        if layer_type == CSA:
            ih, idim = self.index_n_heads, self.index_head_dim
            out += 2 * h * 2 * idim + rate * 2 * idim + idim + q * ih * idim + h * ih
        return out

    def _hc_params(self) -> int:
        n, h = self.hc_mult, self.hidden_size
        mix = (2 + n) * n
        return n * h * mix + mix + 3

    def _layer_params(self, layer_type: str) -> tuple[int, int]:
        """(all parameters, those of the routed experts a token does not use) of one decoder layer."""
        h, e, k, i = self.hidden_size, self.n_routed_experts, self.num_experts_per_tok, self.moe_intermediate_size
        moe = e * h + 3 * e * h * i + 3 * h * i
        total = self._attention_params(layer_type) + 2 * h + 2 * self._hc_params() + moe
        return total, (e - k) * 3 * h * i

    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """Parameter counts (buffers are not parameters: the routers' selection bias, the hash tables)."""
        h, v, n = self.hidden_size, self.vocab_size, self.hc_mult
        head = n * h * n + n + 1
        total = v * h + (0 if self.tie_word_embeddings else v * h) + h + head
        idle = 0
        for layer_type in self.layer_types:
            layer, unused = self._layer_params(layer_type)
            total, idle = total + layer, idle + unused
        if include_mtp:
            layer, unused = self._layer_params(SLIDING)
            per_depth = layer + 2 * h + 2 * h * h + h + head  # enorm, hnorm, e_proj, h_proj, its norm and head
            total, idle = total + self.num_nextn_predict_layers * per_depth, idle + (
                self.num_nextn_predict_layers * unused)
        return ParameterCount(total=total, active=total - idle, embedding=v * h)

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """Training FLOPs per token: ``6 * (active matmul parameters) + attention``. A query attends to at most
        ``sliding_window`` raw keys, plus on CSA layers ``min(index_topk, visible entries)`` compressed entries and
        on HCA layers every visible entry (``seq_len / 2 / rate`` on average); each key costs ``2 * 2 * head_dim``
        multiply-adds per head forward (scores and values), times 3 for forward + backward. The CSA indexer adds
        its scores over every visible entry, ``index_n_heads * index_head_dim`` each, forward (x3 when trained)."""
        counts = self.num_parameters(include_mtp=include_mtp)
        matmul = counts.active - (0 if self.tie_word_embeddings else counts.embedding)
        heads, d = self.num_attention_heads, self.head_dim
        types = list(self.layer_types) + ([SLIDING] * self.num_nextn_predict_layers if include_mtp else [])
        keys = 0.0
        indexer = 0.0
        for layer_type in types:
            keys += min(self.sliding_window, seq_len / 2)
            rate = self.compress_rate(layer_type)
            if rate:
                visible = seq_len / 2 / rate
                keys += min(self.index_topk, visible) if layer_type == CSA else visible
            if layer_type == CSA:
                passes = 1 if self.indexer_training == "off" else 3
                indexer += passes * 2 * (seq_len / 2 / rate) * self.index_n_heads * self.index_head_dim
        return float(6 * matmul + 3 * 4 * keys * heads * d + indexer)


def _compress_yarn(rope: Mapping[str, Any], max_position_embeddings: int) -> YarnScaling | None:
    """The compressed layers' YaRN from an HF rope dict; as transformers does for V4, ``attention_factor`` is 1
    unless the dict sets it (the reference never scales cos/sin by YaRN's mscale)."""
    kind = rope.get("rope_type", rope.get("type", "yarn"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"the compressed layers' rope must be 'default' or 'yarn', got {kind!r}")
    rope = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    rope.setdefault("attention_factor", 1.0)
    return YarnScaling.from_dict({**rope, "rope_type": "yarn"}, max_position_embeddings=max_position_embeddings)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tiny(layer_types: Sequence[str], **fields: Any) -> dict[str, Any]:
    layers = len(layer_types)
    return dict(vocab_size=32000, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, num_experts_per_tok=2,
                n_routed_experts=8, routed_scaling_factor=1.5, max_position_embeddings=4096,
                rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=1024, beta_fast=32.0,
                                         beta_slow=1.0, attention_factor=1.0),
                layer_types=tuple(layer_types), compress_rate_csa=4, compress_rate_hca=16,
                mlp_layer_types=hash_schedule(layers, 1), hc_mult=2, hc_sinkhorn_iters=20, sliding_window=16,
                o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=8,
                num_nextn_predict_layers=1, **fields)


PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V4-Flash (April 2026): 284B total, 13B active, 1M context. Dims: its config.json (43 layers, width
    # 4096, 64 heads of 512 with a 64-wide rope part, q_lora 1024, 8 output groups of 1024, 256 experts of 2048
    # top-6 plus one shared, the first 3 layers hash-routed, window 128, indexer 64 x 128 keeping 512, CSA every 4
    # and HCA every 128 tokens after two sliding-only layers, 4 hyper-connection streams, YaRN 16 over 65,536 on
    # the compressed layers' rope base 160,000, one MTP layer).
    "deepseek4-flash": {},
    # DeepSeek-V4-Pro: 1.6T total, 49B active. Dims as published (61 layers of width 7168, 128 heads of 512,
    # q_lora 1536, 16 output groups of 1024, 384 experts of 3072 top-6, routed scaling 2.5, indexer top-1024) and
    # transformers' default schedule for it (two HCA layers, then HCA / CSA alternating).
    "deepseek4-pro": dict(hidden_size=7168, moe_intermediate_size=3072, num_hidden_layers=61, num_attention_heads=128,
                          q_lora_rank=1536, n_routed_experts=384, routed_scaling_factor=2.5, o_groups=16,
                          index_topk=1024, layer_types=pro_schedule(61), mlp_layer_types=hash_schedule(61)),
    # ~10M parameters (8M embedding): every part acts at the recipe's default --seq-len 64: a 16-token window,
    # CSA entries every 4 tokens of which the indexer keeps 8, HCA entries every 16, 2 streams, 1 hash layer.
    "deepseek4-tiny": _tiny((SLIDING, CSA, HCA, CSA)),
    # ~17M parameters: 6 layers of width 256 (Pro's schedule), 16 experts top-4.
    "deepseek4-small": {**_tiny(pro_schedule(6)), "hidden_size": 256, "moe_intermediate_size": 128,
                        "num_attention_heads": 8, "o_groups": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
                        "mlp_layer_types": hash_schedule(6, 2)},
}
DeepSeekV4Config.PRESETS = PRESETS


def kind_name(kind: tuple[str, str]) -> str:
    """A stack's attribute-safe name: ``sliding_hash``, ``csa_moe``, ``hca_moe``, ..."""
    short = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}
    return f"{short[kind[0]]}_{'hash' if kind[1] == HASH_MOE else 'moe'}"
