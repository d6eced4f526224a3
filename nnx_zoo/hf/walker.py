"""Load a module from a checkpoint through a ``KeyTable`` (plan, then read onto shards), and export it back.

Loading first plans every key from the files' headers alone and reports every problem (missing, unexpected,
misshapen, mistyped) in one ``CheckpointMismatchError``; then it reads tensors one at a time and places each
Variable directly onto its resolved sharding, each device receiving only its own shard. Weights holding NaN or
infinities are all named in one ``CheckpointFormatError`` once every tensor was read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from itertools import groupby, product
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from nnx_zoo.hf.config_io import write_json
from nnx_zoo.hf.errors import CheckpointFormatError, CheckpointMismatchError
from nnx_zoo.hf.safetensors_io import (
    FLOAT_DTYPES,
    FP4_DTYPE,
    FP4_GROUP,
    FP8_SCALE_SUFFIX,
    INTEGER_DTYPES,
    MXFP4_DTYPE,
    SCALE_DTYPES,
    SCALE_SUFFIX,
    SafetensorsCheckpoint,
    TensorToWrite,
    nonfinite_count,
    scale_key_candidates,
    write_shards,
)
from nnx_zoo.hf.table import KeyTable, Shape, Slot
from nnx_zoo.layers.lora import LoRAParam
from nnx_zoo.sharding import iter_variables, variable_spec
from nnx_zoo.sharding.rules import Rules

M = TypeVar("M", bound=nnx.Module)
Cell = tuple[str, tuple[int, ...]]


class AliasedCheckpoint:
    """A checkpoint whose keys are seen in a table's naming (``KeyTable.aliases``): ``entries`` under the renamed
    keys, ``read`` / ``read_weight`` of a renamed key read the file's own. A weight's scale is found beside it
    in the file's naming (``layers.0.ffn.experts.0.w1.scale`` beside ``layers.0.ffn.experts.0.w1.weight``), then
    renamed, so an alias that renames a weight but not its scale still pairs them."""

    def __init__(self, ckpt: SafetensorsCheckpoint, table: KeyTable):
        self.ckpt, self.directory, self.fp8_block, self.fp4 = ckpt, ckpt.directory, ckpt.fp8_block, ckpt.fp4
        self.mxfp4 = ckpt.mxfp4
        self.original = {}
        for key in ckpt.entries:
            renamed = table.canonical(key)
            if renamed in self.original:
                raise CheckpointFormatError(f"{ckpt.directory}: {key} and {self.original[renamed]} are the same "
                                            f"tensor ({renamed}) under two namings; a checkpoint holds each once")
            self.original[renamed] = key
        self.entries = {renamed: ckpt.entries[key] for renamed, key in self.original.items()}
        self.renamed = {key: renamed for renamed, key in self.original.items()}

    def is_quantized(self, key: str) -> bool:
        return self.ckpt.is_quantized(self.original[key])

    def is_mxfp4(self, key: str) -> bool:
        return self.ckpt.is_mxfp4(self.original[key])

    def scale_keys(self, key: str) -> list[str]:
        return [self.renamed[k] for k in self.ckpt.scale_keys(self.original[key])]

    def file_key(self, key: str) -> str:
        """The file's own name of (renamed) ``key``."""
        return self.original[key]

    def read(self, key: str) -> np.ndarray:
        return self.ckpt.read(self.original[key])

    def read_weight(self, key: str) -> np.ndarray:
        return self.ckpt.read_weight(self.original[key])


def aliased(ckpt: SafetensorsCheckpoint, table: KeyTable) -> Any:
    """``ckpt`` itself, or seen through ``table``'s aliases when it has some."""
    return AliasedCheckpoint(ckpt, table) if table.aliases else ckpt


