"""Safetensors checkpoint files: validated headers, one tensor at a time, quantized weights, sharded writes.

``SafetensorsCheckpoint(directory)`` opens the files of a checkpoint directory (those its
``model.safetensors.index.json`` names, else every ``*.safetensors``), validates every header up front (a
truncated, empty or corrupt file is reported before any tensor is read) and reads tensors on demand;
``write_shards`` writes size-capped shards and the index.

Quantized weights are dequantized to float32 one tensor at a time as they are read (``read_weight``):
- float8 (``F8_E4M3`` / ``F8_E5M2``) ``[out, in]`` with one scale per ``weight_block_size`` block (``[128, 128]``
  unless ``config.json``'s ``quantization_config`` says otherwise), the last row / column of blocks possibly
  partial. The scale sits beside the weight as ``<key>_scale_inv`` (DeepSeek-V3) or, for ``<name>.weight``, as
  ``<name>.scale`` (DeepSeek-V4); it is float32 or ``F8_E8M0`` (UE8M0: a power of two, ``2^(byte - 127)``).
- FP4 (``I8`` ``[out, in / 2]``, two E2M1 values per byte, low nibble first) with ``<name>.scale`` ``[out,
  in / 32]`` (one scale per 32 inputs of a row, MXFP4), read as FP4 only where ``config.json`` declares
  ``expert_dtype: "fp4"`` (DeepSeek-V4's routed experts).
- MXFP4 in HF's ``mxfp4`` format (``quantization_config.quant_method: "mxfp4"``, GPT-OSS's experts): ``U8``
  ``<name>_blocks [..., out, in / 32, 16]`` (the same E2M1 pairs, low nibble first) with ``<name>_scales [..., out,
  in / 32]`` (UE8M0 bytes), read as transformers' dequantization reads them: float32 ``[..., in, out]`` (the last two
  dims swapped), the layout of the unquantized tensor ``<name>`` (a family's table renames ``<name>_blocks``).
Both scalings are by powers of two (or by the stored float32 scale), so the float32 result is exact.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from nnx_zoo.hf.config_io import (
    config_json_path,
    fp4_experts,
    fp8_block_size,
    json_kind,
    mxfp4_blocks,
    read_json_object,
    write_json,
)
from nnx_zoo.hf.errors import CheckpointFormatError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
          "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
INTEGER_DTYPES = ("I64", "I32", "I16", "I8", "U8")
INDEX_NAME = "model.safetensors.index.json"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FP4_DTYPE = "I8"  # packed E2M1 pairs, where config.json declares expert_dtype "fp4"
FP4_GROUP = 32  # inputs of a row sharing one FP4 scale (MXFP4)
MXFP4_DTYPE, MXFP4_BLOCKS, MXFP4_SCALES = "U8", "_blocks", "_scales"  # HF's mxfp4 format: <name>_blocks/_scales
SCALE_DTYPES = (*FLOAT_DTYPES, "F8_E8M0")
FP8_SCALE_SUFFIX = "_scale_inv"  # ``<key>_scale_inv``: the per-block inverse scales of float8 weight ``<key>``
SCALE_SUFFIX = ".scale"  # ``<name>.scale`` beside ``<name>.weight``: DeepSeek-V4's scales (float8 and FP4)
_LISTED = 8  # problems of one file listed in full; the rest are counted


class TensorInfo(NamedTuple):
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "F32", "BF16", "F8_E4M3", ...


def checkpoint_files(directory: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a checkpoint directory (those its index names, else every ``*.safetensors``)
    and the index's key -> file name map (empty without an index)."""
    if not directory.exists():
        raise CheckpointFormatError(f"{directory}: no such directory; pass the checkpoint directory (the one "
                                    "holding config.json and *.safetensors)")
    if not directory.is_dir():
        raise CheckpointFormatError(f"{directory}: is a file, not a checkpoint directory; pass the directory "
                                    f"holding config.json and *.safetensors (perhaps {directory.parent})")
    index_path = directory / INDEX_NAME
    weight_map: Any = {}
    if index_path.exists():  # the index names the checkpoint's files; other *.safetensors there are not part of it
        weight_map = read_json_object(index_path, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointFormatError(f"{index_path}: 'weight_map' must be an object mapping each tensor key to "
                                        f"the name of its safetensors file, got {json_kind(weight_map)}")
        if not weight_map:
            raise CheckpointFormatError(f"{index_path}: 'weight_map' is empty; it names no safetensors files")
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not (directory / n).is_file()]
        if absent:
            raise CheckpointFormatError(f"{index_path}: names {len(absent)} safetensors file(s) that are not in "
                                        f"{directory}: {absent}; the download is incomplete or the index is stale")
        files = [directory / n for n in names]
    else:
        files = sorted(f for f in directory.glob("*.safetensors") if f.is_file())
    if not files:
        pickles = sorted(f.name for f in directory.glob("*.bin"))
        hint = f"; {pickles} are PyTorch pickles, which are not read: convert them to safetensors" if pickles else ""
        raise CheckpointFormatError(f"{directory}: holds no *.safetensors files{hint}")
    return files, weight_map


