"""The sharding report: where every Variable lives and what each device pays for it.

It works on an abstract model (``nnx.eval_shape``) and an ``AbstractMesh``, so it describes a 671B model on a
512-device mesh from a laptop without allocating anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from nnx_zoo.sharding.create import abstract_module, iter_variables, logical_names, variable_resolution
from nnx_zoo.sharding.resolve import Fallback
from nnx_zoo.sharding.rules import get_rules


@dataclasses.dataclass(frozen=True)
class VariableRow:
    path: str
    kind: str  # the Variable's class name
    is_param: bool  # an nnx.Param (or a subclass such as LoRAParam): trained, so it gets optimizer state
    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...] | None
    spec: tuple[Any, ...]
    per_device_shape: tuple[int, ...]
    bytes: int
    bytes_per_device: int
    fallbacks: tuple[Fallback, ...] = ()  # dimensions placed on fewer shards than their rule asks (allow_partial)
    wanted_bytes_per_device: int = 0  # bytes per device had every dimension divided as its rule asks

    @property
    def sharded(self) -> bool:
        return self.per_device_shape != self.shape

    @property
    def fallback_bytes_per_device(self) -> int:
        """What the fallbacks cost each device: bytes held beyond the rule's ideal split (0 without fallbacks)."""
        return max(0, self.bytes_per_device - self.wanted_bytes_per_device) if self.fallbacks else 0


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Per-Variable placement plus totals. ``print(report.table())``, ``report.save_json(path)``."""

    mesh_shape: dict[str, int]
    rows: tuple[VariableRow, ...]

    @property
    def params(self) -> tuple[VariableRow, ...]:
        return tuple(r for r in self.rows if r.is_param)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(r.shape) for r in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(r.bytes for r in self.params)

    @property
    def param_bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.params)

    @property
    def adamw_bytes_per_device(self) -> int:
        """AdamW's two moments, each shaped, typed and sharded like its parameter."""
        return 2 * self.param_bytes_per_device

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """Every dimension placed on a dividing prefix of its rule's mesh axes (``allow_partial``)."""
        return tuple(f for r in self.rows for f in r.fallbacks)

    @property
    def fallback_bytes_per_device(self) -> int:
        """Bytes per device that the fallbacks add over the rules' ideal split (parameters and the rest)."""
        return sum(r.fallback_bytes_per_device for r in self.rows)

    def fallback_summary(self) -> list[str]:
        """One line per (logical name, size, wanted axes, placed axes): how many tensors, their bytes per device
        and what the fallback adds per device (parameters; AdamW's moments add twice that again)."""
        groups: dict[tuple[Any, ...], list[VariableRow]] = {}
        for r in self.rows:
            for f in r.fallbacks:
                groups.setdefault((f.name, f.size, f.wanted, f.placed, f.wanted_shards, f.placed_shards), []).append(r)
        lines = []
        for (name, size, wanted, placed, n_wanted, n_placed), rows in groups.items():
            extra = sum(r.fallback_bytes_per_device for r in rows)
            lines.append(
                f"  {name!r} (size {size}) does not divide over {','.join(wanted)} ({n_wanted} shards): placed on "
                f"{','.join(placed) or 'no axis'} ({n_placed} shards) in {len(rows)} tensor(s) holding "
                f"{_human(sum(r.bytes_per_device for r in rows))} per device, +{_human(extra)} per device over an "
                "even split"
            )
        return lines

    @property
    def bytes_per_device(self) -> int:
        """Every Variable (parameters and the rest) per device."""
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def sharded_fraction(self) -> float:
        """Fraction of parameter bytes that are split across devices."""
        total = self.param_bytes
        return sum(r.bytes for r in self.params if r.sharded) / total if total else 0.0

    @property
    def annotated_fraction(self) -> float:
        """Fraction of parameter bytes whose Variable carries logical names."""
        total = self.param_bytes
        return sum(r.bytes for r in self.params if r.names is not None) / total if total else 0.0

    def totals(self) -> dict[str, Any]:
        return {
            "num_parameters": self.num_parameters,
            "param_bytes": self.param_bytes,
            "param_bytes_per_device": self.param_bytes_per_device,
            "adamw_bytes_per_device": self.adamw_bytes_per_device,
            "params_plus_adamw_bytes_per_device": self.param_bytes_per_device + self.adamw_bytes_per_device,
            "bytes_per_device": self.bytes_per_device,
            "sharded_fraction": self.sharded_fraction,
            "annotated_fraction": self.annotated_fraction,
            "fallback_dimensions": len(self.fallbacks),
            "fallback_bytes_per_device": self.fallback_bytes_per_device,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh_shape,
            "variables": [
                {**dataclasses.asdict(r), "spec": [list(a) if isinstance(a, tuple) else a for a in r.spec],
                 "fallbacks": [str(f) for f in r.fallbacks]}
                for r in self.rows
            ],
            "totals": self.totals(),
        }

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    def table(self) -> str:
        head = ("path", "shape", "logical names", "spec", "per device", "bytes/device")
        body = [
            (
                r.path,
                "x".join(map(str, r.shape)) or "()",
                ",".join(str(n) for n in r.names) if r.names is not None else "(none)",
                _spec_str(r.spec),
                "x".join(map(str, r.per_device_shape)) or "()",
                _human(r.bytes_per_device),
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
        line = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()  # noqa: E731
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items() if v > 1) or "one device"
        t = self.totals()
        foot = [
            f"mesh: {mesh}",
            f"parameters: {t['num_parameters']:,} ({_human(t['param_bytes'])}); "
            f"{100 * t['sharded_fraction']:.2f}% of bytes sharded, {100 * t['annotated_fraction']:.2f}% annotated",
            f"per device: parameters {_human(t['param_bytes_per_device'])}, AdamW state "
            f"{_human(t['adamw_bytes_per_device'])}, together {_human(t['params_plus_adamw_bytes_per_device'])}",
        ]
        if self.fallbacks:
            foot += [f"fallbacks: {len(self.fallbacks)} dimension(s) do not divide over their rule's mesh axes and "
                     "sit on the longest prefix of them that divides (more replication than the rule asks for):",
                     *self.fallback_summary()]
        return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, body), "", *foot])


