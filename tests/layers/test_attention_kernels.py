"""The attention implementations behind ``attention`` against the einsum reference (``attention_impl="xla"``),
CPU, float32: values and gradients (q, k, v) of ``blockwise`` for MHA, GQA, MQA and MLA's 192/128 widths under
causal masking, left padding, packed ``segment_ids`` and a decode step against a partly filled cache, with tiles
that do not divide the lengths; the whole models (llama3-tiny, deepseek3-tiny) with ``attention_impl="blockwise"``
against ``"xla"``; the kernel under Explicit and Auto meshes (FSDP x TP, and queries split over the sequence);
and what ``auto`` picks per backend and shape (faked platforms).

Rows that see no key (left-padding queries) differ by convention (``xla``: the mean of the values; blockwise:
0): they are compared for finiteness only, and the gradient tests weight them by 0.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo import AutoConfig, AutoModelForCausalLM, Llama3Config
from nnx_zoo.layers import attention as attn_module
from nnx_zoo.layers import blockwise_attention, kernels
from nnx_zoo.layers.attention import (
    ATTENTION_IMPLS,
    AttentionFallbackWarning,
    AttentionMask,
    attention,
    choose_attention_impl,
    dot_product_attention,
)
from nnx_zoo.models.deepseek.config import DeepSeekV3Config
from nnx_zoo.sharding import make_mesh, named_sharding, use_rules

TOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ---------------------------------------------------------------------------------------------- kernel level
# (name, query heads, kv heads, qk width, v width)
HEADS = {"mha": (4, 4, 8, 8), "gqa": (6, 2, 8, 8), "mqa": (4, 1, 16, 16), "mla": (2, 2, 192, 128)}
# (name, q_len, k_len, q_offset, left pads per row, segment starts per row or None, cache slots written)
MASKS = {
    "causal": (11, 11, 0, None, None),
    "left_padding": (11, 11, 0, (0, 4), None),
    "segments": (11, 11, 0, (0, 2), ((0, 5, 8), (0, 6, 11))),  # left padding too in row 1
    "decode": (3, 13, 6, (0, 2), None),  # 3 new tokens at slots 6..8 of a 13-slot cache
}


def _case(heads: str, mask_case: str, seed: int = 0):
    h, n, dqk, dv = HEADS[heads]
    q_len, k_len, offset, pads, segments = MASKS[mask_case]
    rng = np.random.default_rng(seed)
    b = 2
    q = jnp.asarray(rng.normal(size=(b, q_len, h, dqk)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, k_len, n, dqk)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, k_len, n, dv)), jnp.float32)
    kv_valid = None
    if pads is not None:
        valid = np.arange(k_len)[None, :] >= np.asarray(pads)[:, None]
        if mask_case == "decode":
            valid &= np.arange(k_len)[None, :] < offset + q_len  # slots after the new tokens: never written
        kv_valid = jnp.asarray(valid)
    segment_ids = None
    if segments is not None:
        ids = np.zeros((b, k_len), np.int32)
        for row, starts in enumerate(segments):
            for start in starts:
                ids[row, start:] += 1
        segment_ids = jnp.asarray(ids)
    mask = AttentionMask(q_offset=offset if mask_case != "decode" else jnp.int32(offset), kv_valid=kv_valid,
                         segment_ids=segment_ids)
    # Rows that see at least one key: their own slot is valid (causal includes it).
    seen = np.asarray(mask.query_valid(q_len)) & np.ones((b, q_len), bool)
    return q, k, v, mask, seen


def _values_and_grads(impl: str, q, k, v, mask, seen, **blocks):
    weight = jnp.asarray(np.random.default_rng(9).normal(size=q.shape[:3] + (v.shape[-1],)), jnp.float32)
    weight = weight * jnp.asarray(seen)[:, :, None, None]  # rows without a key carry no gradient

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, mask, 0.37, impl, **blocks) * weight)

    def run(q, k, v):
        return attention(q, k, v, mask, 0.37, impl, **blocks), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(run)(q, k, v)


def _assert_close(got, want, seen):
    (out, grads), (ref, ref_grads) = got, want
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(np.asarray(out)[seen], np.asarray(ref)[seen]) < TOL
    for name, g, r in zip("qkv", grads, ref_grads):
        assert np.isfinite(np.asarray(g)).all(), name
        assert rel_err(g, r) < TOL, name


# GQA (the general case of the grouping) under every mask; the other head layouts under the masks that stress them.
KERNEL_CASES = [("gqa", m) for m in MASKS] + [("mha", "causal"), ("mha", "decode"), ("mqa", "left_padding"),
                                               ("mqa", "segments"), ("mla", "segments"), ("mla", "decode")]


@pytest.mark.parametrize(("heads", "mask_case"), KERNEL_CASES)
def test_blockwise_equals_xla(heads, mask_case):
    """Tiles of 4 queries x 3 keys: neither divides 11 or 13, and the causal bound skips whole key blocks."""
    q, k, v, mask, seen = _case(heads, mask_case)
    want = _values_and_grads("xla", q, k, v, mask, seen)
    got = _values_and_grads("blockwise", q, k, v, mask, seen, block_q=4, block_k=3)
    _assert_close(got, want, seen)
    if not seen.all():  # rows that see nothing: output 0 (the convention), finite
        assert not np.asarray(got[0])[~seen].any()


def test_blockwise_one_tile_and_masks_matter():
    """Default tiles (one tile here) agree too, and dropping the segment ids changes the answer (the test above
    would notice a kernel that ignored them)."""
    q, k, v, mask, seen = _case("gqa", "segments")
    want = _values_and_grads("xla", q, k, v, mask, seen)
    _assert_close(_values_and_grads("blockwise", q, k, v, mask, seen), want, seen)
    crossing = attention(q, k, v, mask._replace(segment_ids=None), 0.37, "blockwise")
    assert rel_err(np.asarray(crossing)[seen], np.asarray(want[0])[seen]) > 1e-2


def test_dense_mask_matches_the_rule():
    """``AttentionMask.dense`` is the documented rule, written out with loops."""
    _, _, _, mask, _ = _case("mha", "segments")
    dense = np.asarray(mask.dense(11, 11))
    valid, seg = np.asarray(mask.kv_valid), np.asarray(mask.segment_ids)
    want = np.zeros((2, 1, 11, 11), bool)
    for b in range(2):
        for i in range(11):
            for j in range(11):
                want[b, 0, i, j] = j <= i and valid[b, j] and seg[b, i] == seg[b, j]
    np.testing.assert_array_equal(dense, want)
    _, _, _, decode, _ = _case("mha", "decode")
    dense = np.asarray(decode.dense(3, 13))
    assert dense[0, 0, 0].tolist() == [True] * 7 + [False] * 6  # slot 6 sees slots 0..6
    assert dense[1, 0, 2].tolist() == [False] * 2 + [True] * 7 + [False] * 4  # pads 0..1, slot 8 sees 2..8


# ------------------------------------------------------------------------------------------------ whole models
def _model_inputs(vocab: int):
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(1, vocab, (2, 12)), jnp.int32)
    pad = jnp.asarray(np.arange(12)[None, :] >= np.array([[0], [3]]), jnp.int32)  # row 1 left-padded
    segments = jnp.asarray(np.arange(12)[None, :] >= np.array([[7], [8]]), jnp.int32)  # two documents a row
    return ids, pad, segments


@pytest.mark.parametrize("preset", ["llama3-tiny", "deepseek3-tiny"])
def test_model_blockwise_equals_xla(preset, monkeypatch):
    """Logits (real tokens) and every parameter's gradient of a loss over real tokens; tiles of 5 x 4 over 12."""
    monkeypatch.setattr(blockwise_attention, "DEFAULT_BLOCK_Q", 5)
    monkeypatch.setattr(blockwise_attention, "DEFAULT_BLOCK_K", 4)
    # One layer (deepseek: an MoE layer) keeps the compile short; every layer's attention is the same code.
    extra = {"first_k_dense_replace": 0, "num_nextn_predict_layers": 0} if "deep" in preset else {}
    config = AutoConfig.preset(preset, num_hidden_layers=1, **extra)
    ids, pad, segments = _model_inputs(config.vocab_size)
    real = np.asarray(pad).astype(bool)

    def run(impl):
        model = AutoModelForCausalLM.create(config.with_overrides(attention_impl=impl), seed=0)

        def loss(m):
            logits = m(ids, pad, segment_ids=segments)
            return jnp.sum(jnp.where(pad[..., None] > 0, logits, 0.0) ** 2) * 1e-3, logits

        (_, logits), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        return np.asarray(logits), jax.tree.leaves(grads)

    want_logits, want_grads = run("xla")
    got_logits, got_grads = run("blockwise")
    assert rel_err(got_logits[real], want_logits[real]) < TOL
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < TOL if np.linalg.norm(w) > 0 else not np.asarray(g).any()


