"""Attention: the mask, the one dispatch function over its implementations, and the grouped-query module.

- ``AttentionMask`` says which keys each query sees without building a ``[q, k]`` array: causal from the query's
  slot (``q_offset + i``), key validity (padding, unwritten cache slots) and packed-document ``segment_ids``.
  ``causal_mask`` builds one; ``.dense()`` gives the boolean ``[b, 1, q, k]`` array for the einsum path.
- ``attention(q, k, v, mask, scale, impl)`` is the only place that branches on ``attention_impl``:

  ========== ==============================================================================================
  ``xla``    ``dot_product_attention``: einsum scores ``[b, heads, q, k]`` and a float32 softmax. The reference.
  blockwise  ``nnx_zoo.layers.blockwise_attention``: online softmax over key blocks with a flash-style backward;
             memory linear in the sequence; any backend, every mask.
  ``cudnn``  ``jax.nn.dot_product_attention(implementation="cudnn")`` (NVIDIA GPUs): causal, no padding or
             segments, bf16/fp16, head dims up to 256 (MLA's 128-wide values are zero-padded to 192).
  tokamax    ``tokamax.dot_product_attention`` (optional package; Mosaic GPU / TPU kernels; value width may
             differ): causal, no padding or segments.
  ``auto``   ``choose_attention_impl``: by backend and shape (see there).
  ========== ==============================================================================================

  A kernel asked for by name that cannot serve a call (segments or padding for cudnn/tokamax, a missing
  package, the wrong backend or dtype, a sequence split over devices, a local-attention feature it lacks) falls
  back to the portable path with one warning line naming the reason and the path used
  (``AttentionFallbackWarning``): every implementation computes the same attention, so the fallback changes speed,
  never meaning.
- Local attention, per layer (``attention``'s keywords; ``Attention``'s constructor): a sliding ``window``, a
  ``chunk`` (``nnx_zoo.layers.attention_mask`` says which keys each leaves visible), learned per-head ``sinks`` (an
  extra softmax column with no value) and logit ``softcap``. ``xla`` and ``blockwise`` run all four (blockwise
  skips the key blocks outside a window or chunk); cuDNN runs its local-window mode (windows only); tokamax runs
  windows and soft-capping.
- ``Attention``: multi-head attention with grouped key/value heads (MHA, GQA, MQA).

Rows with no visible key (a left-padding query): ``xla`` gives the mean of all values there, the other paths 0.
No real token reads those rows; compare implementations on rows that see a key.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from nnx_zoo.layers import blockwise_attention as blockwise
from nnx_zoo.layers import kernels
from nnx_zoo.layers.attention_mask import AttentionMask, causal_mask
from nnx_zoo.layers.kv_cache import ring_keys, ring_mask, write_ring, write_slots
from nnx_zoo.layers.linear import DEFAULT_INIT, Linear
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import apply_rope, rotate_pairs
from nnx_zoo.layers.spec import explicit_spec, resolve_activation
from nnx_zoo.sharding import axes_tuple, restore_sharding, shard, sharding_of
from nnx_zoo.sharding.constrain import shard_to_spec

_SCORE_NAMES = ("activation_batch", "activation_heads", "activation_length", "activation_kv_length")
_GROUPED_SCORE_NAMES = ("activation_batch", "activation_kv_heads", None, "activation_length", "activation_kv_length")
_GROUPED_Q_NAMES = ("activation_batch", "activation_length", "activation_kv_heads", None, "activation_kv")
_BLE = ("activation_batch", "activation_length", "activation_embed")
_BLHD = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
_BLND = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
_BKND = ("activation_batch", "activation_kv_length", "activation_kv_heads", "activation_kv")
_QUERY_SIDE = ("activation_batch", "activation_length")
_KEY_SIDE = ("activation_batch", "activation_kv_length")

__all__ = ["ATTENTION_IMPLS", "LOCAL_FEATURES", "ROPE_STYLES", "Attention", "AttentionFallbackWarning", "AttentionMask",
           "activation_spec", "ambient_mesh", "attention", "causal_mask", "choose_attention_impl", "dense_mask",
           "dot_product_attention", "run_per_query_shard", "token_mask_of", "vary_over"]

ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "tokamax")
# How ``Attention`` ropes queries and keys: rotate-half (Llama, Qwen), consecutive pairs rotated in place (Llama 4's
# complex-number rope), or not at all (None: a NoPE layer; its cos/sin may be None).
ROPE_STYLES = ("half", "pairs", None)

# auto on CPU: the einsum path while one head's scores (q_len * k_len) are at most 512 x 512, blockwise beyond.
# Measured on this 2-core CPU (benchmarks/kernel_memory.py, section attention_cpu: one causal call, forward +
# backward, 8 query / 2 key-value heads of width 32, float32), blockwise / xla: 0.52 at 256, 0.96 at 512, 0.39 at
# 1024, 0.28 at 2048, 0.24 at 4096 (xla 7.5 s there). Up to 512 the two are within noise of each other (blockwise
# is one tile there), so the CPU train-step benchmarks (sequences of 128) keep exactly the einsum program they
# had; beyond it blockwise is faster and its memory linear.
CPU_XLA_MAX_SCORES = 512 * 512
# auto on GPU/TPU: the einsum path only for a few queries (decoding: one score row per query, linear in the
# cache), a kernel or blockwise otherwise.
ACCELERATOR_XLA_MAX_QUERIES = 16
CUDNN_MAX_HEAD_DIM = 256


class AttentionFallbackWarning(UserWarning):
    """An attention implementation asked for cannot serve a call (or its package is missing); another runs."""


def dense_mask(mask: AttentionMask | jax.Array | None, q_len: int, k_len: int) -> jax.Array | None:
    """A boolean ``[b or 1, 1, q, k]`` mask from an ``AttentionMask`` (a dense array or None passes through)."""
    return mask.dense(q_len, k_len) if isinstance(mask, AttentionMask) else mask


def token_mask_of(mask: AttentionMask | jax.Array | None, q_len: int) -> jax.Array:
    """``[batch or 1, q_len]`` bool: which queries are real tokens (a token sees its own slot)."""
    if mask is None:
        return jnp.ones((1, q_len), bool)
    if isinstance(mask, AttentionMask):
        return mask.query_valid(q_len)
    return jnp.any(mask[:, 0] & jnp.eye(q_len, mask.shape[-1], dtype=bool), axis=-1)


# ------------------------------------------------------------------------------------- the einsum path (reference)
def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask | jax.Array | None, scale: float, *,
    window: int | None = None, chunk: int | None = None, sinks: jax.Array | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """``softmax(q k^T * scale + mask) v`` for ``q [b, q, h, d_qk]``, ``k [b, k, n, d_qk]``, ``v [b, k, n, d_v]``
    -> ``[b, q, h, d_v]``, with an ``AttentionMask`` or a boolean ``mask [b or 1, 1, q, k]`` (True = visible).

    ``n`` key/value heads must divide the ``h`` query heads: query head ``i`` attends with key/value head
    ``i // (h // n)`` (grouped-query attention; ``n == h`` is multi-head, ``n == 1`` multi-query attention).
    Keys and values are never repeated per query head: the queries are viewed as ``[b, q, n, h // n, d]``.
    Masked scores are filled with the dtype's minimum, not -inf, so a fully masked row (a left-pad query) stays
    finite. The softmax is computed in float32. This is ``attention_impl="xla"``, the reference.

    Local attention (see the module docstring): ``window`` / ``chunk`` need an ``AttentionMask``; ``softcap``
    caps the scaled scores (``cap * tanh(s / cap)``) before masking; ``sinks [h]`` join the softmax as one more
    column per query head, whose probability is dropped.
    """
    if (window is not None or chunk is not None) and not isinstance(mask, AttentionMask):
        raise ValueError("a sliding window or chunk needs an AttentionMask (causal_mask), not a dense mask")
    mask = mask.dense(q.shape[1], k.shape[1], window=window, chunk=chunk) if isinstance(mask, AttentionMask) \
        else mask
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads == heads:
        scores = _capped(jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(scale, q.dtype), softcap)
        sink = None if sinks is None else sinks.reshape(1, heads, 1, 1)
        probs = _masked_softmax(shard(scores, _SCORE_NAMES), mask, v.dtype, sink)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    q = _grouped_queries(q, k, v)
    # Letters: b batch, q query position, k key position, n kv head, g query head within its group, d feature.
    scores = _capped(jnp.einsum("bqngd,bknd->bngqk", q, k) * jnp.asarray(scale, q.dtype), softcap)
    sink = None if sinks is None else sinks.reshape(1, kv_heads, heads // kv_heads, 1, 1)
    probs = _masked_softmax(shard(scores, _GROUPED_SCORE_NAMES), None if mask is None else mask[:, :, None],
                            v.dtype, sink)
    return _merged_heads(jnp.einsum("bngqk,bknd->bqngd", probs, v))


def _capped(scores: jax.Array, softcap: float | None) -> jax.Array:
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _grouped_queries(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``q [b, q, h, d]`` viewed as ``[b, q, n, h // n, d]`` for ``n`` key/value heads."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads or v.shape[2] != kv_heads:
        raise ValueError(f"key/value heads ({kv_heads}, values {v.shape[2]}) must be equal and divide the "
                         f"query heads ({heads})")
    grouped = (*q.shape[:2], kv_heads, heads // kv_heads, q.shape[3])
    # Query head i = kv head i // groups: the kv-head dim is the major half of the split, laid out like heads.
    return jnp.reshape(q, grouped, out_sharding=explicit_spec(_GROUPED_Q_NAMES, grouped))


def _merged_heads(out: jax.Array) -> jax.Array:
    """``[b, q, n, g, d]`` -> ``[b, q, n * g, d]`` laid out like the query heads."""
    merged = (*out.shape[:2], out.shape[2] * out.shape[3], out.shape[4])
    return jnp.reshape(out, merged, out_sharding=explicit_spec(_BLHD, merged))


def _masked_softmax(scores: jax.Array, mask: jax.Array | None, dtype: jnp.dtype,
                    sink: jax.Array | None = None) -> jax.Array:
    """Softmax over the last (key) dim in float32, masked keys filled with the scores dtype's minimum; ``sink``
    (broadcast against the scores without their key dim) is one more logit in each row's normalizer."""
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    scores = scores.astype(jnp.float32)
    if sink is None:
        return jax.nn.softmax(scores, axis=-1).astype(dtype)
    sink = jnp.broadcast_to(sink.astype(jnp.float32), scores.shape[:-1] + (1,))
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
    exp = jnp.exp(scores - top)
    return (exp / (jnp.sum(exp, axis=-1, keepdims=True) + jnp.exp(sink - top))).astype(dtype)


# ------------------------------------------------------------------------------------------------- the chooser
def tokamax_available() -> bool:
    """Whether the optional ``tokamax`` package imports (``pip install 'nnx-zoo[gpu]'``)."""
    return kernels.tokamax() is not None


def _tokamax_missing() -> str:
    """Not installed, or installed and failing to import (with its error)."""
    return kernels.tokamax_unavailable() or "tokamax does not import"


def _warn_once(message: str) -> None:
    kernels.warn_once(message, AttentionFallbackWarning)


def _portable(q_len: int, k_len: int, platform: str) -> str:
    """The portable path for a shape: the einsum path while its scores are small, else blockwise."""
    if platform == "cpu":
        return "xla" if q_len * k_len <= CPU_XLA_MAX_SCORES else "blockwise"
    return "xla" if q_len <= ACCELERATOR_XLA_MAX_QUERIES else "blockwise"


LOCAL_FEATURES = ("window", "chunk", "sinks", "softcap")
# What each GPU/TPU kernel runs of the local-attention features (xla and blockwise run them all).
_KERNEL_FEATURES = {"cudnn": frozenset({"window"}), "tokamax": frozenset({"window", "softcap"})}


def _feature_refusal(impl: str, features: frozenset[str]) -> str | None:
    missing = sorted(features - _KERNEL_FEATURES[impl])
    return None if not missing else f"local attention with {', '.join(missing)} (it runs: " \
        f"{', '.join(sorted(_KERNEL_FEATURES[impl])) or 'none'})"


def _cudnn_refusal(q_len: int, k_len: int, platform: str, segments: bool, padding: bool, qk_dim: int,
                   v_dim: int, features: frozenset[str] = frozenset()) -> str | None:
    """Why cuDNN flash attention cannot serve a call (None: it can)."""
    if platform != "gpu":
        return f"it runs on NVIDIA GPUs only (platform {platform!r})"
    if qk_dim > CUDNN_MAX_HEAD_DIM or qk_dim % 8 or v_dim > qk_dim:
        return f"head dims {qk_dim}/{v_dim} (needs qk <= {CUDNN_MAX_HEAD_DIM}, a multiple of 8, v <= qk)"
    return _feature_refusal("cudnn", features) or _mask_refusal(q_len, k_len, segments, padding)


def _tokamax_refusal(q_len: int, k_len: int, platform: str, segments: bool, padding: bool,
                     features: frozenset[str] = frozenset()) -> str | None:
    """Why tokamax's attention cannot serve a call (None: it can)."""
    if not tokamax_available():
        return _tokamax_missing()
    if platform not in ("gpu", "tpu"):
        return f"its kernels run on GPUs and TPUs (platform {platform!r})"
    return _feature_refusal("tokamax", features) or _mask_refusal(q_len, k_len, segments, padding)


def _mask_refusal(q_len: int, k_len: int, segments: bool, padding: bool) -> str | None:
    """What cuDNN's and tokamax's causal kernels cannot take (None: a plain causal self-attention call)."""
    if segments:
        return "packed documents (segment_ids)"
    if padding:
        return "padding or a cache offset (kv_valid / q_offset)"
    if q_len != k_len:
        return f"queries ({q_len}) and keys ({k_len}) of different lengths"
    return None


def choose_attention_impl(requested: str, *, q_len: int, k_len: int, platform: str | None = None,
                          segments: bool = False, padding: bool = False, qk_dim: int = 128,
                          v_dim: int = 128, features: Sequence[str] = ()) -> str:
    """The implementation ``attention`` runs for ``attention_impl=requested`` on a call of this shape.

    ``platform``: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (default: JAX's default backend). ``segments``: packed
    documents; ``padding``: invalid keys (left padding, unwritten cache slots) or a decode step's cache offset;
    ``features``: the local-attention features the layer uses (``LOCAL_FEATURES``: cuDNN runs ``window`` alone,
    tokamax ``window`` and ``softcap``).

    ``auto``:
      - CPU: ``xla`` while one head's scores ``q_len * k_len`` are at most ``CPU_XLA_MAX_SCORES`` (512 x 512;
        beyond it blockwise was measured faster: 0.39x the time at 1024, 0.24x at 4096), ``blockwise`` beyond
        (memory linear in the sequence). Decoding (one query row per token) stays on ``xla``.
      - GPU: ``cudnn`` where it serves (causal, no padding or segments, head dims <= 256), else ``tokamax`` where
        installed and serving, else the portable path (``xla`` for <= 16 queries, e.g. decoding; ``blockwise``).
      - TPU: ``tokamax`` where installed and serving, else the portable path.
    ``xla`` and ``blockwise`` always run as asked. ``cudnn`` / ``tokamax`` asked for by name where they cannot
    serve fall back to the portable path with one ``AttentionFallbackWarning`` line saying why. Two things this
    function cannot see are checked by ``attention`` itself, with the same fallback: the dtype (cuDNN flash
    attention takes bfloat16/float16 only) and queries split over devices (context parallelism) for the kernels.

    >>> choose_attention_impl("auto", q_len=8192, k_len=8192, platform="cpu")
    'blockwise'
    >>> choose_attention_impl("auto", q_len=2048, k_len=2048, platform="gpu", segments=True)
    'blockwise'
    """
    if requested not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {requested!r}; choose one of {ATTENTION_IMPLS}")
    platform = kernels.platform_name(platform)
    unknown = set(features) - set(LOCAL_FEATURES)
    if unknown:
        raise ValueError(f"unknown local-attention features {sorted(unknown)}; they are {LOCAL_FEATURES}")
    if requested in ("xla", "blockwise"):
        return requested
    features = frozenset(features)
    portable = _portable(q_len, k_len, platform)
    cudnn_no = _cudnn_refusal(q_len, k_len, platform, segments, padding, qk_dim, v_dim, features)
    tokamax_no = _tokamax_refusal(q_len, k_len, platform, segments, padding, features)
    if requested == "cudnn":
        if cudnn_no is None:
            return "cudnn"
        _warn_once(f"attention_impl='cudnn' cannot serve {cudnn_no}; using {portable!r}")
        return portable
    if requested == "tokamax":
        if tokamax_no is None:
            return "tokamax"
        _warn_once(f"attention_impl='tokamax' cannot serve: {tokamax_no}; using {portable!r}")
        return portable
    # auto
    if platform == "gpu" and cudnn_no is None:
        return "cudnn"
    if platform in ("gpu", "tpu"):
        if tokamax_no is None:
            return "tokamax"
        if not tokamax_available() and portable == "blockwise":
            _warn_once(f"{_tokamax_missing()}: attention uses {portable!r}")
        elif portable == "blockwise" and features and (cudnn_no or "").startswith("local attention"):
            _warn_once(f"no GPU/TPU attention kernel runs {cudnn_no.split(' (')[0]}: attention uses 'blockwise'")
    return portable


# -------------------------------------------------------------------------------------------- the one dispatcher
def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask | jax.Array | None, scale: float,
              impl: str = "auto", *, block_q: int | None = None, block_k: int | None = None,
              window: int | None = None, chunk: int | None = None, sinks: jax.Array | None = None,
              softcap: float | None = None) -> jax.Array:
    """Attention of ``q [b, q, h, d_qk]`` over ``k [b, k, n, d_qk]`` and ``v [b, k, n, d_v]`` (``n`` divides
    ``h``: GQA/MQA; ``d_v`` may differ from ``d_qk``: MLA) -> ``[b, q, h, d_v]``, run by ``impl``
    (``ATTENTION_IMPLS``; ``auto`` and fallbacks as ``choose_attention_impl`` says).

    ``mask``: an ``AttentionMask`` (every implementation), a dense boolean ``[b or 1, 1, q, k]`` array or None
    (no mask at all; both only for ``xla``, which then runs whatever ``impl`` says). On a mesh the kernels run
    inside ``shard_map`` over the activations' layout (queries may be split over the sequence; keys whole) and
    return what the einsum path returns, laid out the same way. ``block_q`` / ``block_k``: blockwise's tiles
    (default ``blockwise_attention.DEFAULT_BLOCK_Q`` / ``DEFAULT_BLOCK_K``, read at call time).

    A layer's local attention (module docstring): ``window`` (keys at slots ``> q_slot - window``), ``chunk``
    (keys of the query's chunk of its document), ``sinks [heads]`` (learned logits, differentiable) and
    ``softcap`` (scores ``cap * tanh(s / cap)``).

    >>> out = attention(q, k, v, causal_mask(seq, pad_mask), head_dim**-0.5, impl="blockwise")
    >>> out = attention(q, k, v, causal_mask(seq), head_dim**-0.5, window=128, sinks=layer_sinks)
    """
    local = dict(window=window, chunk=chunk, sinks=sinks, softcap=softcap)
    features = tuple(name for name, value in local.items() if value is not None)
    if not isinstance(mask, AttentionMask):
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention_impl {impl!r}; choose one of {ATTENTION_IMPLS}")
        return dot_product_attention(q, k, v, mask, scale, **local)
    q_len, k_len = q.shape[1], k.shape[1]
    padding = mask.kv_valid is not None or not mask.static_start
    chosen = choose_attention_impl(impl, q_len=q_len, k_len=k_len, segments=mask.segment_ids is not None,
                                   padding=padding, qk_dim=q.shape[3], v_dim=v.shape[3], features=features)
    if chosen in ("cudnn", "tokamax"):
        refusal = _kernel_refusal_here(chosen, q)
        if refusal is not None:
            fallback = _portable(q_len, k_len, kernels.platform_name())
            if impl == chosen:  # asked for by name: say so; auto just takes the portable path
                _warn_once(f"attention_impl={chosen!r} cannot serve {refusal}; using {fallback!r}")
            chosen = fallback
    if chosen == "xla":
        return dot_product_attention(q, k, v, mask, scale, **local)
    kernel: Callable[..., jax.Array]
    if chosen == "blockwise":
        kernel = functools.partial(_blockwise_local, scale=scale, block_q=block_q or blockwise.DEFAULT_BLOCK_Q,
                                   block_k=block_k or blockwise.DEFAULT_BLOCK_K, window=window, chunk=chunk,
                                   softcap=softcap)
    elif chosen == "cudnn":
        kernel = functools.partial(_cudnn_local, scale=scale, window=window)
    else:
        kernel = functools.partial(_tokamax_local, scale=scale, window=window, softcap=softcap)
    q = _grouped_queries(q, k, v)
    q_spec = activation_spec(_GROUPED_Q_NAMES[:-1] + (None,), q.shape)
    kv_names = ("activation_batch", "activation_kv_length", "activation_kv_heads", None)
    extras = {}
    if chosen == "blockwise" and chunk is not None:
        starts = jnp.broadcast_to(mask.doc_starts(q_len), q.shape[:2])
        extras["q_doc_start"] = (starts, PartitionSpec(*q_spec[:2]))
    if chosen == "blockwise" and sinks is not None:  # [heads] -> [kv heads, group], laid out like the queries
        extras["sinks"] = (sinks.astype(jnp.float32).reshape(q.shape[2:4]), PartitionSpec(*q_spec[2:4]))
    out = run_per_query_shard(kernel, queries=[(q, q_spec)], mask=mask, out_specs=q_spec, extras=extras,
                              keys=[(k, activation_spec(kv_names, k.shape)), (v, activation_spec(kv_names, v.shape))])
    return _merged_heads(out)