class SafetensorsCheckpoint:
    """The safetensors files of a checkpoint directory: ``entries`` (key -> ``TensorInfo``) from the headers,
    tensors read on demand; ``fp8_block``, ``fp4`` (whether ``I8`` weights are FP4) and ``mxfp4`` (whether ``U8``
    ``*_blocks`` are MXFP4) from ``config.json``.
    Use as a context manager (closes the files).

    Tensors are read with plain ``readinto`` into a fresh array, not through a memory map: mapped pages of the
    files would stay resident in the process (and count in its RSS) until the map is closed, adding a second copy
    of the checkpoint to peak host memory. Each array read here can be freed as soon as its Variable is filled.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.entries: dict[str, TensorInfo] = {}
        self._extents: dict[str, tuple[int, int]] = {}  # key -> (byte offset in its file, byte length)
        self._handles: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()
        try:
            self._open()
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _open(self) -> None:
        files, weight_map = checkpoint_files(self.directory)  # a bad path is reported before config.json
        config_file = config_json_path(self.directory)
        config = read_json_object(config_file, "model config")
        self.fp8_block = fp8_block_size(config, config_file)
        self.fp4 = fp4_experts(config, config_file)
        self.mxfp4 = mxfp4_blocks(config, config_file)
        for file in files:
            try:
                handle = self._stack.enter_context(open(file, "rb", buffering=0))  # noqa: SIM115 (stack closes it)
            except OSError as err:
                raise CheckpointFormatError(f"{file}: cannot be opened ({err.strerror})") from None
            self._handles[file] = handle
            self._add_file(file, handle)
        misplaced = [f"{k} (in {f}, absent there)" for k, f in weight_map.items()
                     if k not in self.entries or self.entries[k].file.name != f]
        if misplaced:
            raise CheckpointFormatError(f"{self.directory / INDEX_NAME}: {len(misplaced)} keys are not in the file "
                                        "the index names for them: " + ", ".join(misplaced[:_LISTED])
                                        + _more(misplaced))

    def _add_file(self, file: Path, handle: Any) -> None:
        header_len, header = _read_header(file, handle)
        header.pop("__metadata__", None)
        size = os.fstat(handle.fileno()).st_size
        problems = [p for p in (_entry_problem(k, v, size - 8 - header_len) for k, v in header.items()) if p]
        if problems:
            why = ("the file is truncated (an incomplete download?) or its header is corrupt: its header places "
                   f"tensor data past the end of the file ({size} bytes)" if any(past for past, _ in problems)
                   else "its safetensors header is corrupt")
            lines = [line for _, line in problems]
            raise CheckpointFormatError(f"{file}: {why}; {len(lines)} tensor(s) affected:\n    "
                                        + "\n    ".join(lines[:_LISTED]) + _more(lines))
        for key, info in header.items():
            if key in self.entries:
                raise CheckpointFormatError(f"{key} is in both {self.entries[key].file} and {file}; a checkpoint "
                                            "holds each tensor once")
            start, end = info["data_offsets"]
            self.entries[key] = TensorInfo(file, tuple(info["shape"]), info["dtype"])
            self._extents[key] = (8 + header_len + start, end - start)

    def read(self, key: str) -> np.ndarray:
        """The tensor stored under ``key``, as stored (float8 stays float8)."""
        file, shape, dtype = self.entries[key]
        if dtype not in DTYPES:
            raise CheckpointFormatError(f"{file}: {key} has safetensors dtype {dtype}, which is not supported")
        offset, _ = self._extents[key]
        out = np.empty(shape, DTYPES[dtype])
        self._handles[file].seek(offset)
        _read_exact(self._handles[file], memoryview(out.reshape(-1).view(np.uint8)), file, key)
        return out

    def file_key(self, key: str) -> str:
        """The file's own name of ``key`` (itself; ``walker.AliasedCheckpoint`` renames)."""
        return key

    def is_quantized(self, key: str) -> bool:
        """Whether ``key`` is stored quantized (float8, ``I8`` in a checkpoint that declares FP4, or ``U8``
        ``*_blocks`` in one that declares MXFP4)."""
        dtype = self.entries[key].dtype
        return dtype in FP8_DTYPES or (dtype == FP4_DTYPE and self.fp4) or self.is_mxfp4(key)

    def is_mxfp4(self, key: str) -> bool:
        """Whether ``key`` is MXFP4 blocks (``U8`` ``<name>_blocks`` in a checkpoint declaring ``mxfp4``)."""
        return self.mxfp4 and key.endswith(MXFP4_BLOCKS) and self.entries[key].dtype == MXFP4_DTYPE

    def scale_keys(self, key: str) -> list[str]:
        """The scales beside weight ``key`` in the files (one, normally; none for an unquantized weight)."""
        return [k for k in scale_key_candidates(key) if k in self.entries]

    def read_weight(self, key: str) -> np.ndarray:
        """``read(key)``, quantized weights dequantized to float32 with their scales (``scale_keys``)."""
        if not self.is_quantized(key):
            return self.read(key)
        scales = self.scale_keys(key)
        if len(scales) != 1:  # the planner reports this first; a direct caller gets the same facts
            raise CheckpointFormatError(f"{self.entries[key].file}: {key} is {self.entries[key].dtype} with "
                                        f"{len(scales)} scales ({' or '.join(scale_key_candidates(key))}); "
                                        "a quantized weight needs exactly one")
        tensor, scale = self.read(key), self.read(scales[0])
        if self.is_mxfp4(key):
            return dequantize_mxfp4(tensor, scale)
        if self.entries[key].dtype == FP4_DTYPE:
            return dequantize_fp4(tensor, scale)
        return dequantize_fp8(tensor, scale, self.fp8_block)


