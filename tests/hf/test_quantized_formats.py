"""DeepSeek-V4's quantized checkpoint formats, each read exactly against transformers' own dequantizer
(``quant_reference``): float8 E4M3 with UE8M0 (or float32) block scales under ``<name>.scale``, ragged shapes
included, and FP4 E2M1 pairs with UE8M0 scales per 32 inputs; every malformed pairing reported in the planner's one
error, naming the key and the file."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from nnx_zoo.hf import DENSE, CheckpointFormatError, CheckpointMismatchError, KeyTable, Row, SafetensorsCheckpoint
from nnx_zoo.hf.safetensors_io import scale_to_float32
from nnx_zoo.hf.walker import aliased, plan_load
from tests.hf.quant_reference import quantize_fp4, quantize_fp8, reference_dequantize, write_checkpoint

UE8M0 = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
FP4 = {"quantization_config": {**UE8M0, "expert_dtype": "fp4"}}


def _weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Normal values whose rows span six decades and columns three, so neighbouring blocks and groups get different
    scale exponents along both sides (a block misplaced either way reads the wrong scale)."""
    g = torch.Generator().manual_seed(seed)
    rows = 10.0 ** torch.empty(shape[0], 1).uniform_(-4, 2, generator=g)
    cols = 10.0 ** torch.empty(1, shape[1]).uniform_(-2, 1, generator=g)
    return torch.randn(shape, generator=g) * rows * cols


def _read(directory: Path, key: str) -> np.ndarray:
    with SafetensorsCheckpoint(directory) as ckpt:
        return ckpt.read_weight(key)


def test_ue8m0_bytes_decode_as_powers_of_two():
    every = torch.arange(256, dtype=torch.uint8)
    ours = scale_to_float32(every.numpy().view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(ours, every.view(torch.float8_e8m0fnu).float().numpy())  # 255 is NaN in both
    assert ours[127] == 1.0 and ours[0] == 2.0**-127 and np.isnan(ours[255])


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (100, 50), (129, 1)])
def test_fp8_with_ue8m0_blocks_matches_transformers(tmp_path, shape):
    q, scale = quantize_fp8(_weights(shape, seed=shape[0]))
    path = write_checkpoint(tmp_path, {"layers.0.attn.wq_a.weight": q, "layers.0.attn.wq_a.scale": scale},
                            {"quantization_config": UE8M0})
    ours = _read(path, "layers.0.attn.wq_a.weight")
    assert ours.dtype == np.float32 and ours.shape == shape
    np.testing.assert_array_equal(ours, reference_dequantize(q, scale, (128, 128)).numpy())


def test_fp8_with_float32_blocks_of_a_configured_size(tmp_path):
    """DeepSeek-V4-Flash-Base's layout (float32 ``.scale``), with non-square 32 x 64 blocks from config.json."""
    q, scale = quantize_fp8(_weights((100, 150), seed=1), (32, 64))
    scale = scale.float()
    path = write_checkpoint(tmp_path, {"w.weight": q, "w.scale": scale},
                            {"quantization_config": {**UE8M0, "weight_block_size": [32, 64]}})
    np.testing.assert_array_equal(_read(path, "w.weight"), reference_dequantize(q, scale, (32, 64)).numpy())


