"""Several layer stacks through one pipeline (``pipeline_stack`` / ``pipeline_1f1b_value_and_grad`` with stacks by
name and ``layer_stacks``): the per-layer aux terms come back per stack in each stack's model order, and the loss
and every gradient equal the un-pipelined layers run one by one in model order.

Two toy stacks ``a`` (16 layers) and ``b`` (8), the layers in model order ``(a, a, b)`` eight times, each kind its
own function; each layer returns a loss term (differentiated) and its output summed over the rows (stats). On
stage 2 a GPipe chunk is ``(a, a, b)`` four times and an interleaved one (2 virtual stages) twice: one scan
segment whose pattern takes every other local ``a`` layer, so ``a``'s aux runs in two pattern positions and must
be put back in order, and interleaved moves chunks of 4 ``a`` and 2 ``b`` layers to their stages and back.

Cost: one small compile per schedule (about a second each here), stage 2 alone on 2 devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.pipeline import pipeline_1f1b_value_and_grad, pipeline_stack
from nnx_zoo.layers.scan import create_stack
from nnx_zoo.sharding import create_sharded, make_mesh, use_rules
from tests.layers.test_pipeline_1f1b import WIDTH, _head, _inputs

KINDS = ("a", "a", "b") * 8
COUNTS = {"a": 16, "b": 8}


def _stacks() -> nnx.Dict:
    return nnx.Dict({name: create_stack(lambda r: Linear(WIDTH, WIDTH, kernel_names=("embed", "mlp"), rngs=r), count,
                                        nnx.Rngs(seed), "layers")
                     for seed, (name, count) in enumerate(COUNTS.items())})


def _layer(name, layer, h, scale):
    h = jnp.tanh(layer(h) * scale) if name == "a" else jnp.sin(layer(h)) + 0.5 * h
    return h, (0.01 * jnp.sum(h * h), jnp.sum(h, axis=(0, 1)))  # (loss term, stats [WIDTH]): sums over rows


@functools.cache
def _want():
    """Loss (head + every layer's term), the gradients (stacks, head, input) and each stack's stats [n, WIDTH],
    the layers run one at a time in model order."""
    x, target, scale, w = _inputs()
    graphdef, state = nnx.split(_stacks())

    def loss(state, w, x):
        stacks, taken, h, total = nnx.merge(graphdef, state), dict.fromkeys(COUNTS, 0), x, 0.0
        stats = {name: [] for name in COUNTS}
        for name in KINDS:
            layer_graph, layer_state = nnx.split(stacks[name])
            layer = nnx.merge(layer_graph, jax.tree.map(lambda a, i=taken[name]: a[i], layer_state))
            taken[name] += 1
            h, (part, st) = _layer(name, layer, h, scale)
            total, stats[name] = total + part, stats[name] + [st]
        return _head(w, h, target) + total, {name: jnp.stack(s) for name, s in stats.items()}

    (value, stats), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(state, w, x)
    return value, grads, stats


def _check(loss, grads, stats):
    want_loss, want_grads, want_stats = _want()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for name in COUNTS:  # per stack, in its model order
        np.testing.assert_allclose(stats[name], want_stats[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_stacks_by_name_give_the_unpipelined_loss_gradients_and_per_stack_aux(schedule):
    mesh = make_mesh({"stage": 2}, devices=jax.devices()[:2])
    x, target, scale, w = map(jnp.asarray, _inputs())  # arrays: the per-row scale is split with the micro-batches
    graphdef, state = nnx.split(create_sharded(_stacks, mesh, "default"))
    assert state["a"]["kernel"][...].sharding.spec[0] == "stage"

    def stacks(state):
        return dict(nnx.merge(graphdef, state).items())

    with jax.set_mesh(mesh), use_rules("default"):
        if schedule == "gpipe":
            def loss(state, w, x):
                h, aux = pipeline_stack(stacks(state), _layer, x, scale, microbatches=4, with_aux=True,
                                        layer_stacks=KINDS)
                return _head(w, h, target) + sum(jnp.sum(parts) for parts, _ in aux.values()), aux

            (value, aux), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(state, w, x)
            _check(value, grads, {name: st for name, (_, st) in aux.items()})
        else:
            @jax.jit
            def run(state, w, x):
                return pipeline_1f1b_value_and_grad(stacks(state), _layer, lambda w, h, t: (_head(w, h, t), None), w,
                                                    x, target, scale, microbatches=4, virtual_stages=2,
                                                    with_aux=True, layer_stacks=KINDS)

            value, d_stacks, d_w, d_x, stats, _ = run(state, w, x)
            _check(value, (d_stacks, d_w, d_x), stats)


def _carrying_layer(name, layer, carry, scale):
    """``a`` layers hand their input on (the chunk's carried value); ``b`` layers add the last one handed."""
    h, skip = carry
    if name == "a":
        return (jnp.tanh(layer(h) * scale), h), jnp.sum(h, axis=(0, 1))
    return (jnp.sin(layer(h)) + 0.5 * skip, skip), jnp.sum(h, axis=(0, 1))


def test_a_chunk_carry_is_handed_on_inside_each_stage_chunk():
    """``pipeline_stack(..., chunk_carry=)``: a value the layers of a chunk hand on among themselves (GLM-5's
    top-k), made afresh at each chunk's start (each chunk ``(a, a, b) x 4`` starts with a writer): the loss and
    gradients equal the layers run one by one with the value handed through all of them. Under GPipe on stage 2."""
    mesh = make_mesh({"stage": 2}, devices=jax.devices()[:2])
    x, target, scale, w = map(jnp.asarray, _inputs())
    graphdef, state = nnx.split(create_sharded(_stacks, mesh, "default"))

    def reference(state, w, x):
        stacks, taken, carry = nnx.merge(graphdef, state), dict.fromkeys(COUNTS, 0), (x, jnp.zeros_like(x))
        for name in KINDS:
            layer_graph, layer_state = nnx.split(stacks[name])
            layer = nnx.merge(layer_graph, jax.tree.map(lambda a, i=taken[name]: a[i], layer_state))
            taken[name] += 1
            carry, _ = _carrying_layer(name, layer, carry, scale)
        return _head(w, carry[0], target)

    def pipelined(state, w, x):
        h, _ = pipeline_stack(dict(nnx.merge(graphdef, state).items()), _carrying_layer, x, scale, microbatches=4,
                              with_aux=True, layer_stacks=KINDS, chunk_carry=jnp.zeros_like)
        return _head(w, h, target)

    with jax.set_mesh(mesh), use_rules("default"):
        got = jax.jit(jax.value_and_grad(pipelined, argnums=(0, 1, 2)))(state, w, x)
        want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(state, w, x)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