# ------------------------------------------------------------------------------------------------ under a mesh
MESHES = [  # (mesh sizes, rules, mode): FSDP x TP (heads split), and queries split over the sequence
    ({"fsdp": 2, "tensor": 2}, "default", "explicit"),
    ({"fsdp": 2, "tensor": 2}, "default", "auto"),
    ({"fsdp": 2, "expert": 2}, "ep-as-cp", "explicit"),
    ({"fsdp": 2, "context": 2, "expert": 2}, "ep-as-cp", "auto"),  # the sequence over (context, expert): 4 parts
]


MESH_CASES = [(*m, "gqa") for m in MESHES] + [(*MESHES[2], "mla")]


@pytest.mark.parametrize(("sizes", "rules", "mode", "heads"), MESH_CASES, ids=lambda v: str(v).replace(" ", ""))
def test_blockwise_under_mesh_equals_one_device_xla(sizes, rules, mode, heads):
    """Left padding and segments, sequence 16 (divisible by 4 context parts), tiles 3 x 5: values, gradients and
    the output's layout (that of the einsum path on the same mesh)."""
    h, n, dqk, dv = HEADS[heads]
    h, n = (4, 2) if heads == "gqa" else (4, 4)  # heads divisible by tensor=2
    rng = np.random.default_rng(5)
    b, s = 4, 16
    q = jnp.asarray(rng.normal(size=(b, s, h, dqk)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, n, dqk)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, n, dv)), jnp.float32)
    pad = np.arange(s)[None, :] >= np.array([[0], [3], [0], [6]])
    seg = (np.arange(s)[None, :] >= np.array([[9], [4], [12], [7]])).astype(np.int32)
    weight = jnp.asarray(rng.normal(size=(b, s, h, dv)) * pad[:, :, None, None], jnp.float32)

    def run(impl, q, k, v, pad, seg):
        mask = AttentionMask.causal(s, pad, seg)

        def loss(q, k, v):
            return jnp.sum(attention(q, k, v, mask, 0.2, impl, block_q=3, block_k=5) * weight)

        return attention(q, k, v, mask, 0.2, impl, block_q=3, block_k=5), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    want = jax.jit(run, static_argnums=0)("xla", q, k, v, jnp.asarray(pad), jnp.asarray(seg))
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:math.prod(sizes.values())])
    with jax.set_mesh(mesh), use_rules(rules):
        qkv_sharding = named_sharding(("activation_batch", "activation_length", "activation_heads", None), rules,
                                      mesh)
        # Keys and values whole along the sequence, as the attention modules hand them over.
        kv_sharding = named_sharding(("activation_batch", "activation_kv_length", "activation_kv_heads", None),
                                     rules, mesh)
        side = named_sharding(("activation_batch", "activation_length"), rules, mesh)
        assert (side.spec[1] is not None) == (rules == "ep-as-cp")  # queries split over the sequence
        args = (jax.device_put(q, qkv_sharding), jax.device_put(k, kv_sharding), jax.device_put(v, kv_sharding),
                jax.device_put(jnp.asarray(pad), side), jax.device_put(jnp.asarray(seg), side))
        got = jax.jit(run, static_argnums=0)("blockwise", *args)
        if mode == "explicit":
            ref_layout = jax.jit(run, static_argnums=0).eval_shape("xla", *args)[0].sharding
            assert jax.typeof(got[0]).sharding.spec == ref_layout.spec
    _assert_close(got, want, pad)


