"""Rotary position embeddings: the ``default``, ``linear``, ``llama3`` and ``yarn`` schedules, applied
interleaved (DeepSeek) or rotate-half (Llama, Qwen).

The formulas follow Hugging Face transformers (``modeling_rope_utils``), which is the reference the model
families here are checked against: frequencies are computed in float32, cos/sin are scaled by YaRN's attention
factor, and interleaved rope writes its output evens-then-odds (the same attention scores as rotating pairs in
place, because queries and keys get the same layout). ``rope_from_hf`` reads a config's rope settings in both
of their HF forms (transformers-5 ``rope_parameters``, legacy ``rope_scaling`` + ``rope_theta``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Union

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


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (HF ``rope_type="linear"``): every frequency is divided by ``factor``.

    >>> inv_freq, _ = rope_frequencies(64, 10000.0, LinearScaling(factor=4.0))
    """

    factor: float

    def to_dict(self) -> dict[str, Any]:
        """The HF rope dict (``type``/``rope_type`` both written)."""
        return {"type": "linear", "rope_type": "linear", "factor": self.factor}


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency-dependent scaling (HF ``rope_type="llama3"``).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
    those shorter than ``original_max_position_embeddings / high_freq_factor`` are kept, and the band between is
    interpolated smoothly. Llama 3.1/3.2 ship ``Llama3Scaling(8.0, 1.0, 4.0, 8192)`` (3.2: factor 32).

    >>> inv_freq, _ = rope_frequencies(128, 500000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_dict(self) -> dict[str, Any]:
        """The HF rope dict (``type``/``rope_type`` both written)."""
        return {"type": "llama3", "rope_type": "llama3", "factor": self.factor,
                "low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


# None is the default schedule (no scaling).
RopeScaling = Union[LinearScaling, Llama3Scaling, YarnScaling, None]
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_multiplier(scaling: YarnScaling | None) -> float:
    """Extra factor on the attention softmax scale: ``yarn_mscale(factor, mscale_all_dim) ** 2`` when set."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling = None) -> tuple[np.ndarray, float]:
    """``(inv_freq [dim // 2] float32, cos/sin multiplier)`` for the default schedule (``scaling=None``) or the
    ``linear``, ``llama3`` or YaRN schedule that ``scaling`` describes.

    >>> inv_freq, attention_factor = rope_frequencies(128, 500000.0, Llama3Scaling(8.0, 1.0, 4.0, 8192))
    """
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(theta), exponents, dtype=np.float32)
    if scaling is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    if isinstance(scaling, LinearScaling):
        return (np.float32(1.0) / pos_freqs / np.float32(scaling.factor)).astype(np.float32), 1.0
    if isinstance(scaling, Llama3Scaling):
        return _llama3_frequencies((np.float32(1.0) / pos_freqs).astype(np.float32), scaling), 1.0
    if not isinstance(scaling, YarnScaling):
        raise TypeError(f"rope scaling must be None, LinearScaling, Llama3Scaling or YarnScaling, got {scaling!r}")
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


def _llama3_frequencies(inv_freq: np.ndarray, s: Llama3Scaling) -> np.ndarray:
    """Llama 3.1's scaling of the default ``inv_freq`` (float32 arithmetic, as transformers does it)."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    long_scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(s.factor), inv_freq)
    # Equal band factors (Llama 4 Scout's 1 and 1) leave no medium band: the inf/nan here are never selected below.
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (np.float32(s.original_max_position_embeddings) / wavelen - np.float32(s.low_freq_factor)
                  ) / np.float32(s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * long_scaled / np.float32(s.factor) + smooth * long_scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, long_scaled).astype(np.float32)


def rope_scaling_from_dict(d: Mapping[str, Any] | None, *, max_position_embeddings: int | None = None
                           ) -> RopeScaling:
    """The scaling an HF rope dict describes (``rope_type`` or legacy ``type``; None or ``"default"``: None).

    As transformers does, ``llama3`` and ``yarn`` without ``original_max_position_embeddings`` take
    ``max_position_embeddings``. Types other than ``default``, ``linear``, ``llama3`` and ``yarn`` are an error.
    """
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported (partial_rotary_factor="
                         f"{d['partial_rotary_factor']})")
    if kind in ("llama3", "yarn") and "original_max_position_embeddings" not in d:
        if max_position_embeddings is None:
            raise ValueError(f"{kind} rope needs 'original_max_position_embeddings' (or max_position_embeddings)")
        d = {**d, "original_max_position_embeddings": max_position_embeddings}

    def need(key: str) -> Any:
        if d.get(key) is None:
            raise ValueError(f"{kind} rope needs {key!r}, got keys {sorted(d)}")
        return d[key]

    if kind == "default":
        return None
    if kind == "linear":
        return LinearScaling(factor=float(need("factor")))
    if kind == "llama3":
        return Llama3Scaling(factor=float(need("factor")), low_freq_factor=float(need("low_freq_factor")),
                             high_freq_factor=float(need("high_freq_factor")),
                             original_max_position_embeddings=int(need("original_max_position_embeddings")))
    if kind == "yarn":
        return YarnScaling.from_dict({**d, "rope_type": "yarn"}, max_position_embeddings=max_position_embeddings)
    raise ValueError(f"rope type {kind!r} is not supported; supported types are {ROPE_TYPES}")


def rope_from_hf(config: Mapping[str, Any], *, default_theta: float = 10000.0) -> tuple[float, RopeScaling]:
    """``(rope_theta, scaling)`` from an HF ``config.json`` dict, in either form.

    transformers 5 writes ``rope_parameters`` (holding ``rope_type`` and ``rope_theta``); hub checkpoints carry
    the legacy ``rope_scaling`` (None for the default schedule) next to a top-level ``rope_theta``. As in
    transformers, a non-empty ``rope_scaling`` wins over ``rope_parameters``, a ``rope_theta`` inside the rope
    dict wins over the top-level one, and a top-level ``original_max_position_embeddings`` wins over the rope
    dict's.

    >>> theta, scaling = rope_from_hf({"rope_parameters": {"rope_type": "linear", "factor": 2.0,
    ...                                                     "rope_theta": 1e6}})
    >>> theta, scaling
    (1000000.0, LinearScaling(factor=2.0))
    """
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", default_theta)
    if config.get("original_max_position_embeddings") is not None and rope.get(
            "rope_type", rope.get("type")) in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    scaling = rope_scaling_from_dict(rope, max_position_embeddings=config.get("max_position_embeddings"))
    return float(theta), scaling


def rope_to_hf(theta: float, scaling: RopeScaling) -> dict[str, Any]:
    """The ``config.json`` keys for ``(theta, scaling)`` in the hub's legacy form (``rope_theta`` and
    ``rope_scaling``), which transformers 4 and 5 both read."""
    return {"rope_theta": float(theta), "rope_scaling": None if scaling is None else scaling.to_dict()}


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[*positions.shape, dim // 2]`` (float32), scaled by ``attention_factor``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool) -> jax.Array:
    """Rotate ``x [batch, seq, heads, dim]`` by ``cos``/``sin [batch, seq, rot // 2]``.

    ``interleaved=False`` pairs dim ``i`` with ``i + rot/2`` (rotate-half). ``interleaved=True`` pairs
    ``(2i, 2i+1)`` and writes the rotated pairs evens-then-odds. Partial rotary (``rot < dim``, HF
    ``partial_rotary_factor``): only the first ``rot`` dims rotate, the rest pass through unchanged, after them.
    """
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        rotated = apply_rope(x[..., :rot], cos, sin, interleaved=interleaved)
        return jnp.concatenate([rotated, x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the last ``rot = 2 * cos.shape[-1]`` dims of ``x [batch, seq, (heads,) dim]`` in place, as consecutive
    pairs ``(d, d + 1)`` (DeepSeek-V4's layout: each head is ``[nope | rope]``), leaving the leading dims as they
    are. ``cos``/``sin [batch, seq, rot // 2]``; the rotation is computed in float32 and cast back to ``x``'s dtype.

    Unlike ``apply_rope(..., interleaved=True)``, which writes the rotated pairs evens-then-odds (the same scores,
    a permuted layout), pairs stay where they are: DeepSeek-V4 reads its keys as values too and undoes the rotation
    on the attention output (``rotate_pairs(out, cos, -sin)``), so the layout must be the stored one.

    >>> cos, sin = rope_cos_sin(jnp.arange(8)[None], rope_frequencies(64, 1e4)[0])
    >>> rotate_pairs(jnp.ones((1, 8, 4, 512)), cos, sin).shape
    (1, 8, 4, 512)
    """
    rot = 2 * cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - rot], x[..., x.shape[-1] - rot:]
    pairs = rope.astype(jnp.float32).reshape(*rope.shape[:-1], rot // 2, 2)
    if x.ndim == cos.ndim + 1:  # a heads dim between the sequence and the features
        cos, sin = cos[..., None, :], sin[..., None, :]
    cos, sin = cos.astype(jnp.float32), sin.astype(jnp.float32)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, rotated.astype(x.dtype)], axis=-1)
