"""Hugging Face checkpoints <-> DeepSeekV3: one declarative key table, one loading walker, one writer.

The table says, for every HF key, which of our Variables it fills and how (``Same``, ``Dense`` = an
``nn.Linear`` weight ``[out, in]`` <-> our ``[*in, *out]`` kernel, or a fused-expert slice). Stacked Variables
(scanned layers, routed experts) are filled slot by slot: a slot is a leading index ``(layer,)`` or
``(layer, expert)``. Loading first plans every key from the files' headers alone and reports every problem
(missing, unexpected, wrong shape) in one error; then it reads tensors one at a time and places each Variable
directly onto its resolved sharding, each device receiving only its own shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from safetensors.numpy import save_file

from nnx_zoo.hf.errors import CheckpointFormatError, CheckpointMismatchError, json_kind, read_json_object
from nnx_zoo.layers.lora import LoRAParam
from nnx_zoo.models.deepseek.config import DeepSeekV3Config
from nnx_zoo.sharding import abstract_module, get_rules, iter_variables, variable_spec
from nnx_zoo.sharding.rules import Rules

Shape = tuple[int, ...]


# ---------------------------------------------------------------- transforms: HF tensor <-> our (sub-)array
@dataclasses.dataclass(frozen=True)
class Same:
    """Stored identically (norm scales, biases, the embedding table, the router bias)."""

    def hf_shape(self, ours: Shape) -> Shape:
        return ours

    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray:
        return a

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a


@dataclasses.dataclass(frozen=True)
class Dense:
    """An ``nn.Linear`` weight ``[prod(out), prod(in)]`` <-> our kernel ``[*in, *out]`` (``n_in`` input dims)."""

    n_in: int = 1

    def hf_shape(self, ours: Shape) -> Shape:
        return (math.prod(ours[self.n_in :]), math.prod(ours[: self.n_in]))

    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray:
        return a.T.reshape(ours)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(math.prod(a.shape[: self.n_in]), -1).T


@dataclasses.dataclass(frozen=True)
class FusedGateUp:
    """transformers-5 ``experts.gate_up_proj [E, 2I, H]`` -> ``wi_gate`` (half 0) / ``wi_up`` (half 1) ``[E, H, I]``."""

    half: int

    def hf_shape(self, ours: Shape) -> Shape:
        experts, hidden, inner = ours
        return (experts, 2 * inner, hidden)

    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray:
        inner = ours[2]
        return a[:, self.half * inner : (self.half + 1) * inner, :].transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class FusedDown:
    """transformers-5 ``experts.down_proj [E, H, I]`` -> ``wo [E, I, H]``."""

    def hf_shape(self, ours: Shape) -> Shape:
        experts, inner, hidden = ours
        return (experts, hidden, inner)

    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray:
        return a.transpose(0, 2, 1)


SAME, DENSE = Same(), Dense()

# ---------------------------------------------------------------- the key table
TOP_TABLE = (
    ("model.embed_tokens.weight", "embed.embedding", SAME),
    ("model.norm.weight", "norm.scale", SAME),
    ("lm_head.weight", "lm_head.kernel", DENSE),
)
# Keys of one decoder layer, under ``model.layers.{i}.``; ``{e}`` is the routed expert (our second stacked dim).
LAYER_TABLE = (
    ("input_layernorm.weight", "input_norm.scale", SAME),
    ("post_attention_layernorm.weight", "post_attn_norm.scale", SAME),
    ("self_attn.q_proj.weight", "attn.q_proj.kernel", DENSE),
    ("self_attn.q_a_proj.weight", "attn.q_a_proj.kernel", DENSE),
    ("self_attn.q_a_proj.bias", "attn.q_a_proj.bias", SAME),
    ("self_attn.q_a_layernorm.weight", "attn.q_a_norm.scale", SAME),
    ("self_attn.q_b_proj.weight", "attn.q_b_proj.kernel", DENSE),
    ("self_attn.kv_a_proj_with_mqa.weight", "attn.kv_a_proj.kernel", DENSE),
    ("self_attn.kv_a_proj_with_mqa.bias", "attn.kv_a_proj.bias", SAME),
    ("self_attn.kv_a_layernorm.weight", "attn.kv_a_norm.scale", SAME),
    ("self_attn.kv_b_proj.weight", "attn.kv_b_proj.kernel", DENSE),
    ("self_attn.o_proj.weight", "attn.o_proj.kernel", Dense(n_in=2)),
    ("self_attn.o_proj.bias", "attn.o_proj.bias", SAME),
    ("mlp.gate_proj.weight", "mlp.gate.kernel", DENSE),
    ("mlp.up_proj.weight", "mlp.up.kernel", DENSE),
    ("mlp.down_proj.weight", "mlp.down.kernel", DENSE),
    ("mlp.gate.weight", "mlp.router", DENSE),
    ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias", SAME),
    ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.gate.kernel", DENSE),
    ("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.up.kernel", DENSE),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.down.kernel", DENSE),
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.wi_gate", DENSE),
    ("mlp.experts.{e}.up_proj.weight", "mlp.experts.wi_up", DENSE),
    ("mlp.experts.{e}.down_proj.weight", "mlp.experts.wo", DENSE),
)
# A multi-token-prediction depth (``model.layers.{num_hidden_layers + d}.``): its own keys plus a full layer.
MTP_TABLE = (
    ("enorm.weight", "enorm.scale", SAME),
    ("hnorm.weight", "hnorm.scale", SAME),
    ("eh_proj.weight", "eh_proj.kernel", DENSE),
    ("shared_head.norm.weight", "final_norm.scale", SAME),
) + tuple((hf, "layer." + ours, t) for hf, ours, t in LAYER_TABLE)
# transformers-5 fused expert layout: one key fills a whole layer's experts of one or two Variables.
FUSED_EXPERTS = {
    "mlp.experts.gate_up_proj": (("mlp.experts.wi_gate", FusedGateUp(0)), ("mlp.experts.wi_up", FusedGateUp(1))),
    "mlp.experts.down_proj": (("mlp.experts.wo", FusedDown()),),
}
# Hub MTP layers repeat the main model's embedding and head; they are written on export and ignored on import.
MTP_DUPLICATES = ("embed_tokens.weight", "shared_head.head.weight")
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FP8_SCALE_SUFFIX = "_scale_inv"


@dataclasses.dataclass(frozen=True)
class Slot:
    """HF key ``key`` fills ``path[index]`` (a leading index of a stacked Variable) via ``transform``."""

    key: str
    path: str
    index: tuple[int, ...]
    transform: Any


def _stacks(config: DeepSeekV3Config) -> list[tuple[str, int, int, tuple]]:
    """(stack name, first HF layer index, count, table) of each stack."""
    c = config
    return [("dense_layers", 0, c.num_dense_layers, LAYER_TABLE),
            ("moe_layers", c.first_k_dense_replace, c.num_moe_layers, LAYER_TABLE),
            ("mtp_layers", c.num_hidden_layers, c.num_nextn_predict_layers, MTP_TABLE)]


def canonical_slots(config: DeepSeekV3Config, shapes: dict[str, Shape]) -> list[Slot]:
    """Every HF key (per-expert layout) of a model whose Variables have ``shapes`` (path -> shape)."""
    slots = [Slot(hf, ours, (), t) for hf, ours, t in TOP_TABLE if ours in shapes]
    for stack, first, count, table in _stacks(config):
        for hf, ours, t in table:
            path = f"{stack}.{ours}"
            if path not in shapes:
                continue
            for j in range(count):
                prefix = f"model.layers.{first + j}."
                if "{e}" in hf:
                    slots += [Slot(prefix + hf.format(e=e), path, (j, e), t) for e in range(shapes[path][1])]
                else:
                    slots.append(Slot(prefix + hf, path, (j,), t))
    unmapped = sorted(set(shapes) - {s.path for s in slots})
    if unmapped:  # a Variable added to the model without a row in the key table
        raise ValueError(f"no HF key in the table maps to {unmapped}; add rows to nnx_zoo/models/deepseek/hf.py")
    return slots


def _fused_slots(config: DeepSeekV3Config, key: str, shapes: dict[str, Shape]) -> list[Slot]:
    match = _LAYER_KEY.match(key)
    if not match or match.group(2) not in FUSED_EXPERTS:
        return []
    layer = int(match.group(1))
    for stack, first, count, table in _stacks(config):
        if first <= layer < first + count:
            prefix = "layer." if table is MTP_TABLE else ""
            return [Slot(key, f"{stack}.{prefix}{ours}", (layer - first,), t)
                    for ours, t in FUSED_EXPERTS[match.group(2)] if f"{stack}.{prefix}{ours}" in shapes]
    return []


# ---------------------------------------------------------------- reading safetensors
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_INDEX = "model.safetensors.index.json"
_LISTED = 8  # problems of one file listed in full; the rest are counted


def checkpoint_files(directory: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a checkpoint directory (those its index names, else every ``*.safetensors``)
    and the index's key -> file name map (empty without an index)."""
    if not directory.exists():
        raise CheckpointFormatError(f"{directory}: no such directory; pass the checkpoint directory (the one "
                                    "holding config.json and *.safetensors)")
    if not directory.is_dir():
        raise CheckpointFormatError(f"{directory}: is a file, not a checkpoint directory; pass the directory "
                                    f"holding config.json and *.safetensors (perhaps {directory.parent})")
    index_path = directory / _INDEX
    weight_map: dict[str, str] = {}
    if index_path.exists():  # the index names the checkpoint's files; other *.safetensors there are not part of it
        weight_map = read_json_object(index_path, "safetensors index").get("weight_map")  # type: ignore[assignment]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointFormatError(f"{index_path}: 'weight_map' must be an object mapping each tensor key to "
                                        f"the name of its safetensors file, got {json_kind(weight_map)}")
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not (directory / n).is_file()]
        if absent:
            raise CheckpointFormatError(f"{index_path}: names {len(absent)} safetensors file(s) that are not in "
                                        f"{directory}: {absent}; the download is incomplete or the index is stale")
        files = [directory / n for n in names]
        if not files:
            raise CheckpointFormatError(f"{index_path}: 'weight_map' is empty; it names no safetensors files")
    else:
        files = sorted(f for f in directory.glob("*.safetensors") if f.is_file())
    if not files:
        pickles = sorted(f.name for f in directory.glob("*.bin"))
        hint = f"; {pickles} are PyTorch pickles, which are not read: convert them to safetensors" if pickles else ""
        raise CheckpointFormatError(f"{directory}: holds no *.safetensors files{hint}")
    return files, weight_map


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
    if info["dtype"] in _DTYPES:
        need = math.prod(shape) * np.dtype(_DTYPES[info["dtype"]]).itemsize
        if need != offsets[1] - offsets[0]:
            return False, (f"{key}: shape {shape} of {info['dtype']} needs {need} bytes, its data_offsets span "
                           f"{offsets[1] - offsets[0]}")
    return None


