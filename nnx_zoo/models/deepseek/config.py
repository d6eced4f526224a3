"""DeepSeekV3Config: the model's hyper-parameters, named as in Hugging Face ``config.json``, plus presets.

The class defaults are DeepSeek-V3 (671B total, 37B active). Fields after ``initializer_range`` are nnx_zoo's
own (compute/parameter dtype, MoE compute path, layer scanning, rematerialization) and are not written to HF.
DeepSeek-V2 (and V2-Lite) is the same model with another router: ``topk_method`` (``ROUTERS``) picks it.
DeepSeek-V3.2 is V3 plus DeepSeek Sparse Attention: ``index_topk > 0`` gives every MLA layer a lightning indexer
(``nnx_zoo.models.deepseek.indexer``). Together they decide which transformers architecture
(``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` / ``DeepseekV32ForCausalLM``, ``hf_model_type``) the
config is read from and written as.

A family built on DeepSeek's model (GLM-5, Mistral 4) subclasses this config and answers a few hooks its own way:
``HF_ARCHITECTURES`` (the transformers architecture it reads and writes), ``router``, ``is_moe_layer(i)``,
``reuses_topk(i)`` (a layer without an indexer attending to an earlier layer's choice), ``query_scale(positions)``
(a factor on each query), and the field ``index_rope_interleave``. DeepSeek's own code asks these, never a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax

from nnx_zoo.layers.pipeline import STAGE_AXIS, pipeline_chunk
from nnx_zoo.layers.rope import YarnScaling
from nnx_zoo.models.decoder_config import FamilyConfig, ParameterCount

# DeepSeek-V3.2's indexer training (the V3.2 report, section 2.1): 'off' (no indexer loss), 'dense_warmup' (dense
# attention; the indexer learns the attention distribution, the rest of the model frozen), 'sparse' (top-k
# attention; the indexer learns on its selected keys from detached inputs, the model from the LM loss alone).
INDEXER_TRAINING = ("off", "dense_warmup", "sparse")


class Router(NamedTuple):
    """How an MoE block picks its experts; one row of ``ROUTERS``, chosen by the config's ``topk_method`` (a
    family built on this config may name its own: its config's ``router``)."""

    scoring: str  # 'sigmoid' | 'softmax' of the float32 router logits
    group_top: int  # a group's score is the sum of its best ``group_top`` scores; 0: no group limit
    selection_bias: bool  # select on scores + e_score_correction_bias (a RouterBias Variable); weights unbiased
    hf_model_type: str  # the transformers architecture that routes this way (config.json is written as it)
    may_renormalize: bool = True  # whether norm_topk_prob=True is allowed (the references agree on it)


# topk_method (HF's name for it) -> Router. V3: sigmoid, group score = sum of the top 2 biased scores. V2
# (transformers' DeepseekV2TopkRouter): softmax, no bias; group_limited_greedy scores a group by its best expert.
ROUTERS: dict[str, Router] = {
    "noaux_tc": Router("sigmoid", 2, True, "deepseek_v3"),
    "greedy": Router("softmax", 0, False, "deepseek_v2", may_renormalize=False),
    "group_limited_greedy": Router("softmax", 1, False, "deepseek_v2", may_renormalize=False),
}
# Per transformers architecture: its class name; its defaults for keys a config.json may leave out, where they
# differ from ours; what it cannot express (fields that must hold these values, not written to config.json); the
# topk_method values (ROUTERS) it routes by (none: the config's router, whatever the file says); whether
# transformers builds a model from "head_dim": null (the key shapes nothing, but V3.2's config class type-checks it);
# and whether its checkpoints hold the fused expert tensors ("fused_experts": export writes them).
_NO_INDEXER = dict(index_topk=0)
_V3_ROUTERS = ("noaux_tc",)
_HF_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(name="DeepseekV3ForCausalLM", defaults=dict(topk_method="noaux_tc"), fixed=_NO_INDEXER,
                        routers=_V3_ROUTERS),
    # V3.2: V3 plus the indexer; its main MLA always rotates consecutive pairs, its indexer rotates halves.
    "deepseek_v32": dict(name="DeepseekV32ForCausalLM", defaults=dict(
        topk_method="noaux_tc", index_topk=2048, index_n_heads=64, index_head_dim=128, n_group=8, topk_group=4,
        first_k_dense_replace=3, num_nextn_predict_layers=0),
        fixed=dict(rope_interleave=True, index_rope_interleave=False), routers=_V3_ROUTERS, head_dim_null=False),
    "deepseek_v2": dict(name="DeepseekV2ForCausalLM", defaults=dict(
        topk_method="greedy", first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0,
        norm_topk_prob=False, n_group=None, topk_group=None, max_position_embeddings=2048),
        # V2 rotates consecutive pairs (complex multiplication) and has no multi-token-prediction layers.
        fixed=dict(rope_interleave=True, num_nextn_predict_layers=0, **_NO_INDEXER),
        routers=("greedy", "group_limited_greedy")),
    # Moonshot's Kimi K2 is the DeepSeek-V3 architecture: its config.json says model_type "kimi_k2" with
    # architectures ["DeepseekV3ForCausalLM"] (transformers itself reads a kimi_k2 text config as deepseek_v3, see
    # its Kimi_K25Config). It is read as V3 ("reads_as"); export writes deepseek_v3, which transformers loads.
    "kimi_k2": dict(name="DeepseekV3ForCausalLM", defaults=dict(topk_method="noaux_tc"), fixed=_NO_INDEXER,
                    reads_as="deepseek_v3", routers=_V3_ROUTERS),
}
# The decoder-layer stacks of a model (attribute names, each a scan over its layers): (is MoE, reuses an earlier
# layer's top-k). A stack holds its kind's layers in model order; ``DeepSeekV3Config.layer_stacks`` says which.
# ``prefix_moe_layers``: the MoE layers before the last ``pipeline_layers`` ones, run before the pipeline (a model
# without ``pipeline_layers`` has none); ``moe_layers`` is the stack a 'stage' axis pipelines.
LAYER_STACKS: dict[str, tuple[bool, bool]] = {
    "dense_layers": (False, False),
    "prefix_moe_layers": (True, False),
    "moe_layers": (True, False),
    "shared_topk_dense_layers": (False, True),
    "shared_topk_moe_layers": (True, True),
}

