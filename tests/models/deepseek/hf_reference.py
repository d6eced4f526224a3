"""Hugging Face reference models for the DeepSeek tests (V3, and V2 / V3.2 with ``arch="v2"`` / ``"v32"``; the
families built on DeepSeek's parts, GLM-5 and Mistral 4, with ``arch="glm5"`` / ``"mistral4"``): tiny random
configs, checkpoints, outputs.

Weights are redrawn larger than HF's 0.02 init (and norms away from 1, router biases non-zero) so every
component moves the logits visibly and a wrong transform cannot hide.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    Mistral4Config,
    Mistral4ForCausalLM,
)

BASE: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=64, rope_theta=1000.0, rope_interleave=True, rms_norm_eps=1e-6,
)
# DeepseekV2Config takes BASE less V3's routing keys (its rope always rotates consecutive pairs); V2 routes with
# softmax, greedy by default, and never renormalises.
V2_BASE: dict[str, Any] = {k: v for k, v in BASE.items() if k not in ("rope_interleave", "n_group", "topk_group",
                                                                     "norm_topk_prob")}
# DeepseekV32Config: V3's keys (its MLA always rotates consecutive pairs) plus a lightning indexer; its tiny heads
# (8 of width 8, rope on the first 4) score with little chance of ties at the top-k boundary.
V32_BASE: dict[str, Any] = {**{k: v for k, v in BASE.items() if k != "rope_interleave"}, "index_topk": 5,
                            "index_n_heads": 8, "index_head_dim": 8}
# GlmMoeDsaConfig (GLM-5): V3.2's keys (its MLA always rotates pairs; so does its indexer) on 4 layers, layer 1 and 3
# reusing the top-k of layers 0 and 2 ("shared"), layers 0-1 dense: every kind of layer stack.
GLM5_BASE: dict[str, Any] = {**V32_BASE, "num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"],
                             "mlp_layer_types": ["dense", "dense", "sparse", "sparse"]}
# Mistral4Config: V3's keys with its rope block (YaRN over an original context of 4 positions, so a 12-token
# sequence spans three steps of the query scale 1 + 0.1 * log(1 + floor(position / 4))).
MISTRAL4_ROPE = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 4,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
MISTRAL4_BASE: dict[str, Any] = {**{k: v for k, v in BASE.items() if k != "rope_theta"},
                                 "rope_parameters": MISTRAL4_ROPE}
ARCHS = {"v3": (DeepseekV3Config, DeepseekV3ForCausalLM, BASE),
         "v2": (DeepseekV2Config, DeepseekV2ForCausalLM, V2_BASE),
         "v32": (DeepseekV32Config, DeepseekV32ForCausalLM, V32_BASE),
         "glm5": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, GLM5_BASE),
         "mistral4": (Mistral4Config, Mistral4ForCausalLM, MISTRAL4_BASE)}
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def make_hf_model(seed: int = 0, arch: str = "v3", **overrides: Any) -> DeepseekV3ForCausalLM:
    """A random ``DeepseekV3ForCausalLM`` (``arch="v2"`` / ``"v32"``: ``DeepseekV2ForCausalLM`` /
    ``DeepseekV32ForCausalLM``; eager attention, float32) from ``BASE`` (``V2_BASE``, ``V32_BASE``) updated with
    ``overrides``."""
    config_cls, model_cls, base = ARCHS[arch]
    # A deep copy: transformers' configs write into the dicts they are given (the rope block).
    config = config_cls(**copy.deepcopy({**base, **overrides}), attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.3 * torch.rand_like(b))
    return model


def save_hf(model: DeepseekV3ForCausalLM, path: Path, *, legacy_rope: bool = False) -> Path:
    """``save_pretrained``; with ``legacy_rope`` the config is rewritten in the hub's layout (``rope_scaling`` +
    top-level ``rope_theta``), as real DeepSeek-V3 checkpoints have it."""
    model.save_pretrained(path)
    if legacy_rope:
        config_file = path / "config.json"
        d = json.loads(config_file.read_text())
        rope = d.pop("rope_parameters")
        d["rope_theta"] = rope.pop("rope_theta")
        rope.pop("rope_type", None)
        d["rope_scaling"] = rope if rope.get("type", "default") != "default" else None
        config_file.write_text(json.dumps(d, indent=2))
    return path


def hf_outputs(model: DeepseekV3ForCausalLM, ids: np.ndarray, attention_mask: np.ndarray | None = None
               ) -> dict[str, Any]:
    """Logits, hidden states (HF's tuple: embeddings, layer outputs but the last, final normed) and each MoE
    layer's chosen experts ``[tokens, k]`` (from a hook on its router)."""
    chosen: dict[int, np.ndarray] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda _m, _in, out, i=i: chosen.__setitem__(i, out[2].numpy())))
    mask = None if attention_mask is None else torch.as_tensor(attention_mask)
    with torch.no_grad():
        out = model(torch.as_tensor(ids), attention_mask=mask, output_hidden_states=True)
    for h in hooks:
        h.remove()
    return {
        "logits": out.logits.numpy(),
        "hidden_states": [h.numpy() for h in out.hidden_states],
        "experts": [chosen[i] for i in sorted(chosen)],
    }


def padded_inputs(batch: int, seq: int, vocab: int, padded: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Random token ids ``[batch, seq]`` and, with ``padded``, a mask whose row 0 is left-padded by three tokens."""
    ids = np.random.default_rng(0).integers(0, vocab, (batch, seq)).astype(np.int32)
    if not padded:
        return ids, None
    mask = np.ones((batch, seq), np.int32)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return ids, mask


def case_builder(cases: dict[str, dict[str, Any]], tmp_path_factory: Any, *, batch: int, seq: int,
                 first_seed: int = 0) -> Any:
    """``get(name) -> (checkpoint dir, HF model, HF outputs, ids, mask)`` for ``cases`` (name -> ``hf``: overrides
    of ``make_hf_model``, ``padded``, ``legacy_rope``); each HF model is built, saved and run once."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            case = cases[name]
            hf = make_hf_model(seed=first_seed + len(cache), **case["hf"])
            ids, mask = padded_inputs(batch, seq, hf.config.vocab_size, case.get("padded", False))
            path = save_hf(hf, tmp_path_factory.mktemp(name), legacy_rope=case.get("legacy_rope", False))
            cache[name] = (path, hf, hf_outputs(hf, ids, mask), ids, mask)
        return cache[name]

    return get


def load_recipe(name: str = "pretrain") -> Any:
    """``recipes/<name>.py`` as a module (its ``main(argv)`` runs the recipe in this process)."""
    import importlib.util

    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location(name, root / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_l2(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