class _Checkpoint:
    """The safetensors files of a directory: key -> (file, shape, dtype) from headers; tensors read on demand.

    Every header is validated on opening (a truncated, empty or corrupt file is reported before any tensor is
    read). Tensors are read with plain ``readinto`` into a fresh array, not through a memory map: mapped pages of
    the files would stay resident in the process (and count in its RSS) until the map is closed, adding a second
    copy of the checkpoint to peak host memory. Each array read here is freed as soon as its Variable is filled.
    """

    def __init__(self, directory: Path, stack: contextlib.ExitStack):
        self.directory = directory
        files, weight_map = checkpoint_files(directory)
        self.handles: dict[Path, Any] = {}
        self.entries: dict[str, tuple[Path, Shape, str]] = {}
        self._extents: dict[str, tuple[int, int]] = {}  # key -> (byte offset in its file, byte length)
        for file in files:
            try:
                handle = stack.enter_context(open(file, "rb", buffering=0))  # noqa: SIM115 (closed by the stack)
            except OSError as err:
                raise CheckpointFormatError(f"{file}: cannot be opened ({err.strerror})") from None
            self.handles[file] = handle
            self._add_file(file, handle)
        misplaced = [f"{k} (in {f}, absent there)" for k, f in weight_map.items()
                     if k not in self.entries or self.entries[k][0].name != f]
        if misplaced:
            raise CheckpointFormatError(f"{directory / _INDEX}: {len(misplaced)} keys are not in the file the index "
                                        "names for them: " + ", ".join(misplaced[:_LISTED]) + _more(misplaced))

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
                raise CheckpointFormatError(f"{key} is in both {self.entries[key][0]} and {file}; a checkpoint holds "
                                            "each tensor once")
            start, end = info["data_offsets"]
            self.entries[key] = (file, tuple(info["shape"]), info["dtype"])
            self._extents[key] = (8 + header_len + start, end - start)

    def read(self, key: str) -> np.ndarray:
        file, shape, dtype = self.entries[key]
        offset, length = self._extents[key]
        if dtype not in _DTYPES:
            raise CheckpointFormatError(f"{file}: {key} has safetensors dtype {dtype}, which is not supported")
        out = np.empty(shape, _DTYPES[dtype])
        self.handles[file].seek(offset)
        _read_exact(self.handles[file], memoryview(out.reshape(-1).view(np.uint8)), file, key)
        return out


