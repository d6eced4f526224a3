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
    FP8_SCALE_SUFFIX,
    SafetensorsCheckpoint,
    TensorToWrite,
    nonfinite_count,
    write_shards,
)
from nnx_zoo.hf.table import KeyTable, Shape, Slot
from nnx_zoo.layers.lora import LoRAParam
from nnx_zoo.sharding import iter_variables, variable_spec
from nnx_zoo.sharding.rules import Rules

M = TypeVar("M", bound=nnx.Module)
Cell = tuple[str, tuple[int, ...]]


# ---------------------------------------------------------------- planning
def plan_load(ckpt: SafetensorsCheckpoint, table: KeyTable, shapes: Mapping[str, Shape]) -> dict[str, list[Slot]]:
    """Slots of every Variable, from headers only; raises ``CheckpointMismatchError`` listing every problem."""
    canonical = table.slots(shapes)
    expected = {s.key: s for s in canonical}
    alternates = table.alternate_slots(shapes)
    depth = {s.path: len(s.index) for s in canonical}  # stacked dims a canonical key indexes
    skipped = table.skipped()
    found: dict[str, list[Slot]] = {}
    covered: dict[Cell, str] = {}
    unexpected: list[str] = []
    problems: dict[str, dict[str, None]] = {"shape": {}, "dtype": {}}  # ordered sets: one key may fill two slots
    for key in sorted(ckpt.entries):
        if skipped.search(key):
            continue
        if key.endswith(FP8_SCALE_SUFFIX):
            weight_key = key[: -len(FP8_SCALE_SUFFIX)]
            if weight_key not in ckpt.entries or not ckpt.entries[weight_key].dtype.startswith("F8"):
                unexpected.append(f"{key} (a float8 scale without a float8 weight {weight_key})")
            continue
        slots = [expected[key]] if key in expected else alternates.get(key, [])
        if not slots:
            unexpected.append(key)
            continue
        for slot in slots:
            cells = _cells(slot, shapes[slot.path], depth[slot.path])
            clash = next((covered[c] for c in cells if c in covered), None)
            if clash is not None:
                unexpected.append(f"{key} (fills the same weights as {clash})")
                continue
            covered.update(dict.fromkeys(cells, key))  # present, even if unusable: not reported as missing
            problem = _slot_problem(ckpt, slot, shapes)
            if problem:
                problems[problem[0]][problem[1]] = None
            else:
                found.setdefault(slot.path, []).append(slot)
    missing = [s.key for s in canonical if (s.path, s.index) not in covered]
    wrong, wrong_dtypes = list(problems["shape"]), list(problems["dtype"])
    if missing or unexpected or wrong or wrong_dtypes:
        raise CheckpointMismatchError(missing, unexpected, wrong, str(ckpt.directory), wrong_dtypes)
    return found


def _cells(slot: Slot, shape: Shape, depth: int) -> list[Cell]:
    """Coverage cells at canonical depth: a whole-layer (alternate) slot covers every expert of its layer."""
    rest = product(*(range(n) for n in shape[len(slot.index) : depth]))
    return [(slot.path, slot.index + tail) for tail in rest]


def _slot_problem(ckpt: SafetensorsCheckpoint, slot: Slot, shapes: Mapping[str, Shape]) -> tuple[str, str] | None:
    """Why ``slot``'s tensor cannot fill its Variable, as ("shape" | "dtype", message), or None."""
    file, hf_shape, dtype = ckpt.entries[slot.key]
    if dtype not in FLOAT_DTYPES:  # integer or bool data would be cast to meaningless weights
        return "dtype", f"{slot.key}: {dtype} in {file.name}, where a floating-point weight belongs"
    want = tuple(slot.transform.hf_shape(shapes[slot.path][len(slot.index):]))
    if tuple(hf_shape) != want:
        return "shape", f"{slot.key}: checkpoint has {list(hf_shape)}, the model needs {list(want)}"
    if dtype.startswith("F8"):
        scale_key, block = slot.key + FP8_SCALE_SUFFIX, ckpt.fp8_block
        if len(want) != 2:
            return "dtype", f"{slot.key}: {dtype} {len(want)}-D tensor; only 2-D float8 matrices are dequantized"
        if scale_key not in ckpt.entries:
            return "shape", f"{slot.key}: float8 weight without {scale_key}"
        scale = ckpt.entries[scale_key]
        blocks = tuple(-(-n // b) for n, b in zip(want, block))
        if scale.dtype not in FLOAT_DTYPES:
            return "dtype", f"{scale_key}: {scale.dtype}, where a floating-point scale belongs"
        if scale.shape != blocks:
            return "shape", (f"{scale_key}: checkpoint has {list(scale.shape)}, {block} blocks of {list(want)} "
                             f"need {list(blocks)}")
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
    plan = plan_load(ckpt, table, {p: shape for p, shape in shapes.items() if p not in given})
    checked: set[str] = set()
    nonfinite: list[str] = []

    def read(key: str) -> np.ndarray:
        tensor = ckpt.read_weight(key)
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
        leaves.append(_assemble(shapes[p], var.dtype, sharding, plan[p], read))
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
            return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)  # fused halves, in order

        return TensorToWrite(parts[0].key, nbytes, tensor)

    # A key filled from several Variables comes as consecutive slots of that key: one tensor, its parts joined.
    groups = [list(group) for _, group in groupby(export_slots(table, shapes), key=lambda s: s.key)]
    write_shards(directory, [to_write(parts) for parts in groups], max_shard_bytes)
    write_json(directory / "config.json", config)


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
