"""Muon (``--optimizer muon``): each DeepSeek weight's matrix view, training progress, sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers as Dims

from nnx_zoo import DeepSeekV3
from nnx_zoo.sharding import create_sharded, get_rules, iter_variables, logical_names, logical_to_mesh_axes, make_mesh
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


def _run(mesh, steps=2):
    config = small_config(num_nextn_predict_layers=0, num_hidden_layers=1, first_k_dense_replace=0)  # 1 MoE layer
    opt = OptimizerConfig(name="muon", lr=1e-2, warmup_steps=0, schedule="constant")

    def make():
        model = DeepSeekV3(config, rngs=nnx.Rngs(0))
        return TrainState(model, make_optimizer(opt, model, steps))

    state = create_sharded(make, mesh)
    batch = _fixed_batch(config.vocab_size)
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
    experts = sharded_params["moe_layers"]["mlp"]["experts"]["wi_gate"][...]
    assert "fsdp" in str(experts.sharding.spec)  # the expert weights really were sharded
    for a, b in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(single_params)):
        # atol: AdamW divides by sqrt(v), so where a gradient is ~0 its reduction-order noise moves a weight by up
        # to ~lr * 1e-2 (seen: 3.6e-5 on one embedding entry of 32768); lr is 1e-2, so 1e-4 is 1% of a step.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
