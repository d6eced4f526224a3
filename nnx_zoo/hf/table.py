"""A family's declarative HF key table: which HF key fills which of our Variables, how, and in which slot.

A transform maps one HF tensor to (part of) one Variable: ``Same``; ``Dense`` (an ``nn.Linear`` weight
``[out, in]`` <-> our kernel ``[*in, *out]``); ``FusedGateUp`` / ``FusedDown`` (transformers-5 fused expert
tensors; exported only by a stack that asks for them, ``Stack.export_alternates``); ``Interleaved`` (one of two
Variables whose entries alternate along a tensor's last dim, GPT-OSS's gate/up). One HF key may fill several
Variables (a row per part, each with its part's transform): export joins the parts back into one tensor (the
transform's ``join``, else along dim 1), in the order of their ``half``. Stacked Variables (scanned
layers, routed experts) are filled slot by slot: a ``Slot`` is one HF key and the leading index it fills, ``()``
for a plain Variable, ``(layer,)`` or ``(layer, expert)`` for a stacked one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np

Shape = tuple[int, ...]


class Transform(Protocol):
    def hf_shape(self, ours: Shape) -> Shape: ...  # the HF tensor's shape for our (sub-)array's shape
    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Same:
    """Stored identically (norm scales, biases, embedding tables, router biases)."""

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
class GroupedDense:
    """A block-diagonal linear's weight ``[groups * out, in / groups]`` (each group's ``[out, in / groups]`` block,
    stacked) <-> our kernel ``[groups, *in_of_group, out]`` (DeepSeek-V4's grouped output projection)."""

    def hf_shape(self, ours: Shape) -> Shape:
        return (ours[0] * ours[-1], math.prod(ours[1:-1]))

    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray:
        groups, out = ours[0], ours[-1]
        return a.reshape(groups, out, *ours[1:-1]).transpose(0, *range(2, len(ours)), 1)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a.transpose(0, a.ndim - 1, *range(1, a.ndim - 1)).reshape(a.shape[0] * a.shape[-1], -1)


@dataclasses.dataclass(frozen=True)
class FusedGateUp:
    """transformers-5 ``experts.gate_up_proj [E, 2I, H]`` -> gate (half 0) / up (half 1) kernels ``[E, H, I]``."""

    half: int

    def hf_shape(self, ours: Shape) -> Shape:
        experts, hidden, inner = ours
        return (experts, 2 * inner, hidden)

    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray:
        inner = ours[2]
        return a[:, self.half * inner : (self.half + 1) * inner, :].transpose(0, 2, 1)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        """Our kernels ``[E, H, I]`` -> this half of ``gate_up_proj``, ``[E, I, H]`` (halves join on dim 1)."""
        return a.transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class FusedDown:
    """transformers-5 ``experts.down_proj [E, H, I]`` -> down kernels ``[E, I, H]``."""

    def hf_shape(self, ours: Shape) -> Shape:
        experts, inner, hidden = ours
        return (experts, hidden, inner)

    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray:
        return a.transpose(0, 2, 1)

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a.transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class Interleaved:
    """One of two Variables stored interleaved along the last dim of one HF tensor: ``half`` 0 takes the even
    entries, 1 the odd ones (GPT-OSS's ``experts.gate_up_proj [E, H, 2I]``: gate ``[..., ::2]``, up ``[..., 1::2]``,
    and its bias ``[E, 2I]``). Our part ``[..., n]`` <-> the HF tensor ``[..., 2n]``."""

    half: int

    def hf_shape(self, ours: Shape) -> Shape:
        return (*ours[:-1], 2 * ours[-1])

    def to_ours(self, a: np.ndarray, ours: Shape) -> np.ndarray:
        return a[..., self.half :: 2]

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        return a

    @staticmethod
    def join(parts: list[np.ndarray]) -> np.ndarray:
        """The HF tensor from both parts (half 0 first): their entries alternating along the last dim."""
        return np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)


SAME, DENSE = Same(), Dense()
# Buffers some older checkpoints carry that no model needs (rope frequencies are recomputed from the config).
ALWAYS_IGNORED = (r"(^|\.)rotary_emb\.inv_freq$",)


class Row(NamedTuple):
    """HF key ``hf`` fills our Variable ``ours`` via ``transform``. In a ``Stack`` both are relative to the
    layer, and ``{e}`` in ``hf`` numbers the Variable's second stacked dim (routed experts)."""

    hf: str
    ours: str
    transform: Any = SAME


@dataclasses.dataclass(frozen=True)
class Stack:
    """A stacked module of ours (``path``, leading dim = layer) stored as HF layers ``hf_prefix.format(i=n)``
    for ``n`` in ``layers``. ``alternates``: HF key (relative) -> ((our Variable, transform), ...) that fill a
    whole layer slot at once, another layout of keys the ``{e}`` rows also cover (fused experts); read always,
    written instead of the rows they cover when ``export_alternates`` (an architecture whose transformers model
    reads only the fused layout)."""

    path: str
    hf_prefix: str
    layers: range
    rows: tuple[Row, ...]
    alternates: Mapping[str, tuple[tuple[str, Any], ...]] = dataclasses.field(default_factory=dict)
    export_alternates: bool = False