def scale_key_candidates(key: str) -> tuple[str, ...]:
    """Where the scale of weight ``key`` may be stored: ``<key>_scale_inv`` (DeepSeek-V3), for ``<name>.weight``
    also ``<name>.scale`` (DeepSeek-V4), for MXFP4 ``<name>_blocks`` also ``<name>_scales``."""
    if key.endswith(MXFP4_BLOCKS):
        return key + FP8_SCALE_SUFFIX, key[: -len(MXFP4_BLOCKS)] + MXFP4_SCALES
    if key.endswith(".weight"):
        return key + FP8_SCALE_SUFFIX, key[: -len(".weight")] + SCALE_SUFFIX
    return (key + FP8_SCALE_SUFFIX,)


def _more(items: list[str]) -> str:
    return f"\n    ... and {len(items) - _LISTED} more" if len(items) > _LISTED else ""


def _read_exact(handle: Any, view: memoryview, file: Path, what: str) -> None:
    done = 0
    while done < len(view):  # one read() returns at most ~2 GiB
        n = handle.readinto(view[done:])
        if not n:
            raise CheckpointFormatError(f"{file}: the file ended while reading {what}; it is truncated (or changed "
                                        "while being read)")
        done += n


def _read_header(file: Path, handle: Any) -> tuple[int, dict[str, Any]]:
    """(header length, header object) of one safetensors file, or ``CheckpointFormatError`` saying why not."""
    size = os.fstat(handle.fileno()).st_size
    if size < 8:
        raise CheckpointFormatError(f"{file}: {size} bytes, too short for a safetensors file (which starts with "
                                    "an 8-byte header length); the file is empty or truncated")
    length = bytearray(8)
    _read_exact(handle, memoryview(length), file, "the header length")
    header_len = int.from_bytes(length, "little")
    if header_len > size - 8:
        raise CheckpointFormatError(f"{file}: its header length field says {header_len} bytes but the file has "
                                    f"{size}; it is not a safetensors file, or is truncated or corrupt")
    raw = bytearray(header_len)
    _read_exact(handle, memoryview(raw), file, "the header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(f"{file}: the safetensors header is not valid JSON ({err}); the file is "
                                    "corrupt or not a safetensors file") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{file}: the safetensors header holds {json_kind(header)}, not a JSON object")
    return header_len, header


def _entry_problem(key: str, info: Any, data_size: int) -> tuple[bool, str] | None:
    """(whether its data runs past the end, what is wrong) of one header entry, or None; ``data_size``: the
    bytes after the header."""
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return False, f"{key}: malformed entry {info!r} (needs dtype, shape and data_offsets)"
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        return False, f"{key}: shape {shape!r} is not a list of non-negative integers"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return False, f"{key}: data_offsets {offsets!r} are not [start, end] with 0 <= start <= end"
    if offsets[1] > data_size:
        return True, f"{key}: data at bytes {offsets[0]}..{offsets[1]} of the data section, which has {data_size}"
    if info["dtype"] in DTYPES:
        need = math.prod(shape) * np.dtype(DTYPES[info["dtype"]]).itemsize
        if need != offsets[1] - offsets[0]:
            return False, (f"{key}: shape {shape} of {info['dtype']} needs {need} bytes, its data_offsets span "
                           f"{offsets[1] - offsets[0]}")
    return None