def _kernel_refusal_here(impl: str, q: jax.Array) -> str | None:
    """What the chooser cannot see that stops a GPU/TPU kernel: the dtype, or queries split over devices
    (each device's causal mask would need its own offset)."""
    if impl == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"{q.dtype} inputs (cuDNN flash attention takes bfloat16/float16)"
    if ambient_mesh() is not None and axes_tuple(activation_spec(_QUERY_SIDE, q.shape[:2])[1]):
        return "queries split over the sequence (context parallelism)"
    return None


# ----------------------------------------------------------------------------------------- the per-device kernels
def _blockwise_local(q, k, v, q_offset, kv_valid, q_seg, kv_seg, *, scale, block_q, block_k, window, chunk,
                     softcap, q_doc_start=None, sinks=None):
    return blockwise.blockwise_attention(q, k, v, scale=scale, q_offset=q_offset, kv_valid=kv_valid,
                                         q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_q=block_q,
                                         block_k=block_k, window=window, chunk=chunk, q_doc_start=q_doc_start,
                                         softcap=softcap, sinks=sinks)


def _flat_heads(q: jax.Array) -> jax.Array:
    """Grouped ``[b, q, n, g, d]`` -> ``[b, q, n * g, d]`` (query head ``i`` uses key/value head ``i // g``)."""
    return q.reshape(*q.shape[:2], q.shape[2] * q.shape[3], q.shape[4])


