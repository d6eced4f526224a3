"""``pipeline_1f1b_value_and_grad``: the 1F1B schedule over the ``stage`` axis, and interleaved 1F1B (virtual
stages, ``V > 1``), give the loss and every gradient (stacked layers, head, input) of ``jax.value_and_grad`` of the
un-pipelined stack + head, under Auto and Explicit meshes, with FSDP beside the stages, a per-row argument split
with the micro-batches, and more items than a stage keeps inputs for (its ``(V + 1) S - 1`` slots are reused). The
schedule's table (``pipeline_order``) runs each item one tick after the one it needs and keeps at most
``(V + 1) S - 1 <= 2VS - 1`` stage inputs; the compiled 1F1B programs' temporaries shrink with the micro-batch,
where GPipe's (autodiff of ``pipeline_stack``) stay those of the whole batch.

A toy stack (4 tanh(Linear) layers of width 16, a linear + squared-error head) keeps each compile to a second or
two; CI runs 1F1B's ring wrap and interleaved on stage 2 (alone, and with FSDP 4 under Explicit),
``NNX_ZOO_FULL_MATRIX=1`` more meshes (with FSDP, stage 2 and 4, both modes; interleaved on 8 layers for stage 4).
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.pipeline import (
    B_CHUNK,
    B_MICRO,
    B_OK,
    B_SLOT,
    F_CHUNK,
    F_MICRO,
    F_OK,
    F_SLOT,
    pipeline_1f1b_value_and_grad,
    pipeline_order,
    pipeline_stack,
    skips_idle_ticks,
)
from nnx_zoo.layers.scan import create_stack, run_stack
from nnx_zoo.sharding import create_sharded, make_mesh, use_rules

WIDTH, LAYERS, BATCH, SEQ = 16, 4, 8, 4


def _stack(layers: int = LAYERS) -> nnx.Module:
    return create_stack(lambda r: Linear(WIDTH, WIDTH, kernel_names=("embed", "mlp"), rngs=r), layers, nnx.Rngs(0),
                        "layers")


def _layer(layer, h, scale):
    return jnp.tanh(layer(h) * scale)


def _head(w, h, target):
    return jnp.sum((h @ w - target) ** 2)


@functools.cache
def _inputs(seq: int = SEQ) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    x, target = (rng.normal(size=(BATCH, seq, WIDTH)).astype(np.float32) for _ in range(2))
    scale = (1.0 + 0.1 * rng.normal(size=(BATCH, 1, 1))).astype(np.float32)  # per row: split with the rows
    return x, target, scale, (0.3 * rng.normal(size=(WIDTH, WIDTH))).astype(np.float32)


@functools.cache
def _want(layers: int = LAYERS):
    x, target, scale, w = _inputs()
    graphdef, state = nnx.split(_stack(layers))

    def loss(state, w, x):
        h = run_stack(nnx.merge(graphdef, state), lambda layer, h, _: (_layer(layer, h, scale), None), x)[0]
        return _head(w, h, target)

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(state, w, x)
    return value, jax.tree.leaves(grads)


def _on_mesh(mesh, microbatches, virtual_stages=1, layers=LAYERS):
    x, target, scale, w = _inputs()
    stack = create_sharded(functools.partial(_stack, layers), mesh, "default")
    graphdef, state = nnx.split(stack)
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    with jax.set_mesh(mesh), use_rules("default"):
        @jax.jit
        def run(state, w, x, target, scale):
            return pipeline_1f1b_value_and_grad(nnx.merge(graphdef, state), _layer, _head, w, x, target, scale,
                                                microbatches=microbatches, virtual_stages=virtual_stages)

        return run(state, jnp.asarray(w), *(jax.device_put(a, rows) for a in (x, target, scale)))


# (mesh sizes, devices, mode, micro-batches, virtual stages, layers). The trainer's cases
# (tests/models/test_pipeline.py) run 1F1B with FSDP under both modes; CI here adds the ring's wrap, and
# interleaved (V = 2: chunk 1 on stage 0, so every chunk moves) alone with the wrap and beside FSDP 4, Explicit.
CASES = [({"stage": 2}, 2, "auto", 8, 1, LAYERS),  # 8 micro-batches through a ring of 3 slots per stage
         ({"stage": 2}, 2, "auto", 4, 2, LAYERS),  # 8 items through 5 slots
         ({"stage": 2, "fsdp": 4}, 8, "explicit", 2, 2, LAYERS)]
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    CASES += [({"stage": 2, "fsdp": 4}, 8, "explicit", 2, 1, LAYERS),
              ({"stage": 4, "fsdp": 2}, 8, "auto", 4, 1, LAYERS),
              ({"stage": 4, "fsdp": 2}, 8, "explicit", 4, 1, LAYERS),
              ({"stage": 2}, 2, "explicit", 8, 1, LAYERS), ({"stage": 4}, 4, "auto", 8, 1, LAYERS),
              ({"stage": 2}, 2, "explicit", 8, 2, LAYERS), ({"stage": 2, "fsdp": 4}, 8, "auto", 2, 2, LAYERS),
              ({"stage": 4, "fsdp": 2}, 8, "auto", 4, 2, 8), ({"stage": 4}, 4, "explicit", 8, 2, 8),
              ({"stage": 2}, 2, "auto", 2, 4, 8)]


@pytest.mark.parametrize(("sizes", "devices", "mode", "microbatches", "virtual_stages", "layers"), CASES)
def test_1f1b_gives_the_loss_and_gradients_of_the_unpipelined_stack(sizes, devices, mode, microbatches,
                                                                     virtual_stages, layers):
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:devices])
    loss, d_state, d_head, d_x = _on_mesh(mesh, microbatches, virtual_stages, layers)
    want_loss, want_grads = _want(layers)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves((d_state, d_head, d_x)), want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert d_state["kernel"][...].sharding.spec[0] == "stage"  # each stage's layers' gradients stay on it


def test_1f1b_keeps_a_bounded_window_where_gpipe_keeps_every_micro_batch():
    """Temp bytes of the compiled programs on stage 2 (2 devices), 512 positions so that activations dominate, with
    2 micro-batches of 4 rows and 8 of 1: GPipe's backward keeps what every micro-batch's layers saved (the whole
    batch's, whatever the count); 1F1B keeps the stage inputs of at most 2S - 1 = 3 micro-batches and recomputes the
    stage in its backward, so its temporaries shrink with the micro-batch; so does interleaved 1F1B (V = 2, at most
    (V + 1) S - 1 = 5 inputs)."""
    mesh = make_mesh({"stage": 2}, devices=jax.devices()[:2])
    x, target, scale, w = _inputs(512)
    graphdef, state = nnx.split(create_sharded(_stack, mesh, "default"))

    def gpipe(state, w, x, target, scale, microbatches):
        def loss(state, w, x):
            h = pipeline_stack(nnx.merge(graphdef, state), _layer, x, scale, microbatches=microbatches)
            return _head(w, h, target)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(state, w, x)

    def one_f_one_b(state, w, x, target, scale, microbatches, virtual_stages=1):
        return pipeline_1f1b_value_and_grad(nnx.merge(graphdef, state), _layer, _head, w, x, target, scale,
                                            microbatches=microbatches, virtual_stages=virtual_stages)

    def temp_bytes(fn, microbatches, *static):
        with jax.set_mesh(mesh), use_rules("default"):
            compiled = jax.jit(fn, static_argnums=(5, 6)[:1 + len(static)]).lower(
                state, w, x, target, scale, microbatches, *static).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    # Measured: GPipe 2.85 MB, 1F1B 0.66 MB with 8 micro-batches (1.84 MB with 2); interleaved (V = 2: 5 saved
    # inputs, each tick half a stage's layers) 0.56 MB with 8 (1.71 MB with 2).
    f1b_temp = {m: temp_bytes(one_f_one_b, m) for m in (2, 8)}
    gpipe_temp = temp_bytes(gpipe, 8)
    assert f1b_temp[8] < gpipe_temp / 2
    assert f1b_temp[8] < f1b_temp[2] / 2
    interleaved_temp = {m: temp_bytes(one_f_one_b, m, 2) for m in (2, 8)}
    assert interleaved_temp[8] < gpipe_temp / 2
    assert interleaved_temp[8] < interleaved_temp[2] / 2


@pytest.mark.parametrize(("stages", "virtual", "micro"), [(2, 1, 3), (4, 1, 9), (2, 2, 4), (4, 2, 8), (3, 3, 9),
                                                          (2, 4, 6)])
def test_the_order_runs_each_item_after_what_it_needs_and_keeps_at_most_2vs_minus_1_inputs(stages, virtual, micro):
    """The table the program runs (``pipeline_order``): every (micro-batch, virtual stage) forward and backward
    once, each forward one tick after the previous virtual stage's (stage ``S - 1``'s chunk ``v`` feeding stage 0's
    chunk ``v + 1``), each backward one tick after the next virtual stage's (the last one's in its forward's tick),
    ``M V + V S + S - 2`` ticks; and the saved inputs: each backward finds its own input in its slot, never
    overwritten, with ``(V + 1) S - 1`` alive on stage 0 at the most (within the ``2 V S - 1`` bound), and the
    slots the program allocates are exactly that many."""
    order = pipeline_order(stages, virtual, micro)
    chunks = virtual * stages
    assert order.shape == (micro * virtual + virtual * stages + stages - 2, stages, 8)
    forward, backward = {}, {}
    for t, row in enumerate(order):
        for s, item in enumerate(row):
            if item[F_OK]:
                key = (int(item[F_MICRO]), int(item[F_CHUNK]) * stages + s)
                assert key not in forward
                forward[key] = t
            if item[B_OK]:
                key = (int(item[B_MICRO]), int(item[B_CHUNK]) * stages + s)
                assert key not in backward
                backward[key] = t
    every = {(m, k) for m in range(micro) for k in range(chunks)}
    assert set(forward) == every and set(backward) == every
    for (m, k), t in forward.items():
        assert k == 0 or forward[m, k - 1] == t - 1
    for (m, k), t in backward.items():
        assert backward.get((m, k + 1), forward[m, k] - 1) == t - 1  # the last chunk: in its forward's tick
    most = []
    for s in range(stages):
        held: dict[int, tuple[int, int]] = {}
        peak = 0
        for row in order[:, s]:
            if row[F_OK]:  # this tick's input is saved before this tick's backward reads it (as the program does)
                assert int(row[F_SLOT]) not in held
                held[int(row[F_SLOT])] = (int(row[F_MICRO]), int(row[F_CHUNK]))
            peak = max(peak, len(held))
            if row[B_OK]:
                assert held.pop(int(row[B_SLOT])) == (int(row[B_MICRO]), int(row[B_CHUNK]))
        most.append(peak)
    assert most == [(virtual + 1) * stages - 1 - 2 * s for s in range(stages)]
    assert order[..., F_SLOT].max() + 1 == most[0] <= 2 * virtual * stages - 1


def test_interleaving_needs_micro_batches_in_groups_of_stages_and_layers_in_equal_chunks():
    mesh = make_mesh({"stage": 2}, devices=jax.devices()[:2])
    x, target, scale, w = _inputs()
    graphdef, state = nnx.split(create_sharded(_stack, mesh, "default"))

    def trace(microbatches, virtual_stages):
        with jax.set_mesh(mesh), use_rules("default"):
            jax.eval_shape(lambda state: pipeline_1f1b_value_and_grad(
                nnx.merge(graphdef, state), _layer, _head, w, x, target, scale, microbatches=microbatches,
                virtual_stages=virtual_stages), state)

    with pytest.raises(ValueError, match=r"groups of the 2 stages: 1 micro-batches is not a multiple of 2; use a "
                                         r"multiple of 2 that divides the batch of 8 \(one of \[2, 4, 8\]\)"):
        trace(1, 2)
    with pytest.raises(ValueError, match=r"the 4 layers \(stack of each, in model order: layers x4\) do not split into "
                                         r"6 identical chunks \(2 pipeline stages x 3 virtual stages\).*use "
                                         r"--virtual-stages one of \[1, 2\]"):
        trace(2, 3)
    trace(1, 1)  # plain 1F1B takes any micro-batch count


def test_an_idle_stage_runs_no_layer_and_no_head():
    """Counted as they run (a host callback in each layer and in the head; stage 2, 4 layers, 4 micro-batches):
    GPipe runs each micro-batch's layers once in its forward (``M L`` calls; the masked program ran every stage in
    each of its ``M + S - 1`` steps), interleaved 1F1B (``V = 2``; 1F1B is the same program) twice (the forward and
    the backward's recompute: exactly the valid items of ``pipeline_order``, ``2 M L``, where every tick's forward
    and backward on every stage would be ``2 T L / V``) and the head once per micro-batch (where every stage's tick
    would be ``T S``). The branch is taken per stage: skipped work, not masked results. (A mesh of the stage axis
    alone: a host callback inside a ``shard_map`` that leaves several axes Auto fails to lower in jax 0.10; and on
    the CPU only a stage-only mesh skips: ``skips_idle_ticks``, asserted below.)"""
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    x, target, scale, w = map(jnp.asarray, _inputs())
    graphdef, state = nnx.split(create_sharded(_stack, mesh, "default"))
    calls = {"layer": 0, "head": 0}

    def counted(name, fn):
        def run(first, h, *args):  # takes the activation: a callback that reads nothing is hoisted out of loops
            jax.debug.callback(lambda h: calls.__setitem__(name, calls[name] + 1), h, partitioned=True)
            return fn(first, h, *args)
        return run

    def gpipe(state, w, x):
        return _head(w, pipeline_stack(nnx.merge(graphdef, state), counted("layer", _layer), x, scale,
                                       microbatches=4), target)

    def one_f_one_b(state, x):  # interleaved (V = 2): the 1F1B program, with the ring and chunk moves
        return pipeline_1f1b_value_and_grad(nnx.merge(graphdef, state), counted("layer", _layer),
                                            counted("head", _head), w, x, target, scale, microbatches=4,
                                            virtual_stages=2)

    with jax.set_mesh(mesh), use_rules("default"):
        assert skips_idle_ticks()
        loss, grads = jax.jit(jax.value_and_grad(gpipe, argnums=(0, 1, 2)))(state, w, x)
        jax.effects_barrier()
        assert calls == {"layer": 4 * LAYERS, "head": 0}  # masked: (M + S - 1) S L / S = 5 * 4
    want_loss, want_grads = _want()  # the skipped GPipe, differentiated through its conds, is exact
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with jax.set_mesh(mesh), use_rules("default"):
        calls.update(layer=0, head=0)
        jax.block_until_ready(jax.jit(one_f_one_b)(state, x))
        jax.effects_barrier()
    order = pipeline_order(2, 2, 4)  # 12 ticks; masked: 2 T S L / (V S) = 48 layer calls, T S = 24 heads
    assert int(order[..., F_OK].sum() + order[..., B_OK].sum()) * LAYERS // 4 == calls["layer"] == 2 * 4 * LAYERS
    assert calls["head"] == 4
    with jax.set_mesh(make_mesh({"stage": 2, "fsdp": 4})):  # XLA:CPU: collectives in a branch can deadlock
        assert not skips_idle_ticks()


def test_both_pipelines_warn_when_xla_cpu_has_few_collective_workers(monkeypatch):
    """Traced with ``PJRT_NPROC=8`` for this process's 8 devices (one XLA:CPU collective worker each: the pool a
    pipelined step's in-flight collectives can starve), GPipe and 1F1B each warn with the fix; at conftest's 32,
    neither does."""
    mesh = make_mesh({"stage": 2}, devices=jax.devices()[:2])
    x, target, scale, w = map(jnp.asarray, _inputs())
    graphdef, state = nnx.split(create_sharded(_stack, mesh, "default"))
    programs = {"GPipe": lambda state: pipeline_stack(nnx.merge(graphdef, state), _layer, x, scale, microbatches=2),
                "1F1B": lambda state: pipeline_1f1b_value_and_grad(nnx.merge(graphdef, state), _layer, _head, w, x,
                                                                    target, scale, microbatches=2)}
    with jax.set_mesh(mesh), use_rules("default"):
        monkeypatch.setenv("PJRT_NPROC", "8")
        for name, program in programs.items():
            with pytest.warns(RuntimeWarning, match=rf"pipelined {name} step on XLA:CPU: 8 devices share 8 "
                                                    r"collective workers.*PJRT_NPROC=32"):
                jax.eval_shape(program, state)
        monkeypatch.setenv("PJRT_NPROC", "32")
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for program in programs.values():
                jax.eval_shape(lambda state, program=program: program(state), state)  # traced afresh
