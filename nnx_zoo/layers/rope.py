"""Rotary position embeddings: the default schedule and YaRN, applied interleaved or rotate-half.

The formulas follow Hugging Face transformers (``_compute_yarn_parameters``), which is the reference the model
families here are checked against: frequencies are computed in float32, cos/sin are scaled by YaRN's attention
factor, and interleaved rope writes its output evens-then-odds (the same attention scores as rotating pairs in
place, because queries and keys get the same layout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension (the ``rope_scaling`` / ``rope_parameters`` block of an HF config).

    ``factor=None`` means ``max_position_embeddings / original_max_position_embeddings`` (resolved by the
    caller). ``attention_factor`` overrides the cos/sin multiplier derived from ``mscale``/``mscale_all_dim``.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, max_position_embeddings: int | None = None) -> YarnScaling:
        """From an HF rope dict (legacy ``rope_scaling`` or transformers-5 ``rope_parameters``)."""
        kind = d.get("rope_type", d.get("type", "yarn"))
        if kind != "yarn":
            raise ValueError(f"rope type {kind!r} is not supported; only 'default' and 'yarn' are")
        if "original_max_position_embeddings" not in d:
            raise ValueError(f"yarn rope needs 'original_max_position_embeddings', got keys {sorted(d)}")
        orig = int(d["original_max_position_embeddings"])
        factor = d.get("factor")
        if factor is None:
            if max_position_embeddings is None:
                raise ValueError("yarn 'factor' is missing and max_position_embeddings is unknown")
            factor = max_position_embeddings / orig
        return cls(
            factor=float(factor),
            original_max_position_embeddings=orig,
            beta_fast=float(d.get("beta_fast") or 32.0),
            beta_slow=float(d.get("beta_slow") or 1.0),
            mscale=None if d.get("mscale") is None else float(d["mscale"]),
            mscale_all_dim=None if d.get("mscale_all_dim") is None else float(d["mscale_all_dim"]),
            attention_factor=None if d.get("attention_factor") is None else float(d["attention_factor"]),
            truncate=bool(d.get("truncate", True)),
        )

    def to_dict(self) -> dict[str, Any]:
        """The HF dict (``type``/``rope_type`` both written, as hub configs and transformers 5 read them)."""
        out: dict[str, Any] = {"type": "yarn", "rope_type": "yarn", "factor": self.factor,
                               "original_max_position_embeddings": self.original_max_position_embeddings,
                               "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if not self.truncate:
            out["truncate"] = False
        return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_multiplier(scaling: YarnScaling | None) -> float:
    """Extra factor on the attention softmax scale: ``yarn_mscale(factor, mscale_all_dim) ** 2`` when set."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_frequencies(dim: int, theta: float, scaling: YarnScaling | None = None) -> tuple[np.ndarray, float]:
    """``(inv_freq [dim // 2] float32, cos/sin multiplier)`` for the default schedule or YaRN."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(theta), exponents, dtype=np.float32)
    if scaling is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    s = scaling
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    inv_extrapolation = np.float32(1.0) / pos_freqs
    inv_interpolation = np.float32(1.0) / (np.float32(s.factor) * pos_freqs)
    inv_freq = inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[*positions.shape, dim // 2]`` (float32), scaled by ``attention_factor``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool) -> jax.Array:
    """Rotate ``x [batch, seq, heads, dim]`` by ``cos``/``sin [batch, seq, dim // 2]``.

    ``interleaved=False`` pairs dim ``i`` with ``i + dim/2`` (rotate-half). ``interleaved=True`` pairs
    ``(2i, 2i+1)`` and writes the rotated pairs evens-then-odds.
    """
    half = x.shape[-1] // 2
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
