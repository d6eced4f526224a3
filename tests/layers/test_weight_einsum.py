"""weight_einsum under Explicit meshes: the numbers of a plain einsum, and the cheaper of the two ways to serve a
mesh axis that splits both the contracted dim and the weight's output dim."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.layers.spec import weight_einsum
from nnx_zoo.sharding import make_mesh, use_rules

# SEQ = 12 makes every activation's element count a multiple of 3 and every weight's a power of two, so the
# collectives that move activations can be told apart after XLA's reshapes.
BATCH, SEQ, NARROW, WIDE = 8, 12, 64, 512
# Under the default rules on fsdp 4 + tensor_transpose 2 the activations' model width is split over
# tensor_transpose, and so are the vocabulary / mlp widths: both dims of the up- and down-projections.
SIZES = {"fsdp": 4, "tensor_transpose": 2}


def _activation_collectives(hlo: str) -> list[int]:
    """Element counts of the activation arrays (multiples of 3) that collectives in ``hlo`` take or give."""
    counts = []
    for line in hlo.splitlines():
        if re.search(r" (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line):
            line = re.sub(r"metadata=\{.*", "", line)
            for dims in re.findall(r"f32\[([\d,]*)\]", line):
                n = int(np.prod([int(d) for d in dims.split(",") if d]))
                if n % 3 == 0:
                    counts.append(n)
    return counts


@pytest.mark.parametrize(("d_in", "d_out", "out_name"), [
    (NARROW, WIDE, "activation_vocab"),  # lm_head / up-projection: the output is the wide side
    (WIDE, NARROW, "activation_embed"),  # down-projection: the input is the wide side
])
def test_explicit_weight_einsum_moves_the_narrow_side_only(d_in, d_out, out_name):
    names = ("activation_batch", "activation_length", out_name)
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(BATCH, SEQ, d_in)).astype(np.float32)
    w_np = rng.normal(size=(d_in, d_out)).astype(np.float32) / np.sqrt(d_in)

    def loss(x, w):
        return jnp.sum(jnp.sin(weight_einsum("bsi,io->bso", x, w, names)))

    want_value, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(x_np, w_np)
    mesh = make_mesh(SIZES, shard_mode="explicit")
    with jax.set_mesh(mesh), use_rules("default"):
        x = jax.device_put(x_np, jax.P("fsdp", None, "tensor_transpose"))
        w = jax.device_put(w_np, jax.P(("fsdp", "tensor_transpose") if d_in == NARROW else "fsdp",
                                       None if d_in == NARROW else "tensor_transpose"))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile()  # compiled once
        value, grads = step(x, w)
        out = jax.jit(lambda x, w: weight_einsum("bsi,io->bso", x, w, names))(x, w)
        hlo = step.as_text()
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(grads, want_grads):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert jax.typeof(grads[0]).sharding.spec == jax.typeof(x).sharding.spec
    assert jax.typeof(grads[1]).sharding.spec == jax.typeof(w).sharding.spec
    assert jax.typeof(out).sharding.spec == jax.P("fsdp", None, "tensor_transpose")
    # Activations cross devices only at their narrow width: the wide side is never gathered, and no device
    # builds wide partial sums to reduce-scatter (what a contraction split over tensor_transpose would do).
    moved = _activation_collectives(hlo)
    assert moved, "expected activations to cross devices"
    assert max(moved) <= BATCH // SIZES["fsdp"] * SEQ * NARROW, sorted(set(moved))


# ---- single device: the row-major backward (_einsum_row_major_grads) ----

@pytest.mark.parametrize(("equation", "expected"), [
    ("cda,ab->cdb", 2),  # Linear on [batch, seq, in]: the lm_head
    ("th,hx->tx", 1),  # fused expert gate/up projection
    ("tei,eih->th", 1),  # expert down-projection, contracting (expert, width)
    ("dea,abc->debc", 2),  # Linear into (heads, head_dim)
    ("deab,abc->dec", 2),  # Linear out of (heads, head_dim)
    ("bthn,chn->bthc", None),  # weight's contracted dims are not leading
    ("bse,ve->bsv", None),  # tied embedding: table is [vocab, embed]
    ("th,he->et", None),  # output dims reordered
])
def test_matmul_shape_recognises_plain_matmuls_only(equation, expected):
    from nnx_zoo.layers.spec import _matmul_shape

    assert _matmul_shape(equation) == expected


@pytest.mark.parametrize(("equation", "x_shape", "w_shape"), [
    ("cda,ab->cdb", (2, 6, 8), (8, 40)),
    ("tei,eih->th", (12, 4, 5), (4, 5, 8)),
    ("deab,abc->dec", (2, 3, 4, 5), (4, 5, 6)),
])
def test_row_major_backward_equals_autodiff(equation, x_shape, w_shape):
    """Single device: values and both gradients equal those of a plain einsum (float32)."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    out_shape = jax.eval_shape(lambda: jnp.einsum(equation, x, w)).shape
    cotangent = jax.random.normal(kg, out_shape)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * cotangent)

    ours = jax.jit(jax.value_and_grad(loss(lambda x, w: weight_einsum(equation, x, w, (None,) * len(out_shape))),
                                      argnums=(0, 1)))(x, w)
    plain = jax.value_and_grad(loss(lambda x, w: jnp.einsum(equation, x, w)), argnums=(0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # The hand-written backward is in use (not autodiff's dot_general for the weight gradient).
    assert "custom_vjp_call" in str(jax.make_jaxpr(
        lambda x, w: weight_einsum(equation, x, w, (None,) * len(out_shape)))(x, w))


@pytest.mark.parametrize(("devices", "used"), [(8, False), (1, True)])
def test_row_major_backward_is_single_device_only(devices, used):
    """Under a mesh of several devices the sharding-aware path decides and the custom backward is not used; a
    one-device mesh (the trainer always sets one) is a single device."""
    mesh = make_mesh({"fsdp": devices}, shard_mode="auto", devices=jax.devices()[:devices])
    x, w = jnp.ones((8, 4, 16)), jnp.ones((16, 32))
    with jax.set_mesh(mesh), use_rules("default"):
        jaxpr = str(jax.make_jaxpr(lambda w: weight_einsum("cda,ab->cdb", x, w, (None,) * 3))(w))
    assert ("custom_vjp_call" in jaxpr) == used
