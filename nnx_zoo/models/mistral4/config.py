"""Mistral4Config: Mistral 4 hyper-parameters (HF ``model_type`` ``mistral4``), named as in ``config.json``, plus
presets.

Mistral 4 is DeepSeek-V3's model (MLA, shared experts, MoE) with two changes, so the config is a
``DeepSeekV3Config`` with Mistral Small 4's defaults and:
- its router (transformers' ``Mistral4TopkRouter``): softmax over the experts, limited to the ``topk_group`` of
  ``n_group`` groups whose two best scores sum highest, no selection bias; the top-k's scores, divided by their
  sum when ``norm_topk_prob``, times ``routed_scaling_factor``;
- a query scale by position (transformers' ``get_llama_4_attn_scale``): each query is multiplied by
  ``1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings))``, with the period
  the rope block's ``original_max_position_embeddings`` (YaRN's).
Its rope is V3's (YaRN on the ``qk_rope_head_dim`` dims, softmax scale times ``mscale_all_dim``'s ``mscale ** 2``),
consecutive pairs unless ``rope_interleave`` is false. transformers writes the rope block as ``rope_parameters``
with the query scale's keys in it; so does ``to_hf_dict``. Without YaRN (``rope_scaling=None``) the model here
ropes the ``qk_rope_head_dim`` dims by the default schedule, but transformers' Mistral 4 cannot (its default rotary
embedding spans ``qk_nope_head_dim + qk_rope_head_dim`` and fails on the rope part): such a config is refused at
the HF boundary (``from_hf``, ``to_hf_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from nnx_zoo.layers.rope import YarnScaling
from nnx_zoo.models.deepseek.config import DeepSeekV3Config, Router

# transformers' Mistral4TopkRouter: softmax scores, group score = the sum of a group's two best, no bias.
ROUTER = Router("softmax", 2, False, "mistral4")
# Mistral Small 4's rope (transformers' Mistral4Config default, the checkpoint's): YaRN 128 over 8192 positions.
_YARN = YarnScaling(factor=128.0, original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                    mscale_all_dim=1.0)
_HF_DEFAULT_ROPE = dict(_YARN.to_dict(), rope_theta=10000.0, llama_4_scaling_beta=0.1)
# transformers has no per-expert key mapping for mistral4: its checkpoints hold the fused expert tensors
# (mlp.experts.gate_up_proj / down_proj), which export writes ("fused_experts"); import reads either layout.
_HF = {"mistral4": dict(name="Mistral4ForCausalLM", defaults=dict(rope_theta=10000.0),
                        fixed=dict(topk_method="noaux_tc", index_topk=0, num_nextn_predict_layers=0), routers=(),
                        fused_experts=True, head_dim_null=False)}  # a null head_dim reaches its rope and fails


@dataclasses.dataclass(frozen=True)
class Mistral4Config(DeepSeekV3Config):
    """Mistral 4 hyper-parameters (HF ``config.json`` names) and nnx_zoo run options. ``topk_method`` is not
    used: the router is Mistral 4's (``ROUTER``).

    >>> cfg = Mistral4Config.preset("mistral-small-4-119b")
    >>> cfg = Mistral4Config.from_hf("/path/to/checkpoint")         # a directory with config.json, or its dict
    >>> cfg.query_scale(jnp.array([[0, 8192, 3 * 8192]]))         # 1 + 0.1 * log(1 + floor(p / 8192))
    """

    HF_ARCHITECTURES: ClassVar[dict[str, dict[str, Any]]] = _HF

    # Mistral Small 4 (mistralai/Mistral-Small-4-119B-2603): transformers' Mistral4Config defaults (its docstring
    # names that checkpoint).
    vocab_size: int = 131072
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 36
    first_k_dense_replace: int = 0
    num_attention_heads: int = 32
    q_lora_rank: int | None = 1024
    kv_lora_rank: int = 256
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 128
    num_experts_per_tok: int = 4
    n_group: int | None = 1
    topk_group: int | None = 1
    routed_scaling_factor: float = 1.0
    rope_scaling: YarnScaling | None = _YARN
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    # ---- Mistral 4's own (written into the rope block) ----
    llama_4_scaling_beta: float = 0.1  # 0: no query scale
    # The query scale's period when rope_scaling has none (no YaRN); None: rope_scaling's. transformers reads one
    # key for both, so with YaRN they must agree.
    original_max_position_embeddings: int | None = None

    def _problems(self) -> list[str]:
        p = super()._problems()
        beta, period = self.llama_4_scaling_beta, self.original_max_position_embeddings
        if not isinstance(beta, (int, float)) or isinstance(beta, bool) or beta < 0:
            p.append(f"llama_4_scaling_beta must be a number >= 0 (0: no query scale), got {beta!r}")
        if period is not None and (not isinstance(period, int) or period <= 0):
            p.append(f"original_max_position_embeddings must be a positive integer or None, got {period!r}")
        elif (period is not None and isinstance(self.rope_scaling, YarnScaling)
              and period != self.rope_scaling.original_max_position_embeddings):
            p.append(f"original_max_position_embeddings={period} differs from rope_scaling's "
                     f"{self.rope_scaling.original_max_position_embeddings}: transformers reads one value for both "
                     "(leave it None to use rope_scaling's)")
        elif beta and self.query_scale_period is None:
            p.append("llama_4_scaling_beta > 0 needs a period: original_max_position_embeddings, or YaRN "
                     "rope_scaling")
        return p

    @property
    def router(self) -> Router:
        return ROUTER

    @property
    def hf_model_type(self) -> str:
        return "mistral4"

    @property
    def query_scale_period(self) -> int | None:
        """The positions per step of the query scale: ``original_max_position_embeddings``, else YaRN's."""
        if self.original_max_position_embeddings is not None:
            return self.original_max_position_embeddings
        if isinstance(self.rope_scaling, YarnScaling):
            return self.rope_scaling.original_max_position_embeddings
        return None

    def query_scale(self, positions: jax.Array) -> jax.Array | None:
        """``1 + llama_4_scaling_beta * log(1 + floor(positions / period))`` in float32 (transformers'
        ``get_llama_4_attn_scale``), ``[batch, seq]`` for ``positions [batch, seq]``; None when the beta is 0."""
        if not self.llama_4_scaling_beta:
            return None
        steps = jnp.floor(positions.astype(jnp.float32) / jnp.float32(self.query_scale_period))
        return 1 + jnp.float32(self.llama_4_scaling_beta) * jnp.log(1 + steps)

    # ---- Hugging Face config.json ----
    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any], overrides: Mapping[str, Any]) -> Mistral4Config:
        d = dict(d)
        d.pop("original_max_position_embeddings", None)  # the query scale's period is the rope block's
        key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        if not d.get(key):  # no rope block: transformers' default, Mistral Small 4's
            key, d["rope_parameters"] = "rope_parameters", dict(_HF_DEFAULT_ROPE)
        rope = dict(d[key]) if isinstance(d[key], Mapping) else d[key]
        if isinstance(rope, dict):
            if rope.get("llama_4_scaling_beta") is None:
                raise ValueError("the rope block has no llama_4_scaling_beta: transformers' Mistral4Attention "
                                 "multiplies the queries by a scale it needs (0 for none)")
            d["llama_4_scaling_beta"] = rope.pop("llama_4_scaling_beta")
            if rope.get("rope_type", rope.get("type", "default")) == "default":  # the period is not YaRN's
                d["original_max_position_embeddings"] = rope.pop("original_max_position_embeddings", None)
            head_dim = d.get("qk_nope_head_dim", cls.qk_nope_head_dim) + d.get("qk_rope_head_dim",
                                                                              cls.qk_rope_head_dim)
            factor = rope.pop("partial_rotary_factor", None)
            if factor is not None and int(head_dim * factor) != d.get("qk_rope_head_dim", cls.qk_rope_head_dim):
                raise ValueError(f"partial_rotary_factor={factor} ropes int({head_dim} * {factor}) dims, not "
                                 "qk_rope_head_dim: transformers' rope would not fit the rope part")
            rope.pop("max_position_embeddings", None)
            d[key] = rope
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                _refuse_default_rope(d.get("qk_nope_head_dim", cls.qk_nope_head_dim))
        return super()._from_hf_dict(d, overrides)  # type: ignore[return-value]

    def to_hf_dict(self) -> dict[str, Any]:
        """transformers' ``Mistral4Config`` dict, the rope block as ``rope_parameters`` (holding ``rope_theta``
        and the query scale's keys, where transformers reads them) and Mistral's token ids."""
        if self.rope_scaling is None:
            _refuse_default_rope(self.qk_nope_head_dim)
        d = super().to_hf_dict()
        d.pop("rope_scaling")
        rope = {"rope_type": "default"} if self.rope_scaling is None else self.rope_scaling.to_dict()
        rope.update(rope_theta=d.pop("rope_theta"), llama_4_scaling_beta=self.llama_4_scaling_beta)
        if self.query_scale_period is not None:
            rope["original_max_position_embeddings"] = self.query_scale_period
        d.pop("original_max_position_embeddings", None)
        d.update(rope_parameters=rope, bos_token_id=1, eos_token_id=2, pad_token_id=11)
        return d