# ---------------------------------------------------------------- planning
def plan_load(ckpt: SafetensorsCheckpoint, table: KeyTable, shapes: Mapping[str, Shape],
              integer: frozenset[str] = frozenset()) -> dict[str, list[Slot]]:
    """Slots of every Variable, from headers only; raises ``CheckpointMismatchError`` listing every problem.
    ``integer``: the paths of integer Variables (a hash router's table), filled from integer tensors only."""
    canonical = table.slots(shapes)
    expected: dict[str, list[Slot]] = {}  # one key may fill several Variables (a row per part)
    for s in canonical:
        expected.setdefault(s.key, []).append(s)
    alternates = table.alternate_slots(shapes)
    depth = {s.path: len(s.index) for s in canonical}  # stacked dims a canonical key indexes
    skipped = table.skipped()
    scale_of = {s: key for key in ckpt.entries for s in ckpt.scale_keys(key)}  # scale -> the weight beside it
    found: dict[str, list[Slot]] = {}
    covered: dict[Cell, str] = {}
    unexpected: list[str] = []
    problems: dict[str, dict[str, None]] = {"shape": {}, "dtype": {}}  # ordered sets: one key may fill two slots
    for key in sorted(ckpt.entries):
        if skipped.search(key):
            continue
        slots = expected.get(key) or alternates.get(key, [])
        if not slots:
            unpaired = _unpaired_scale(ckpt, key, scale_of)
            if unpaired != "":  # "": a scale beside its quantized weight, checked with that weight's slot
                unexpected.append(unpaired or key)
            continue
        for slot in slots:
            cells = _cells(slot, shapes[slot.path], depth[slot.path])
            clash = next((covered[c] for c in cells if c in covered), None)
            if clash is not None:
                unexpected.append(f"{key} (fills the same weights as {clash})")
                continue
            covered.update(dict.fromkeys(cells, key))  # present, even if unusable: not reported as missing
            problem = _slot_problem(ckpt, slot, shapes, slot.path in integer)
            if problem:
                problems[problem[0]][problem[1]] = None
            else:
                found.setdefault(slot.path, []).append(slot)
    missing = list(dict.fromkeys(s.key for s in canonical if (s.path, s.index) not in covered))
    wrong, wrong_dtypes = list(problems["shape"]), list(problems["dtype"])
    if missing or unexpected or wrong or wrong_dtypes:
        raise CheckpointMismatchError(missing, unexpected, wrong, str(ckpt.directory), wrong_dtypes)
    return found


def _cells(slot: Slot, shape: Shape, depth: int) -> list[Cell]:
    """Coverage cells at canonical depth: a whole-layer (alternate) slot covers every expert of its layer."""
    rest = product(*(range(n) for n in shape[len(slot.index) : depth]))
    return [(slot.path, slot.index + tail) for tail in rest]


def _unpaired_scale(ckpt: Any, key: str, scale_of: Mapping[str, str]) -> str | None:
    """For a key no slot takes: "" when it is the scale of a quantized weight (checked with that weight), what is
    wrong when it is a scale nothing uses, else None (a plain unexpected key)."""
    weight = scale_of.get(key)
    if weight is not None:
        if ckpt.is_quantized(weight):
            return ""
        return (f"{key} (in {_where(ckpt, key)}: a scale beside {weight}, which is "
                f"{ckpt.entries[weight].dtype}, not quantized)")
    if key.endswith(FP8_SCALE_SUFFIX):
        return f"{key} (a float8 scale without a float8 weight {key[: -len(FP8_SCALE_SUFFIX)]})"
    if key.endswith(SCALE_SUFFIX) and key[: -len(SCALE_SUFFIX)] + ".weight" not in ckpt.entries:
        return f"{key} (in {_where(ckpt, key)}: a scale without its weight {key[: -len(SCALE_SUFFIX)]}.weight)"
    return None


def _where(ckpt: Any, key: str) -> str:
    """The file holding ``key``, and the file's own name of the key where an alias renamed it."""
    file_key = ckpt.file_key(key)
    return ckpt.entries[key].file.name + ("" if file_key == key else f" as {file_key}")