def _more(items: list[str]) -> str:
    return f"\n    ... and {len(items) - _LISTED} more" if len(items) > _LISTED else ""


def nonfinite_count(a: np.ndarray, chunk: int = 1 << 20) -> int:
    """How many NaN / infinite values ``a`` (a floating array) holds; checked in chunks, so no full-size mask."""
    flat = a.reshape(-1)
    return sum(int(np.count_nonzero(~np.isfinite(flat[i : i + chunk]))) for i in range(0, flat.size, chunk))


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """``weight [out, in]`` (float8) times its per-block ``scale_inv [ceil(out/b0), ceil(in/b1)]`` -> float32."""
    rows, cols = weight.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite results are reported by the loader
        return weight.astype(np.float32) * scale[:rows, :cols]


# ---------------------------------------------------------------- planning
def plan_load(ckpt: _Checkpoint, config: DeepSeekV3Config, shapes: dict[str, Shape],
              block: tuple[int, int]) -> dict[str, list[Slot]]:
    """Slots of every Variable, from headers only; raises ``CheckpointMismatchError`` listing every problem."""
    expected = {s.key: s for s in canonical_slots(config, shapes)}
    found: dict[str, list[Slot]] = {}
    covered: dict[tuple[str, tuple[int, ...]], str] = {}
    unexpected: list[str] = []
    problems: dict[str, dict[str, None]] = {"shape": {}, "dtype": {}}  # ordered sets: a fused key fills two slots
    mtp_prefixes = tuple(f"model.layers.{config.num_hidden_layers + d}." for d in range(
        config.num_nextn_predict_layers))
    for key in sorted(ckpt.entries):
        if _IGNORED.search(key) or (key.startswith(mtp_prefixes) and key.split(".", 3)[3] in MTP_DUPLICATES):
            continue
        if key.endswith(_FP8_SCALE_SUFFIX):
            weight_key = key[: -len(_FP8_SCALE_SUFFIX)]
            if weight_key not in ckpt.entries or not ckpt.entries[weight_key][2].startswith("F8"):
                unexpected.append(f"{key} (a float8 scale without a float8 weight {weight_key})")
            continue
        slots = [expected[key]] if key in expected else _fused_slots(config, key, shapes)
        if not slots:
            unexpected.append(key)
            continue
        for slot in slots:
            cells = _cells(slot, shapes[slot.path])
            clash = next((covered[c] for c in cells if c in covered), None)
            if clash is not None:
                unexpected.append(f"{key} (fills the same weights as {clash})")
                continue
            covered.update(dict.fromkeys(cells, key))  # present, even if unusable: not reported as missing
            problem = _slot_problem(ckpt, slot, shapes, block)
            if problem:
                problems[problem[0]][problem[1]] = None
            else:
                found.setdefault(slot.path, []).append(slot)
    missing = [s.key for s in expected.values() if (s.path, s.index) not in covered]
    wrong, wrong_dtypes = list(problems["shape"]), list(problems["dtype"])
    if missing or unexpected or wrong or wrong_dtypes:
        raise CheckpointMismatchError(missing, unexpected, wrong, str(ckpt.directory), wrong_dtypes)
    return found


