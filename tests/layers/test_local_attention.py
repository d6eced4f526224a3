"""Local attention through the one dispatcher (``attention``), CPU, float32: sliding windows, chunks, per-head sinks
and logit soft-capping.

- The einsum path (``xla``, the reference) against the rules written out with loops in numpy: which keys each
  query sees (window in slots, chunks from each document's first real token), and the softmax with a sink column
  and capped scores.
- ``blockwise`` against ``xla``: values and gradients (q, k, v, sinks) at 1e-5 under causal masking, left padding,
  packed documents and a decode step against a partly filled cache, with tiles small enough that windows and
  chunks skip whole key blocks on both sides; and under meshes, queries split over the sequence (a window's keys
  living on the previous shard).
- The key-block bounds: a window-``w`` query block visits at most ``ceil((w - 1 + bq) / bk) + 1`` key blocks.
- The chooser: cuDNN runs windows only, tokamax windows and soft-capping; anything else falls back with one line.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.layers import blockwise_attention as bw
from nnx_zoo.layers import kernels
from nnx_zoo.layers.attention import AttentionFallbackWarning, AttentionMask, attention, dot_product_attention
from nnx_zoo.sharding import make_mesh, named_sharding, use_rules
from tests.layers.test_attention_kernels import _case, _pick, rel_err

TOL = 1e-5
SCALE = 0.37

# name -> the keywords of one layer's local attention (sinks filled in per head count)
FEATURES = {
    "window": dict(window=4),
    "chunk": dict(chunk=3),
    "window-sinks": dict(window=3, sinks=True),
    "chunk-softcap-sinks": dict(chunk=4, softcap=2.0, sinks=True),
    "window-softcap": dict(window=6, softcap=1.5),
}


def _local(features: str, heads: int) -> dict:
    kw = dict(FEATURES[features])
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(np.random.default_rng(3).normal(size=(heads,)) * 2, jnp.float32)
    return kw


def _values_and_grads(impl, q, k, v, mask, seen, local, **blocks):
    weight = jnp.asarray(np.random.default_rng(9).normal(size=q.shape[:3] + (v.shape[-1],)), jnp.float32)
    weight = weight * jnp.asarray(seen)[:, :, None, None]
    sinks = local.pop("sinks", None)

    def out(q, k, v, sinks):
        return attention(q, k, v, mask, SCALE, impl, sinks=sinks, **local, **blocks)

    def loss(q, k, v, sinks):
        return jnp.sum(out(q, k, v, sinks) * weight)

    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    return jax.jit(lambda *a: (out(*a), jax.grad(loss, argnums=argnums)(*a)))(q, k, v, sinks)


def _assert_close(got, want, seen):
    (out, grads), (ref, ref_grads) = got, want
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(np.asarray(out)[seen], np.asarray(ref)[seen]) < TOL
    for name, g, r in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        assert np.isfinite(np.asarray(g)).all(), name
        assert rel_err(g, r) < TOL, name


# ---------------------------------------------------------------------------------------------- the reference
def _doc_starts(valid: np.ndarray, seg: np.ndarray | None) -> np.ndarray:
    """Each slot's document start, by walking back from it (the rule in words, not a cummax)."""
    b, k = valid.shape
    out = np.zeros((b, k), np.int64)
    for r in range(b):
        for i in range(k):
            j = i
            while j > 0 and valid[r, j - 1] and (seg is None or seg[r, j - 1] == seg[r, i]):
                j -= 1
            out[r, i] = j
    return out


