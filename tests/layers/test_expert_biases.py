"""Routed experts with biases and the generalized gated activation (``RoutedExperts(use_bias=True)``, ``Glu(limit,
alpha, up_offset)``) against a float64 numpy loop, on every ``moe_impl`` path: ``dense``, ``gmm``, ``ep`` without a
mesh, ``ep`` under a capacity no pair exceeds (the slot path), and ``ep`` / ``gmm`` on an FSDP 4 x EP 2 mesh (each
shard adding only its own experts' biases). The expert weights, all three biases and the routing are random."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_zoo.layers import RoutedExperts
from nnx_zoo.layers.mlp import Glu
from nnx_zoo.sharding import make_mesh, use_rules
from nnx_zoo.sharding.rules import DEFAULT

TOKENS, FEATURES, HIDDEN, EXPERTS, K = 16, 16, 8, 8, 2
LIMIT, ALPHA, OFFSET = 0.8, 1.702, 1.0


def _glu64(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    gate, up = np.minimum(gate, LIMIT), np.clip(up, -LIMIT, LIMIT)
    return gate / (1 + np.exp(-ALPHA * gate)) * (up + OFFSET)


def test_glu_gain_and_offset():
    rng = np.random.default_rng(1)
    gate, up = rng.normal(size=(2, 64)) * 2
    got = Glu(LIMIT, ALPHA, OFFSET)(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), _glu64(gate, up), rtol=1e-5, atol=1e-6)
    plain = Glu()(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32))  # the defaults: silu(gate) * up
    np.testing.assert_allclose(np.asarray(plain), gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def case():
    experts = RoutedExperts(EXPERTS, FEATURES, HIDDEN, limit=LIMIT, alpha=ALPHA, up_offset=OFFSET, use_bias=True,
                            kernel_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for name in ("wi_gate_bias", "wi_up_bias", "wo_bias"):  # zero at init: random here, so each one counts
        var = getattr(experts, name)
        var[...] = jnp.asarray(rng.normal(size=var.shape), jnp.float32)
    x = rng.normal(size=(TOKENS, FEATURES)).astype(np.float32)
    idx = np.stack([rng.choice(EXPERTS, K, replace=False) for _ in range(TOKENS)]).astype(np.int32)
    weights = rng.uniform(0.2, 1.0, (TOKENS, K)).astype(np.float32)
    p = {n: np.asarray(getattr(experts, n)[...], np.float64)
         for n in ("wi_gate", "wi_up", "wo", "wi_gate_bias", "wi_up_bias", "wo_bias")}
    want = np.zeros((TOKENS, FEATURES))
    for t in range(TOKENS):
        for j in range(K):
            e, h = idx[t, j], x[t].astype(np.float64)
            act = _glu64(h @ p["wi_gate"][e] + p["wi_gate_bias"][e], h @ p["wi_up"][e] + p["wi_up_bias"][e])
            want[t] += weights[t, j] * (act @ p["wo"][e] + p["wo_bias"][e])
    return experts, (x, idx, weights), want


PATHS = {"dense": ("dense", None, None), "gmm": ("gmm", None, None), "ep": ("ep", None, None),
         "ep-capacity": ("ep", 4.0, None),  # capacity 8 per expert: no pair dropped, through the slot path
         "ep-mesh-explicit": ("ep", None, "explicit"), "gmm-mesh-auto": ("gmm", None, "auto")}


@pytest.mark.parametrize("path", PATHS)
def test_every_path_adds_each_experts_biases(case, path):
    experts, inputs, want = case
    impl, capacity, mode = PATHS[path]
    graphdef, state = nnx.split(experts)

    @jax.jit
    def run(state, x, idx, weights):
        with use_rules(DEFAULT):
            return nnx.merge(graphdef, state)(x, idx, weights, impl=impl, capacity_factor=capacity,
                                              return_dropped=True)

    if mode is None:
        out, dropped = run(state, *inputs)
    else:
        mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode=mode)
        with jax.set_mesh(mesh):
            out, dropped = run(*jax.device_put((state, *inputs), NamedSharding(mesh, PartitionSpec())))
    assert int(dropped) == 0
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
