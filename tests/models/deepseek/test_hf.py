"""HF checkpoint import/export: export loads in transformers with the same logits, every problem reported at
once, float8 blocks dequantized, the transformers-5 fused expert layout, and multi-token-prediction heads."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.models.deepseek.hf import CheckpointMismatchError, canonical_slots, dequantize_fp8, iter_hf_keys
from nnx_zoo.sharding import abstract_module, iter_variables
from tests.models.deepseek.hf_reference import YARN, make_hf_model, rel_l2, save_hf

IDS = np.random.default_rng(1).integers(0, 96, (2, 9)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """A random HF checkpoint (q_lora, YaRN, group routing with bias) and HF's logits for ``IDS``."""
    hf = make_hf_model(seed=7, rope_scaling=YARN)
    path = save_hf(hf, tmp_path_factory.mktemp("hf"))
    with torch.no_grad():
        logits = hf(torch.as_tensor(IDS)).logits.numpy()
    return path, logits


def params_of(model: DeepSeekV3) -> dict[str, np.ndarray]:
    return {p: np.asarray(v[...]) for p, v in iter_variables(model)}


def assert_same_params(a: DeepSeekV3, b: DeepSeekV3) -> None:
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for p in pa:
        np.testing.assert_array_equal(pa[p], pb[p], err_msg=p)


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config_update: dict | None = None) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` holding ``tensors`` (one file), config optionally updated."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.update(config_update or {})
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_export_is_loadable_by_transformers(checkpoint, tmp_path):
    path, hf_logits = checkpoint
    model = DeepSeekV3.from_pretrained(path, moe_impl="dense")
    out = tmp_path / "export"
    model.save_pretrained(out, max_shard_bytes=16 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1 and shard_files == sorted(p.name for p in out.glob("*.safetensors"))
    for name in shard_files:  # size-capped, unless one tensor alone is larger
        tensors = load_file(out / name)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 16 * 1024
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]  # per-expert keys
    assert set(index["weight_map"]) == set(load_file(path / "model.safetensors"))  # exactly HF's key set

    reloaded_hf = DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = reloaded_hf(torch.as_tensor(IDS)).logits.numpy()
    assert rel_l2(logits, hf_logits) < 1e-6
    assert_same_params(DeepSeekV3.from_pretrained(out, moe_impl="dense"), model)


def test_mismatch_lists_every_problem(checkpoint, tmp_path):
    path, _ = checkpoint
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(3, 3)
    tensors["model.layers.2.self_attn.o_proj.weight"] = torch.zeros(32, 25)
    bad = rewrite(path, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointMismatchError) as info:
        DeepSeekV3.from_pretrained(bad)
    err = info.value
    assert err.missing == ["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert err.unexpected == ["model.layers.0.mlp.extra_proj.weight"]
    assert len(err.wrong) == 1 and "model.layers.2.self_attn.o_proj.weight" in err.wrong[0]
    assert "[32, 25]" in err.wrong[0] and "[32, 24]" in err.wrong[0]
    message = str(err)
    for key in ("experts.2.up_proj", "extra_proj", "o_proj"):
        assert key in message


def _quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 e4m3 weight, float32 scale_inv per block, the dequantized float32 weight)."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:rows, :cols] = w
    amax = padded.reshape(nr, block, nc, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / 448.0).float()
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (w / expanded).to(torch.float8_e4m3fn)
    return q, scale, q.float() * expanded


def test_fp8_blocks_are_dequantized(checkpoint, tmp_path):
    path, _ = checkpoint
    tensors = load_file(path / "model.safetensors")
    quantized, dequantized = dict(tensors), dict(tensors)
    for key, w in tensors.items():
        if key.endswith("_proj.weight") or key.endswith("_proj_with_mqa.weight"):
            q, scale_inv, deq = _quantize_blocks(w, 16)  # 16x16 blocks: several per matrix, ragged edges
            quantized[key], quantized[key + "_scale_inv"], dequantized[key] = q, scale_inv, deq
    assert sum(t.dtype == torch.float8_e4m3fn for t in quantized.values()) > 50
    fp8_dir = rewrite(path, tmp_path / "fp8", quantized, {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}})
    deq_dir = rewrite(path, tmp_path / "deq", dequantized)
    from_fp8 = DeepSeekV3.from_pretrained(fp8_dir, moe_impl="dense")
    assert_same_params(from_fp8, DeepSeekV3.from_pretrained(deq_dir, moe_impl="dense"))

    reference = DeepseekV3ForCausalLM.from_pretrained(deq_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        ref_logits = reference(torch.as_tensor(IDS)).logits.numpy()
    assert rel_l2(from_fp8(jnp.asarray(IDS)), ref_logits) < 1e-5


def test_dequantize_fp8_default_blocks():
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(300, 260)).astype(ml_dtypes.float8_e4m3fn)
    scale_inv = rng.uniform(0.5, 2.0, size=(3, 3)).astype(np.float32)
    out = dequantize_fp8(weight, scale_inv)
    for i, j in [(0, 0), (129, 5), (299, 259), (200, 130)]:
        assert out[i, j] == np.float32(weight[i, j]) * scale_inv[i // 128, j // 128]


def test_fused_expert_layout_loads(checkpoint, tmp_path):
    path, _ = checkpoint
    tensors = load_file(path / "model.safetensors")
    config = DeepSeekV3Config.from_hf(path)
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts"
        experts = range(config.n_routed_experts)
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]) for e in experts])
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in experts])
    fused_dir = rewrite(path, tmp_path / "fused", fused)
    assert_same_params(DeepSeekV3.from_pretrained(fused_dir), DeepSeekV3.from_pretrained(path))


def _add_mtp_weights(path: Path, dst: Path) -> Path:
    """``path`` plus random MTP weights at layer ``num_hidden_layers`` (hub layout, embed/head copies included),
    as two shards and an index."""
    tensors = load_file(path / "model.safetensors")
    config = DeepSeekV3Config.from_hf(path)
    abstract = abstract_module(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0)))
    shapes = {p: tuple(v.shape) for p, v in iter_variables(abstract)}
    gen = torch.Generator().manual_seed(3)
    mtp = {}
    for slot in canonical_slots(config, shapes):
        if slot.path.startswith("mtp_layers."):
            t = torch.randn(slot.transform.hf_shape(shapes[slot.path][len(slot.index):]), generator=gen)
            mtp[slot.key] = 1 + 0.2 * t if "norm" in slot.key else 0.15 * t
    prefix = f"model.layers.{config.num_hidden_layers}."
    mtp[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    rewrite(path, dst, tensors)
    os.rename(dst / "model.safetensors", dst / "main.safetensors")
    save_file(mtp, str(dst / "mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(tensors, "main.safetensors"), **dict.fromkeys(mtp, "mtp.safetensors")}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_mtp_heads_load_and_match_hf(checkpoint, tmp_path):
    path, hf_logits = checkpoint
    mtp_dir = _add_mtp_weights(path, tmp_path / "mtp")
    model = DeepSeekV3.from_pretrained(mtp_dir, moe_impl="dense")
    assert model.config.num_nextn_predict_layers == 1
    assert DeepSeekV3.from_pretrained(path).config.num_nextn_predict_layers == 0  # no MTP weights, no heads
    out = nnx.jit(lambda m, ids: m.forward(ids, with_mtp=True))(model, jnp.asarray(IDS))
    assert rel_l2(out.logits, hf_logits) < 1e-5

    # HF's MTP module (what generate(use_mtp=True) drafts with), fed the main model's final hidden state and the
    # tokens shifted by one at their own positions.
    main = DeepseekV3ForCausalLM.from_pretrained(mtp_dir, attn_implementation="eager").eval()
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{main.config.num_hidden_layers}.*"]
    mtp = MtpModel.from_pretrained(main).eval()
    ids = torch.as_tensor(IDS).long()
    with torch.no_grad():
        last_hidden = main(ids, output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(1, ids.shape[1])[None].expand(ids.shape[0], -1)
        hidden = mtp.forward_layer(0, last_hidden[:, :-1], positions, None, input_ids=ids[:, 1:])
        ref = mtp._project_to_logits(hidden).numpy()
    # Our last position reads a pad token (there is no next token): compare the others.
    assert rel_l2(out.mtp_logits[0][:, :-1], ref) < 1e-5

    # Export writes the MTP head back (hub layout), and it reloads identically.
    exported = tmp_path / "mtp_export"
    model.save_pretrained(exported)
    keys = set(json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"])
    assert keys == set(json.loads((mtp_dir / "model.safetensors.index.json").read_text())["weight_map"])
    assert keys == set(iter_hf_keys(model.config, {p: tuple(v.shape) for p, v in iter_variables(model)}))
    assert_same_params(DeepSeekV3.from_pretrained(exported, moe_impl="dense"), model)


def test_load_onto_mesh_places_each_variable(checkpoint):
    from nnx_zoo.sharding import make_mesh, variable_spec

    path, _ = checkpoint
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model = DeepSeekV3.from_pretrained(path, mesh=mesh)
    plain = DeepSeekV3.from_pretrained(path)
    for (p, var), (_, ref) in zip(iter_variables(model), iter_variables(plain)):
        want = variable_spec(p, var, model.rules, mesh)
        assert var[...].sharding.spec == want, p
        np.testing.assert_array_equal(np.asarray(jax.device_get(var[...])), np.asarray(ref[...]), err_msg=p)
    sharded = [p for p, var in iter_variables(model) if len(var[...].sharding.device_set) > 1 and any(
        a is not None for a in var[...].sharding.spec)]
    assert "moe_layers.mlp.experts.wi_gate" in sharded and "embed.embedding" in sharded
