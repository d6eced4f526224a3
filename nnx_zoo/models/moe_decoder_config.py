"""``MoEDecoderConfig``: the dense decoder's config plus a sparse mixture-of-experts MLP in some or all layers
(``nnx_zoo.layers.sparse_moe``), shared by the MoE families on the dense core (Qwen3-MoE, Mixtral, GLM-4.5).

A family names its own HF fields for the experts (Qwen3-MoE's ``num_experts`` / ``moe_intermediate_size``,
Mixtral's ``num_local_experts`` with ``intermediate_size`` as the expert width) and answers four questions. Three
are a name map, the class keyword ``experts=ExpertFields(...)``: which field holds ``num_routed_experts``,
``expert_intermediate_size`` and ``renormalize_topk`` (or a constant, as Mixtral's always-renormalised top-k);
the config then has those three as read-only attributes. The fourth, ``is_moe_layer(i)``, is a method. A family
may also name another router than softmax top-k (``router_kind``, ``router_options``) and shared experts
(``shared_expert_intermediate_size``). Everything else (validation, HF writing of the family's own fields,
parameter counts, FLOPs) is here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

from nnx_zoo.layers.moe import MOE_IMPLS  # noqa: F401  (re-exported: the MoE configs' moe_impl choices)
from nnx_zoo.layers.routers import ROUTERS
from nnx_zoo.models.decoder_config import DecoderConfig, LayerKind, ParameterCount


class ExpertFields(NamedTuple):
    """Which config field answers each of a family's expert questions: a string names the field (read per
    instance), any other value is the answer itself, a constant of the family. Mixtral's, as its class keyword:

    >>> experts=ExpertFields(num_routed_experts="num_local_experts", expert_intermediate_size="intermediate_size",
    ...                      renormalize_topk=True)
    """

    num_routed_experts: str | int  # routed experts per MoE layer
    expert_intermediate_size: str | int  # one routed expert's SwiGLU width
    renormalize_topk: str | bool  # whether the k chosen weights are divided by their sum


@dataclasses.dataclass(frozen=True)
class MoEDecoderConfig(DecoderConfig):
    """A decoder whose layers are dense SwiGLU or sparse MoE by config. Use a family's subclass:

    >>> cfg = Qwen3MoEConfig.preset("qwen3-moe-tiny")
    >>> [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    [True, True, True, True]
    >>> cfg.num_parameters().active < cfg.num_parameters().total
    True

    ``output_router_logits`` (HF's name) turns on the Switch load-balancing loss: the model's ``aux_loss`` is
    then ``router_aux_loss_coef`` times transformers' ``aux_loss``.
    """

    # nnx_zoo's own fields (not written to config.json).
    NNX_ONLY: ClassVar[frozenset[str]] = frozenset({"moe_impl", "grouped_matmul_impl", "moe_capacity_factor",
                                                    "batch_split_factor"})

    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    # ---- nnx_zoo only ----
    moe_impl: str = "auto"  # 'auto' | 'dense' | 'gmm' | 'ep' (nnx_zoo.layers.moe)
    grouped_matmul_impl: str = "auto"  # the gmm path's kernel (nnx_zoo.layers.grouped_matmul)
    moe_capacity_factor: float | None = None  # ep only: tokens per expert capped at factor * T * k / E
    batch_split_factor: int = 1  # each MoE layer runs on this many micro-batches (nnx_zoo.layers.batch_split)

    # ---- what a family answers ----
    EXPERT_FIELDS: ClassVar[ExpertFields | None] = None  # the class keyword experts=

    def __init_subclass__(cls, *, experts: ExpertFields | None = None, **kwargs: Any) -> None:
        """A family's class keywords: ``experts=ExpertFields(...)`` (each field it names must exist) and
        ``DecoderConfig``'s."""
        super().__init_subclass__(**kwargs)
        if experts is None:
            return
        missing = [name for name in experts if isinstance(name, str) and not hasattr(cls, name)]
        if missing:
            raise TypeError(f"{cls.__name__}: experts={experts} names no field {', '.join(map(repr, missing))}")
        cls.EXPERT_FIELDS = experts

    def _expert_answer(self, question: str) -> Any:
        if self.EXPERT_FIELDS is None:
            raise NotImplementedError(f"{type(self).__name__} names no expert fields (class keyword experts=)")
        answer = getattr(self.EXPERT_FIELDS, question)
        return getattr(self, answer) if isinstance(answer, str) else answer

    @property
    def num_routed_experts(self) -> int:
        return self._expert_answer("num_routed_experts")

    @property
    def expert_intermediate_size(self) -> int:
        return self._expert_answer("expert_intermediate_size")

    @property
    def renormalize_topk(self) -> bool:
        return self._expert_answer("renormalize_topk")

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (from 0) has the sparse MoE MLP (else the dense SwiGLU)."""
        raise NotImplementedError

    def layer_kinds(self) -> tuple[Any, ...]:
        return tuple(LayerKind(moe=self.is_moe_layer(i)) for i in range(self.num_hidden_layers))

    @property
    def router_kind(self) -> str:
        """The routing of every MoE layer, a name in ``nnx_zoo.layers.routers.ROUTERS`` (softmax top-k here)."""
        return "softmax"

    @property
    def router_options(self) -> dict[str, Any]:
        """The router's settings beyond top-k and renormalisation (``SparseMoE``'s ``n_group``, ``topk_group``,
        ``routed_scaling_factor``); none for softmax top-k."""
        return {}

    @property
    def has_routing_bias(self) -> bool:
        """Whether the router selects on a bias that aux-loss-free balancing moves (``update_routing_bias``)."""
        return ROUTERS[self.router_kind]

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Width of the shared-experts SwiGLU added to every MoE layer's output (0: none)."""
        return 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def _problems(self) -> list[str]:
        p = super()._problems()
        if p:  # the shape is broken already: the MoE questions below may not be answerable
            return p
        experts, k = self.num_routed_experts, self.num_experts_per_tok
        if not (isinstance(experts, int) and experts >= 0):
            p.append(f"the number of routed experts must be a non-negative integer, got {experts!r}")
        elif not (isinstance(k, int) and 0 < k <= max(experts, 1)):
            p.append(f"num_experts_per_tok must be in 1..{experts} (the routed experts), got {k!r}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            p.append(f"moe_capacity_factor must be None or positive, got {self.moe_capacity_factor!r}")
        if not (isinstance(self.batch_split_factor, int) and not isinstance(self.batch_split_factor, bool)
                and self.batch_split_factor >= 1):
            p.append(f"batch_split_factor must be a positive integer (1: off), got {self.batch_split_factor!r}")
        if not (isinstance(self.expert_intermediate_size, int) and self.expert_intermediate_size > 0):
            p.append(f"the expert width must be a positive integer, got {self.expert_intermediate_size!r}")
        return p

    def to_hf_dict(self) -> dict[str, Any]:
        """``DecoderConfig.to_hf_dict`` plus the MoE fields (every field the family adds, but nnx_zoo's own)."""
        d = super().to_hf_dict()
        dense = {f.name for f in dataclasses.fields(DecoderConfig)}
        for f in dataclasses.fields(self):
            if f.name not in dense and f.name not in self.NNX_ONLY:
                value = getattr(self, f.name)
                d[f.name] = list(value) if isinstance(value, tuple) else value
        return d

    def num_parameters(self, *, include_mtp: bool = False) -> ParameterCount:
        """Parameter counts: ``active`` counts the router, ``k`` routed experts and the shared experts of each MoE
        layer (a router's selection bias is a buffer, not a parameter, as in HF)."""
        del include_mtp
        h, v = self.hidden_size, self.vocab_size
        top = v * h + (0 if self.tie_word_embeddings else v * h) + h
        attention = self._layer_params() - 3 * h * self.intermediate_size  # a dense layer without its MLP
        experts, k, width = self.num_routed_experts, self.num_experts_per_tok, self.expert_intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size
        total = active = top
        for i in range(self.num_hidden_layers):
            if self.is_moe_layer(i):
                total += attention + h * experts + 3 * experts * h * width + shared
                active += attention + h * experts + 3 * k * h * width + shared
            else:
                total += attention + 3 * h * self.intermediate_size
                active += attention + 3 * h * self.intermediate_size
        return ParameterCount(total=total, active=active, embedding=v * h)