def _slot_problem(ckpt: SafetensorsCheckpoint, slot: Slot, shapes: Mapping[str, Shape],
                  integer: bool = False) -> tuple[str, str] | None:
    """Why ``slot``'s tensor cannot fill its Variable, as ("shape" | "dtype", message), or None."""
    file, hf_shape, dtype = ckpt.entries[slot.key]
    want = tuple(slot.transform.hf_shape(shapes[slot.path][len(slot.index):]))
    if integer:
        if dtype not in INTEGER_DTYPES:  # a table of ids: a float tensor there is another tensor
            return "dtype", f"{slot.key}: {dtype} in {file.name}, where an integer table belongs"
    elif ckpt.is_quantized(slot.key):
        return _quantized_problem(ckpt, slot.key, want)
    elif dtype not in FLOAT_DTYPES:  # integer or bool data would be cast to meaningless weights
        # a scaled I8 looks like packed FP4, which is read only where config.json says so: say what it lacks
        hint = (" (config.json does not declare FP4 weights: no expert_dtype \"fp4\" in it or its "
                "quantization_config)" if dtype == FP4_DTYPE and ckpt.scale_keys(slot.key) else "")
        if dtype == MXFP4_DTYPE and ckpt.scale_keys(slot.key):  # MXFP4 blocks in a file that does not say so
            hint = " (config.json does not declare MXFP4: no quantization_config quant_method \"mxfp4\")"
        return "dtype", f"{slot.key}: {dtype} in {file.name}, where a floating-point weight belongs{hint}"
    if tuple(hf_shape) != want:
        return "shape", f"{slot.key}: checkpoint has {list(hf_shape)}, the model needs {list(want)}"
    return None