def _local_window(window: int | None) -> tuple[int, int] | None:
    """jax/tokamax's ``local_window_size`` (keys ``i - left .. i + right``) of a causal window of ``window`` slots."""
    return None if window is None else (window - 1, 0)


def _cudnn_local(q, k, v, q_offset, kv_valid, q_seg, kv_seg, *, scale, window):
    del q_offset, kv_valid, q_seg, kv_seg  # the chooser sent only causal, unpadded, one-document calls here
    b, s, n, g, _ = q.shape
    dv = v.shape[-1]
    if dv < q.shape[-1]:  # MLA: the public API wants value width == query width; zero columns add nothing
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv)))
    out = jax.nn.dot_product_attention(_flat_heads(q), k, v, scale=scale, is_causal=True, implementation="cudnn",
                                       local_window_size=_local_window(window))
    return out[..., :dv].reshape(b, s, n, g, dv)


def _tokamax_local(q, k, v, q_offset, kv_valid, q_seg, kv_seg, *, scale, window, softcap):
    del q_offset, kv_valid, q_seg, kv_seg  # causal, unpadded, one document (see _tokamax_refusal)
    import tokamax  # optional; the chooser checked it is installed

    b, s, n, g, _ = q.shape
    names = ("mosaic", "triton") if kernels.platform_name() == "gpu" else ("mosaic",)
    options = dict(scale=scale, is_causal=True, local_window_size=_local_window(window), logits_soft_cap=softcap)
    try:
        out = tokamax.dot_product_attention(_flat_heads(q), k, v, implementation=names, **options)
    except ValueError:  # tokamax names a kernel it could not import (e.g. Mosaic GPU): its Triton one alone
        if names[1:] == ():
            raise
        out = tokamax.dot_product_attention(_flat_heads(q), k, v, implementation=names[1:], **options)
    return out.reshape(b, s, n, g, v.shape[-1])


