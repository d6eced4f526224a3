"""Muon (``--optimizer muon``): each DeepSeek weight's matrix view, training progress, sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers as Dims

from nnx_zoo import DeepSeekV3
from nnx_zoo.layers.spec import weight_einsum
from nnx_zoo.sharding import (
    create_sharded,
    get_rules,
    iter_variables,
    logical_names,
    logical_to_mesh_axes,
    make_mesh,
    shard,
)
from nnx_zoo.train import OptimizerConfig, TrainState, make_optimizer, train_step
from nnx_zoo.train.optim import muon_dimension_numbers
from tests.models.deepseek.small import small_config
from tests.train.toy_lm import ToyLM

# Every DeepSeek parameter kind (path with the stack prefix removed) -> its expected Muon view (None: AdamW).
EXPECTED = {
    "attn.q_a_proj.kernel": Dims((1,), (2,)),  # [layer, embed | q_lora]
    "attn.q_b_proj.kernel": Dims((1,), (2, 3)),  # [layer, q_lora | heads*kv]: heads fold into the output
    "attn.kv_a_proj.kernel": Dims((1,), (2,)),
    "attn.kv_b_proj.kernel": Dims((1,), (2, 3)),
    "attn.o_proj.kernel": Dims((1, 2), (3,)),  # [layer, heads*kv | embed]: heads fold into the input
    "mlp.gate.kernel": Dims((1,), (2,)),
    "mlp.up.kernel": Dims((1,), (2,)),
    "mlp.down.kernel": Dims((1,), (2,)),
    "mlp.router": Dims((1,), (2,)),
    "mlp.experts.wi_gate": Dims((2,), (3,)),  # [layer, expert, embed | moe_mlp]: one matrix per expert
    "mlp.experts.wi_up": Dims((2,), (3,)),
    "mlp.experts.wo": Dims((2,), (3,)),
    "mlp.shared_experts.gate.kernel": Dims((1,), (2,)),
    "mlp.shared_experts.up.kernel": Dims((1,), (2,)),
    "mlp.shared_experts.down.kernel": Dims((1,), (2,)),
    "eh_proj.kernel": Dims((1,), (2,)),
    "embed.embedding": None,
    "lm_head.kernel": None,
    "scale": None,  # every RMSNorm
}


def _kind(path: str) -> str:
    path = path.split(".", 1)[1] if path.split(".")[0].endswith("_layers") else path
    path = path.removeprefix("layer.")  # the MTP head's decoder layer
    return "scale" if path.endswith(".scale") else path


def test_dimension_numbers_of_every_deepseek_parameter():
    model = nnx.eval_shape(lambda: DeepSeekV3(small_config(), rngs=nnx.Rngs(0)))
    seen = set()
    for path, var in iter_variables(nnx.state(model, nnx.Param)):
        kind = _kind(path)
        assert kind in EXPECTED, f"no expectation for {path}"
        assert muon_dimension_numbers(logical_names(var), var.shape, path) == EXPECTED[kind], path
        seen.add(kind)
    assert seen == set(EXPECTED)


@pytest.mark.parametrize("preset", ["llama3-tiny", "qwen3-tiny"])
def test_dimension_numbers_of_the_dense_families(preset):
    """Grouped-query K/V kernels ``[layers, embed, kv_heads, kv]`` are one ``embed x (kv_heads*kv)`` matrix per
    layer, like the query's; norms, embedding and head stay on AdamW."""
    from nnx_zoo import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.preset(preset)
    model = nnx.eval_shape(lambda: AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0)))
    dims = {path: muon_dimension_numbers(logical_names(var), var.shape, path)
            for path, var in iter_variables(nnx.state(model, nnx.Param))}
    by_kind = {path.split(".", 1)[1]: d for path, d in dims.items() if path.startswith("layers.")}
    assert by_kind["attn.q_proj.kernel"] == by_kind["attn.k_proj.kernel"] == Dims((1,), (2, 3))
    assert by_kind["attn.o_proj.kernel"] == Dims((1, 2), (3,))
    assert by_kind["mlp.up.kernel"] == Dims((1,), (2,))
    assert {path for path, d in dims.items() if d is None} == {
        path for path in dims if "norm" in path or path.startswith(("embed", "lm_head"))}


def test_unreadable_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot tell the input dims from the output dims"):
        muon_dimension_numbers(("embed", "heads", "mlp"), (4, 2, 8), "odd.kernel")
    assert muon_dimension_numbers(("moe_layers", "exp"), (2, 8)) is None  # a vector per (layer, expert)


def _fixed_batch(vocab, rows=8, seq=16):
    ids = jax.random.randint(jax.random.key(1), (rows, seq + 1), 0, vocab)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((rows, seq), jnp.float32)}


