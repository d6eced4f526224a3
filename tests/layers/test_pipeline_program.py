"""The pipeline schedules' bubble, read from the compiled program as ``benchmarks/pipeline_schedules.py`` reads it: the
matmul FLOPs in each device's program (every ``dot``, times the trip counts of the loops around it, and every branch
of a conditional as if taken, as XLA's ``cost_analysis()`` counts them) against the un-pipelined program's divided
by the stages. The SPMD pipeline puts every stage's work on every tick, in ``jax.lax.cond`` branches that an idle
stage skips (``test_pipeline_1f1b.py`` counts what runs: the valid items only), or masked where ``skips_idle_ticks``
says so; either way this static count is the tick count: GPipe runs ``M + S - 1`` forward and as many backward
ticks; 1F1B and interleaved 1F1B (V chunks per stage) run ``M V + V S + S - 2`` ticks of a chunk's forward and a
backward that recomputes the chunk (4 matmul passes for 3 useful ones), and run the head on every stage in every
tick. A schedule that grew an idle tick, or a recompute, fails here.

A toy stack (4 tanh(Linear) layers of width 16, a linear head to 5 outputs: the dim that tells the head's dots
apart) on stage 2 with 4 micro-batches (V = 2 for interleaved); four compiles of a second or so.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.pipeline import pipeline_1f1b_value_and_grad, pipeline_stack
from nnx_zoo.layers.scan import create_stack, run_stack
from nnx_zoo.sharding import create_sharded, make_mesh, use_rules

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import pipeline_schedules as ps  # noqa: E402

WIDTH, LAYERS, BATCH, SEQ, OUT = 16, 4, 8, 4, 5  # OUT: the head's output dim, no other dim's size
STAGES, MICRO, VIRTUAL = 2, 4, 2  # VIRTUAL: interleaved's chunks per stage


def _stack() -> nnx.Module:
    return create_stack(lambda r: Linear(WIDTH, WIDTH, kernel_names=("embed", "mlp"), rngs=r), LAYERS, nnx.Rngs(0),
                        "layers")


def _layer(layer, h):
    return jnp.tanh(layer(h))


def _head(w, h, target):
    return jnp.sum((h @ w - target) ** 2)


@functools.cache
def _flops() -> dict[str, dict[str, float]]:
    """Dot FLOPs per device (``{"layers", "head"}``) of the un-pipelined value-and-grad and of both schedules."""
    rng = np.random.default_rng(0)
    x, target = (jnp.asarray(rng.normal(size=(BATCH, SEQ, n)), jnp.float32) for n in (WIDTH, OUT))
    w = jnp.asarray(rng.normal(size=(WIDTH, OUT)), jnp.float32)
    mesh = make_mesh({"stage": STAGES}, devices=jax.devices()[:STAGES])
    graphdef, state = nnx.split(create_sharded(_stack, mesh, "default"))

    def plain(state, w, x):
        return _head(w, run_stack(nnx.merge(graphdef, state), lambda layer, h, _: (_layer(layer, h), None), x)[0],
                     target)

    def gpipe(state, w, x):
        return _head(w, pipeline_stack(nnx.merge(graphdef, state), _layer, x, microbatches=MICRO), target)

    def one_f_one_b(state, w, x, virtual_stages=1):
        return pipeline_1f1b_value_and_grad(nnx.merge(graphdef, state), _layer, _head, w, x, target,
                                            microbatches=MICRO, virtual_stages=virtual_stages)

    def count(fn, *args) -> dict[str, float]:
        return ps.dot_flops(jax.jit(fn).lower(*args).compile().as_text(), vocab=OUT)

    local = jax.tree.map(np.asarray, state)  # the un-pipelined program on one device
    out = {"plain": count(jax.value_and_grad(plain, argnums=(0, 1, 2)), local, w, x)}
    with jax.set_mesh(mesh), use_rules("default"):
        out["gpipe"] = count(jax.value_and_grad(gpipe, argnums=(0, 1, 2)), state, w, x)
        out["1f1b"] = count(one_f_one_b, state, w, x)
        out["interleaved"] = count(functools.partial(one_f_one_b, virtual_stages=VIRTUAL), state, w, x)
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_executed_matmul_flops_are_the_schedules_ticks(schedule):
    flops = _flops()
    useful = flops["plain"]["layers"] / STAGES
    v = VIRTUAL if schedule == "interleaved" else 1
    bubble = ps.FORMULAS[schedule][1](STAGES, MICRO, v)  # what the benchmark writes as "this program"
    assert flops[schedule]["layers"] == pytest.approx(useful / (1 - bubble), rel=1e-9)
    # chunk forwards per stage: MICRO x v useful, one per tick executed (plus the backward's recompute in 1F1B)
    ticks = MICRO + STAGES - 1 if schedule == "gpipe" else MICRO * v + v * STAGES + STAGES - 2
    assert bubble == pytest.approx(1 - MICRO / ticks if schedule == "gpipe" else 1 - 3 * MICRO * v / (4 * ticks))
    # GPipe's head runs once, outside the pipeline; 1F1B's on every stage in every tick, masked.
    head_runs = 1 if schedule == "gpipe" else ticks / MICRO
    assert flops[schedule]["head"] == pytest.approx(flops["plain"]["head"] * head_runs, rel=1e-9)