# ------------------------------------------------------------------------------------------------- under a mesh
def ambient_mesh() -> jax.sharding.AbstractMesh | None:
    """The ambient mesh a kernel runs ``shard_map`` over (None: no mesh, or already inside ``shard_map``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(t == AxisType.Manual for t in mesh.axis_types):
        return None
    return mesh



def activation_spec(names: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
    """The layout ``names`` resolve to (as ``shard`` would place them), each dim kept on the longest prefix of its
    mesh axes that divides it: ``shard_map`` needs whole shards (Auto meshes may otherwise pad)."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = tuple(resolve_activation(names, shape))
    entries = []
    for dim, entry in zip(shape, spec + (None,) * (len(shape) - len(spec))):
        kept: list[str] = []
        for axis in axes_tuple(entry):
            if dim % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]):
                break
            kept.append(axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*entries)


def run_per_query_shard(kernel: Callable[..., Any], *, queries: Sequence[tuple[jax.Array, PartitionSpec]],
                        keys: Sequence[tuple[jax.Array, PartitionSpec]], mask: AttentionMask, out_specs: Any,
                        extras: dict[str, tuple[jax.Array, PartitionSpec]] | None = None,
                        **kernel_kwargs: Any) -> Any:
    """``kernel(*queries, *keys, q_offset, kv_valid, q_segment_ids, kv_segment_ids, **kernel_kwargs)`` on each
    device's block of queries inside ``shard_map`` when a mesh is ambient (without one: once, on whole arrays).

    ``queries`` / ``keys``: ``(array, spec)`` pairs, each array ``[b, q or k, ...]`` laid out as its spec says.
    Queries keep their layout (batch, sequence and heads split as the rules say); keys should be whole along the
    sequence (``activation_kv_length``), so each device sees every key its queries may attend to. The three masks
    come from ``mask`` and may each be None (the kernel is then given None): the query-side segment ids are split
    like the first query, ``kv_valid`` and the key-side segment ids laid out as ``(activation_batch,
    activation_kv_length)``. ``out_specs``: ``shard_map``'s, matching what ``kernel`` returns (None for an output
    that is None).

    A device holding queries ``[start, start + local_q)`` of the sequence passes ``q_offset + start`` to its
    kernel, so its causal mask (and its query positions) are the global ones. ``extras``: more arrays, by the
    keyword the kernel takes them under, each ``(array, spec)`` (per-query document starts, per-head sinks).
    """
    q_offset = jnp.asarray(mask.q_offset, jnp.int32)
    masks = (mask.kv_valid, mask.query_segment_ids(queries[0][0].shape[1]), mask.segment_ids)
    extras = dict(extras or {})
    names = list(extras)
    arrays = [a for a, _ in (*queries, *keys)] + [extras[k][0] for k in names]
    mesh = ambient_mesh()
    if mesh is None:
        n = len(arrays) - len(names)
        return kernel(*arrays[:n], q_offset, *masks, **dict(zip(names, arrays[n:])), **kernel_kwargs)
    q_spec = queries[0][1]
    mask_specs = [activation_spec(_KEY_SIDE, masks[0].shape) if masks[0] is not None else None,
                  PartitionSpec(*q_spec[:2]) if masks[1] is not None else None,
                  activation_spec(_KEY_SIDE, masks[2].shape) if masks[2] is not None else None]
    present = [i for i, m in enumerate(masks) if m is not None]  # shard_map takes arrays, not None
    specs = ([s for _, s in (*queries, *keys)] + [extras[k][1] for k in names] + [PartitionSpec()]
             + [mask_specs[i] for i in present])
    args = [*arrays, q_offset] + [masks[i] for i in present]
    args = [shard_to_spec(a, s) for a, s in zip(args, specs)]
    length_axes = axes_tuple(q_spec[1])
    every_axis = tuple(dict.fromkeys(a for s in specs for e in s for a in axes_tuple(e)))
    n = len(arrays)
    n_tensors = n - len(names)

    def per_device(*local_args):
        tensors, offset, present_masks = local_args[:n], local_args[n], local_args[n + 1:]
        start = jax.lax.axis_index(length_axes) * tensors[0].shape[1] if length_axes else 0
        local_masks = [None, None, None]
        for i, m in zip(present, present_masks):
            local_masks[i] = m
        # Every input varies over every mesh axis in play, so the kernel's gradients (which do) have the
        # inputs' types; shard_map then sums the key gradients (and any extra's, e.g. sinks) over the devices
        # that shared them.
        tensors = [vary_over(a, every_axis) for a in tensors]
        local_masks = [vary_over(m, every_axis) for m in local_masks]
        return kernel(*tensors[:n_tensors], vary_over(offset + start, every_axis), *local_masks,
                      **dict(zip(names, tensors[n_tensors:])), **kernel_kwargs)

    return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs)(*args)