def _cells(slot: Slot, shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Coverage cells: per (layer, expert) for expert Variables, whatever layout filled them."""
    if slot.path.endswith(("experts.wi_gate", "experts.wi_up", "experts.wo")) and len(slot.index) == 1:
        return [(slot.path, slot.index + (e,)) for e in range(shape[1])]
    return [(slot.path, slot.index)]


def _slot_problem(ckpt: _Checkpoint, slot: Slot, shapes: dict[str, Shape],
                  block: tuple[int, int]) -> tuple[str, str] | None:
    """Why ``slot``'s tensor cannot fill its Variable, as ("shape" | "dtype", message), or None."""
    file, hf_shape, dtype = ckpt.entries[slot.key]
    if dtype not in _FLOAT_DTYPES:  # integer or bool data would be cast to meaningless weights
        return "dtype", f"{slot.key}: {dtype} in {file.name}, where a floating-point weight belongs"
    want = tuple(slot.transform.hf_shape(shapes[slot.path][len(slot.index):]))
    if tuple(hf_shape) != want:
        return "shape", f"{slot.key}: checkpoint has {list(hf_shape)}, the model needs {list(want)}"
    if dtype.startswith("F8"):
        scale_key = slot.key + _FP8_SCALE_SUFFIX
        if len(want) != 2:
            return "dtype", f"{slot.key}: {dtype} {len(want)}-D tensor; only 2-D float8 matrices are dequantized"
        blocks = tuple(-(-n // b) for n, b in zip(want, block))
        if scale_key not in ckpt.entries:
            return "shape", f"{slot.key}: float8 weight without {scale_key}"
        if ckpt.entries[scale_key][2] not in _FLOAT_DTYPES:
            return "dtype", f"{scale_key}: {ckpt.entries[scale_key][2]}, where a floating-point scale belongs"
        if tuple(ckpt.entries[scale_key][1]) != blocks:
            return "shape", (f"{scale_key}: checkpoint has {list(ckpt.entries[scale_key][1])}, {block} blocks of "
                             f"{list(want)} need {list(blocks)}")
    return None


# ---------------------------------------------------------------- loading
def _device_regions(shape: Shape, sharding: Any) -> dict[Any, tuple[tuple[int, int], ...]]:
    """device -> (start, stop) per dim of the shard it holds."""
    out = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        out[device] = tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))
    return out


def _aligned_empty(shape: list[int], dtype: Any, alignment: int = 64) -> np.ndarray:
    """``np.empty`` whose data starts on an ``alignment``-byte boundary (XLA:CPU aliases such host buffers)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _assemble(shape: Shape, dtype: Any, sharding: Any, slots: list[Slot],
              read: Callable[[str], np.ndarray]) -> jax.Array:
    """Build one Variable on ``sharding``: each HF tensor is read once and copied into the shards it touches.

    Shard buffers are 64-byte aligned, so that on CPU ``device_put`` adopts them without a copy (peak host memory
    stays near the model's size); on an accelerator they are copied over and freed when this returns.
    """
    regions = _device_regions(shape, sharding)
    buffers = {r: _aligned_empty([stop - start for start, stop in r], dtype) for r in set(regions.values())}
    for slot in slots:
        n = len(slot.index)
        sub = slot.transform.to_ours(read(slot.key), shape[n:]).astype(dtype, copy=False)
        for region, buf in buffers.items():
            if all(start <= i < stop for i, (start, stop) in zip(slot.index, region[:n])):
                dst = tuple(i - start for i, (start, _) in zip(slot.index, region[:n]))
                buf[dst] = sub[tuple(slice(start, stop) for start, stop in region[n:])]
    arrays = [jax.device_put(buffers[region], device) for device, region in regions.items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _fp8_block(config_file: Path) -> tuple[int, int]:
    """The float8 ``weight_block_size`` of ``config.json`` ([128, 128] when it names none)."""
    quantization = read_json_object(config_file, "model config").get("quantization_config") or {}
    if not isinstance(quantization, dict):
        raise CheckpointFormatError(f"{config_file}: quantization_config must be a JSON object, got "
                                    f"{json_kind(quantization)}")
    block = quantization.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CheckpointFormatError(f"{config_file}: quantization_config.weight_block_size must be two positive "
                                    f"integers, got {block!r}")
    return block[0], block[1]


def _mtp_depth_present(ckpt: _Checkpoint, config: DeepSeekV3Config) -> int:
    layers = {int(m.group(1)) for m in map(_LAYER_KEY.match, ckpt.entries) if m}
    depth = 0
    while config.num_hidden_layers + depth in layers:
        depth += 1
    return depth


def load_pretrained(cls: type, path: str | Path, *, mesh: Mesh | None = None, rules: Rules | str | None = None,
                    dtype: Any = None, **config_overrides: Any) -> Any:
    """Load an HF DeepSeek-V3 checkpoint directory into ``cls`` (``DeepSeekV3``).

    ``dtype`` sets both the parameter and compute dtype (default: the config's, float32); ``config_overrides``
    set any config field (``moe_impl="dense"``, ...). MTP heads are built only for the MTP layers the files
    hold. Float8 weights are dequantized with their ``weight_scale_inv`` blocks.

    Unreadable files raise ``CheckpointFormatError`` naming the file (weights holding NaN or infinities: every
    such key, after all were read); files that do not fit the model raise ``CheckpointMismatchError``.
    """
    directory = Path(path)
    checkpoint_files(directory)  # a missing / non-directory path is reported before config.json is looked for
    block = _fp8_block(directory / "config.json")
    overrides = dict(config_overrides)
    if dtype is not None:
        overrides.setdefault("dtype", dtype)
        overrides.setdefault("param_dtype", dtype)
    rules = get_rules(rules if rules is not None else "default")
    with contextlib.ExitStack() as stack:
        ckpt = _Checkpoint(directory, stack)
        config = DeepSeekV3Config.from_hf(directory, **overrides)
        if "num_nextn_predict_layers" not in config_overrides:
            depth = min(config.num_nextn_predict_layers, _mtp_depth_present(ckpt, config))
            config = config.with_overrides(num_nextn_predict_layers=depth)
        abstract = abstract_module(lambda: cls(config, rngs=nnx.Rngs(0), rules=rules))
        graphdef, abstract_state = nnx.split(abstract)
        variables = dict(iter_variables(abstract_state))
        shapes = {p: tuple(v.shape) for p, v in variables.items()}
        plan = plan_load(ckpt, config, shapes, block)

        checked: set[str] = set()
        nonfinite: list[str] = []

        def read(key: str) -> np.ndarray:
            tensor = ckpt.read(key)
            if tensor.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
                tensor = dequantize_fp8(tensor, ckpt.read(key + _FP8_SCALE_SUFFIX), block)
            if key not in checked:  # a fused key is read once per Variable it fills
                checked.add(key)
                bad = nonfinite_count(tensor)
                if bad:
                    nonfinite.append(f"{key} in {ckpt.entries[key][0].name}: {bad} of {tensor.size} values")
            return tensor

        leaves = []
        for p, var in variables.items():
            sharding = (SingleDeviceSharding(jax.devices()[0]) if mesh is None
                        else NamedSharding(mesh, variable_spec(p, var, rules, mesh)))
            leaves.append(_assemble(shapes[p], var.dtype, sharding, plan[p], read))
    if nonfinite:
        raise CheckpointFormatError(f"{directory}: {len(nonfinite)} weights hold NaN or infinite values (a corrupt "
                                    "or diverged checkpoint):\n    " + "\n    ".join(nonfinite))
    state = jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------- saving
def _export_slots(config: DeepSeekV3Config, shapes: dict[str, Shape]) -> list[Slot]:
    slots = canonical_slots(config, shapes)
    head = ("lm_head.kernel", DENSE) if "lm_head.kernel" in shapes else ("embed.embedding", SAME)
    for d in range(config.num_nextn_predict_layers):
        prefix = f"model.layers.{config.num_hidden_layers + d}."
        slots += [Slot(prefix + "embed_tokens.weight", "embed.embedding", (), SAME),
                  Slot(prefix + "shared_head.head.weight", head[0], (), head[1])]
    return slots


def _shard_plan(slots: list[Slot], nbytes: Callable[[Slot], int], limit: int) -> list[list[Slot]]:
    shards: list[list[Slot]] = [[]]
    size = 0
    for slot in slots:
        if shards[-1] and size + nbytes(slot) > limit:
            shards.append([])
            size = 0
        shards[-1].append(slot)
        size += nbytes(slot)
    return shards


def save_pretrained(model: Any, path: str | Path, *, max_shard_bytes: int = 4 * 2**30) -> None:
    """Write ``config.json``, ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_shard_bytes`` (a
    single larger tensor gets a shard of its own) and ``model.safetensors.index.json``, per-expert keys."""
    config: DeepSeekV3Config = model.config
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    variables = dict(iter_variables(nnx.state(model)))
    adapters = [p for p, v in variables.items() if isinstance(v, LoRAParam)]
    if adapters:
        raise ValueError(f"the model holds LoRA adapters ({adapters[0]}, ...), which Hugging Face checkpoints have no "
                         "place for; fold them into the weights with nnx_zoo.merge_lora(model) first")
    shapes = {p: tuple(v.shape) for p, v in variables.items()}
    slots = _export_slots(config, shapes)

    def nbytes(slot: Slot) -> int:
        var = variables[slot.path]
        return math.prod(shapes[slot.path][len(slot.index):]) * np.dtype(var.dtype).itemsize

    shards = _shard_plan(slots, nbytes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    host = _HostCache(variables)
    for number, shard_slots in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {s.key: np.ascontiguousarray(s.transform.to_hf(host.get(s.path)[s.index])) for s in shard_slots}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": sum(nbytes(s) for s in slots)}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))


class _HostCache:
    """Host copies of Variables, keeping only the most recent (export walks Variables in order)."""

    def __init__(self, variables: dict[str, nnx.Variable]):
        self.variables = variables
        self.path: str | None = None
        self.value: np.ndarray | None = None

    def get(self, path: str) -> np.ndarray:
        if path != self.path:
            self.path, self.value = path, np.asarray(jax.device_get(self.variables[path][...]))
        return self.value


def iter_hf_keys(config: DeepSeekV3Config, shapes: dict[str, Shape]) -> Iterator[str]:
    """The HF keys ``save_pretrained`` writes for a model with these Variable shapes."""
    return (s.key for s in _export_slots(config, shapes))
