"""MiniMax-M2 against transformers' ``MiniMaxM2ForCausalLM`` beyond the shared MoE cases (``test_moe_exact.py``: aux
loss, both-way export, the fused layout and every ``moe_impl``): every hidden state and each layer's chosen experts
on a left-padded batch; each distinctive part, turned off, moves the logits (the q/k norm over the whole
projection, made per head or dropped; partial rope; the selection-only bias: zeroed, the choices change; added to
the weights too, the logits move while the first layer's choices stay); the presets' parameter counts equal
transformers' model built on the meta device and the published size; the hub's config.json reads as the preset;
settings that transformers would build otherwise are refused, naming the key."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import MiniMaxM2Config as HFMiniMaxM2Config
from transformers import MiniMaxM2ForCausalLM

from nnx_zoo import AutoModelForCausalLM, MiniMaxM2, MiniMaxM2Config
from nnx_zoo.layers import routers
from nnx_zoo.layers.norm import RMSNorm, rms_normalize
from tests.models.dense_reference import left_padded_batch, make_hf, rel_err, save_hf

TOL = 1e-5
MOVED = 1e-3  # a part turned off moves the logits by more than this (relative)
# MiniMax-M2's config.json as published (MiniMaxAI/MiniMax-M2; quantization_config and auto_map left out), with the
# keys transformers ignores.
HUB = dict(architectures=["MiniMaxM2ForCausalLM"], attn_type_list=[1] * 62, head_dim=128, hidden_act="silu",
           hidden_size=3072, intermediate_size=1536, max_position_embeddings=196608, model_type="minimax_m2",
           mtp_transformer_layers=1, num_attention_heads=48, num_experts_per_tok=8, num_hidden_layers=62,
           num_key_value_heads=8, num_local_experts=256, num_mtp_modules=3, qk_norm_type="per_layer",
           rms_norm_eps=1e-06, rope_theta=5000000, rotary_dim=64, scoring_func="sigmoid", shared_intermediate_size=0,
           tie_word_embeddings=False, use_cache=True, use_mtp=True, use_qk_norm=True, use_routing_bias=True,
           vocab_size=200064, torch_dtype="bfloat16")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """transformers' tiny MiniMax-M2 (3 layers, 8 experts top-2, rope on 4 of 8 dims), its checkpoint, a
    left-padded batch and its outputs: logits, hidden states and each layer's chosen experts (its router's own
    ``top_k_index``, recorded by hooks)."""
    hf = make_hf("minimax_m2", seed=11, num_hidden_layers=3)
    path = save_hf(hf, tmp_path_factory.mktemp("minimax_m2"))
    ids, mask = left_padded_batch(hf.config.vocab_size, seed=11)
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2].numpy()))
             for layer in hf.model.layers]
    with torch.no_grad():
        out = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask, dtype=torch.long),
                 output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    ref = dict(logits=out.logits.numpy(), hidden_states=[h.numpy() for h in out.hidden_states],
               experts=np.stack(chosen).reshape(len(chosen), *ids.shape, -1))
    return path, ids, mask, ref


def _run(model, ids, mask):
    out = model.forward(ids, mask, with_hidden_states=True, with_routing=True)
    return np.asarray(out.logits), np.asarray(out.hidden_states), np.asarray(out.expert_indices)


def _same_choices(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> bool:
    real = mask.astype(bool)
    return np.array_equal(np.sort(ours, -1)[:, real], np.sort(ref, -1)[:, real])


def test_logits_every_hidden_state_and_the_experts_chosen(built):
    path, ids, mask, ref = built
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model) is MiniMaxM2 and model.config.rotary_dim == 4
    logits, hidden, experts = _run(model, ids, mask)
    errors = [rel_err(logits, ref["logits"], keep=mask)]
    assert len(hidden) == len(ref["hidden_states"]) == 4
    errors += [rel_err(a, b, keep=mask) for a, b in zip(hidden, ref["hidden_states"])]
    assert max(errors) < TOL, errors
    assert experts.shape == ref["experts"].shape and _same_choices(experts, ref["experts"], mask)
    print(f"minimax_m2: logits {errors[0]:.1e}, hidden states max {max(errors[1:]):.1e} (max relative)")


def _qk_norm(kind: str):
    """``RMSNorm.__call__`` with the full-width (``axes=2``) norms replaced: ``per_head`` (each head its own
    statistic, the same scales), or ``none`` (no q/k norm); every other norm as before."""
    original = RMSNorm.__call__

    def call(self, x):
        if self.axes == 1:
            return original(self, x)
        if kind == "none":
            return x
        return rms_normalize(x, self.eps) * self.scale[...].reshape(x.shape[-2:])

    return call


def _weights_on_biased_scores(original):
    """``group_limited_top_k`` choosing as before but weighing the experts by ``scores + bias`` too."""
    def choose(scores, k, *, bias=None, **kw):
        return original(scores if bias is None else scores + bias, k, **kw)

    return choose


def test_turning_each_part_off_moves_the_logits(built, monkeypatch):
    """Each part, turned off, gives other logits than transformers' (which the model matches): the test config
    exercises every part. The bias zeroed changes the experts chosen; the bias added to the weights leaves the first
    layer's choices as they were."""
    path, ids, mask, ref = built
    moved = {}
    for name, kind in (("q/k norm per head", "per_head"), ("no q/k norm", "none")):
        with monkeypatch.context() as patch:
            patch.setattr(RMSNorm, "__call__", _qk_norm(kind))
            moved[name] = rel_err(_run(MiniMaxM2.from_pretrained(path), ids, mask)[0], ref["logits"], keep=mask)
    logits, _, _ = _run(MiniMaxM2.from_pretrained(path, partial_rotary_factor=1.0), ids, mask)
    moved["rope on whole heads"] = rel_err(logits, ref["logits"], keep=mask)

    unbiased = MiniMaxM2.from_pretrained(path)
    unbiased.layers.mlp.e_score_correction_bias[...] = jnp.zeros_like(unbiased.layers.mlp.e_score_correction_bias[...])
    logits, _, experts = _run(unbiased, ids, mask)
    moved["no selection bias"] = rel_err(logits, ref["logits"], keep=mask)
    assert not _same_choices(experts, ref["experts"], mask)
    with monkeypatch.context() as patch:
        patch.setattr(routers, "group_limited_top_k", _weights_on_biased_scores(routers.group_limited_top_k))
        logits, _, experts = _run(MiniMaxM2.from_pretrained(path), ids, mask)
    moved["bias in the weights"] = rel_err(logits, ref["logits"], keep=mask)
    # The first layer chooses as before (later layers see other inputs, so they may not).
    assert _same_choices(experts[:1], ref["experts"][:1], mask)
    print("minimax_m2 parts off, logits moved by: " + ", ".join(f"{k} {v:.1e}" for k, v in moved.items()))
    still = {name: err for name, err in moved.items() if err < MOVED}
    assert not still, f"these parts do not act in the test config: {still}"