_V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                       mscale=1.0, mscale_all_dim=1.0)
_V2_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                       mscale=0.707, mscale_all_dim=0.707)


@dataclasses.dataclass(frozen=True)
class DeepSeekV3Config(FamilyConfig):
    """DeepSeek-V3 hyper-parameters (HF ``config.json`` names) and nnx_zoo run options.

    >>> cfg = DeepSeekV3Config.preset("deepseek3-small")
    >>> cfg = DeepSeekV3Config.from_hf("/path/to/checkpoint")   # a directory with config.json, or a dict
    >>> cfg.with_overrides(num_hidden_layers=2).num_parameters().total
    """

    # transformers' config class defaults where a config.json leaves the key out (FamilyConfig.HF_CLASS_DEFAULTS)
    HF_CLASS_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "deepseek_v3": {"max_position_embeddings": 4096}, "kimi_k2": {"max_position_embeddings": 4096},
    }

    # The transformers architectures this config reads and writes (see _HF_ARCHITECTURES); a family built on it
    # names its own.
    HF_ARCHITECTURES: ClassVar[dict[str, dict[str, Any]]] = _HF_ARCHITECTURES
    # config.json keys without which the model's shape is a guess (FamilyConfig.from_hf names the missing ones)
    INDEXER_STAGES: ClassVar[tuple[str, ...]] = INDEXER_TRAINING  # indexer_training's values (--indexer-stage)
    REQUIRED_HF_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_routed_experts", "num_experts_per_tok")

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int | None = 8  # None (as transformers writes it) only when the router has no group limit
    topk_group: int | None = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"  # the router (ROUTERS): 'noaux_tc' (V3), 'greedy' / 'group_limited_greedy' (V2)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = _V3_YARN  # a dict is accepted and converted
    rope_interleave: bool = True
    max_position_embeddings: int = 163840
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_nextn_predict_layers: int = 1
    # DeepSeek-V3.2 sparse attention (DSA): each query attends only to the index_topk earlier keys its lightning
    # indexer (index_n_heads heads of width index_head_dim) scores highest. 0: no indexer, dense MLA (V3, V2).
    index_topk: int = 0
    index_n_heads: int = 64
    index_head_dim: int = 128
    # The indexer's rope on its first qk_rope_head_dim dims: rotate-half (False, V3.2) or consecutive pairs (True).
    index_rope_interleave: bool = False
    initializer_range: float = 0.02
    # ---- nnx_zoo only ----
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of parameters
    moe_impl: str = "auto"  # 'dense': every expert on every token (small-scale reference); 'gmm': sort + grouped
    # matmul (grouped_matmul_impl below);
    # 'ep': expert parallelism over the mesh axes the rules map 'exp' to (falls back to 'gmm' without them);
    # 'auto': the measured fastest of dense/gmm on the backend (nnx_zoo.layers.moe.default_moe_impl)
    grouped_matmul_impl: str = "auto"  # the gmm path's grouped matmul: 'auto' | 'tiled' (portable) | 'xla'
    # (jax.lax.ragged_dot) | 'tokamax' | 'pallas_triton' (nnx_zoo.layers.grouped_matmul.choose_grouped_matmul_impl)
    moe_capacity_factor: float | None = None  # 'ep': <= ceil(cf * tokens * k / E) tokens per expert; None: dropless
    batch_split_factor: int = 1  # split each MoE layer's batch into this many micro-batches (1 = off)
    scan_layers: bool = True  # scan each layer stack (one compiled body); False unrolls it (debugging, same numbers)
    remat_policy: str = "none"  # 'none' | 'full' | 'dots_saveable' | 'dots_with_no_batch_dims_saveable'
    seq_aux_loss_alpha: float = 0.0  # weight of the sequence-wise balance loss (V3 paper eq. 17-20); 0 = off.
    # When > 0, model.forward(...) carries it as aux_loss, which the trainer adds to the loss.
    attention_impl: str = "auto"  # MLA's attention kernel: 'auto' | 'xla' (einsum, the reference) | 'blockwise'
    # (portable flash) | 'cudnn' | 'tokamax' (nnx_zoo.layers.attention.choose_attention_impl)
    indexer_training: str = "off"  # DSA's indexer signal (INDEXER_TRAINING): 'off' | 'dense_warmup' | 'sparse'
    indexer_loss_weight: float = 1.0  # the indexer's KL loss in the training loss (gradients reach only the indexer)
    # How many of the last MoE layers a 'stage' mesh axis pipelines (None: every MoE layer). The MoE layers before
    # them live in ``prefix_moe_layers`` (whole on every stage, like the dense prefix) and run before the pipeline
    # with it; without 'stage' the layers run in order, the same model. V3's 58 MoE layers on 16 stages: 48 (the
    # first 10 MoE layers outside). It changes the parameter tree, not the HF checkpoint (the key table maps both).
    pipeline_layers: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            rope = dict(self.rope_scaling)
            if rope.get("rope_type", rope.get("type", "yarn")) == "default":
                object.__setattr__(self, "rope_scaling", None)
            else:
                scaling = YarnScaling.from_dict(rope, max_position_embeddings=self.max_position_embeddings)
                object.__setattr__(self, "rope_scaling", scaling)
        self._canonical_dtypes()
        self._raise_problems()

    @property
    def mtp_depth(self) -> int:
        """``FamilyConfig.mtp_depth``: one depth per MTP head (``num_nextn_predict_layers``)."""
        return self.num_nextn_predict_layers

    def _problems(self) -> list[str]:
        p: list[str] = []
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                p.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            p.append(f"q_lora_rank must be a positive integer or None (no query compression), got {self.q_lora_rank!r}")
        if isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim % 2:
            p.append(f"qk_rope_head_dim must be even (rope rotates pairs), got {self.qk_rope_head_dim}")
        for name in ("n_shared_experts", "num_nextn_predict_layers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                p.append(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if not isinstance(self.first_k_dense_replace, int):
            p.append(f"first_k_dense_replace must be an integer, got {self.first_k_dense_replace!r}")
        elif isinstance(self.num_hidden_layers, int) and not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            p.append(f"first_k_dense_replace={self.first_k_dense_replace} must be in [0, num_hidden_layers="
                     f"{self.num_hidden_layers}]")
        counts = ("num_hidden_layers", "first_k_dense_replace", "num_nextn_predict_layers")
        if all(isinstance(getattr(self, n), int) for n in counts) and self.has_moe:  # else reported above
            p += self._moe_problems()
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            if not _is_number(getattr(self, name)) or not getattr(self, name) > 0:
                p.append(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            p.append(f"rope_scaling must be None, a YarnScaling or an HF rope dict, got {self.rope_scaling!r}")
        if self.moe_capacity_factor is not None:
            if not isinstance(self.moe_capacity_factor, (int, float)) or not self.moe_capacity_factor > 0:
                p.append(f"moe_capacity_factor must be a positive number or None (dropless), got "
                         f"{self.moe_capacity_factor!r}")
            elif self.moe_impl != "ep":
                p.append(f"moe_capacity_factor is only used by moe_impl='ep' (got moe_impl={self.moe_impl!r}); "
                         "the other paths are dropless")
        if not isinstance(self.batch_split_factor, int) or self.batch_split_factor < 1:
            p.append(f"batch_split_factor must be a positive integer (1 = off), got {self.batch_split_factor!r}")
        if not isinstance(self.seq_aux_loss_alpha, (int, float)) or self.seq_aux_loss_alpha < 0:
            p.append(f"seq_aux_loss_alpha must be a number >= 0 (0 = off), got {self.seq_aux_loss_alpha!r}")
        return p + self._indexer_problems() + self._pipeline_layers_problems()

    def _pipeline_layers_problems(self) -> list[str]:
        value = self.pipeline_layers
        if value is None or not isinstance(self.num_hidden_layers, int) or not isinstance(
                self.first_k_dense_replace, int):
            return []
        moe = self.num_moe_layers
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= moe:
            return [f"pipeline_layers={value!r} must be None (every MoE layer pipelined) or a count of MoE layers in "
                    f"[1, {moe}] (num_hidden_layers {self.num_hidden_layers} - first_k_dense_replace "
                    f"{self.first_k_dense_replace}): the last pipeline_layers MoE layers form the pipelined stack"]
        if self.shares_topk:
            return [f"pipeline_layers={value}: a model whose layers reuse an earlier layer's top-k pipelines every "
                    "MoE layer after the dense prefix; leave it None"]
        return []

    def check_pipeline(self, stages: int, virtual_stages: int = 1) -> None:
        """A ``ValueError`` saying which ``pipeline_layers`` fit when the pipelined MoE layers (the last
        ``pipeline_layers``, default all) do not split into ``stages * virtual_stages`` equal chunks; with layers
        reusing an earlier layer's top-k (GLM-5's shared layers) among them, when the chunks are not identical or
        a chunk starts with a reusing layer (the top-k would have to cross a stage)."""
        kinds = self.pipelined_kinds()
        if "shared_topk_moe_layers" in kinds:
            self._check_shared_chunks(kinds, stages, virtual_stages)
            return
        moe, chunks = len(self.layer_stacks()["moe_layers"]), stages * virtual_stages
        if moe % chunks == 0:
            return
        total = self.num_moe_layers
        fits = [n for n in range(total - total % chunks, 0, -chunks)][:3]
        counts = ", ".join(f"--model.pipeline_layers {n}: the first {total - n} MoE layers run before the pipeline"
                           for n in fits)
        others = [v for v in range(1, moe // stages + 1) if moe % (v * stages) == 0]
        fix = (f"--virtual-stages one of {others}" if virtual_stages > 1 and moe % stages == 0 else
               f"a '{STAGE_AXIS}' mesh size that divides {moe}")
        raise ValueError(f"the {moe} pipelined MoE layers (num_hidden_layers {self.num_hidden_layers} - "
                         f"first_k_dense_replace {self.first_k_dense_replace}"
                         + (f", the last pipeline_layers={self.pipeline_layers}" if self.pipeline_layers else "")
                         + f") do not split into {chunks} equal chunks ({stages} stages x {virtual_stages} virtual "
                         f"stages); use {fix}" + (f", or pipeline only the last MoE layers ({counts}; they run with "
                         "the dense prefix, whole on every stage)" if fits else "")
                         + f", or num_hidden_layers with a multiple of {chunks} MoE layers")

    def pipelined_kinds(self) -> tuple[str, ...]:
        """The stack name of each pipelined layer, in model order: the MoE layers after the dense prefix (and after
        the ``prefix_moe_layers``), those reusing a top-k included."""
        stacks = self.layer_stacks()
        owner = {i: name for name in ("moe_layers", "shared_topk_moe_layers") for i in stacks[name]}
        return tuple(owner[i] for i in sorted(owner))

    def _check_shared_chunks(self, kinds: tuple[str, ...], stages: int, virtual_stages: int) -> None:
        stacks = self.layer_stacks()
        pipelined = sorted(stacks["moe_layers"] + stacks["shared_topk_moe_layers"])
        later = [i for name in ("dense_layers", "shared_topk_dense_layers") for i in stacks[name] if i > pipelined[0]]
        if self.pipeline_layers is not None or later:
            raise ValueError("with layers reusing an earlier layer's top-k (indexer 'shared'), the pipeline takes "
                             "every MoE layer after the dense prefix: pipeline_layers is not supported, and no dense "
                             f"layer may follow the first MoE layer (dense layers {later} do); train it on a mesh "
                             f"without '{STAGE_AXIS}'")
        chunk = pipeline_chunk(kinds, stages, virtual_stages, suffix_advice=False)  # (no pipeline_layers here)
        if chunk[0] != "moe_layers":
            first = pipelined[:: len(chunk)]
            raise ValueError(f"each of the {stages * virtual_stages} pipeline chunks of {len(chunk)} MoE layers starts "
                             f"with a layer that reuses an earlier layer's top-k (indexer 'shared': layers {first} "
                             "start the chunks), which would have to cross a stage; give each chunk's first layer its "
                             "own indexer (indexer_types 'full'), use a chunk count whose chunks start with a 'full' "
                             f"layer, or train it on a mesh without '{STAGE_AXIS}'")

    def _indexer_problems(self) -> list[str]:
        p: list[str] = []
        if self.indexer_training not in INDEXER_TRAINING:
            p.append(f"indexer_training must be one of {INDEXER_TRAINING}, got {self.indexer_training!r}")
        if not _is_number(self.indexer_loss_weight) or self.indexer_loss_weight < 0:
            p.append(f"indexer_loss_weight must be a number >= 0, got {self.indexer_loss_weight!r}")
        if not isinstance(self.index_topk, int) or isinstance(self.index_topk, bool) or self.index_topk < 0:
            return p + [f"index_topk must be an integer >= 0 (0 = no sparse attention), got {self.index_topk!r}"]
        if not isinstance(self.index_rope_interleave, bool):
            p.append(f"index_rope_interleave must be true or false, got {self.index_rope_interleave!r}")
        if isinstance(self.num_hidden_layers, int) and self.num_hidden_layers > 0:
            reusing = [i for i in range(self.num_hidden_layers) if self.reuses_topk(i)]
            if reusing and not self.index_topk:
                p.append(f"layers {reusing} reuse an earlier layer's top-k keys, but there is no indexer: set "
                         "index_topk > 0")
            elif reusing and reusing[0] == 0:
                p.append("layer 0 cannot reuse an earlier layer's top-k keys: no layer before it ran an indexer")
        if self.index_topk == 0:
            if self.indexer_training != "off":
                p.append(f"indexer_training={self.indexer_training!r} needs the lightning indexer: set index_topk > 0 "
                         "(DeepSeek-V3.2's sparse attention)")
            return p
        for name in ("index_n_heads", "index_head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                p.append(f"{name} must be a positive integer (index_topk > 0), got {getattr(self, name)!r}")
        if not p and isinstance(self.qk_rope_head_dim, int) and self.index_head_dim < self.qk_rope_head_dim:
            p.append(f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim}: "
                     "the indexer rotates its first qk_rope_head_dim dims")
        if self.q_lora_rank is None:
            p.append("index_topk > 0 (DeepSeek-V3.2's indexer) needs q_lora_rank: the indexer's queries are read "
                     "from the compressed query latent")
        if self.topk_method != "noaux_tc":
            p.append(f"index_topk > 0 (DeepSeek-V3.2) routes as V3 does: topk_method must be 'noaux_tc', got "
                     f"{self.topk_method!r}")
        if not self.rope_interleave:
            p.append("index_topk > 0 (DeepSeek-V3.2): its MLA rotates consecutive pairs, rope_interleave must be true")
        return p

    def _moe_problems(self) -> list[str]:
        try:
            router = self.router
        except KeyError:
            return [f"topk_method must be one of {tuple(ROUTERS)}, got {self.topk_method!r}"]
        p: list[str] = []
        top = router.group_top  # 0: no group limit, n_group / topk_group unused
        names = ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
        for name in names + (("n_group", "topk_group") if top else ()):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                p.append(f"{name} must be a positive integer (the model has MoE layers), got {getattr(self, name)!r}")
        if not router.may_renormalize and self.norm_topk_prob:
            # transformers' DeepseekV2 ignores it; DeepSeek's own V2 code renormalises and then skips the scaling.
            p.append(f"norm_topk_prob=True is not supported with topk_method={self.topk_method!r}: the references "
                     "disagree on it (transformers never renormalises V2's weights); set it False")
        if not _is_number(self.routed_scaling_factor) or not self.routed_scaling_factor > 0:
            p.append(f"routed_scaling_factor must be a positive number, got {self.routed_scaling_factor!r}")
        if p:
            return p
        if self.num_experts_per_tok > self.n_routed_experts:
            return [f"num_experts_per_tok={self.num_experts_per_tok} must be <= n_routed_experts="
                    f"{self.n_routed_experts}"]
        if not top:
            return p
        per_group = self.n_routed_experts // self.n_group
        if self.n_routed_experts % self.n_group:
            p.append(f"n_routed_experts={self.n_routed_experts} must be divisible by n_group={self.n_group}")
        elif per_group < top:
            p.append(f"each expert group needs at least {top} experts (a group's score is the sum of its top {top}); "
                     f"n_routed_experts={self.n_routed_experts}, n_group={self.n_group}")
        if self.topk_group > self.n_group:
            p.append(f"topk_group={self.topk_group} must be <= n_group={self.n_group}")
        elif not p and self.num_experts_per_tok > self.topk_group * per_group:
            p.append(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {self.topk_group * per_group} "
                     f"experts in the topk_group={self.topk_group} selected groups of {per_group}")
        return p

    def sparse_attention_keys(self, seq_len: int) -> int:
        """How many keys a query of a ``seq_len`` training sequence attends to when attention is sparse
        (DeepSeek-V3.2's ``index_topk``), 0 when it is dense (no indexer, the top-k covers the sequence, or the
        indexer's dense warm-up). ``nnx_zoo.layers.kernel_choices.kernel_choices`` reports it."""
        if self.index_topk and self.index_topk < seq_len and self.indexer_training != "dense_warmup":
            return self.index_topk
        return 0

    # ---- per-layer structure and positions (hooks a family built on this config answers its own way) ----
    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (from 0) has the MoE block (else the dense SwiGLU): here every layer
        from ``first_k_dense_replace`` on."""
        return index >= self.first_k_dense_replace

    def reuses_topk(self, index: int) -> bool:
        """Whether decoder layer ``index`` runs no indexer of its own and attends to the keys the nearest earlier
        layer with an indexer chose (cross-layer top-k sharing). Never here: every layer has its indexer."""
        return False

    @property
    def shares_topk(self) -> bool:
        """Whether some layer reuses an earlier layer's top-k (so the layers with an indexer hand theirs on)."""
        return any(self.reuses_topk(i) for i in range(self.num_hidden_layers))

    def layer_stacks(self) -> dict[str, tuple[int, ...]]:
        """Each layer stack's layers in model order (``LAYER_STACKS``' names; empty for a kind the model lacks):
        the dense and MoE layers, and apart from them those that reuse an earlier layer's top-k (they have no
        indexer, so no stack can hold both kinds)."""
        kinds = {name: [] for name in LAYER_STACKS}
        by_kind = {kind: name for name, kind in LAYER_STACKS.items() if name != "prefix_moe_layers"}
        for i in range(self.num_hidden_layers):
            kinds[by_kind[(self.is_moe_layer(i), self.reuses_topk(i))]].append(i)
        if self.pipeline_layers is not None:  # the MoE layers before the pipelined ones: a stack of their own
            split = len(kinds["moe_layers"]) - self.pipeline_layers
            kinds["prefix_moe_layers"], kinds["moe_layers"] = kinds["moe_layers"][:split], kinds["moe_layers"][split:]
        return {name: tuple(layers) for name, layers in kinds.items()}

    def query_scale(self, positions: jax.Array) -> jax.Array | None:
        """A factor on each query of attention at ``positions [batch, seq]`` (``[batch, seq]`` float32), or None
        for none (here: none; a family whose attention scales queries by position returns it)."""
        del positions
        return None

    @property
    def has_routing_bias(self) -> bool:
        """Whether the router selects on a bias that aux-loss-free balancing moves (``update_routing_bias``)."""
        return self.router.selection_bias

    @property
    def routers_train(self) -> bool:
        """Whether training moves the routers: not in the indexer's dense warm-up, which freezes all but the
        indexers. Aux-loss-free balancing (``DeepSeekV3.update_routing_bias``) leaves frozen routers alone."""
        return self.indexer_training != "dense_warmup"

    def training_notes(self, trained: int, total: int, *, pretrained: bool) -> list[str]:
        """What a run of this config trains, in words for its log (``recipes/pretrain.py`` prints them):
        ``trained`` of ``total`` parameters by the indexer stage; nothing to say without an indexer."""
        topk, stage = self.index_topk, self.indexer_training
        if not topk:
            return []
        if stage == "dense_warmup":
            return [f"indexer warm-up: dense attention, training the indexer only ({trained:,} parameters), the rest "
                    f"frozen ({total - trained:,}); its loss is the KL to the attention distribution (metric "
                    "indexer_loss); the language-model loss is measured, not trained"
                    + ("" if pretrained else ". The model starts from a random initialization: a warm-up is meant "
                       "to start from a trained dense model (--from-pretrained)")]
        if stage == "sparse":
            return [f"indexer sparse stage: each query attends to its top {topk} keys; the indexer trains on its KL "
                    "over them from detached inputs (metric indexer_loss), the rest on the language-model loss"]
        return [f"indexer: each query attends to its top {topk} keys; the indexer is frozen ({total - trained:,} "
                "parameters; --indexer-stage off: no indexer loss)"]

    @property
    def hf_model_type(self) -> str:
        """The transformers architecture this config is written as: ``deepseek_v32`` with an indexer, else the
        router's (``deepseek_v3`` / ``deepseek_v2``)."""
        return "deepseek_v32" if self.index_topk else self.router.hf_model_type

    @property
    def router(self) -> Router:
        """The router ``topk_method`` names (``ROUTERS``)."""
        return ROUTERS[self.topk_method]

    # ---- derived sizes ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """``(query/key width, value width)`` of one attention head (192 and 128 in V3)."""
        return self.qk_head_dim, self.v_head_dim

    @property
    def num_dense_layers(self) -> int:
        return sum(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    # The MoE questions every MoE family's config answers (``MoEDecoderConfig``'s names), in DeepSeek's fields.
    @property
    def num_routed_experts(self) -> int:
        return self.n_routed_experts

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Width of the shared-experts SwiGLU of each MoE layer (DeepSeek fuses its shared experts into one)."""
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.num_dense_layers

    @property
    def has_moe(self) -> bool:
        """Whether any layer (main stack or MTP) is an MoE layer."""
        return self.num_moe_layers > 0 or self.num_nextn_predict_layers > 0

    # ---- Hugging Face config.json (``FamilyConfig.from_hf`` reads the file) ----
    @classmethod
    def hf_model_types(cls) -> tuple[str, ...]:
        return tuple(cls.HF_ARCHITECTURES)

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> DeepSeekV3Config:
        architectures = cls.HF_ARCHITECTURES
        model_type = d.get("model_type", next(iter(architectures)))
        if model_type not in architectures:
            what = ("a DeepSeek V2/V3 model (nor V3.2 or Kimi K2)" if architectures is _HF_ARCHITECTURES
                    else f"a {cls.__name__} model")
            raise ValueError(f"unsupported config: model_type {model_type!r} is not {what}: {cls.__name__} reads "
                             f"{sorted(architectures)}")
        arch = architectures[model_type]
        model_type = arch.get("reads_as", model_type)
        d = {**arch["defaults"], **d, **arch["fixed"]}
        problems = []
        if d.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("mlp_bias"):
            problems.append("mlp_bias=true is not supported (DeepSeek's MLPs have no biases)")
        if "head_dim" in d and d["head_dim"] is None and not arch.get("head_dim_null", True):
            problems.append(f"head_dim is null: transformers' {model_type} cannot build that model (its config class "
                            "refuses null, or its rope fails on it); give an integer or leave the key out (the key "
                            "does not shape the model: its heads are qk_nope_head_dim + qk_rope_head_dim wide)")
        if d.get("moe_layer_freq", 1) != 1:  # transformers ignores it (every layer past the dense ones is MoE)
            problems.append(f"moe_layer_freq={d['moe_layer_freq']!r} is not supported (only 1: every layer from "
                            "first_k_dense_replace on is an MoE layer)")
        if model_type == "deepseek_v32":
            layer_types = d.get("mlp_layer_types")
            if layer_types is not None:  # transformers' spelling of first_k_dense_replace
                dense = sum(1 for t in layer_types if t == "dense")
                if list(layer_types) != ["dense"] * dense + ["sparse"] * (len(layer_types) - dense):
                    problems.append(f"mlp_layer_types {layer_types!r} is not supported (only dense layers first, "
                                    "then sparse ones)")
                d["first_k_dense_replace"] = dense
        router = ROUTERS.get(d.get("topk_method"))
        if not arch["routers"]:  # the architecture routes one way, whatever the file says (the config's router)
            pass
        elif d.get("topk_method") not in arch["routers"]:
            problems.append(f"topk_method {d.get('topk_method')!r} is not a {model_type} router (one of "
                            f"{list(arch['routers'])})")
        elif d.get("scoring_func", router.scoring) != router.scoring:
            problems.append(f"scoring_func {d['scoring_func']!r} does not match topk_method {d['topk_method']!r}, "
                            f"which scores with {router.scoring!r}")
        if problems:
            raise ValueError("unsupported config:\n  - " + "\n  - ".join(problems))
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and k not in ("rope_scaling", "dtype")}
        if "num_nextn_predict_layers" not in d and "num_mtp_layers" in d:
            kwargs["num_nextn_predict_layers"] = d["num_mtp_layers"]
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if rope and not isinstance(rope, Mapping):
            raise ValueError(f"rope_scaling / rope_parameters must be a JSON object or null, got {rope!r}")
        rope = dict(rope) if rope else {}
        theta = rope.pop("rope_theta", None)
        if theta is None:
            theta = d.get("rope_theta", cls.rope_theta)
        if not _is_number(theta):
            raise ValueError(f"rope_theta must be a number, got {theta!r}")
        kwargs["rope_theta"] = float(theta)
        kind = rope.get("rope_type", rope.get("type", "default"))
        kwargs["rope_scaling"] = None if kind == "default" else rope
        try:
            return cls(**{**kwargs, **overrides})
        except TypeError as err:  # a value of the wrong JSON type deep in the rope dict (float(None), ...)
            raise ValueError(f"a config value has the wrong type: {err}") from err

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (hub layout: legacy ``rope_scaling`` and top-level ``rope_theta``), of the
        transformers architecture that routes as ``topk_method`` does (``DeepseekV3ForCausalLM`` for
        ``noaux_tc``, ``DeepseekV2ForCausalLM`` for V2's softmax routers)."""
        router = self.router
        arch = self.HF_ARCHITECTURES[self.hf_model_type]
        unwritable = {k: getattr(self, k) for k, v in arch["fixed"].items() if getattr(self, k) != v}
        if unwritable:
            raise ValueError(f"{arch['name']} (topk_method={self.topk_method!r}) cannot hold {unwritable}: it "
                             f"needs {arch['fixed']}")
        d: dict[str, Any] = {"architectures": [arch["name"]], "model_type": self.hf_model_type}
        for f in dataclasses.fields(self):
            if f.name == "initializer_range":
                d[f.name] = self.initializer_range
                break
            if f.name not in arch["fixed"] and (self.index_topk or not f.name.startswith("index_")):
                d[f.name] = getattr(self, f.name)
        d["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_dict()
        d.update(hidden_act="silu", num_key_value_heads=self.num_attention_heads, scoring_func=router.scoring,
                 rms_norm_eps=self.rms_norm_eps, torch_dtype=self.param_dtype, bos_token_id=0, eos_token_id=1,
                 use_cache=True)
        return d

    # ---- sizes and cost ----
    def _attention_params(self) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        bias = self.attention_bias
        if self.q_lora_rank is None:
            q = h * heads * self.qk_head_dim
        else:
            q = h * self.q_lora_rank + self.q_lora_rank * (1 + heads * self.qk_head_dim) + bias * self.q_lora_rank
        kv_a = (h + bias) * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * (1 + heads * (self.qk_nope_head_dim + self.v_head_dim))
        o = heads * self.v_head_dim * h + bias * h
        return q + kv_a + kv_b + o + 2 * h + self._indexer_params()  # + input and post-attention norms

    def _indexer_params(self) -> int:
        """The lightning indexer's parameters in one layer (0 without one): wq_b, wk, k_norm, weights_proj."""
        if not self.index_topk:
            return 0
        width = self.index_n_heads * self.index_head_dim
        return self.q_lora_rank * width + self.hidden_size * (self.index_head_dim + self.index_n_heads) + 2 * (
            self.index_head_dim)

    def _num_reusing_layers(self) -> int:
        return sum(self.reuses_topk(i) for i in range(self.num_hidden_layers))

    def _moe_params(self) -> tuple[int, int]:
        """(all parameters, parameters of the unchosen routed experts) of one MoE layer's MLP."""
        h, e = self.hidden_size, self.n_routed_experts
        expert = 3 * h * self.moe_intermediate_size
        total = e * h + e * expert + self.n_shared_experts * expert
        return total, (e - self.num_experts_per_tok) * expert

    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """Parameter counts (the router's selection bias is a buffer, not a parameter, as in HF)."""
        h, v = self.hidden_size, self.vocab_size
        attn = self._attention_params()
        moe_total, moe_idle = self._moe_params() if self.has_moe else (0, 0)
        total = v * h + (0 if self.tie_word_embeddings else v * h) + h
        total += self.num_dense_layers * (attn + 3 * h * self.intermediate_size)
        total += self.num_moe_layers * (attn + moe_total)
        total -= self._num_reusing_layers() * self._indexer_params()  # layers reusing a top-k have no indexer
        idle = self.num_moe_layers * moe_idle
        if include_mtp:
            total += self.num_nextn_predict_layers * (3 * h + 2 * h * h + attn + moe_total)
            idle += self.num_nextn_predict_layers * moe_idle
        return ParameterCount(total=total, active=total - idle, embedding=v * h)

    def train_flops_per_token(self, seq_len: int, *, include_mtp: bool = False) -> float:
        """Training FLOPs per token: ``6 * (active matmul parameters) + attention``.

        Matmul parameters are the active ones minus the input embedding (a lookup; a tied table still counts
        once, as the output head). Attention adds ``6 * keys * heads * (qk_head_dim + v_head_dim)`` per layer
        (forward ``2 * keys * heads * (qk + v)`` for scores and mixing, times 3 for forward + backward), where
        ``keys`` a query attends to is ``seq_len / 2`` on average under the causal mask, and at most
        ``index_topk`` with DeepSeek-V3.2's sparse attention. The lightning indexer adds its scores, ``seq_len *
        index_n_heads * index_head_dim`` per layer forward (causal), times 3 when ``indexer_training`` trains it.
        """
        counts = self.num_parameters(include_mtp=include_mtp)
        matmul = counts.active - (0 if self.tie_word_embeddings else counts.embedding)
        layers = self.num_hidden_layers + (self.num_nextn_predict_layers if include_mtp else 0)
        keys = seq_len / 2 if not self.index_topk else min(seq_len / 2, self.index_topk)
        attention = 6 * keys * self.num_attention_heads * (self.qk_head_dim + self.v_head_dim) * layers
        if self.index_topk:  # the layers that run an indexer (not those reusing an earlier layer's top-k)
            passes = 1 if self.indexer_training == "off" else 3
            indexed = layers - self._num_reusing_layers()
            attention += passes * seq_len * self.index_n_heads * self.index_head_dim * indexed
        return float(6 * matmul + attention)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_SMALL_DEFAULTS: dict[str, Any] = dict(rope_scaling=None, max_position_embeddings=4096)

# name -> fields. Shapes of the real models are their published config.json values.
PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 / R1: 671B total, 37B active.
    "deepseek3-671b": {},
    # MaxText's deepseek3-tiny dims (64 wide, 61 layers of which 3 dense, 16 experts top-8, the real vocab and
    # YaRN). MaxText does not limit routing to groups, which is n_group = topk_group = 1 here.
    "deepseek3-tiny": dict(
        vocab_size=129280, hidden_size=64, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=61,
        first_k_dense_replace=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=8,
        n_group=1, topk_group=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
    ),
    # ~10M parameters (8M of them embeddings): trains in minutes on a 2-core CPU.
    "deepseek3-mini": dict(
        vocab_size=32000, hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=1.0, num_nextn_predict_layers=1, **_SMALL_DEFAULTS,
    ),
    # ~26M parameters: a 6-layer V3 (MLA with query compression, 16 routed experts top-4 in 2 of 4 groups, MTP).
    "deepseek3-small": dict(
        vocab_size=32000, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=6,
        first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, num_nextn_predict_layers=1, **_SMALL_DEFAULTS,
    ),
    # DeepSeek-V3.2 / V3.2-Exp: DeepSeek-V3's shape (above) plus DeepSeek Sparse Attention, a lightning indexer of
    # 64 heads x 128 in every layer (the MTP layer's too) choosing the 2048 keys each query attends to; 1 MTP layer.
    # Dims: inference/config_671B_v3.2.json of github.com/deepseek-ai/DeepSeek-V3.2-Exp (index_n_heads 64,
    # index_head_dim 128, index_topk 2048; the rest as V3), and transformers' DeepseekV32Config defaults (its
    # checkpoint: deepseek-ai/DeepSeek-V3.2-Exp). 671.9B (V3's 671.0B + 0.85B of indexers), 38.4B active; 683.5B
    # with the MTP layer, 685.4B counting the MTP layer's stored copies of embedding and head (the hub's "685B").
    "deepseek3.2-671b": dict(index_topk=2048, index_n_heads=64, index_head_dim=128),
    # Moonshot's Kimi K2 (Base / Instruct, July 2025): the DeepSeek-V3 architecture with 384 routed experts top-8
    # and no group limit (n_group = topk_group = 1), 64 heads, one dense layer, routed scaling 2.827, a 163840
    # vocabulary, rope_theta 50000 with YaRN 32 over 4096 (beta_fast = beta_slow = 1), no MTP layers. Dims:
    # moonshotai/Kimi-K2-Instruct config.json as MaxText's configs/models/kimi-k2-1t.yml copies it (rms_norm_eps
    # 1e-6, max_position_embeddings 131072). Kimi-K2-Instruct-0905 and K2-Thinking have this shape with YaRN 64
    # (max_position_embeddings 262144). 1.026T total, 32.9B active (transformers counts the same); Moonshot
    # publishes 1T / 32B (model card), 1.04T / 32.6B (tech report).
    "kimi-k2-1t": dict(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        first_k_dense_replace=1, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
        n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=50000.0, max_position_embeddings=131072, num_nextn_predict_layers=0,
        rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
    ),
    # DeepSeek-V2-Lite (16B total, 2.4B active): softmax routing, greedy top-6 of 64 (its config.json's n_group =
    # topk_group = 1 are unused by greedy), no query compression.
    "deepseek2-lite": dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        topk_method="greedy", rope_scaling=_V2_YARN, rope_interleave=True, num_nextn_predict_layers=0,
    ),
    # DeepSeek-V2 (236B total, 21B active): softmax routing, top-6 of 160 within the 3 best of 8 groups.
    "deepseek2-236b": dict(
        vocab_size=102400, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=60, first_k_dense_replace=1, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=160, n_shared_experts=2,
        num_experts_per_tok=6, n_group=8, topk_group=3, routed_scaling_factor=16.0, norm_topk_prob=False,
        topk_method="group_limited_greedy", rope_scaling=_V2_YARN, rope_interleave=True, num_nextn_predict_layers=0,
    ),
    # ~10M parameters: a 4-layer V2-Lite (no query compression, 2 shared experts, greedy softmax top-2 of 8).
    "deepseek2-tiny": dict(
        vocab_size=32000, hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
        n_group=None, topk_group=None, routed_scaling_factor=1.0, norm_topk_prob=False, topk_method="greedy",
        num_nextn_predict_layers=0, **_SMALL_DEFAULTS,
    ),
}
# ~10M parameters: deepseek3-mini with a 4 x 32 indexer keeping 32 keys per query, so at the recipe's default
# --seq-len 64 the attention of the later half of each sequence is sparse.
PRESETS["deepseek3.2-tiny"] = dict(PRESETS["deepseek3-mini"], index_topk=32, index_n_heads=4, index_head_dim=32)
# ~26M parameters: deepseek3-small with an 8 x 32 indexer keeping 64 keys per query (sparse from --seq-len 128).
PRESETS["deepseek3.2-small"] = dict(PRESETS["deepseek3-small"], index_topk=64, index_n_heads=8, index_head_dim=32)
DeepSeekV3Config.PRESETS = PRESETS  # preset(name) reads them; deepseek3-671b, deepseek3-mini, ...
