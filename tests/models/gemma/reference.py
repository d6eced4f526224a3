"""Tiny random transformers Gemma checkpoints (PyTorch, CPU, float32) for the Gemma 3 and Gemma 4 tests.

``make_gemma3(**config)`` builds transformers' ``Gemma3ForCausalLM`` (or, with ``multimodal=True``, a
``Gemma3ForConditionalGeneration`` around the same text model and a one-layer SigLIP tower) with every weight drawn
at random: ``(1 + w)`` norm weights around 0 (scales near 1, but a transposed or misplaced one shows), the rest
N(0, 0.3). ``make_gemma4`` does the same for Gemma 4 (``Gemma4ForCausalLM`` or ``Gemma4ForConditionalGeneration``;
its norms apply ``w``, drawn around 1, and each layer's ``layer_scalar`` buffer is drawn too). ``hf_outputs`` runs
one once: logits, every hidden state and, for an MoE model, each layer's chosen experts.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import numpy as np
import torch

GEMMA3_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
                   sliding_window=4, query_pre_attn_scalar=24, rope_theta=1e6, rope_local_base_freq=1e4)


def randomize(model: torch.nn.Module, seed: int, *, norm_center: float = 0.0, std: float = 0.3) -> torch.nn.Module:
    """Every parameter of ``model`` drawn at random (``seed``): norm weights ``norm_center + N(0, 0.1)``, the rest
    N(0, std); eval mode."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                p.copy_(norm_center + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    return model.eval()


def make_gemma3(seed: int = 0, *, multimodal: bool = False, **overrides) -> torch.nn.Module:
    """transformers' Gemma 3 text model (``Gemma3ForCausalLM``) on ``GEMMA3_TINY`` with ``overrides``, or the
    image-text ``Gemma3ForConditionalGeneration`` holding it; random weights, eager attention, eval mode."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

    text = Gemma3TextConfig(**copy.deepcopy({**GEMMA3_TINY, **overrides}))
    if not multimodal:
        return randomize(Gemma3ForCausalLM._from_config(text, attn_implementation="eager"), seed)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    return randomize(Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager"), seed)


@contextlib.contextmanager
def gemma3_attention_softcap() -> Iterator[None]:
    """transformers' Gemma 3 attention with its ``attn_logit_softcapping`` applied.

    transformers 5's ``Gemma3Attention`` reads the config value but never hands it to its attention function (its
    eager path takes ``softcap=``; Gemma 2 passes it, Gemma 3 does not), so a Gemma 3 config with the cap set runs
    uncapped there. nnx_zoo applies the cap, as Gemma 2 and the original Gemma code do; this patch makes
    transformers' own eager attention do the same, so the cap can be checked against its arithmetic.
    """
    from transformers.models.gemma3 import modeling_gemma3

    plain = modeling_gemma3.eager_attention_forward

    def capped(module, *args, **kwargs):
        return plain(module, *args, **{**kwargs, "softcap": module.attn_logit_softcapping})

    modeling_gemma3.eager_attention_forward = capped
    try:
        yield
    finally:
        modeling_gemma3.eager_attention_forward = plain


GEMMA4_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, global_head_dim=16, max_position_embeddings=128,
                   rms_norm_eps=1e-6, sliding_window=4, hidden_size_per_layer_input=0, vocab_size_per_layer_input=96,
                   final_logit_softcapping=3.0)


def make_gemma4(seed: int = 0, *, multimodal: bool = False, **overrides) -> torch.nn.Module:
    """transformers' Gemma 4 text model (``Gemma4ForCausalLM``) on ``GEMMA4_TINY`` with ``overrides``, or the
    multimodal ``Gemma4ForConditionalGeneration`` holding it (no vision or audio tower); random weights and layer
    scalars, eager attention, eval mode."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    text = Gemma4TextConfig(**copy.deepcopy({**GEMMA4_TINY, **overrides}))
    if multimodal:
        model = Gemma4ForConditionalGeneration._from_config(Gemma4Config(text_config=text.to_dict()),
                                                            attn_implementation="eager")
    else:
        model = Gemma4ForCausalLM._from_config(text, attn_implementation="eager")
    randomize(model, seed, norm_center=1.0)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
        # Gemma 4 attends at scale 1 over normed queries and keys: with their norms' weights near 1 the scores are
        # ~head_dim and the softmax so sharp that float32 rounding grows ~3x a layer; weights near 0.5 keep the
        # comparison at rounding level (and still exercise every weight).
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.sub_(0.5)
    return model


def hf_outputs(model: torch.nn.Module, ids: np.ndarray, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """``{"logits": [b, s, vocab], "hidden": [layers + 1, b, s, embed]}`` of transformers' forward, and
    ``"experts": [layers, b, s, k]`` (sorted) for a model with routed experts."""
    config = model.config.get_text_config()
    moe = getattr(config, "enable_moe_block", False)
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True,
                    output_router_logits=moe or None,
                    attention_mask=None if mask is None else torch.as_tensor(mask, dtype=torch.long))
    result = {"logits": out.logits.numpy(), "hidden": np.stack([h.numpy() for h in out.hidden_states])}
    if moe:
        probs = np.stack([p.numpy().reshape(*ids.shape, -1) for p in out.router_logits])
        result["experts"] = np.sort(np.argsort(-probs, axis=-1)[..., :config.top_k_experts], axis=-1)
    return result


def rel(ours, ref, keep: np.ndarray | None = None) -> float:
    """max |ours - ref| / max |ref| (over the positions ``keep`` marks, all when None)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if keep is not None:
        ours, ref = ours[..., keep.astype(bool), :], ref[..., keep.astype(bool), :]
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
