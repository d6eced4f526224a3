"""``grouped_matmul``: the tiled path against ``jax.lax.ragged_dot`` (values and both gradients), the dispatcher
on faked platforms and packages, its memory (no ``[groups, rows, ...]`` expansion), and the MoE ``gmm`` path built
on it against ``dense``: ``RoutedExperts`` and the whole DeepSeek model, on one device and under meshes.

float32 on CPU; values and gradients within 1e-5 relative (the test session runs matmuls at "highest" precision).
"""

from __future__ import annotations

import functools
import re
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.layers import RoutedExperts, kernels
from nnx_zoo.layers import attention as attn_module
from nnx_zoo.layers import grouped_matmul as gm_module
from nnx_zoo.layers.grouped_matmul import choose_grouped_matmul_impl, default_tile, grouped_matmul
from nnx_zoo.sharding import get_rules, logical_to_mesh_axes, make_mesh, state_shardings

RTOL, ATOL = 1e-5, 1e-6
K, N = 6, 5


def _operands(m: int, groups: int, seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (m, K)), jax.random.normal(kw, (groups, K, N))


def _value_and_grads(impl, tile=None, chunk=None):
    """jit of (sum(sin(out)), d/d lhs, d/d rhs): a cotangent that differs per element."""
    def loss(lhs, rhs, sizes):
        if impl == "reference":
            out = jax.lax.ragged_dot(lhs, rhs, sizes)
        else:
            out = grouped_matmul(lhs, rhs, sizes, impl=impl, tile=tile, chunk=chunk)
        return jnp.sum(jnp.sin(out) * jnp.arange(1, out.shape[1] + 1)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _assert_same(got, want):
    """Each array within 1e-5 relative of the reference, element-wise; entries that cancel to near zero (a
    gradient's sum over ``n`` terms) are held to 1e-5 of the array's largest entry instead: their float32 rounding
    is relative to the terms summed, not to the result."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=max(ATOL, RTOL * float(np.max(np.abs(w), initial=0))))


# (group sizes, rows m, tile, chunk): None = the defaults
CASES = {
    "uneven-with-empty-groups": ([3, 0, 5, 2], 10, 4, None),
    "one-group-holds-all-rows": ([0, 0, 13, 0], 13, 4, None),
    "tile-does-not-divide-groups": ([7, 9, 0, 13], 29, 8, None),
    "m-smaller-than-a-tile": ([1, 2], 3, 8, None),
    "rows-past-the-groups-are-zero": ([2, 3, 1], 9, 4, None),
    "all-groups-empty": ([0, 0, 0], 4, 8, None),
    "several-scan-chunks": ([7, 9, 0, 13], 29, 4, 3),
    "one-tile-per-chunk": ([3, 0, 5, 2], 10, 2, 1),
    "default-tile-and-chunk": ([40, 0, 25, 31, 0, 32], 128, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiled_equals_ragged_dot_values_and_gradients(case):
    sizes, m, tile, chunk = CASES[case]
    lhs, rhs = _operands(m, len(sizes))
    sizes = jnp.asarray(sizes, jnp.int32)
    got = _value_and_grads("tiled", tile, chunk)(lhs, rhs, sizes)
    want = _value_and_grads("reference")(lhs, rhs, sizes)
    _assert_same(got, want)
    if int(sizes.sum()) < m:  # rows past the last group: zero output, zero gradient
        assert not np.any(got[0][1][int(sizes.sum()):]) and not np.any(got[1][0][int(sizes.sum()):])


_M, _G = 24, 5
_random_case = (_value_and_grads("tiled", tile=4, chunk=2), _value_and_grads("reference"))  # one compile each


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, _M), min_size=_G, max_size=_G))
def test_tiled_equals_ragged_dot_for_random_group_sizes(cuts):
    sizes = np.diff([0, *sorted(cuts)])  # sums to max(cuts) <= _M: empty groups, one group with every row, ...
    lhs, rhs = _operands(_M, _G, seed=1)
    tiled, reference = _random_case
    _assert_same(tiled(lhs, rhs, jnp.asarray(sizes, jnp.int32)), reference(lhs, rhs, jnp.asarray(sizes, jnp.int32)))


def _out_and_cotangents(f, lhs, rhs, cotangent):
    """(f(lhs, rhs), d/d lhs, d/d rhs) for the output cotangent ``cotangent``, jitted."""
    def run(a, b, ct):
        out, vjp = jax.vjp(f, a, b)
        return (out, *vjp(ct))

    return jax.jit(run)(lhs, rhs, cotangent)


def test_bfloat16_accumulates_in_float32():
    """bf16 operands: the output and both gradients are the float32 products of the same bf16 values, rounded
    once to bf16 (tolerance: one bf16 rounding, 2^-8 relative, doubled for accumulation order)."""
    lhs, rhs = _operands(40, 3)
    lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    sizes = jnp.array([17, 0, 23], jnp.int32)
    cotangent = jax.random.normal(jax.random.key(3), (40, N)).astype(jnp.bfloat16)
    got = _out_and_cotangents(lambda a, b: grouped_matmul(a, b, sizes, impl="tiled", tile=8), lhs, rhs, cotangent)
    want = _out_and_cotangents(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs.astype(jnp.float32),
                               rhs.astype(jnp.float32), cotangent.astype(jnp.float32))
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=2**-7, atol=2**-7 * float(np.abs(w).max()))
    out = grouped_matmul(lhs, rhs, sizes, impl="tiled", preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32


@pytest.mark.parametrize("impl", ["tiled", "xla"])
def test_float32_weights_with_bfloat16_rows_compute_in_bfloat16(impl):
    """float32 master weights, bfloat16 activations: the product is the one of the weights cast to bfloat16 (the
    tiled path casts chunk by chunk), the output is bfloat16, the weights' gradient float32."""
    lhs, rhs = _operands(40, 3)
    lhs = lhs.astype(jnp.bfloat16)
    sizes = jnp.array([17, 0, 23], jnp.int32)
    cotangent = jax.random.normal(jax.random.key(3), (40, N)).astype(jnp.bfloat16)
    got = _out_and_cotangents(lambda a, b: grouped_matmul(a, b, sizes, impl=impl, tile=8, chunk=2), lhs, rhs,
                              cotangent)
    want = _out_and_cotangents(lambda a, b: jax.lax.ragged_dot(a, b.astype(jnp.bfloat16), sizes), lhs, rhs,
                               cotangent)
    assert got[0].dtype == jnp.bfloat16 and got[2].dtype == jnp.float32
    for g, w in zip(got, want):
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=2**-7, atol=2**-7 * float(np.abs(w).max()))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int64, jnp.uint8])
def test_group_sizes_take_any_integer_type_and_get_no_gradient(dtype):
    lhs, rhs = _operands(6, 2)
    sizes = np.array([4, 2]).astype(dtype)

    def f(lhs, rhs, sizes):
        return jnp.sum(grouped_matmul(lhs, rhs, sizes, impl="tiled"))

    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2), allow_int=True))(lhs, rhs, sizes)
    assert grads[2].dtype == jax.dtypes.float0
    with pytest.raises(TypeError, match="integers"):
        grouped_matmul(lhs, rhs, sizes.astype(np.float32), impl="tiled")


