"""Which kernels a model config will run on this backend: what the recipe prints at start and in its summary, and
what the sharding plan counts; and the one check of every kernel setting's name (``kernel_setting_problems``),
which every family's config runs when it is built.

The choices themselves are made where the kernels are dispatched (``choose_attention_impl`` in
``nnx_zoo.layers.attention``, ``default_moe_impl`` in ``nnx_zoo.layers.moe``, ``choose_grouped_matmul_impl`` in
``nnx_zoo.layers.grouped_matmul``); ``kernel_choices`` only asks them, for any family's config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nnx_zoo.layers.attention import ATTENTION_IMPLS, LOCAL_FEATURES, choose_attention_impl
from nnx_zoo.layers.delta_rule import DELTA_RULE_IMPLS, choose_delta_rule_impl
from nnx_zoo.layers.grouped_matmul import GROUPED_MATMUL_IMPLS, choose_grouped_matmul_impl
from nnx_zoo.layers.moe import MOE_IMPLS, default_moe_impl
from nnx_zoo.layers.scan import REMAT_POLICIES

# Config field -> the names its kernel takes. A config has the fields it has; each one present is checked when the
# config is built, so a misspelt kernel fails at once, not on the first step that would run that path.
KERNEL_SETTINGS: dict[str, tuple[str, ...]] = {
    "attention_impl": ATTENTION_IMPLS,
    "moe_impl": MOE_IMPLS,
    "grouped_matmul_impl": GROUPED_MATMUL_IMPLS,
    "remat_policy": tuple(REMAT_POLICIES),
    "delta_rule_impl": DELTA_RULE_IMPLS,
}


def kernel_setting_problems(config: Any, narrower: Mapping[str, tuple[str, ...]] | None = None) -> list[str]:
    """One line per kernel setting (``KERNEL_SETTINGS``) of the dataclass ``config`` whose value its kernel does
    not take; ``narrower`` (field -> names) replaces the choices where a family runs fewer kernels.

    >>> kernel_setting_problems(Qwen3MoEConfig.preset("qwen3-moe-tiny"))
    []
    """
    allowed = {**KERNEL_SETTINGS, **(narrower or {})}
    fields = {f.name for f in dataclasses.fields(config)}
    return [f"{name} must be one of {choices}, got {getattr(config, name)!r}"
            for name, choices in allowed.items() if name in fields and getattr(config, name) not in choices]


def kernel_choices(config: Any, *, seq_len: int, segments: bool = False, platform: str | None = None
                   ) -> dict[str, str]:
    """``{"attention": ..., "moe": ..., "grouped_matmul": ..., "delta_rule": ...}``: the implementation each kernel
    setting of ``config`` resolves to for training sequences of ``seq_len`` tokens (``segments``: packed documents)
    on ``platform`` (default: JAX's default backend). MoE entries appear only for configs with MoE layers, the
    delta rule's for configs with linear-attention layers; layers of
    a local attention kind whose features need another kernel (sinks, a chunk: no cuDNN) get
    ``"attention_<kind>"`` (``"attention_sliding": "blockwise"``).

    >>> kernel_choices(Llama3Config.preset("llama3-tiny"), seq_len=64, platform="cpu")
    {'attention': 'xla'}
    """
    qk_dim, v_dim = config.attention_head_dims

    def attention(features: tuple[str, ...] = ()) -> str:
        return choose_attention_impl(config.attention_impl, q_len=seq_len, k_len=seq_len, platform=platform,
                                     segments=segments, qk_dim=qk_dim, v_dim=v_dim, features=features)

    # Layers of another attention kind (a window, a chunk, sinks) may need another kernel: "attention_<kind>".
    per_kind: dict[str, str] = {}
    if hasattr(config, "layer_kinds") and hasattr(config, "attention_options"):
        for kind in dict.fromkeys(config.layer_kinds()):
            options = config.attention_options(kind)
            features = tuple(k for k in LOCAL_FEATURES if options.get(k) not in (None, False))
            per_kind.setdefault(kind.attention, attention(features))
    full = per_kind.pop("full", None)
    choices = {"attention": full or (next(iter(per_kind.values())) if per_kind else attention())}
    choices.update({f"attention_{kind}": impl for kind, impl in per_kind.items() if impl != choices["attention"]})
    sparse_keys = getattr(config, "sparse_attention_keys", None)
    topk = sparse_keys(seq_len) if sparse_keys is not None else 0
    if topk:  # a family's sparse attention: each query's top-k keys gathered, no score matrix
        choices["attention"] = f"sparse-top{topk}"
    delta_rule = getattr(config, "delta_rule_impl", None)
    if delta_rule is not None and any(k.attention == "linear" for k in config.layer_kinds()):
        choices["delta_rule"] = choose_delta_rule_impl(delta_rule, seq_len, config.delta_rule_chunk_size)
    moe_impl = getattr(config, "moe_impl", None)
    if moe_impl is not None and getattr(config, "num_moe_layers", 0) > 0:
        moe = default_moe_impl(platform) if moe_impl == "auto" else moe_impl
        choices["moe"] = moe
        # ep computes its own experts by the platform's dropless path: a grouped matmul where that is gmm.
        if moe == "gmm" or (moe == "ep" and default_moe_impl(platform) == "gmm"):
            choices["grouped_matmul"] = choose_grouped_matmul_impl(config.grouped_matmul_impl, platform)
    return choices


def describe(config: Any, choices: dict[str, str]) -> str:
    """One line: each kernel and, where it was not asked for by name, the setting it came from.

    >>> describe(config, {"attention": "blockwise", "moe": "gmm"})  # config: attention_impl 'auto', moe_impl 'gmm'
    'attention blockwise (attention_impl=auto), moe gmm'
    """
    parts = []
    for kernel, chosen in choices.items():
        asked = getattr(config, f"{kernel}_impl", None)
        parts.append(f"{kernel} {chosen}" if asked == chosen else f"{kernel} {chosen} ({kernel}_impl={asked})")
    return ", ".join(parts)
