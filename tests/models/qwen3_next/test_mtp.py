"""The multi-token-prediction depth of Qwen3-Next and Qwen3.5 (HF ``mtp.*``), which transformers lacks, against an
independent torch reference built from transformers' own modules: its decoder layer at a full-attention index
(``Qwen3NextDecoderLayer`` / ``Qwen3_5DecoderLayer``, MoE or dense as the MTP layer is), its ``(1 + w)`` RMSNorm and a
bias-free ``torch.nn.Linear``, with random weights written into the checkpoint as the releases store them (fused
experts). The reference reads transformers' final (normed) hidden states and the ids shifted left by one, concatenates
``[norm(embedding) | norm(hidden)]``, projects, runs the layer (causal, the model's rope, a position padding when its
token or the next is), norms and applies the shared head. Cases: Qwen3-Next with every layer MoE (the release's
layout: the MTP layer is MoE) and Qwen3.5 dense with tied embeddings, on a batch whose row 0 is left-padded by 3.

Also HF I/O: our save writes ``mtp.*`` and ``mtp_num_hidden_layers`` and reloads to the same MTP logits; files
without ``mtp.*`` (transformers' own save) load without MTP, unless ``mtp_num_hidden_layers=1`` is asked for (a
mismatch error naming the keys); ``mtp_num_hidden_layers=0`` skips the files' MTP weights.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from nnx_zoo import AutoModelForCausalLM
from nnx_zoo.hf import CheckpointMismatchError
from tests.models.dense_reference import left_padded_batch, rel_err
from tests.models.qwen3_next.reference import _randomize, make_hf

TOL = 1e-5
SEQ, PAD = 11, 3
FULL_INDEX = 3  # the tiny configs' full-attention layer (linear x3, then full)
# case -> (make_hf overrides, seed)
MTP_CASES = {"qwen3_next": (dict(mlp_only_layers=[]), 0), "qwen3_5": ({}, 2)}


def _reference_mtp(hf: torch.nn.Module, case: str, seed: int) -> torch.nn.Module:
    """The MTP depth from transformers' modules, its parameter names the checkpoint's under ``mtp.``."""
    if case == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer as Layer
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm as Norm
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm as Norm
    c = hf.config
    assert c.layer_types[FULL_INDEX] == "full_attention"
    h, eps = c.hidden_size, c.rms_norm_eps
    mtp = torch.nn.ModuleDict(dict(
        pre_fc_norm_embedding=Norm(h, eps=eps), pre_fc_norm_hidden=Norm(h, eps=eps),
        fc=torch.nn.Linear(2 * h, h, bias=False), layers=torch.nn.ModuleList([Layer(c, FULL_INDEX)]),
        norm=Norm(h, eps=eps)))
    return _randomize(mtp, seed + 100)


def _reference_mtp_logits(hf: torch.nn.Module, mtp: torch.nn.Module, case: str, ids: np.ndarray,
                          mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(MTP logits ``[b, s, vocab]``, the positions that are real for the MTP: token and next token real, the main
    logits)."""
    b, s = ids.shape
    ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.long)
    with torch.no_grad():
        out = hf(ids_t, attention_mask=mask_t, output_hidden_states=True)
        final = out.hidden_states[-1]
        torch.testing.assert_close(hf.lm_head(final), out.logits, rtol=0, atol=0)  # the normed final state
        following = torch.cat([ids_t[:, 1:], torch.zeros((b, 1), dtype=torch.long)], dim=1)
        real = mask_t.bool() & torch.cat([mask_t[:, 1:], torch.zeros((b, 1), dtype=torch.long)], 1).bool()
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(hf.model.embed_tokens(following)),
                              mtp.pre_fc_norm_hidden(final)], dim=-1))
        positions = torch.arange(s)[None].expand(b, s)
        rope_positions = positions if case == "qwen3_next" else positions[None].expand(3, b, s)  # text mrope
        cos_sin = hf.model.rotary_emb(x, rope_positions)
        allowed = torch.tril(torch.ones(s, s, dtype=torch.bool))[None] & real[:, None, :]
        bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]  # eager attention's mask
        for layer in mtp.layers:
            x = layer(x, position_embeddings=cos_sin, attention_mask=bias, position_ids=positions)
        return hf.lm_head(mtp.norm(x)).numpy(), real.numpy(), out.logits.numpy()