def _quantized_problem(ckpt: Any, key: str, want: Shape) -> tuple[str, str] | None:
    """Why quantized weight ``key`` (float8, FP4 or MXFP4) cannot be dequantized to shape ``want``, or None."""
    if ckpt.is_mxfp4(key):
        return _mxfp4_problem(ckpt, key, want)
    _, stored, dtype = ckpt.entries[key]
    fp4 = dtype == FP4_DTYPE
    what = "FP4 (packed E2M1)" if fp4 else "float8"
    if len(want) != 2:
        return "dtype", f"{key}: {dtype} {len(want)}-D tensor; only 2-D {what} matrices are dequantized"
    if fp4 and want[1] % 2:
        return "shape", f"{key}: the model needs {list(want)}, an odd row length two FP4 values a byte cannot hold"
    packed = (want[0], want[1] // 2) if fp4 else want
    if tuple(stored) != packed:
        need = f"{list(packed)} (FP4 packs two of the {list(want)} values a byte)" if fp4 else f"{list(want)}"
        return "shape", f"{key}: checkpoint has {list(stored)}, the model needs {need}"
    scales = ckpt.scale_keys(key)
    if not scales:  # the names it may have, in the file's own naming
        names = " or ".join(scale_key_candidates(ckpt.file_key(key)))
        return "shape", f"{key}: {what} weight in {_where(ckpt, key)} without its scale ({names})"
    if len(scales) > 1:
        return "shape", f"{key}: {what} weight in {_where(ckpt, key)} with two scales ({' and '.join(scales)})"
    scale_key = scales[0]
    scale = ckpt.entries[scale_key]
    if scale.dtype not in SCALE_DTYPES:
        return "dtype", f"{scale_key}: {scale.dtype} in {_where(ckpt, scale_key)}, where a floating-point scale belongs"
    if fp4:
        grid, how = (want[0], -(-want[1] // FP4_GROUP)), f"one scale per {FP4_GROUP} inputs of each row"
    else:
        grid, how = tuple(-(-n // b) for n, b in zip(want, ckpt.fp8_block)), f"{ckpt.fp8_block} blocks"
    if tuple(scale.shape) != grid:
        return "shape", (f"{scale_key} in {_where(ckpt, scale_key)}: checkpoint has {list(scale.shape)}, {how} of "
                         f"{list(want)} need {list(grid)}")
    return None


def _mxfp4_problem(ckpt: Any, key: str, want: Shape) -> tuple[str, str] | None:
    """Why MXFP4 blocks ``key`` (with their scales) cannot be dequantized to ``want [..., in, out]``, or None."""
    _, stored, _ = ckpt.entries[key]
    if len(want) < 2 or want[-2] % FP4_GROUP:
        return "shape", (f"{key}: MXFP4 blocks in {_where(ckpt, key)} for a {list(want)} tensor, whose inputs (the "
                         f"next-to-last dim) are not a multiple of the {FP4_GROUP} values one scale covers")
    *lead, inputs, outputs = want
    blocks, grid = (*lead, outputs, inputs // FP4_GROUP, FP4_GROUP // 2), (*lead, outputs, inputs // FP4_GROUP)
    if tuple(stored) != blocks:
        return "shape", (f"{key}: checkpoint has {list(stored)} in {_where(ckpt, key)}, the model needs MXFP4 blocks "
                         f"{list(blocks)} for {list(want)} ([..., out, in / 32, 16])")
    scales = ckpt.scale_keys(key)
    if len(scales) != 1:
        names = " or ".join(scale_key_candidates(ckpt.file_key(key)))
        return "shape", f"{key}: MXFP4 blocks in {_where(ckpt, key)} with {len(scales)} scales ({names}); need one"
    scale = ckpt.entries[scales[0]]
    if scale.dtype not in (MXFP4_DTYPE, "F8_E8M0"):
        return "dtype", f"{scales[0]}: {scale.dtype} in {_where(ckpt, scales[0])}, where UE8M0 scale bytes belong"
    if tuple(scale.shape) != grid:
        return "shape", (f"{scales[0]} in {_where(ckpt, scales[0])}: checkpoint has {list(scale.shape)}, one scale "
                         f"per {FP4_GROUP} inputs of {list(want)} needs {list(grid)}")
    return None


# ---------------------------------------------------------------- loading
def load_module(ckpt: SafetensorsCheckpoint, table: KeyTable, abstract: M, *, mesh: Mesh | None,
                rules: Rules, allow_partial: bool = False, given: Mapping[str, jax.Array] | None = None) -> M:
    """``abstract`` (an ``abstract_module``) with every Variable read from ``ckpt`` through ``table``, each
    placed on its resolved sharding over ``mesh`` (one device when ``mesh`` is None). ``allow_partial=True``
    resolves as ``create_sharded(..., allow_partial=True)`` does (a dimension that does not divide goes on the
    longest dividing prefix of its mesh axes), so a loaded model sits where a created one would.

    ``given``: values (dotted path -> array, already placed) of Variables the checkpoint does not hold, taken as
    they are: the plan neither expects keys for them nor accepts any (``nnx_zoo.sharding.create_variables`` makes
    such values for a part of a model without building the rest)."""
    given = dict(given or {})
    graphdef, abstract_state = nnx.split(abstract)
    variables = dict(iter_variables(abstract_state))
    unknown = sorted(set(given) - set(variables))
    if unknown:
        raise ValueError(f"given values for Variables the model does not have: {unknown}")
    for p, value in given.items():
        if tuple(value.shape) != tuple(variables[p].shape) or value.dtype != variables[p].dtype:
            raise ValueError(f"{p}: given {value.dtype}{list(value.shape)}, the model has "
                             f"{variables[p].dtype}{list(variables[p].shape)}")
    shapes = {p: tuple(v.shape) for p, v in variables.items()}
    ckpt = aliased(ckpt, table)
    integer = frozenset(p for p, v in variables.items() if np.issubdtype(np.dtype(v.dtype), np.integer))
    plan = plan_load(ckpt, table, {p: shape for p, shape in shapes.items() if p not in given}, integer)
    checked: set[str] = set()
    nonfinite: list[str] = []

    def read(key: str) -> np.ndarray:
        tensor = ckpt.read_weight(key)  # quantized weights come back dequantized to float32
        if key not in checked:  # an alternate-layout key is read once per Variable it fills
            checked.add(key)
            bad = nonfinite_count(tensor)
            if bad:
                nonfinite.append(f"{key} in {ckpt.entries[key].file.name}: {bad} of {tensor.size} values")
        return tensor

    leaves = []
    for p, var in variables.items():
        if p in given:
            leaves.append(given[p])
            continue
        sharding = (SingleDeviceSharding(jax.devices()[0]) if mesh is None
                    else NamedSharding(mesh, variable_spec(p, var, rules, mesh, allow_partial=allow_partial)))
        # integer tables are taken as stored: an I8 one is not FP4, whatever config.json declares
        leaves.append(_assemble(shapes[p], var.dtype, sharding, plan[p], ckpt.read if p in integer else read))
    if nonfinite:
        raise CheckpointFormatError(f"{ckpt.directory}: {len(nonfinite)} weights hold NaN or infinite values (a "
                                    "corrupt or diverged checkpoint):\n    " + "\n    ".join(nonfinite))
    return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(abstract_state), leaves))


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


# ---------------------------------------------------------------- saving
def export_slots(table: KeyTable, shapes: Mapping[str, Shape]) -> list[Slot]:
    """The slots export writes, in order (``KeyTable.export_slots``): the canonical keys, then the copies."""
    return table.export_slots(shapes)


def save_module(module: nnx.Module, directory: str | Path, table: KeyTable, config: dict[str, Any], *,
                max_shard_bytes: int = 4 * 2**30) -> None:
    """Write ``config`` as ``config.json``, every Variable through ``table`` as ``model-XXXXX-of-YYYYY``
    safetensors shards of at most ``max_shard_bytes`` (a single larger tensor gets a shard of its own), and
    ``model.safetensors.index.json``."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} is a file, and save_pretrained writes a directory (config.json, "
                              f"safetensors shards); pass a new directory path, e.g. {directory}-hf")
    directory.mkdir(parents=True, exist_ok=True)
    variables = dict(iter_variables(nnx.state(module)))
    adapters = [p for p, v in variables.items() if isinstance(v, LoRAParam)]
    if adapters:
        raise ValueError(f"the model holds LoRA adapters ({adapters[0]}, ...), which Hugging Face checkpoints have no "
                         "place for; fold them into the weights with nnx_zoo.merge_lora(model) first")
    shapes = {p: tuple(v.shape) for p, v in variables.items()}
    host = _HostCache(variables)

    def to_write(parts: list[Slot]) -> TensorToWrite:
        nbytes = sum(math.prod(shapes[s.path][len(s.index):]) * np.dtype(variables[s.path].dtype).itemsize
                     for s in parts)

        def tensor() -> np.ndarray:
            arrays = [s.transform.to_hf(host.get(s.path)[s.index]) for s in parts]
            if len(arrays) == 1:
                return arrays[0]
            join = getattr(parts[0].transform, "join", None)  # interleaved parts (``Interleaved.join``), else
            if join is not None:
                return join(arrays)
            # fused halves, in order, joined on dim 1 (or the dim the transform names: ``join_axis``)
            return np.concatenate(arrays, axis=getattr(parts[0].transform, "join_axis", 1))

        return TensorToWrite(parts[0].key, nbytes, tensor)

    # A key filled from several Variables comes as consecutive slots of that key: one tensor, its parts joined.
    groups = [list(group) for _, group in groupby(export_slots(table, shapes), key=lambda s: s.key)]
    write_shards(directory, [to_write(parts) for parts in groups], max_shard_bytes)
    write_json(directory / "config.json", config)


class _HostCache:
    """Host copies of Variables, keeping only the two most recent (export walks Variables in order; a key joined
    from two Variables, fused or interleaved gate/up, alternates between them layer by layer)."""

    def __init__(self, variables: dict[str, nnx.Variable], keep: int = 2):
        self.variables = variables
        self.keep = keep
        self.values: dict[str, np.ndarray] = {}

    def get(self, path: str) -> np.ndarray:
        if path not in self.values:
            if len(self.values) >= self.keep:
                del self.values[next(iter(self.values))]  # the oldest
            self.values[path] = np.asarray(jax.device_get(self.variables[path][...]))
        return self.values[path]