def test_default_tile():
    assert default_tile(12288, 64) == 64  # DeepSeek-V2-Lite shapes at 1 x 2048, top-6 of 64 experts
    assert default_tile(1024, 16) == 32
    assert default_tile(10, 16) == 8 and default_tile(10**6, 8) == 128


def test_tiled_never_expands_to_groups_times_rows():
    """XLA's temp memory of the forward+backward at 64 groups: ragged_dot's masked expansion holds [g, m, k]
    arrays (64 x 2048 x 256 floats = 128 MiB each); the tiled path stays within a few rows-sized buffers."""
    m, k, n, g = 2048, 256, 256, 64
    args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((g, k, n), jnp.float32),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    temp = {impl: _value_and_grads(impl).lower(*args).compile().memory_analysis().temp_size_in_bytes
            for impl in ("tiled", "reference")}
    rows_bytes = m * max(k, n) * 4
    weight_bytes = g * k * n * 4
    assert temp["reference"] > g * rows_bytes  # the expansion this path exists to avoid
    assert temp["tiled"] <= 6 * rows_bytes + 2 * weight_bytes, temp


# ---------------------------------------------------------------------------------------------- the dispatcher
@pytest.fixture
def no_tokamax(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)  # import tokamax -> ImportError


@pytest.fixture
def fake_tokamax(monkeypatch):
    """A tokamax whose ragged_dot records its calls and computes with jax.lax.ragged_dot."""
    calls = []

    def ragged_dot(lhs, rhs, group_sizes, **kwargs):
        calls.append(kwargs)
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, **kwargs)

    monkeypatch.setitem(sys.modules, "tokamax", types.SimpleNamespace(ragged_dot=ragged_dot))
    return calls


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(kernels, "_WARNED", set())