def test_muon_lowers_the_loss_of_a_toy_model():
    model = ToyLM(32, 16, nnx.Rngs(0))
    optimizer = make_optimizer(OptimizerConfig(name="muon", lr=0.1, warmup_steps=0, schedule="constant"), model, 20)
    step = nnx.jit(train_step)
    batch = _fixed_batch(32)
    up_before = model.up[...]
    losses = [float(step(model, optimizer, batch)["loss"]) for _ in range(8)]
    assert losses[-1] < 0.8 * losses[0], losses
    # The Muon half really orthogonalizes: the first update of `up` has near-equal singular values.
    model2 = ToyLM(32, 16, nnx.Rngs(0))
    opt2 = make_optimizer(OptimizerConfig(name="muon", lr=1.0, warmup_steps=0, schedule="constant",
                                          weight_decay=0.0, clip_norm=0.0), model2, 1)
    step(model2, opt2, batch)
    singular = np.linalg.svd(np.asarray(model2.up[...] - up_before), compute_uv=False)
    assert singular.max() / singular.min() < 2.0, singular  # a raw gradient step has a far wider spread


class ToyStack(nnx.Module):
    """The weight kinds Muon must handle, small: heads folded in and out, stacked per-layer experts, a norm."""

    def __init__(self, rngs: nnx.Rngs, vocab=32, embed=16, heads=2, kv=8, layers=2, experts=4, hidden=8):
        init = nnx.initializers.normal(0.1)
        p = lambda shape, names: nnx.Param(init(rngs.params(), shape), out_sharding=names, eager_sharding=False)  # noqa: E731
        self.embed = p((vocab, embed), ("vocab", "embed"))
        self.wq = p((embed, heads, kv), ("embed", "heads", "kv"))
        self.wo = p((heads, kv, embed), ("heads", "kv", "embed"))
        self.wi = p((layers, experts, embed, hidden), ("moe_layers", "exp", "embed_no_exp", "moe_mlp"))
        self.we = p((layers, experts, hidden, embed), ("moe_layers", "exp", "moe_mlp", "embed_no_exp"))
        self.scale = nnx.Param(jnp.ones((embed,)), out_sharding=("norm",), eager_sharding=False)
        self.head = p((embed, vocab), ("embed", "vocab"))

    def __call__(self, input_ids, attention_mask=None):
        acts = ("activation_batch", "activation_length")
        one_hot = jax.nn.one_hot(input_ids, self.embed.shape[0], dtype=jnp.float32)
        h = weight_einsum("blv,ve->ble", one_hot, self.embed[...], (*acts, "activation_embed"))
        q = jnp.tanh(weight_einsum("ble,ehk->blhk", h, self.wq[...], (*acts, "activation_heads", "activation_kv")))
        h = h + weight_einsum("blhk,hke->ble", q, self.wo[...], (*acts, "activation_embed"))
        for layer in range(self.wi.shape[0]):  # every expert on every token, averaged
            mid = jax.nn.silu(weight_einsum("ble,xeh->blxh", h, self.wi[layer],
                                            (*acts, "activation_exp", "activation_moe_mlp")))
            h = h + weight_einsum("blxh,xhe->ble", mid, self.we[layer], (*acts, "activation_embed")) / 4
        h = shard(h * self.scale[...], (*acts, "activation_embed"))
        return weight_einsum("ble,ev->blv", h, self.head[...], (*acts, "activation_vocab"))


def _run(mesh, steps=3):
    opt = OptimizerConfig(name="muon", lr=1e-2, warmup_steps=0, schedule="constant")

    def make():
        model = ToyStack(nnx.Rngs(0))
        return TrainState(model, make_optimizer(opt, model, steps))

    state = create_sharded(make, mesh)
    batch = _fixed_batch(32)
    step = nnx.jit(train_step)
    with jax.set_mesh(mesh):
        spec = logical_to_mesh_axes(("activation_batch", "activation_length"), get_rules("default"), mesh)
        batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, spec))
        losses = [float(step(state.model, state.optimizer, batch)["loss"]) for _ in range(steps)]
    return losses, nnx.state(state.model, nnx.Param)


def test_muon_on_an_explicit_fsdp_mesh_matches_one_device():
    with jax.default_matmul_precision("highest"):
        single, single_params = _run(make_mesh({"fsdp": 1}, devices=jax.devices()[:1]))
        sharded, sharded_params = _run(make_mesh({"fsdp": 8}, shard_mode="explicit"))
    np.testing.assert_allclose(sharded, single, rtol=2e-5)
    assert "fsdp" in str(sharded_params["wi"][...].sharding.spec)  # the expert weights really were sharded
    for a, b in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(single_params)):
        # atol: AdamW divides by sqrt(v), so where a gradient is ~0 its reduction-order noise moves a weight by up
        # to ~lr * 1e-2 (seen on the DeepSeek model: 3.6e-5 on one embedding entry of 32768); 1e-4 is 1% of a step.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