def nonfinite_count(a: np.ndarray, chunk: int = 1 << 20) -> int:
    """How many NaN / infinite values ``a`` (a floating array) holds; checked in chunks, so no full-size mask (nor,
    for a strided view such as a dequantized MXFP4 tensor, a full-size copy: one leading slice at a time)."""
    if not a.flags.c_contiguous and a.ndim > 1:
        return sum(int(np.count_nonzero(~np.isfinite(part))) for part in a)
    flat = a.reshape(-1)
    return sum(int(np.count_nonzero(~np.isfinite(flat[i : i + chunk]))) for i in range(0, flat.size, chunk))


def scale_to_float32(scale: np.ndarray) -> np.ndarray:
    """Stored scales as float32: UE8M0 bytes decoded as ``2^(byte - 127)`` (byte 255 is NaN), floats cast."""
    if scale.dtype != ml_dtypes.float8_e8m0fnu:
        return scale.astype(np.float32)
    exponent = scale.view(np.uint8).astype(np.int32)
    # ldexp is exact, 2^-127 (byte 0) included as a float32 subnormal; NaN is left for the loader to report
    powers = np.ldexp(np.float32(1), np.minimum(exponent, 254) - 127)  # 2^128 would overflow: 255 is NaN anyway
    return np.where(exponent == 255, np.float32(np.nan), powers).astype(np.float32)


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """``weight [out, in]`` (float8) times its per-block ``scale_inv [ceil(out/b0), ceil(in/b1)]`` (float or
    UE8M0) -> float32. Scaled in place one row of blocks at a time: no full-size scale array."""
    rows, cols = weight.shape
    scale = scale_to_float32(scale_inv)
    out = weight.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite results are reported by the loader
        for i in range(0, rows, block[0]):
            out[i : i + block[0]] *= np.repeat(scale[i // block[0]], block[1])[:cols]
    return out


# E2M1 (sign, 2 exponent bits, 1 mantissa bit) by nibble value; a byte holds two, the low nibble first.
FP4_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                           np.float32)
_FP4_BYTE_PAIRS = np.stack([FP4_E2M1_VALUES[np.arange(256) & 0xF], FP4_E2M1_VALUES[np.arange(256) >> 4]], axis=-1)
# The same pairs, each as one 8-byte item: indexing a 1-D table by the bytes is ~10x faster than the [256, 2] one.
_FP4_BYTE_PAIRS_64 = np.ascontiguousarray(_FP4_BYTE_PAIRS).view(np.uint64).reshape(256)


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray, group: int = FP4_GROUP) -> np.ndarray:
    """``packed [out, in / 2]`` (``int8``, two E2M1 values a byte, low nibble first: input ``2j`` in the low
    nibble of byte ``j``) times its ``scale [out, ceil(in / group)]`` (UE8M0 or float) -> float32 ``[out, in]``."""
    rows = packed.shape[0]
    out = _FP4_BYTE_PAIRS_64[packed.view(np.uint8)].view(np.float32).reshape(rows, -1)  # the result's own array
    cols = out.shape[1]
    factors = scale_to_float32(scale)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite results are reported by the loader
        if cols % group == 0:
            groups = out.reshape(rows, cols // group, group)  # a view: scaled in place
            groups *= factors[:, :, None]
        else:  # a partial last group
            out *= np.repeat(factors, group, axis=1)[:, :cols]
    return out


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF ``mxfp4`` ``blocks [..., out, G, 16]`` (``uint8``, 32 E2M1 values per 16 bytes, low nibble first) times
    ``scales [..., out, G]`` (UE8M0 bytes, ``2^(byte - 127)``) -> float32 ``[..., G * 32, out]``: ``dequantize_fp4``
    on the rows, then the last two dims swapped, as transformers' ``convert_moe_packed_tensors`` returns them."""
    *lead, groups, width = blocks.shape
    rows = math.prod(lead)
    if scales.dtype == np.uint8:  # the release stores its UE8M0 scales as plain bytes
        scales = scales.view(ml_dtypes.float8_e8m0fnu)
    out = dequantize_fp4(blocks.reshape(rows, groups * width), scales.reshape(rows, groups), FP4_GROUP)
    return np.swapaxes(out.reshape(*lead, groups * width * 2), -1, -2)


class TensorToWrite(NamedTuple):
    key: str
    nbytes: int
    produce: Callable[[], np.ndarray]  # called when its shard is written, so only one shard is held at a time


def write_shards(directory: Path, tensors: list[TensorToWrite], max_shard_bytes: int) -> None:
    """Write ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_shard_bytes`` (a single larger tensor
    gets a shard of its own), in the given order, and ``model.safetensors.index.json``."""
    shards: list[list[TensorToWrite]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        arrays = {t.key: np.ascontiguousarray(t.produce()) for t in shard}
        save_file(arrays, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(arrays, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(directory / INDEX_NAME, index)