@pytest.mark.parametrize(("platform", "tokamax", "pallas", "want"), [
    ("cpu", True, True, "tiled"),
    ("cpu", False, False, "tiled"),
    ("gpu", True, True, "tokamax"),
    ("cuda", True, False, "tokamax"),
    ("gpu", False, True, "pallas_triton"),
    ("gpu", False, False, "tiled"),
    ("tpu", True, False, "tokamax"),
    ("tpu", False, False, "xla"),
])
def test_auto_picks_per_platform(platform, tokamax, pallas, want, request, monkeypatch):
    request.getfixturevalue("fake_tokamax" if tokamax else "no_tokamax")
    monkeypatch.setattr(gm_module, "_pallas_triton_available", lambda: pallas)
    assert choose_grouped_matmul_impl("auto", platform) == want


def test_named_impls_are_kept_where_they_run(fake_tokamax, monkeypatch):
    monkeypatch.setattr(gm_module, "_pallas_triton_available", lambda: True)
    for impl in ("tiled", "xla", "tokamax"):
        assert choose_grouped_matmul_impl(impl, "cpu") == impl
    assert choose_grouped_matmul_impl("pallas_triton", "gpu") == "pallas_triton"
    with pytest.raises(ValueError, match="'tiled', 'xla', 'tokamax', 'pallas_triton'"):
        choose_grouped_matmul_impl("cutlass", "gpu")


@pytest.mark.parametrize(("impl", "platform", "portable", "says"), [
    ("tokamax", "gpu", "tiled", "tokamax is not installed"),
    ("tokamax", "tpu", "xla", "tokamax is not installed"),
    ("pallas_triton", "cpu", "tiled", "needs an NVIDIA GPU"),
    ("pallas_triton", "tpu", "xla", "needs an NVIDIA GPU"),
    ("auto", "gpu", "tiled", "no GPU grouped-matmul kernel"),
])
def test_a_missing_kernel_says_so_once_and_runs_the_portable_path(impl, platform, portable, says, no_tokamax,
                                                                   fresh_warnings, monkeypatch):
    monkeypatch.setattr(gm_module, "_pallas_triton_available", lambda: False)
    with pytest.warns(RuntimeWarning, match=says):
        assert choose_grouped_matmul_impl(impl, platform) == portable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_grouped_matmul_impl(impl, platform) == portable  # once per process


def test_tokamax_runs_when_installed(fake_tokamax):
    lhs, rhs = _operands(7, 2)
    sizes = jnp.array([3, 4], jnp.int32)
    out = grouped_matmul(lhs, rhs, sizes, impl="tokamax")
    assert fake_tokamax == [{"preferred_element_type": jnp.float32}]
    np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs, sizes), rtol=RTOL)


def test_missing_tokamax_computes_the_same_numbers(no_tokamax, fresh_warnings):
    lhs, rhs = _operands(7, 2)
    sizes = jnp.array([3, 4], jnp.int32)
    with pytest.warns(RuntimeWarning, match="tokamax is not installed"):
        out = grouped_matmul(lhs, rhs, sizes, impl="tokamax")
    np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs, sizes), rtol=RTOL)


def test_pallas_triton_turns_on_jax_lowering_flag_on_gpu(monkeypatch):
    """On a (faked) GPU with the lowering available, the flag that routes ragged_dot's lowering to Pallas-Triton
    is set (it is read when the enclosing jit is lowered); the computation is lax.ragged_dot's."""
    flag = gm_module._PALLAS_TRITON_FLAG
    monkeypatch.setattr(gm_module, "_pallas_triton_available", lambda: True)
    monkeypatch.setattr(kernels, "platform_name", lambda platform=None: "gpu")
    before = getattr(jax.config, flag)
    lhs, rhs = _operands(7, 2)
    sizes = jnp.array([3, 4], jnp.int32)
    try:
        jax.config.update(flag, False)
        out = grouped_matmul(lhs, rhs, sizes, impl="pallas_triton")
        assert getattr(jax.config, flag)
    finally:
        jax.config.update(flag, before)
    np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs, sizes), rtol=RTOL)


def test_config_validates_the_name():
    with pytest.raises(ValueError, match="grouped_matmul_impl must be one of .*'tiled'"):
        DeepSeekV3Config.preset("deepseek3-mini", grouped_matmul_impl="triton")
    assert DeepSeekV3Config.preset("deepseek3-mini").grouped_matmul_impl == "auto"


# ----------------------------------------------------------------------------------------- the MoE gmm path
@pytest.mark.parametrize("impl", ["tiled", "xla"])
def test_routed_experts_gmm_equals_dense(impl):
    """Values and gradients w.r.t. the input, the routing weights and the three expert weights."""
    experts = RoutedExperts(8, 16, 12, grouped_matmul_impl=impl, kernel_init=nnx.initializers.normal(0.3),
                            rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(experts)
    x = jax.random.normal(jax.random.key(1), (40, 16))
    scores = jax.random.uniform(jax.random.key(2), (40, 8)).at[:, 5].add(2.0)  # expert 5 popular, some empty
    weights, idx = jax.lax.top_k(scores, 2)

    def loss(state, x, weights, path):
        out = nnx.merge(graphdef, state)(x, idx, weights, impl=path)
        return jnp.sum(jnp.sin(out)), out

    grads = {path: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)(
        state, x, weights, path) for path in ("gmm", "dense")}
    _assert_same(grads["gmm"], grads["dense"])


# The model: deepseek3-mini cut to one dense and one MoE layer (16 experts top-2), 3 sequences of 16 tokens.
_CONFIG = dict(vocab_size=128, num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0,
               hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4, q_lora_rank=16,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
_BATCH, _SEQ = 8, 16


@functools.cache
def _model_state():
    """(params, the rest), drawn with numpy (the model's own initializers compile one program per shape)."""
    config = DeepSeekV3Config.preset("deepseek3-mini", **_CONFIG)
    abstract = nnx.eval_shape(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        if "['scale']" in jax.tree_util.keystr(path):  # RMSNorm scales
            return jnp.ones(leaf.shape, leaf.dtype)
        return jnp.asarray(rng.normal(0.0, 0.1, leaf.shape), leaf.dtype) if leaf.ndim >= 2 else jnp.zeros(
            leaf.shape, leaf.dtype)

    return tuple(jax.tree_util.tree_map_with_path(draw, nnx.state(abstract, which))
                 for which in (nnx.Param, nnx.Not(nnx.Param)))


def _ids():
    return jnp.asarray(np.random.default_rng(0).integers(0, _CONFIG["vocab_size"], (_BATCH, _SEQ + 1)), jnp.int32)


def _loss_and_grads(moe_impl: str, sizes: dict[str, int] | None = None, mode: str = "explicit",
                    rules: str = "default"):
    """(loss, parameter grads, the logits' sharding == the input's) of the mean next-token cross-entropy."""
    config = DeepSeekV3Config.preset("deepseek3-mini", **_CONFIG, moe_impl=moe_impl)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0), rules=rules)))
    params, rest = _model_state()
    ids = _ids()

    def loss(params, rest, ids):
        logits = nnx.merge(graphdef, params, rest)(ids[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)
        return -jnp.mean(picked)

    step = jax.jit(jax.value_and_grad(loss))
    if sizes is None:
        return step.trace(params, rest, ids).lower().compile(_COMPILER_OPTIONS)(params, rest, ids)
    mesh = make_mesh(sizes, shard_mode=mode)
    params, rest = (jax.tree.unflatten(jax.tree.structure(t), [
        jax.device_put(a, s) for a, s in zip(jax.tree.leaves(t), state_shardings(t, mesh, get_rules(rules)))])
        for t in (params, rest))
    ids = jax.device_put(ids, jax.NamedSharding(mesh, logical_to_mesh_axes(("activation_batch", None), rules, mesh)))
    with jax.set_mesh(mesh):
        return step.trace(params, rest, ids).lower().compile(_COMPILER_OPTIONS)(params, rest, ids)


# Cheaper LLVM optimization: the programs are small and run once, compiling is the cost (XLA:CPU keeps float
# semantics at every level: no fast math).
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@functools.cache
def _dense_reference():
    return jax.device_get(_loss_and_grads("dense"))


def _assert_model_same(got, want):
    got = jax.device_get(got)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1]), strict=True):
        error = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
        assert error <= 2e-5, f"grad {jax.tree_util.keystr(path)}: relative L2 error {error:.2e}"