@pytest.mark.parametrize("name", sorted(MiniMaxM2Config.PRESETS))
def test_preset_counts_equal_transformers(name):
    config = MiniMaxM2Config.preset(name)
    with torch.device("meta"):
        theirs = MiniMaxM2ForCausalLM(HFMiniMaxM2Config.from_dict(config.to_hf_dict()))
    counts = config.num_parameters()
    assert counts.total == sum(p.numel() for p in theirs.parameters())
    if name == "minimax-m2":  # published: 230B total, 10B active (the embedding and the output head left out)
        assert counts.total == 228_689_748_992 and abs(counts.total / 230e9 - 1) < 0.01
        assert round((counts.active - 2 * counts.embedding) / 1e9) == 10
        assert theirs.config.rope_parameters["partial_rotary_factor"] == 0.5


def test_hub_config_reads_as_the_preset_and_odd_settings_are_refused():
    config = MiniMaxM2Config.from_hf(HUB)
    assert config == MiniMaxM2Config.preset("minimax-m2")
    assert (config.rotary_dim, config.rope_theta, config.qk_norm_full_width) == (64, 5e6, True)
    assert MiniMaxM2Config.from_hf({**HUB, "rotary_dim": 32}).partial_rotary_factor == 0.25
    for key, value in (("qk_norm_type", "per_head"), ("use_qk_norm", False), ("scoring_func", "softmax"),
                       ("use_routing_bias", False), ("shared_intermediate_size", 1536),
                       ("router_jitter_noise", 0.01), ("head_dim", None)):
        with pytest.raises(ValueError, match=key):
            MiniMaxM2Config.from_hf({**HUB, key: value})