@pytest.mark.parametrize("mask_case", ["left_padding", "segments", "decode"])
def test_dense_local_mask_and_softmax_match_the_rules(mask_case):
    """The einsum path's mask for window 4 and chunk 3, and its softmax with sinks and soft-capping, against
    loops over the definitions."""
    q, k, v, mask, seen = _case("mha", mask_case)
    q_len, k_len = q.shape[1], k.shape[1]
    offset = int(mask.q_offset)
    valid = np.asarray(mask.kv_valid) if mask.kv_valid is not None else np.ones((2, k_len), bool)
    seg = np.asarray(mask.segment_ids) if mask.segment_ids is not None else None
    starts = _doc_starts(valid, seg)
    for window, chunk in ((4, None), (None, 3)):
        dense = np.asarray(mask.dense(q_len, k_len, window=window, chunk=chunk))
        want = np.zeros_like(dense)
        for b in range(2):
            for i in range(q_len):
                slot = offset + i
                for j in range(k_len):
                    ok = j <= slot and valid[b, j] and (seg is None or seg[b, slot] == seg[b, j])
                    if window is not None:
                        ok = ok and slot - j < window
                    if chunk is not None:  # same chunk, counted from the document's first real token
                        ok = ok and (slot - starts[b, slot]) // chunk == (j - starts[b, slot]) // chunk
                    want[b, 0, i, j] = ok
        np.testing.assert_array_equal(dense, want, err_msg=f"window={window} chunk={chunk}")
        assert dense.sum() < np.asarray(mask.dense(q_len, k_len)).sum()  # the rule hides keys here
    sinks = np.random.default_rng(1).normal(size=(q.shape[2],))
    got = np.asarray(dot_product_attention(q, k, v, mask, SCALE, window=4, sinks=jnp.asarray(sinks), softcap=1.5))
    dense = np.asarray(mask.dense(q_len, k_len, window=4))[:, 0]
    s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), np.asarray(k, np.float64)) * SCALE
    s = 1.5 * np.tanh(s / 1.5)
    e = np.where(dense[:, None], np.exp(s), 0.0)
    p = e / (e.sum(-1, keepdims=True) + np.exp(sinks)[None, :, None, None])
    want = np.einsum("bhqk,bkhd->bqhd", p, np.asarray(v, np.float64))
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- blockwise vs the einsum
LOCAL_CASES = [(m, f) for m in ("causal", "left_padding", "segments", "decode")
               for f in ("window-sinks", "chunk-softcap-sinks")] + [
    ("causal", "window"), ("segments", "chunk"), ("decode", "window-softcap")]


@pytest.mark.parametrize(("mask_case", "features"), LOCAL_CASES)
def test_blockwise_local_equals_xla(mask_case, features):
    """GQA, tiles of 2 queries x 3 keys (neither divides 11 or 13): windows and chunks skip key blocks before a
    query block as the causal bound skips those after it."""
    q, k, v, mask, seen = _case("gqa", mask_case)
    want = _values_and_grads("xla", q, k, v, mask, seen, _local(features, q.shape[2]))
    got = _values_and_grads("blockwise", q, k, v, mask, seen, _local(features, q.shape[2]), block_q=2, block_k=3)
    _assert_close(got, want, seen)
    plain = attention(q, k, v, mask, SCALE, "blockwise", block_q=2, block_k=3)
    assert rel_err(np.asarray(plain)[seen], np.asarray(want[0])[seen]) > 1e-2  # the local rule mattered


