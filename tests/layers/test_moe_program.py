"""The compiled MoE grad step of a stack of ``gmm`` layers (bf16 compute, float32 weights, remat ``full``): the
expert weights are cast once a step, routing moves rows by gathers only, and the layer loop copies no layer's
weights out of the stack on its own (``compiled_programs.moe_weight_ops``, as ``benchmarks/moe_program.py``
reports it for a Qwen3-MoE-shaped step)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from nnx_zoo.layers.scan import create_stack, run_stack
from nnx_zoo.layers.sparse_moe import SparseMoE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import compiled_programs as cp  # noqa: E402

EXPERTS, HIDDEN, WIDTH, LAYERS, K, BATCH, SEQ = 8, 48, 32, 2, 2, 2, 12


@pytest.fixture(scope="module")
def weight_ops() -> dict[str, dict]:
    """``moe_weight_ops`` of the grad step, ``jax.lax.ragged_dot`` as the grouped matmul (a kernel that takes a
    layer's weights whole in bf16, as tokamax does on GPUs)."""
    stack = create_stack(lambda r: SparseMoE(HIDDEN, num_experts=EXPERTS, experts_per_token=K, expert_hidden=WIDTH,
                                             renormalize=True, moe_impl="gmm", grouped_matmul_impl="xla",
                                             dtype=jnp.bfloat16, rngs=r), LAYERS, nnx.Rngs(0), "moe_layers")
    x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, HIDDEN), jnp.bfloat16)

    def loss(stack, x):
        def body(layer, h, _):
            return h + layer(h).output, None
        h, _ = run_stack(stack, body, x, remat_policy="full")
        return jnp.sum(h.astype(jnp.float32) ** 2)

    hlo = nnx.jit(nnx.grad(loss)).lower(stack, x).compile().as_text()
    return cp.moe_weight_ops(hlo, EXPERTS, HIDDEN, WIDTH, BATCH * SEQ, K)


def test_expert_weights_are_cast_once_a_step(weight_ops):
    # One cast of each stacked weight (gate, up, down), outside the layer loops: none in the forward's loop and
    # none again in the backward's recomputation (which would make 2 * LAYERS * 3).
    assert weight_ops["cast"]["runs"] == 3, weight_ops["cast"]
    assert weight_ops["cast in loops"]["runs"] == 0, weight_ops["cast in loops"]


def test_routing_gathers_rows_and_never_scatters_them(weight_ops):
    assert weight_ops["scatter"]["runs"] == 0, weight_ops["scatter"]
    assert weight_ops["gather"]["runs"] > 0, weight_ops["gather"]


def test_no_layer_weights_copied_out_of_the_stack_on_their_own(weight_ops):
    # Each layer's slice of a stacked weight is read inside its consumer's fusion (XLA:CPU), never a copy first.
    assert weight_ops["stack slice"]["runs"] == 0, weight_ops["stack slice"]
    assert weight_ops["copy"]["runs"] == 0, weight_ops["copy"]
    assert weight_ops["stack slice (fused)"]["runs"] > 0, weight_ops["stack slice (fused)"]