def test_decode_under_mesh():
    """A decode step (traced cache offset) under FSDP x TP, Explicit: blockwise equals the one-device einsum."""
    q, k, v, mask, seen = _case("gqa", "decode")
    q = jnp.concatenate([q, q[::-1]])  # batch 4: divisible by fsdp=2
    k, v = jnp.concatenate([k, k[::-1]]), jnp.concatenate([v, v[::-1]])
    mask = mask._replace(kv_valid=jnp.concatenate([mask.kv_valid, mask.kv_valid[::-1]]))
    seen = np.concatenate([seen, seen[::-1]])
    want = _values_and_grads("xla", q, k, v, mask, seen)
    mesh = make_mesh({"fsdp": 2, "tensor": 2}, shard_mode="explicit", devices=jax.devices()[:4])
    with jax.set_mesh(mesh), use_rules("default"):
        q = jax.device_put(q, NamedSharding(mesh, P("fsdp", None, "tensor", None)))
        got = _values_and_grads("blockwise", q, k, v, mask, seen, block_q=2, block_k=4)
    _assert_close(got, want, seen)


# -------------------------------------------------------------------------------------------------- the chooser
@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(kernels, "_WARNED", set())


def _pick(requested, platform, *, tokamax: bool, monkeypatch, **kw):
    monkeypatch.setattr(attn_module, "tokamax_available", lambda: tokamax)
    defaults = dict(q_len=2048, k_len=2048)
    return choose_attention_impl(requested, platform=platform, **{**defaults, **kw})