def _refuse_default_rope(qk_nope_head_dim: int) -> None:
    if qk_nope_head_dim:
        raise ValueError("rope type 'default' is not supported for Mistral 4: transformers' Mistral4 ropes "
                         "qk_nope_head_dim + qk_rope_head_dim dims with it and fails on the rope part; use YaRN (as "
                         "Mistral Small 4)")


# The CPU presets: deepseek3-mini's / -small's dims (every layer MoE, as Mistral 4's) with Mistral 4's router
# (softmax limited to the 2 of 4 groups whose two best scores sum highest) and its YaRN over a short original
# context, so sequences past 64 (128) positions see both the YaRN frequencies and the query scale.
PRESETS: dict[str, dict[str, Any]] = {
    # Mistral Small 4 (mistralai/Mistral-Small-4-119B-2603, March 2026): the class defaults. 119.0B parameters in
    # the text model (its vision encoder aside), 6.63B active (5.56B less embedding and head); Mistral's model card:
    # 119B, 6.5B active.
    "mistral-small-4-119b": {},
    "mistral4-tiny": dict(
        vocab_size=32000, hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=4,
        first_k_dense_replace=0, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, max_position_embeddings=4096,
        rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0)),
}
PRESETS["mistral4-small"] = dict(
    PRESETS["mistral4-tiny"], hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=6,
    q_lora_rank=128, kv_lora_rank=64, n_routed_experts=16, num_experts_per_tok=4,
    rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0))
Mistral4Config.PRESETS = PRESETS