def vary_over(a: jax.Array | None, axes: tuple[str, ...]) -> jax.Array | None:
    """``a`` typed as varying over ``axes`` inside ``shard_map`` (those it does not vary over already)."""
    if a is None:
        return None
    missing = tuple(x for x in axes if x not in blockwise.varying_axes(a))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


class Attention(nnx.Module):
    """Multi-head attention with grouped key/value heads (MHA, GQA, MQA) and rope.

    ``num_kv_heads`` must divide ``num_heads`` (1 is multi-query attention); ``head_dim`` is free of
    ``features / num_heads``. ``use_bias`` adds biases to the q/k/v projections (HF ``attention_bias``; ``o_bias``
    defaults to the same), ``qk_norm`` RMS-normalizes each query and key head over ``head_dim`` before rope
    (HF ``q_norm``/``k_norm``). The softmax scale is ``head_dim ** -0.5`` unless given. ``attention_impl``
    picks the kernel (``ATTENTION_IMPLS``; see ``attention``). A layer's local attention: ``window`` (a sliding
    window of that many slots, itself included), ``chunk``, ``sinks=True`` (a learned logit per head, ``sinks
    [heads]``, initialized to 0) and ``softcap`` (see ``attention``); its decoding cache is then a ring of
    ``ring_slots(max_len, window, chunk)`` slots. ``rope`` (``ROPE_STYLES``): ``"half"`` rotates dim ``i`` with
    ``i + rot/2`` (the default), ``"pairs"`` rotates consecutive pairs ``(2i, 2i+1)`` in place in float32 (the last
    ``rot`` dims; transformers' complex-number rope), None skips rope (a NoPE layer: ``cos``/``sin`` are ignored and
    may be None). A family may replace ``q_norm`` / ``k_norm`` (modules on ``[b, s, heads, head_dim]``, applied
    before rope) or subclass to scale queries.

    Weights carry logical names: ``q_proj`` ``("embed", "heads", "kv")``, ``k_proj``/``v_proj``
    ``("embed", "kv_heads", "kv")``, ``o_proj`` ``("heads", "kv", "embed")``. The output comes back in the
    sharding ``x`` arrived with. ``decode`` runs new tokens against a ``KVCache`` layer slice.

    >>> attn = Attention(64, num_heads=8, num_kv_heads=2, head_dim=32, qk_norm=True, rngs=nnx.Rngs(0))
    >>> cos, sin = rope_cos_sin(jnp.arange(10)[None], rope_frequencies(32, 10000.0)[0])
    >>> attn(jnp.ones((2, 10, 64)), cos, sin, causal_mask(10)).shape
    (2, 10, 64)
    """

    def __init__(
        self,
        features: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        use_bias: bool = False,
        o_bias: bool | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        attention_impl: str = "auto",
        window: int | None = None,
        chunk: int | None = None,
        sinks: bool = False,
        softcap: float | None = None,
        rope: str | None = "half",
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        kernel_init: nnx.initializers.Initializer = DEFAULT_INIT,
        rngs: nnx.Rngs,
    ):
        if rope not in ROPE_STYLES:
            raise ValueError(f"rope must be one of {ROPE_STYLES}, got {rope!r}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must be a positive divisor of num_heads ({num_heads})")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (rope rotates pairs), got {head_dim}")
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention_impl {attention_impl!r}; choose one of {ATTENTION_IMPLS}")
        for name, size in (("window", window), ("chunk", chunk)):
            if size is not None and (not isinstance(size, int) or size < 1):
                raise ValueError(f"{name} must be a positive integer (slots) or None, got {size!r}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {softcap!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.attention_impl = attention_impl
        self.window, self.chunk = window, chunk
        self.rope = rope
        self.softcap = None if softcap is None else float(softcap)
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype), out_sharding=("heads",),
                               eager_sharding=False) if sinks else None
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        kw = dict(dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        self.q_proj = Linear(features, (num_heads, head_dim), kernel_names=("embed", "heads", "kv"),
                             use_bias=use_bias, **kw)
        self.k_proj = Linear(features, (num_kv_heads, head_dim), kernel_names=("embed", "kv_heads", "kv"),
                             use_bias=use_bias, **kw)
        self.v_proj = Linear(features, (num_kv_heads, head_dim), kernel_names=("embed", "kv_heads", "kv"),
                             use_bias=use_bias, **kw)
        self.o_proj = Linear((num_heads, head_dim), features, kernel_names=("heads", "kv", "embed"),
                             use_bias=use_bias if o_bias is None else o_bias, **kw)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None,
                 mask: AttentionMask | jax.Array | None) -> jax.Array:
        """``x [b, s, embed]``, rope ``cos/sin [b or 1, s, rot / 2]`` (``rot = head_dim`` unless partial rotary: then
        only each head's first ``rot`` dims rotate), ``mask`` (``causal_mask``; a dense
        boolean ``[b or 1, 1, s, s]`` or None runs the einsum path) -> ``[b, s, embed]``."""
        in_sharding = sharding_of(x)
        q, k, v = self.project(x, cos, sin)
        # Keys and values are gathered over the sequence (context parallelism keeps only queries split).
        out = self.attend(q, shard(k, _BKND), shard(v, _BKND), mask)
        return restore_sharding(self.o_proj(shard(out, _BLHD), _BLE), in_sharding)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask | jax.Array | None) -> jax.Array:
        """``attention`` with this layer's scale, kernel and local attention."""
        return attention(q, k, v, mask, self.scale, self.attention_impl, window=self.window, chunk=self.chunk,
                         sinks=None if self.sinks is None else self.sinks[...], softcap=self.softcap)

    def project(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(q [b, s, heads, head_dim], k, v [b, s, kv_heads, head_dim])``: q/k normed (``qk_norm``), then
        roped (``rope``: rotate-half, pairs in place, or none)."""
        q, k, v = self.q_proj(x, _BLHD), self.k_proj(x, _BLND), self.v_proj(x, _BLND)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is None:
            return q, k, v
        if self.rope == "pairs":
            return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin), v
        return apply_rope(q, cos, sin, interleaved=False), apply_rope(k, cos, sin, interleaved=False), v

    def decode(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None, k_cache: jax.Array,
               v_cache: jax.Array, start: jax.Array, mask: AttentionMask | jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention for ``t`` new tokens ``x [b, t, embed]`` against one layer's cache.

        The new keys and values are written into ``k_cache``/``v_cache [b, max_len, kv_heads, head_dim]`` at
        slots ``start .. start + t``, ``start`` being the cache's ``length`` before ``KVCache.advance``, which
        gives the rope positions behind ``cos``/``sin`` and ``mask`` (``q_offset = start``, the valid slots).
        A cache with fewer slots than ``mask`` covers is this layer's ring (a window or chunk layer; see
        ``nnx_zoo.layers.kv_cache``): the step attends to the ring's keys in slot order and the new ones, then
        stores the new ones in it. Returns ``(out [b, t, embed], k_cache, v_cache)``."""
        in_sharding = sharding_of(x)
        q, k, v = self.project(x, cos, sin)
        out, k_cache, v_cache = self.attend_cached(q, k, v, k_cache, v_cache, start, mask)
        return restore_sharding(self.o_proj(shard(out, _BLHD), _BLE), in_sharding), k_cache, v_cache

    def attend_cached(self, q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                      start: jax.Array, mask: AttentionMask) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(attention output, k_cache, v_cache)`` of new ``q, k, v`` against a layer's cache (a full one or a
        ring), the new keys and values stored in it."""
        slots = mask.kv_valid.shape[1]
        if k_cache.shape[1] >= slots:
            k_cache, v_cache = write_slots(k_cache, k, start), write_slots(v_cache, v, start)
            return self.attend(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask), k_cache, v_cache
        if self.window is None and self.chunk is None:
            raise ValueError(f"a cache of {k_cache.shape[1]} slots for a full-attention layer over {slots} slots; "
                             "only window or chunk layers keep a ring")
        keys, values = ring_keys(k_cache, k, start), ring_keys(v_cache, v, start)
        out = self.attend(q, keys.astype(q.dtype), values.astype(q.dtype),
                          ring_mask(mask, k_cache.shape[1], start, q.shape[1]))
        return out, write_ring(k_cache, k, start), write_ring(v_cache, v, start)