AUTO_CASES = [  # (platform, tokamax installed, shape/mask keywords, expected)
    ("cpu", False, dict(q_len=128, k_len=128), "xla"),
    ("cpu", False, dict(q_len=512, k_len=512), "xla"),
    ("cpu", False, dict(q_len=1024, k_len=1024), "blockwise"),
    ("cpu", True, dict(q_len=4096, k_len=4096), "blockwise"),
    ("cpu", False, dict(q_len=8192, k_len=8192, segments=True), "blockwise"),
    ("cpu", False, dict(q_len=1, k_len=8192, padding=True), "xla"),  # decoding: one score row
    ("gpu", False, dict(), "cudnn"),
    ("gpu", True, dict(), "cudnn"),
    ("gpu", False, dict(qk_dim=192, v_dim=128), "cudnn"),  # MLA: values zero-padded to 192
    ("gpu", False, dict(segments=True), "blockwise"),
    ("gpu", True, dict(padding=True), "blockwise"),
    ("gpu", True, dict(qk_dim=512, v_dim=512), "tokamax"),  # beyond cuDNN's head dim
    ("gpu", False, dict(qk_dim=512, v_dim=512), "blockwise"),
    ("gpu", False, dict(q_len=1, k_len=4096, padding=True), "xla"),
    ("tpu", True, dict(), "tokamax"),
    ("tpu", False, dict(), "blockwise"),
    ("tpu", True, dict(segments=True), "blockwise"),
    ("cuda", False, dict(), "cudnn"),  # a platform name JAX may report for NVIDIA GPUs
]


@pytest.mark.parametrize(("platform", "tokamax", "kw", "expected"), AUTO_CASES, ids=str)
def test_auto_picks_by_backend_and_shape(platform, tokamax, kw, expected, monkeypatch, fresh_warnings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AttentionFallbackWarning)  # "tokamax is not installed" is expected
        assert _pick("auto", platform, tokamax=tokamax, monkeypatch=monkeypatch, **kw) == expected


def test_explicit_requests(monkeypatch, fresh_warnings):
    for impl in ("xla", "blockwise"):  # always served as asked
        assert _pick(impl, "tpu", tokamax=False, monkeypatch=monkeypatch, segments=True) == impl
    assert _pick("cudnn", "gpu", tokamax=False, monkeypatch=monkeypatch) == "cudnn"
    assert _pick("tokamax", "gpu", tokamax=True, monkeypatch=monkeypatch) == "tokamax"
    falls_back = [
        (dict(requested="cudnn", platform="cpu"), "cudnn.*runs on NVIDIA GPUs only.*using 'blockwise'"),
        (dict(requested="cudnn", platform="gpu", segments=True), "cudnn.*packed documents.*using 'blockwise'"),
        (dict(requested="cudnn", platform="gpu", padding=True), "cudnn.*padding.*using 'blockwise'"),
        (dict(requested="tokamax", platform="gpu"), "tokamax is not installed.*using 'blockwise'"),
    ]
    for kw, message in falls_back:
        requested, platform = kw.pop("requested"), kw.pop("platform")
        with pytest.warns(AttentionFallbackWarning, match=message):
            assert _pick(requested, platform, tokamax=False, monkeypatch=monkeypatch, **kw) == "blockwise"
    with pytest.raises(ValueError, match="unknown attention_impl 'flash'; choose one of"):
        choose_attention_impl("flash", q_len=8, k_len=8)


def test_explicit_cudnn_on_cpu_runs_the_portable_path(fresh_warnings):
    """Asked for cudnn here (CPU): one warning line, and the same numbers as the reference."""
    q, k, v, mask, seen = _case("gqa", "causal")
    with pytest.warns(AttentionFallbackWarning, match="cudnn"):
        got = attention(q, k, v, mask, 0.37, "cudnn")
    np.testing.assert_allclose(got, dot_product_attention(q, k, v, mask, 0.37), rtol=1e-5, atol=1e-6)


def test_config_validates_attention_impl():
    assert ATTENTION_IMPLS == ("auto", "xla", "blockwise", "cudnn", "tokamax")
    for cls in (Llama3Config, DeepSeekV3Config):
        with pytest.raises(ValueError, match=r"attention_impl must be one of \('auto', 'xla', 'blockwise'"):
            cls.preset("llama3-tiny" if cls is Llama3Config else "deepseek3-tiny", attention_impl="flash")
    config = DeepSeekV3Config.preset("deepseek3-tiny")
    assert config.attention_head_dims == (config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
