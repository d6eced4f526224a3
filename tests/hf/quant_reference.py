"""Test helpers: DeepSeek-V4's quantized formats written and read back with torch, independently of nnx_zoo.

Quantizers (ours, for making test files): float8 E4M3 with one UE8M0 scale per block (the scale is the power of
two at or above ``amax / 448``, as transformers' ``Fp8Quantize`` rounds it for ``scale_fmt="ue8m0"``), and FP4
E2M1 pairs with one UE8M0 scale per 32 inputs of a row (the power of two at or above ``amax / 6``).

Reference dequantizer: transformers' own ``Fp8Dequantize._dequantize_one``
(``transformers/integrations/finegrained_fp8.py``: ``_FP4_E2M1_LUT``, ``_unpack_fp4`` low nibble first, the block
size taken from the scale grid as ``rows // scale_rows``). Deriving the block from the grid is right only when the
weight's sides are multiples of the block (a ``[200, 300]`` weight's ``[2, 3]`` grid would give 100 x 100 blocks),
so ``reference_dequantize`` pads a ragged float8 weight with zeros to whole blocks first and crops the result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

E4M3_MAX, E2M1_MAX, FP4_GROUP = 448.0, 6.0, 32
E2M1 = torch.tensor(Fp8Dequantize._FP4_E2M1_LUT, dtype=torch.float32)


def _power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 x), 1 where x is 0 (an all-zero block)."""
    return torch.where(x > 0, torch.exp2(torch.ceil(torch.log2(x.clamp(min=2.0**-126)))), torch.ones_like(x))


def _pad_to(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = w.shape
    return torch.nn.functional.pad(w, (0, -cols % block[1], 0, -rows % block[0]))


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (E4M3 weight ``[out, in]``, UE8M0 scales ``[ceil(out/b0), ceil(in/b1)]``)."""
    rows, cols = w.shape
    padded = _pad_to(w.float(), block)
    tiles = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    scale = _power_of_two_at_least(tiles.abs().amax(dim=(1, 3)) / E4M3_MAX)
    q = (tiles / scale[:, None, :, None]).reshape(padded.shape).to(torch.float8_e4m3fn)[:rows, :cols]
    return q.contiguous(), scale.to(torch.float8_e8m0fnu)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` (``in`` a multiple of 32) -> (int8 ``[out, in/2]``: two E2M1 codes a byte, input ``2j`` in
    byte ``j``'s low nibble; UE8M0 scales ``[out, in/32]``)."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = _power_of_two_at_least(groups.abs().amax(dim=-1) / E2M1_MAX)
    scaled = (groups / scale[..., None]).reshape(rows, cols)
    codes = (scaled[..., None] - E2M1).abs().argmin(dim=-1).to(torch.uint8)  # nearest E2M1 value
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8).contiguous(), scale.to(torch.float8_e8m0fnu)


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """transformers' dequantization to float32; ``block`` (float8): pad ``q`` to whole blocks first."""
    rows, cols = q.shape[0], q.shape[1] * (2 if q.dtype == torch.int8 else 1)
    if block is not None:
        q = _pad_to(q.float(), block).to(q.dtype)  # zeros are exact in E4M3
    out = Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)
    return out[:rows, :cols]


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """``model.safetensors`` (safetensors writes F8_E8M0 from torch.float8_e8m0fnu) and ``config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory
