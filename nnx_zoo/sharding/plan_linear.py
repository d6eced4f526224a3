"""The memory plan's linear-attention layers (the gated delta rule of Qwen3-Next, Qwen3.5 and Kimi Linear;
``nnx_zoo.layers.delta_rule``): what one such layer keeps for its backward pass and the scratch of one chunk.

A config with linear layers answers ``linear_attention_shapes()`` (``LinearShapes``' fields by name); the plan reads
it through ``DecoderShapes.from_config`` (``kind_schedule``) and counts each linear kind with the formulas below
beside the full-attention kinds. Sizes per device: ``T`` tokens (``b`` rows x ``s`` positions), ``a`` bytes of the
compute dtype, value heads ``h`` (after their tensor-parallel split) of ``d_k`` / ``d_v``, ``c`` the chunk size.

Kept for the backward pass, per layer (``linear_layer_bytes``; measured on XLA's buffer assignment, Qwen3.5- and
Kimi-Linear-shaped, float32, 256 tokens in chunks of 64: 0.96-0.97 of the per-layer slope):
- in the compute dtype, per token: the input RMSNorm's ``3e``; the input projections' outputs (``projections``:
  queries, keys, values, the output gate, the write strength and decay inputs, low-rank factors where the family
  has them); the short convolution's ``4`` widths per channel (pre-activation, and SiLU's residuals, as a
  SwiGLU's gate keeps them); the L2 norms' inputs of the queries and keys; ``o_proj``'s input.
- in float32 (the delta rule runs in it), per token: its inputs twice (as given, and laid out in chunks for the
  scan): queries and keys grouped to the value heads, values, the log-decay (one per head, or per key channel:
  KDA) and the write strength; its outputs twice (chunk-major and back); the gated output norm's ``4``.
- in float32, per chunk: the state ``[b, h, d_k, d_v]`` at the chunk's start (the scan's carry, saved for the
  backward: each chunk's body is recomputed from it, ``jax.checkpoint``).

Scratch while one chunk's backward runs (``linear_chunk_scratch_bytes``, the one-layer phase): its body recomputed
and differentiated: per head the ``[c, c]`` matrices (decayed query-key and key-key products, the pairwise decays,
the triangular system; ``LINEAR_CHUNK_MATRICES`` of them with their cotangents) and with a decay per key channel
(KDA) the pairwise decays ``[c, c, d_k]`` (``LINEAR_CHUNK_CHANNEL_MATRICES`` of them with their cotangents), all in
float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# [c, c] float32 matrices per head live in one chunk's backward (measured, see the module docstring).
LINEAR_CHUNK_MATRICES = 12
# [c, c, d_k] float32 tensors per head live in one chunk's backward with a decay per key channel (KDA): one (XLA
# fuses the others into their reductions; fitted to XLA's totals, see the module docstring).
LINEAR_CHUNK_CHANNEL_MATRICES = 1
# Widths per convolution channel the short convolution keeps (pre-activation, SiLU's residuals).
CONV_KEPT = 4
# Widths of [T, h, d_v] in float32 that the delta rule's outputs and the gated output norm keep.
OUTPUT_KEPT = 6


@dataclasses.dataclass(frozen=True)
class LinearShapes:
    """A linear-attention layer's sizes, as its config answers ``linear_attention_shapes()``.

    >>> LinearShapes(key_heads=2, value_heads=4, key_dim=32, value_dim=32, conv_channels=256, projections=392,
    ...              chunk=64).state_bytes(batch=1)
    16384
    """

    key_heads: int  # query/key heads (each serves value_heads // key_heads value heads)
    value_heads: int
    key_dim: int
    value_dim: int
    conv_channels: int  # channels of the short convolution(s) per token (all heads)
    projections: int  # widths per token the input projections write (all heads)
    chunk: int  # delta_rule_chunk_size
    per_channel_decay: bool = False  # KDA: a log-decay per key channel, not per head

    @classmethod
    def from_config(cls, config: Any) -> LinearShapes | None:
        answer = getattr(config, "linear_attention_shapes", None)
        return None if answer is None else cls(**answer())

    def state_bytes(self, batch: int, head_shards: int = 1) -> int:
        """One float32 state ``[b, h, d_k, d_v]`` (heads split ``head_shards`` ways)."""
        return batch * _split(self.value_heads, head_shards) * self.key_dim * self.value_dim * 4


def _split(size: int, parts: int) -> int:
    return -(-size // parts)


def linear_layer_bytes(lin: LinearShapes, hidden: int, dtype_bytes: int, batch: int, seq: int,
                       head_shards: int) -> int:
    """What one linear-attention layer keeps for its backward on one device (module docstring): ``batch`` rows of
    ``seq`` positions, heads split ``head_shards`` ways."""
    t, a = batch * seq, dtype_bytes
    shard = lambda width: _split(width, head_shards)  # noqa: E731 - every width but the hidden one splits by heads
    h, dk, dv = shard(lin.value_heads), lin.key_dim, lin.value_dim
    queries_keys = 2 * shard(lin.key_heads) * dk
    compute = 3 * hidden + shard(lin.projections) + CONV_KEPT * shard(lin.conv_channels) + queries_keys + h * dv
    decay = h * dk if lin.per_channel_decay else h
    rule_inputs = 2 * h * dk + h * dv + decay + h  # queries, keys (grouped), values, log-decay, write strength
    float32 = 2 * rule_inputs + OUTPUT_KEPT * h * dv
    chunks = math.ceil(seq / min(lin.chunk, seq))
    return t * (a * compute + 4 * float32) + chunks * lin.state_bytes(batch, head_shards)


def linear_chunk_scratch_bytes(lin: LinearShapes, batch: int, seq: int, head_shards: int) -> int:
    """What one chunk's backward holds while it runs: its ``[c, c]`` matrices per head (and ``[c, c, d_k]`` with a
    decay per key channel), float32."""
    c, h = min(lin.chunk, seq), _split(lin.value_heads, head_shards)
    per_head = LINEAR_CHUNK_MATRICES * c * c
    if lin.per_channel_decay:
        per_head += LINEAR_CHUNK_CHANNEL_MATRICES * c * c * lin.key_dim
    return 4 * batch * h * per_head


def linear_description(lin: LinearShapes, batch: int, head_shards: int) -> str:
    """The plan table's words for a linear kind: its state and chunk."""
    decay = "per-channel decay" if lin.per_channel_decay else "decay per head"
    return (f"gated delta rule: state [{_split(lin.value_heads, head_shards)} heads x {lin.key_dim} x "
            f"{lin.value_dim}] float32 per row ({lin.state_bytes(batch, head_shards) // max(batch, 1):,} bytes), "
            f"kept at every chunk of {lin.chunk}, {decay}")