@pytest.fixture(scope="module", params=list(MTP_CASES))
def mtp_case(request, tmp_path_factory):
    """case -> transformers' checkpoint without MTP, the same with the reference's ``mtp.*`` weights, our model
    loaded from the latter, the batch, our outputs and the reference's MTP logits."""
    case = request.param
    overrides, seed = MTP_CASES[case]
    hf = make_hf(case, seed=seed, **overrides)
    plain = tmp_path_factory.mktemp(f"{case}-plain")
    hf.save_pretrained(plain)  # transformers drops MTP weights: none here
    mtp = _reference_mtp(hf, case, seed)
    with_mtp = tmp_path_factory.mktemp(f"{case}-mtp")
    hf.config.mtp_num_hidden_layers = 1  # as the releases' config.json says
    hf.save_pretrained(with_mtp)
    (shard,) = with_mtp.glob("*.safetensors")
    weights = {f"mtp.{k}": v.detach().clone().contiguous() for k, v in mtp.state_dict().items()}
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in weights or case != "qwen3_next"  # the fused layout, as stored
    save_file({**load_file(shard), **weights}, shard, metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(with_mtp)
    ids, mask = left_padded_batch(hf.config.vocab_size, seq=SEQ, pad=PAD, seed=seed)
    ours = model.forward(jnp.asarray(ids), jnp.asarray(mask), with_mtp=True)
    want, real, logits = _reference_mtp_logits(hf, mtp, case, ids, mask)
    return dict(case=case, plain=plain, with_mtp=with_mtp, model=model, ids=ids, mask=mask, ours=ours, want=want,
                real=real, logits=logits)


def test_mtp_logits_equal_the_transformers_module_reference(mtp_case):
    c = mtp_case
    ours = c["ours"]
    assert c["model"].config.mtp_num_hidden_layers == 1 and ours.mtp_logits.shape == (1, *c["want"].shape)
    assert ours.mtp_hidden.shape == (1, *c["ids"].shape, c["model"].config.hidden_size)
    err = rel_err(np.asarray(ours.mtp_logits[0]), c["want"], keep=c["real"])
    assert c["real"][0, PAD - 1] == 0 and c["real"][1:, -1].sum() == 0  # padding before, the last position after
    main = rel_err(np.asarray(ours.logits), c["logits"], keep=c["mask"])  # with_mtp: the main logits as before
    assert err < TOL and main < TOL, (err, main)
    print(f"{c['case']}: MTP logits max relative error {err:.2e}")


@pytest.mark.parametrize("mtp_case", ["qwen3_next"], indirect=True)  # the I/O checks once
def test_mtp_weights_save_and_reload(mtp_case, tmp_path):
    c = mtp_case
    c["model"].save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    keys = set().union(*(load_file(f).keys() for f in tmp_path.glob("*.safetensors")))
    assert config["mtp_num_hidden_layers"] == 1
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.input_layernorm.weight"} <= keys
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    out = again.forward(jnp.asarray(c["ids"]), jnp.asarray(c["mask"]), with_mtp=True)
    np.testing.assert_array_equal(np.asarray(out.mtp_logits), np.asarray(c["ours"].mtp_logits))


@pytest.mark.parametrize("mtp_case", ["qwen3_next"], indirect=True)  # the I/O checks once
def test_checkpoints_without_mtp_weights_and_mtp_switched_off(mtp_case):
    c = mtp_case
    plain = AutoModelForCausalLM.from_pretrained(c["plain"])  # no mtp.* in the files: built without MTP
    assert plain.mtp is None and plain.config.mtp_num_hidden_layers == 0
    with pytest.raises(ValueError, match="mtp_num_hidden_layers=0"):
        plain.forward(jnp.asarray(c["ids"]), with_mtp=True)
    with pytest.raises(CheckpointMismatchError, match=r"mtp\.fc\.weight"):
        AutoModelForCausalLM.from_pretrained(c["plain"], mtp_num_hidden_layers=1)
    off = AutoModelForCausalLM.from_pretrained(c["with_mtp"], mtp_num_hidden_layers=0)  # files' MTP skipped
    assert off.mtp is None
    want = {path: leaf for path, leaf in nnx.to_flat_state(nnx.state(c["model"])) if path[0] != "mtp"}
    got = dict(nnx.to_flat_state(nnx.state(off)))
    assert got.keys() == want.keys()
    for path, leaf in got.items():
        np.testing.assert_array_equal(np.asarray(leaf[...]), np.asarray(want[path][...]), err_msg=str(path))
