"""Expert-parallel capacity (``RoutedExperts(impl="ep", capacity_factor=...)``) against a numpy loop.

The documented rule: an expert takes at most ``ceil(capacity_factor * tokens * k / E)`` (token, expert) pairs
(``tokens``: those its EP group sees, at least 1 and at most ``tokens``), first come first served in token order;
a dropped pair contributes nothing and is counted. The reference walks the tokens of each EP group in order,
assigning slots per expert, and computes the kept pairs' SwiGLU outputs in float64.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_zoo.layers import RoutedExperts
from nnx_zoo.sharding import make_mesh, use_rules
from nnx_zoo.sharding.rules import DEFAULT

TOKENS, FEATURES, HIDDEN, EXPERTS, K = 32, 16, 8, 8, 2
CAPACITY_FACTOR = 1.0


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(TOKENS, FEATURES)).astype(np.float32)
    popular = np.array([3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # experts 0 and 1 overflow
    idx = np.stack([rng.choice(EXPERTS, K, replace=False, p=popular / popular.sum()) for _ in range(TOKENS)])
    weights = rng.uniform(0.2, 1.0, (TOKENS, K)).astype(np.float32)
    return x, idx.astype(np.int32), weights


def _experts() -> RoutedExperts:
    return RoutedExperts(EXPERTS, FEATURES, HIDDEN, kernel_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0))


def reference(experts, x, idx, weights, groups, *, order=1):
    """``(out, dropped)``: each group's tokens in order (``order=-1``: reversed, a wrong rule for contrast)."""
    wg, wu, wo = (np.asarray(getattr(experts, n)[...], np.float64) for n in ("wi_gate", "wi_up", "wo"))
    out, dropped = np.zeros((TOKENS, FEATURES)), 0
    for group in groups:
        capacity = max(1, min(math.ceil(CAPACITY_FACTOR * len(group) * K / EXPERTS), len(group)))
        taken = np.zeros(EXPERTS, int)
        for t in group[::order]:
            for j in range(K):
                e = idx[t, j]
                if taken[e] < capacity:
                    h = x[t].astype(np.float64)
                    gate, up = h @ wg[e], h @ wu[e]
                    out[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ wo[e])
                else:
                    dropped += 1
                taken[e] += 1
    return out, dropped


def _run(experts, x, idx, weights, mesh=None, rules=DEFAULT):
    graphdef, state = nnx.split(experts)

    @jax.jit
    def run(state, x, idx, weights):
        with use_rules(rules):
            return nnx.merge(graphdef, state)(x, idx, weights, impl="ep", capacity_factor=CAPACITY_FACTOR,
                                              return_dropped=True)

    if mesh is None:
        return run(state, x, idx, weights)
    with jax.set_mesh(mesh):
        replicated = NamedSharding(mesh, PartitionSpec())
        args = jax.device_put((state, x, idx, weights), replicated)
        return run(*args)


HALVES = [list(range(TOKENS // 2)), list(range(TOKENS // 2, TOKENS))]
ALL = [list(range(TOKENS))]
TOKENS_ON_FSDP_ONLY = (("activation_tokens", "fsdp"), *DEFAULT)  # tokens replicated over the expert axis
CASES = {
    # no mesh: one group of every token
    "no-mesh": (None, None, DEFAULT, ALL),
    # tokens split over (fsdp, expert), experts over expert: each fsdp half is an EP group, gathered over expert
    "default-explicit": ({"fsdp": 2, "expert": 4}, "explicit", DEFAULT, HALVES),
    "default-auto": ({"fsdp": 2, "expert": 4}, "auto", DEFAULT, HALVES),
    # experts over (expert, fsdp): one EP group of all tokens, gathered over both axes (in token order)
    "shard-exp-on-fsdp": ({"fsdp": 2, "expert": 4}, "explicit", "shard-exp-on-fsdp", ALL),
    # tokens replicated over the EP axis: every expert shard sees its fsdp half whole
    "tokens-replicated-over-ep": ({"fsdp": 2, "expert": 4}, "explicit", TOKENS_ON_FSDP_ONLY, HALVES),
}


@pytest.mark.parametrize("case", list(CASES))
def test_capacity_drops_and_counts_exactly_the_pairs_over_capacity(case):
    sizes, mode, rules, groups = CASES[case]
    experts = _experts()
    x, idx, weights = _inputs()
    want, want_dropped = reference(experts, x, idx, weights, groups)
    # The case can tell right from wrong: pairs are dropped, and which ones depends on the order.
    assert 0 < want_dropped < TOKENS * K // 3
    reversed_order, _ = reference(experts, x, idx, weights, groups, order=-1)
    assert np.abs(reversed_order - want).max() > 0.1 * np.abs(want).max()

    mesh = None if sizes is None else make_mesh(sizes, shard_mode=mode)
    out, dropped = _run(experts, jnp.asarray(x), jnp.asarray(idx), jnp.asarray(weights), mesh, rules)
    assert int(dropped) == want_dropped
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_capacity_on_unflattened_sequences_drops_the_same_pairs():
    """ep-as-cp splits the sequence over ``expert``: ``x [batch, seq, embed]`` stays unflattened (each shard
    gathers its block over the EP axes; no all-to-all) and each fsdp half must still be served in token order."""
    from nnx_zoo.layers import moe

    experts = _experts()
    x, idx, weights = _inputs()
    want, want_dropped = reference(experts, x, idx, weights, HALVES)
    mesh = make_mesh({"fsdp": 2, "expert": 4}, shard_mode="explicit")
    with jax.set_mesh(mesh), use_rules("ep-as-cp"):  # the unflattened path is the one taken
        assert moe._per_sequence_dispatch((4, TOKENS // 4, FEATURES), ("expert",), CAPACITY_FACTOR)
    blocks = (jnp.asarray(a).reshape(4, TOKENS // 4, -1) for a in (x, idx, weights))
    out, dropped = _run(experts, *blocks, mesh, "ep-as-cp")
    assert out.shape == (4, TOKENS // 4, FEATURES) and int(dropped) == want_dropped
    np.testing.assert_allclose(np.asarray(out).reshape(TOKENS, -1), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