def _spec_str(spec: tuple[Any, ...]) -> str:
    parts = ["(" + ",".join(a) + ")" if isinstance(a, tuple) else str(a) for a in spec]
    return "P(" + ", ".join(parts) + ")"


def _itemsize_bits(dtype: Any) -> int:
    """Bits per element; also for sub-byte types (int4) and extended ones such as PRNG key arrays (Dropout's)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return 8 * dtype.itemsize
    return jax.dtypes.itemsize_bits(dtype)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def sharding_report(
    model: nnx.Module | Callable[[], nnx.Module],
    mesh: Mesh | AbstractMesh,
    rules: Any = "default",
    *,
    strict: bool = True,
    allow_partial: bool = True,
) -> ShardingReport:
    """Describe how ``model`` (a module, abstract or real, or a function that builds one) lies on ``mesh``.

    A planning tool, so by default a dimension that does not divide over its rule's mesh axes is placed on the
    longest dividing prefix of them (``allow_partial``, see ``nnx_zoo.sharding.resolve``) and listed in
    ``report.fallbacks`` and the table's footer; ``allow_partial=False`` raises instead, as creating a model does
    unless asked. Unknown logical names are an error either way (``strict``).

    >>> mesh = make_abstract_mesh({"fsdp": 64, "expert": 8})
    >>> print(sharding_report(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0)), mesh).table())
    """
    rules = get_rules(rules)
    if not isinstance(model, nnx.Module):
        model = abstract_module(model)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    rows = []
    for path, var in iter_variables(model):
        resolution = variable_resolution(path, var, rules, mesh, strict=strict, allow_partial=allow_partial)
        spec = tuple(resolution.spec)
        shape = tuple(int(d) for d in var.shape)
        spec = spec + (None,) * (len(shape) - len(spec))
        per_device = tuple(
            d // math.prod(sizes[a] for a in ((ax,) if isinstance(ax, str) else ax or ()))
            for d, ax in zip(shape, spec, strict=True)
        )
        bits = _itemsize_bits(var.dtype)
        rows.append(
            VariableRow(
                path=path,
                kind=type(var).__name__,
                is_param=isinstance(var, nnx.Param),
                shape=shape,
                dtype=str(var.dtype),
                names=logical_names(var),
                spec=spec,
                per_device_shape=per_device,
                bytes=-(-math.prod(shape) * bits // 8),
                bytes_per_device=-(-math.prod(per_device) * bits // 8),
                fallbacks=resolution.fallbacks,
                wanted_bytes_per_device=-(-math.prod(shape) * bits // (8 * resolution.wanted_shards)),
            )
        )
    return ShardingReport(mesh_shape=sizes, rows=tuple(rows))