@pytest.mark.parametrize("declared", ["quantization_config", "top level"])
def test_fp4_with_ue8m0_groups_matches_transformers(tmp_path, declared):
    q, scale = quantize_fp4(_weights((24, 192), seed=2))
    every_byte = torch.arange(256, dtype=torch.uint8).view(torch.int8).reshape(2, 128)  # all nibble pairs
    byte_scales = torch.randint(110, 140, (2, 8), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    config = FP4 if declared == "quantization_config" else {"quantization_config": UE8M0, "expert_dtype": "fp4"}
    path = write_checkpoint(tmp_path, {
        "layers.1.ffn.experts.3.w2.weight": q, "layers.1.ffn.experts.3.w2.scale": scale,
        "mtp.0.ffn.experts.0.w1.weight": every_byte, "mtp.0.ffn.experts.0.w1.scale": byte_scales.view(
            torch.float8_e8m0fnu)}, config)
    ours = _read(path, "layers.1.ffn.experts.3.w2.weight")
    assert ours.dtype == np.float32 and ours.shape == (24, 192)
    np.testing.assert_array_equal(ours, reference_dequantize(q, scale).numpy())
    np.testing.assert_array_equal(_read(path, "mtp.0.ffn.experts.0.w1.weight"),
                                  reference_dequantize(every_byte, byte_scales.view(torch.float8_e8m0fnu)).numpy())


def test_unquantized_and_integer_tensors_are_read_as_stored(tmp_path):
    bf16 = _weights((4, 8), seed=4).bfloat16()
    table = torch.arange(12, dtype=torch.int64).reshape(6, 2)
    i8 = torch.arange(-4, 4, dtype=torch.int8)
    path = write_checkpoint(tmp_path, {"attn.compressor.wkv.weight": bf16, "ffn.gate.tid2eid": table, "ids": i8},
                            FP4)
    with SafetensorsCheckpoint(path) as ckpt:
        assert ckpt.read_weight("attn.compressor.wkv.weight").dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(ckpt.read_weight("attn.compressor.wkv.weight").astype(np.float32),
                                      bf16.float().numpy())
        np.testing.assert_array_equal(ckpt.read_weight("ffn.gate.tid2eid"), table.numpy())
        np.testing.assert_array_equal(ckpt.read("ids"), i8.numpy())  # what the loader does for integer Variables
        with pytest.raises(CheckpointFormatError, match=r"ids is I8 with 0 scales"):
            ckpt.read_weight("ids")  # an I8 weight without a scale, where FP4 is declared


# ---------------------------------------------------------------- problems, all in one error
ROWS = ("wq", "wkv", "wo", "w1", "w2", "w3", "shared", "gate", "bias_like")
TABLE = KeyTable(top=tuple(Row(f"model.layers.0.{name}.weight", name, DENSE) for name in ROWS),
                 aliases=((r"^layers\.", "model.layers."),))
SHAPES = {name: (64, 32) for name in ROWS}  # our [in, out] kernels: HF [32, 64]


def test_every_pairing_problem_is_named_with_its_key_and_file(tmp_path):
    fp8, fp8_scale = quantize_fp8(torch.randn(32, 64))
    fp4, fp4_scale = quantize_fp4(torch.randn(32, 64))
    tensors = {
        "layers.0.wq.weight": fp8,  # float8 without a scale
        "layers.0.wkv.weight": fp8, "layers.0.wkv.scale": torch.ones(2, 1).to(torch.float8_e8m0fnu),  # [1, 1] due
        "layers.0.wo.weight": fp8, "layers.0.wo.scale": fp8_scale.view(torch.uint8).to(torch.int8),  # integer scale
        "layers.0.w1.weight": fp4,  # FP4 without a scale
        "layers.0.w2.weight": fp4, "layers.0.w2.scale": torch.ones(32, 4).to(torch.float8_e8m0fnu),  # [32, 2] due
        "layers.0.w3.weight": fp4, "layers.0.w3.scale": fp4_scale,  # fine
        "layers.0.shared.weight": torch.randn(32, 64).bfloat16(),
        "layers.0.shared.scale": fp8_scale,  # a scale beside an unquantized weight
        "layers.0.gate.weight": fp8, "layers.0.gate.scale": fp8_scale,  # fine
        "layers.0.bias_like.weight": torch.randn(32, 64),
        "layers.0.orphan.scale": fp8_scale,  # a scale without any weight
    }
    path = write_checkpoint(tmp_path, tensors, FP4)
    with SafetensorsCheckpoint(path) as ckpt, pytest.raises(CheckpointMismatchError) as info:
        plan_load(aliased(ckpt, TABLE), TABLE, SHAPES)
    err, file = info.value, "model.safetensors"
    assert err.missing == []
    assert err.wrong == [
        f"model.layers.0.w1.weight: FP4 (packed E2M1) weight in {file} as layers.0.w1.weight without its scale "
        "(layers.0.w1.weight_scale_inv or layers.0.w1.scale)",
        f"model.layers.0.w2.scale in {file} as layers.0.w2.scale: checkpoint has [32, 4], one scale per 32 inputs "
        "of each row of [32, 64] need [32, 2]",
        f"model.layers.0.wkv.scale in {file} as layers.0.wkv.scale: checkpoint has [2, 1], (128, 128) blocks of "
        "[32, 64] need [1, 1]",
        f"model.layers.0.wq.weight: float8 weight in {file} as layers.0.wq.weight without its scale "
        "(layers.0.wq.weight_scale_inv or layers.0.wq.scale)"]
    assert err.wrong_dtypes == [
        f"model.layers.0.wo.scale: I8 in {file} as layers.0.wo.scale, where a floating-point scale belongs"]
    assert err.unexpected == [
        f"model.layers.0.orphan.scale (in {file} as layers.0.orphan.scale: a scale without its weight "
        "model.layers.0.orphan.weight)",
        f"model.layers.0.shared.scale (in {file} as layers.0.shared.scale: a scale beside "
        "model.layers.0.shared.weight, which is BF16, not quantized)"]


def test_i8_weight_without_fp4_declared_is_refused(tmp_path):
    fp4, fp4_scale = quantize_fp4(torch.randn(32, 64))
    table = KeyTable(top=(Row("w1.weight", "w1", DENSE),))
    path = write_checkpoint(tmp_path, {"w1.weight": fp4, "w1.scale": fp4_scale}, {"quantization_config": UE8M0})
    with SafetensorsCheckpoint(path) as ckpt, pytest.raises(CheckpointMismatchError) as info:
        plan_load(ckpt, table, {"w1": (64, 32)})
    assert info.value.wrong_dtypes == [
        "w1.weight: I8 in model.safetensors, where a floating-point weight belongs (config.json does not declare "
        "FP4 weights: no expert_dtype \"fp4\" in it or its quantization_config)"]
    assert info.value.unexpected == [
        "w1.scale (in model.safetensors: a scale beside w1.weight, which is I8, not quantized)"]


def test_unknown_expert_dtype_is_a_format_error(tmp_path):
    path = write_checkpoint(tmp_path, {"w": torch.zeros(2)}, {"quantization_config": {"expert_dtype": "int4"}})
    with pytest.raises(CheckpointFormatError, match=r"config.json: quantization_config.expert_dtype must be"):
        SafetensorsCheckpoint(path)