def test_window_visits_only_the_blocks_it_needs():
    """A query block of ``bq`` rows with window ``w`` visits the key blocks holding slots ``start - w + 1 ..
    start + bq - 1``: at most ``ceil((w - 1 + bq) / bk) + 1``, whatever the sequence length."""
    rule = bw._Rule(1.0, 64, 64, 256, None, None)
    nk = 4096 // 64
    visits = []
    for i in range(4096 // 64):
        first, stop = bw._key_blocks_to_visit(rule, jnp.int32(0), jnp.int32(i * 64), nk, None)
        visits.append(int(stop) - int(first))
    assert max(visits) <= math.ceil((256 - 1 + 64) / 64) + 1 == 6
    assert sum(visits) < nk * nk / 8  # not the causal triangle (nk^2 / 2)
    chunked = bw._Rule(1.0, 64, 64, None, 512, None)
    starts = jnp.zeros((1, 64), jnp.int32)
    first, stop = bw._key_blocks_to_visit(chunked, jnp.int32(0), jnp.int32(1536), nk, starts)
    assert (int(first), int(stop)) == (1536 // 64, 1536 // 64 + 1)  # its chunk starts at its first row


# ------------------------------------------------------------------------------------------------ under a mesh
MESHES = [({"fsdp": 2, "tensor": 2}, "default", "explicit"), ({"fsdp": 2, "expert": 2}, "ep-as-cp", "explicit"),
          ({"fsdp": 2, "context": 2, "expert": 2}, "ep-as-cp", "auto")]


@pytest.mark.parametrize(("sizes", "rules", "mode"), MESHES, ids=lambda v: str(v).replace(" ", ""))
def test_blockwise_local_under_mesh_equals_one_device_xla(sizes, rules, mode):
    """Sequence 16 over up to 4 context parts, window 6 (a query's keys on the previous shard), chunk 5 on the
    other call, sinks on both, left padding and segments: values and gradients equal the one-device einsum."""
    rng = np.random.default_rng(5)
    b, s, h, n, d = 4, 16, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    pad = np.arange(s)[None, :] >= np.array([[0], [3], [0], [6]])
    seg = (np.arange(s)[None, :] >= np.array([[9], [4], [12], [7]])).astype(np.int32)
    weight = jnp.asarray(rng.normal(size=(b, s, h, d)) * pad[:, :, None, None], jnp.float32)

    def run(impl, q, k, v, sinks, pad, seg):
        mask = AttentionMask.causal(s, pad, seg)

        def out(q, k, v, sinks):
            a = attention(q, k, v, mask, 0.2, impl, block_q=3, block_k=2, window=6, sinks=sinks)
            return a + attention(q, k, v, mask, 0.2, impl, block_q=3, block_k=2, chunk=5, sinks=sinks)

        grads = jax.grad(lambda *a: jnp.sum(out(*a) * weight), argnums=(0, 1, 2, 3))(q, k, v, sinks)
        return out(q, k, v, sinks), grads

    want = jax.jit(run, static_argnums=0)("xla", q, k, v, sinks, jnp.asarray(pad), jnp.asarray(seg))
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:math.prod(sizes.values())])
    with jax.set_mesh(mesh), use_rules(rules):
        qkv = named_sharding(("activation_batch", "activation_length", "activation_heads", None), rules, mesh)
        kv = named_sharding(("activation_batch", "activation_kv_length", "activation_kv_heads", None), rules, mesh)
        side = named_sharding(("activation_batch", "activation_length"), rules, mesh)
        args = (jax.device_put(q, qkv), jax.device_put(k, kv), jax.device_put(v, kv), sinks,
                jax.device_put(jnp.asarray(pad), side), jax.device_put(jnp.asarray(seg), side))
        got = jax.jit(run, static_argnums=0)("blockwise", *args)
    _assert_close(got, want, pad)


def test_chunk_without_padding_under_an_explicit_mesh():
    """A chunked call with no padding or segments (one row of chunk starts for the whole batch) on an Explicit mesh
    that splits the batch: the einsum path's mask keeps that row whole and equals one device."""
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.normal(size=(4, 8, 2, 8)), jnp.float32) for _ in range(3))
    want = dot_product_attention(q, k, v, AttentionMask.causal(8), SCALE, chunk=3)
    mesh = make_mesh({"fsdp": 2}, shard_mode="explicit", devices=jax.devices()[:2])
    with jax.set_mesh(mesh), use_rules("default"):
        spec = named_sharding(("activation_batch", None, None, None), "default", mesh)
        got = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, AttentionMask.causal(8), SCALE, chunk=3))(
            *(jax.device_put(a, spec) for a in (q, k, v)))
    assert rel_err(np.asarray(got), np.asarray(want)) < TOL


# -------------------------------------------------------------------------------------------------- the chooser
@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(kernels, "_WARNED", set())


def test_kernels_serve_the_features_they_have(monkeypatch, fresh_warnings):
    assert _pick("auto", "gpu", tokamax=False, monkeypatch=monkeypatch, features=("window",)) == "cudnn"
    assert _pick("auto", "gpu", tokamax=True, monkeypatch=monkeypatch, features=("window", "softcap")) == "tokamax"
    assert _pick("tokamax", "tpu", tokamax=True, monkeypatch=monkeypatch, features=("window",)) == "tokamax"
    for requested, features, reason in (("cudnn", ("sinks",), "sinks"), ("cudnn", ("window", "softcap"), "softcap"),
                                        ("tokamax", ("chunk",), "chunk"), ("tokamax", ("sinks",), "sinks")):
        with pytest.warns(AttentionFallbackWarning, match=f"{requested}.*local attention with {reason}.*blockwise"):
            assert _pick(requested, "gpu", tokamax=True, monkeypatch=monkeypatch, features=features) == "blockwise"
    with warnings.catch_warnings(record=True) as caught:  # auto: one line, once
        warnings.simplefilter("always")
        for _ in range(3):
            assert _pick("auto", "gpu", tokamax=True, monkeypatch=monkeypatch, features=("sinks",)) == "blockwise"
    assert len([w for w in caught if "sinks" in str(w.message)]) == 1
    with pytest.raises(ValueError, match="unknown local-attention features"):
        _pick("auto", "gpu", tokamax=True, monkeypatch=monkeypatch, features=("alibi",))