# The gradient tolerance is relative L2 per tensor, 2e-5 as in tests/models/deepseek/test_mesh_matrix.py: a norm
# scale's gradient sums every token's contribution with cancellation, and a sharded run reduces in another order.
@pytest.mark.parametrize(("sizes", "mode", "rules"), [
    (None, None, "default"),
    ({"fsdp": 4, "expert": 2}, "explicit", "default"),
    ({"fsdp": 4, "expert": 2}, "auto", "ep-as-cp"),
    ({"fsdp": 4, "expert": 2}, "explicit", "shard-exp-on-fsdp"),
], ids=["one-device", "explicit-default", "auto-ep-as-cp", "explicit-shard-exp-on-fsdp"])
def test_deepseek_gmm_equals_dense(sizes, mode, rules):
    _assert_model_same(_loss_and_grads("gmm", sizes, mode, rules), _dense_reference())


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_gmm_output_keeps_the_input_sharding(mode):
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode=mode)
    experts = RoutedExperts(8, 16, 12, grouped_matmul_impl="tiled", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))
    weights, idx = jax.lax.top_k(jax.random.uniform(jax.random.key(2), (32, 8)), 2)
    want = experts(x, idx, weights, impl="dense")
    spec = logical_to_mesh_axes(("activation_tokens", None), "default", mesh)
    x = jax.device_put(x, jax.NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x, i, w: experts(x, i, w, impl="gmm"))(x, idx, weights)
        if mode == "explicit":
            assert jax.typeof(out).sharding.spec == jax.typeof(x).sharding.spec
    assert out.sharding.spec == x.sharding.spec
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)


# EP's dropless local computation through the grouped matmul (what accelerators run: default_moe_impl "gmm").
@pytest.mark.parametrize(("sizes", "mode", "rules"), [
    ({"fsdp": 4, "expert": 2}, "explicit", "default"),
    ({"fsdp": 4, "expert": 2}, "auto", "ep-as-cp"),  # the sequence split over expert: per-sequence dispatch
    ({"fsdp": 4, "expert": 2}, "explicit", "shard-exp-on-fsdp"),  # experts over (expert, fsdp)
], ids=["explicit-default", "auto-ep-as-cp", "explicit-shard-exp-on-fsdp"])
def test_ep_with_grouped_local_experts_equals_dense(sizes, mode, rules, monkeypatch):
    from nnx_zoo.layers import moe as moe_module
    from nnx_zoo.sharding import create_sharded, use_rules

    monkeypatch.setattr(moe_module, "default_moe_impl", lambda platform=None: "gmm")
    def make():
        return RoutedExperts(8, 16, 12, grouped_matmul_impl="tiled", kernel_init=nnx.initializers.normal(0.3),
                             rngs=nnx.Rngs(0))

    x = jax.random.normal(jax.random.key(1), (8, 4, 16))
    weights, idx = jax.lax.top_k(jax.random.uniform(jax.random.key(2), (8, 4, 8)), 2)

    def loss(experts, x, weights, impl):
        graphdef, state = nnx.split(experts)

        def f(state, x, weights):
            with use_rules(rules):
                out = nnx.merge(graphdef, state)(x, idx, weights, impl=impl)
            return jnp.sum(jnp.sin(out)), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(state, x, weights)

    want = jax.device_get(loss(make(), x, weights, "dense"))
    mesh = make_mesh(sizes, shard_mode=mode)
    experts = create_sharded(make, mesh, rules)
    spec = logical_to_mesh_axes(("activation_batch", "activation_length", None), rules, mesh)
    x = jax.device_put(x, jax.NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        got = jax.device_get(loss(experts, x, weights, "ep"))
    _assert_same(got, want)


def test_a_broken_tokamax_install_is_told_apart_from_a_missing_one(tmp_path, monkeypatch, fresh_warnings):
    """tokamax 0.0.13+ imports xprof's tools, which need `fire`: an install without it must not be reported as
    'not installed' (a GPU run fell back to the portable kernel with that misleading line)."""
    (tmp_path / "tokamax").mkdir()
    (tmp_path / "tokamax" / "__init__.py").write_text("import fire_missing_for_this_test\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tokamax", raising=False)
    says = "tokamax is installed but does not import.*No module named 'fire_missing_for_this_test'"
    with pytest.warns(RuntimeWarning, match=says):
        assert choose_grouped_matmul_impl("tokamax", "gpu") == "tiled"
    assert re.match(says, attn_module._tokamax_refusal(8, 8, "gpu", False, False))
    monkeypatch.setitem(sys.modules, "tokamax", None)
    assert kernels.tokamax_unavailable() == "tokamax is not installed (pip install 'nnx-zoo[gpu]')"
