"""``DeepSeekV4.from_pretrained`` on a checkpoint in the released layout: the release's key naming (``layers.{i}.``,
``embed.weight``, ``mtp.{k}.``), routed experts in FP4 (``I8`` + UE8M0 per 32 inputs), the attention and shared
expert matrices in float8 with UE8M0 128 x 128 block scales under ``.scale``, the compressor, indexer scorer,
router, embedding and head in BF16 (as V4-Flash ships them), the hash table in I64, ``expert_dtype`` at the top level
of ``config.json``. The checkpoint is a bf16 model's weights quantized here (``quant_reference``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.torch import load_file

from nnx_zoo.models.deepseek4 import DeepSeekV4
from nnx_zoo.models.deepseek4.config import CSA, SLIDING, DeepSeekV4Config, hash_schedule
from nnx_zoo.sharding import iter_variables
from tests.hf.quant_reference import quantize_fp4, quantize_fp8, reference_dequantize, write_checkpoint

CONFIG = DeepSeekV4Config.preset("deepseek4-tiny", vocab_size=256, num_hidden_layers=2, layer_types=(SLIDING, CSA),
                                 mlp_layer_types=hash_schedule(2, 1), param_dtype="bfloat16")
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
FP4_KEY = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
BF16_KEY = re.compile(r"^(embed|head)\.|\.gate\.weight$|\.compressor\.|\.weights_proj\.")  # stay unquantized


def _release_name(key: str) -> str:
    """transformers' naming (what ``save_pretrained`` writes) -> the release's (``hf.ALIASES`` reversed)."""
    key = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(key, key)
    return re.sub(r"^model\.hc_head\.hc_", "hc_head_", re.sub(r"^model\.layers\.", "layers.", key))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """bf16: the model as saved; quantized: the release layout; dequantized: the quantized weights dequantized by
    transformers' own function, stored in float32 (what the quantized checkpoint must load as, exactly)."""
    root = tmp_path_factory.mktemp("v4")
    DeepSeekV4(CONFIG, rngs=nnx.Rngs(0)).save_pretrained(root / "bf16")
    config = json.loads((root / "bf16" / "config.json").read_text())
    quantized, dequantized = {}, {}
    for key, value in load_file(str(next((root / "bf16").glob("*.safetensors")))).items():
        name = _release_name(key)
        if name.endswith(".tid2eid"):
            value = value.long()  # the release's hash tables are I64
        if FP4_KEY.search(name):
            q, scale = quantize_fp4(value)
            dequantized[name] = reference_dequantize(q, scale)
        elif name.endswith(".weight") and value.ndim == 2 and not BF16_KEY.search(name):
            q, scale = quantize_fp8(value)
            dequantized[name] = reference_dequantize(q, scale, (128, 128))
        else:
            quantized[name] = dequantized[name] = value
            continue
        quantized[name], quantized[name.removesuffix("weight") + "scale"] = q, scale
    dtypes = [str(v.dtype) for v in quantized.values()]
    assert dtypes.count("torch.int8") == 3 * 8 * 3  # w1, w2, w3 of 8 experts in 2 layers and the MTP layer
    assert dtypes.count("torch.float8_e4m3fn") > 20 and dtypes.count("torch.int64") == 1
    assert "layers.1.attn.wq_b.scale" in quantized and "mtp.0.ffn.experts.7.w2.scale" in quantized
    return {"bf16": root / "bf16",
            "quantized": write_checkpoint(root / "quantized", quantized, {
                **config, "quantization_config": QUANTIZATION, "expert_dtype": "fp4"}),
            "dequantized": write_checkpoint(root / "dequantized", dequantized, config)}


def _params(model: DeepSeekV4) -> dict[str, np.ndarray]:
    return {p: np.asarray(v[...]) for p, v in iter_variables(nnx.state(model))}


def test_fp4_experts_and_fp8_matrices_load_exactly_and_run_close_to_bf16(checkpoints):
    quantized = DeepSeekV4.from_pretrained(checkpoints["quantized"], attention_impl="xla")  # float32 parameters
    reference = _params(DeepSeekV4.from_pretrained(checkpoints["dequantized"]))
    ours = _params(quantized)
    assert ours.keys() == reference.keys()
    for path, value in ours.items():  # every Variable, each routed expert in its slot, MTP layer included
        np.testing.assert_array_equal(value, reference[path], err_msg=path)

    unquantized = DeepSeekV4.from_pretrained(checkpoints["bf16"], attention_impl="xla")
    graphdef, bf16_state = nnx.split(unquantized)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))  # one program for both models
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 48)))
    want = forward(bf16_state, ids)
    got = forward(nnx.state(quantized), ids)
    # The float8 matrices differ from bf16 by ~3% (E4M3 keeps 3 mantissa bits), the FP4 experts by ~12% (E2M1 keeps
    # one: 0.5, 1, 1.5, 2, 3, 4, 6 times a power of two), and this random model's logits by ~9%. A dequantizer that
    # mis-scales or mis-orders values does not come near: 0.15 leaves room for the quantization error and no more.
    expert = ours["stacks.csa_moe.mlp.experts.wi_gate"]
    bf16_expert = _params(unquantized)["stacks.csa_moe.mlp.experts.wi_gate"].astype(np.float32)
    assert 0.05 < np.linalg.norm(expert - bf16_expert) / np.linalg.norm(bf16_expert) < 0.15
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.15


def test_expert_weights_are_fp4_only_where_config_says_so(checkpoints, tmp_path):
    """The same files with ``expert_dtype`` dropped: the I8 experts are refused, named, not cast to garbage."""
    config = json.loads((checkpoints["quantized"] / "config.json").read_text())
    del config["expert_dtype"]
    for file in checkpoints["quantized"].iterdir():
        (tmp_path / file.name).symlink_to(file)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(?s)72 wrong dtypes:.*model\.layers\.0\.ffn\.experts\.0\.w1\.weight: I8 in "
                                         r"model\.safetensors, where a floating-point weight belongs \(config\.json "
                                         r"does not declare FP4"):
        DeepSeekV4.from_pretrained(tmp_path)