# ------------------------------------------------------------------------------------------- the ring caches
@pytest.mark.parametrize("local", [dict(window=5, sinks=True), dict(chunk=4, softcap=3.0)], ids=str)
def test_ring_cache_decode_equals_full_forward(local):
    """A window-5 (or chunk-4) layer decoding from a ring of 4 (3) slots: a left-padded prompt longer than the
    ring, then steps of 1, 2 and 3 tokens that wrap around it; every real token's output equals the uncached
    forward's, and the ring holds the last slots' keys at ``slot % ring``."""
    from flax import nnx

    from nnx_zoo.layers import Attention, KVCache
    from nnx_zoo.layers.kv_cache import empty_slots, ring_slots
    from tests.layers.test_attention import _extend, _forward

    attn = Attention(32, num_heads=4, num_kv_heads=2, head_dim=16, kernel_init=nnx.initializers.normal(0.3),
                     rngs=nnx.Rngs(0), **local)
    if attn.sinks is not None:
        attn.sinks[...] = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    seq = 16
    mask = (np.arange(seq)[None, :] >= np.array([[0], [4], [9]])).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, seq, 32)), jnp.float32)
    mask = jnp.asarray(mask)
    full = _forward(attn, x, jnp.asarray(positions), mask)
    size = ring_slots(seq + 3, attn.window, attn.chunk)
    assert size == (local.get("window") or local.get("chunk")) - 1
    cache = KVCache(k=jnp.zeros((1, x.shape[0], size, 2, 16)), v=jnp.zeros((1, x.shape[0], size, 2, 16)),
                    **empty_slots(x.shape[0], seq + 3))
    outs, lo = [], 0
    for step in (6, 1, 2, 3, 1, 2, 1):
        out, _, cache = _extend(attn, x[:, lo:lo + step], mask[:, lo:lo + step], cache)
        outs.append(out)
        lo += step
    assert lo == seq
    real = np.asarray(mask).astype(bool)
    assert rel_err(np.asarray(jnp.concatenate(outs, axis=1))[real], np.asarray(full)[real]) < 1e-5
    k_full = np.asarray(attn.project(x, *_rope_of(attn, positions))[1])
    for slot in range(seq - size, seq):
        rows = real[:, slot]
        np.testing.assert_allclose(np.asarray(cache.k[0, :, slot % size])[rows], k_full[rows, slot], rtol=1e-5,
                                   atol=1e-6)


def _rope_of(attn, positions):
    from tests.layers.test_attention import _rope

    return _rope(attn.head_dim, jnp.asarray(positions))


def test_kernel_choices_name_the_local_layers_kernel(monkeypatch, fresh_warnings):
    """A model whose full layers run cuDNN and whose sliding layers carry sinks (cuDNN has none): the report names
    both (GPT-OSS's shape), and a window alone keeps cuDNN."""
    from nnx_zoo.layers import attention as attn_module
    from nnx_zoo.layers.kernel_choices import kernel_choices
    from nnx_zoo.models.decoder_config import LayerKind

    monkeypatch.setattr(attn_module, "tokamax_available", lambda: False)

    class Config:
        attention_impl, attention_head_dims = "auto", (64, 64)

        def __init__(self, sliding: dict):
            self.sliding = sliding

        def layer_kinds(self):
            return (LayerKind("sliding"), LayerKind())

        def attention_options(self, kind):
            return self.sliding if kind.attention == "sliding" else {}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AttentionFallbackWarning)
        assert kernel_choices(Config(dict(window=128, sinks=True)), seq_len=4096, platform="gpu") == {
            "attention": "cudnn", "attention_sliding": "blockwise"}
        assert kernel_choices(Config(dict(window=128)), seq_len=4096, platform="gpu") == {"attention": "cudnn"}