@dataclasses.dataclass(frozen=True)
class Slot:
    """HF key ``key`` fills ``path[index]`` (a leading index of a stacked Variable) via ``transform``."""

    key: str
    path: str
    index: tuple[int, ...] = ()
    transform: Any = SAME


@dataclasses.dataclass(frozen=True)
class KeyTable:
    """Everything a family tells the shared loader and writer about its HF keys.

    ``top``: rows of unstacked Variables; ``stacks``: stacked modules; ``copies``: keys that repeat another
    weight (written on export, skipped on import when present); ``ignored``: regexes of keys skipped on import
    and never written (besides ``ALWAYS_IGNORED``); ``aliases``: ``(regex, replacement)`` pairs that rename a
    file's keys into the table's on import (another naming of the same checkpoint, e.g. a publisher's own, read
    as well as the one written); ``source``: where the table lives, named when a Variable has no row. Rows whose
    Variable the model lacks (an optional projection, an untied head) are skipped.
    """

    top: tuple[Row, ...]
    stacks: tuple[Stack, ...] = ()
    copies: tuple[Slot, ...] = ()
    ignored: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    source: str = "the family's HF key table"

    def canonical(self, key: str) -> str:
        """A file key in the table's naming (``aliases`` applied in order; keys they do not match pass)."""
        for pattern, replacement in self.aliases:
            key = re.sub(pattern, replacement, key)
        return key

    def slots(self, shapes: Mapping[str, Shape]) -> list[Slot]:
        """Every HF key (canonical layout) of a model whose Variables have ``shapes`` (path -> shape)."""
        slots = [Slot(r.hf, r.ours, (), r.transform) for r in self.top if r.ours in shapes]
        for stack in self.stacks:
            for hf, ours, transform in stack.rows:
                path = f"{stack.path}.{ours}"
                if path not in shapes:
                    continue
                for j, layer in enumerate(stack.layers):
                    key = stack.hf_prefix.format(i=layer) + hf
                    if "{e}" in hf:
                        slots += [Slot(key.format(e=e), path, (j, e), transform) for e in range(shapes[path][1])]
                    else:
                        slots.append(Slot(key, path, (j,), transform))
        unmapped = sorted(set(shapes) - {s.path for s in slots})
        if unmapped:  # a Variable added to the model without a row in the key table
            raise ValueError(f"no HF key in the table maps to {unmapped}; add rows to {self.source}")
        return slots

    def export_slots(self, shapes: Mapping[str, Shape]) -> list[Slot]:
        """The slots export writes, in order: the canonical keys (a stack's alternates instead of the rows they
        cover where it exports them), then the copies. An alternate key filled from several Variables (fused gate
        and up projections) comes as consecutive slots of that key, one per part, in the order the parts join (on
        dim 1: ``FusedGateUp``'s ``half``)."""
        fused = [stack for stack in self.stacks if stack.export_alternates]
        covered = {f"{stack.path}.{ours}" for stack in fused for targets in stack.alternates.values()
                   for ours, _ in targets}
        slots = [s for s in self.slots(shapes) if s.path not in covered]
        for stack in fused:
            for hf, targets in stack.alternates.items():
                parts = sorted(((f"{stack.path}.{ours}", t) for ours, t in targets if f"{stack.path}.{ours}" in shapes),
                               key=lambda part: getattr(part[1], "half", 0))
                for j, layer in enumerate(stack.layers):
                    key = stack.hf_prefix.format(i=layer) + hf
                    slots += [Slot(key, path, (j,), t) for path, t in parts]
        by_key: dict[str, list[Slot]] = {}  # a key filling several Variables: its parts consecutive, in join order
        for slot in slots:
            by_key.setdefault(slot.key, []).append(slot)
        return [s for parts in by_key.values() for s in sorted(parts, key=lambda s: getattr(s.transform, "half", 0))
                ] + list(self.copies)

    def alternate_slots(self, shapes: Mapping[str, Shape]) -> dict[str, list[Slot]]:
        """HF key -> the whole-layer slots it fills, for each stack's alternate layouts."""
        out: dict[str, list[Slot]] = {}
        for stack in self.stacks:
            for hf, targets in stack.alternates.items():
                paths = [(f"{stack.path}.{ours}", t) for ours, t in targets if f"{stack.path}.{ours}" in shapes]
                for j, layer in enumerate(stack.layers):
                    key = stack.hf_prefix.format(i=layer) + hf
                    out[key] = [Slot(key, path, (j,), t) for path, t in paths]
        return out

    def skipped(self) -> re.Pattern[str]:
        """Matches the keys import passes over (ignored keys, copies of other weights)."""
        patterns = [f"(?:{p})" for p in ALWAYS_IGNORED + self.ignored] + [f"^{re.escape(c.key)}$" for c in self.copies]
        return re.compile("|".join(patterns))
