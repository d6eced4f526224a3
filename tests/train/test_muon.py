"""Muon (``--optimizer muon``): each DeepSeek weight's matrix view, training progress, sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


class _MuonShapes(nnx.Module):
    """One weight of each matrix view Muon takes (plain, heads folded into the output, heads folded into the input,
    a layer stack), with an embedding table on AdamW beside them; values drawn with numpy."""

    def __init__(self, values: dict[str, np.ndarray]):
        names = {"up": ("embed", "mlp"), "wq": ("embed", "heads", "kv"), "wo": ("heads", "kv", "embed"),
                 "stack": ("layers", "embed", "mlp"), "embed": ("vocab", "embed")}
        for key, value in values.items():
            setattr(self, key, nnx.Param(jnp.asarray(value), out_sharding=names[key], eager_sharding=False))


# Each Muon weight as the 2-D matrices optax.contrib.muon sees by default: [inputs, outputs], one per layer.
_AS_MATRICES = {
    "up": lambda w: {"up": w},
    "wq": lambda w: {"wq": w.reshape(w.shape[0], -1)},
    "wo": lambda w: {"wo": w.reshape(-1, w.shape[-1])},
    "stack": lambda w: {f"stack{i}": w[i] for i in range(w.shape[0])},
}


def test_muon_updates_equal_optax_contrib_muon_on_the_matrices():
    """The first two updates of every Muon weight equal ``optax.contrib.muon``'s on the same weights laid out by
    hand as plain 2-D ``[inputs, outputs]`` matrices (one per layer of a stack), with the same learning rate,
    momentum, Newton-Schulz steps, weight decay and Moonlight's consistent-RMS scale 0.2 (so every Muon update has
    RMS about 0.2 * lr, AdamW's); the embedding table's equal ``optax.adamw``'s. A wrong scale factor, matrix view
    or hyper-parameter moves the updates by percents; the tolerance (rtol 1e-4) covers float32 rounding of the same
    matrix products batched and laid out differently."""
    rng = np.random.default_rng(0)
    shapes = {"up": (16, 24), "wq": (16, 2, 8), "wo": (2, 8, 16), "stack": (3, 16, 8), "embed": (32, 16)}
    values = {k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.normal(0, 1.0, s).astype(np.float32) for k, s in shapes.items()} for _ in range(2)]
    cfg = OptimizerConfig(name="muon", lr=0.02, warmup_steps=0, schedule="constant", weight_decay=0.1,
                          clip_norm=0.0, muon_beta=0.9, muon_ns_steps=4)
    model = _MuonShapes(values)
    optimizer = make_optimizer(cfg, model, 10)

    @nnx.jit
    def step(model, optimizer, grads):
        # d/dw of sum(w * g) is g: the optimizer is handed exactly these gradients.
        g = nnx.grad(lambda m: sum(jnp.sum(getattr(m, k)[...] * v) for k, v in grads.items()))(model)
        optimizer.update(model, g)

    muon = optax.contrib.muon(0.02, ns_steps=4, beta=0.9, weight_decay=0.1, consistent_rms=0.2)
    adamw = optax.adamw(0.02, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.1)
    muon_update, adamw_update = jax.jit(muon.update), jax.jit(adamw.update)
    matrices = {name: m for k, f in _AS_MATRICES.items() for name, m in f(values[k]).items()}
    states = muon.init(matrices), adamw.init(values["embed"])
    table = values["embed"]
    for g in grads:
        before = {k: np.asarray(getattr(model, k)[...]) for k in shapes}
        step(model, optimizer, g)
        ours = {k: np.asarray(getattr(model, k)[...]) - before[k] for k in shapes}
        g_matrices = {name: m for k, f in _AS_MATRICES.items() for name, m in f(g[k]).items()}
        updates, muon_state = muon_update(g_matrices, states[0], matrices)
        matrices = optax.apply_updates(matrices, updates)
        table_update, adamw_state = adamw_update(g["embed"], states[1], table)
        table = optax.apply_updates(table, table_update)
        states = muon_state, adamw_state
        for k, f in _AS_MATRICES.items():
            for name, ours_matrix in f(ours[k]).items():
                np.testing.assert_allclose(ours_matrix, updates[name], rtol=1e-4, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(ours["embed"], table_update, rtol=1e-4, atol=1e-7)
        rms = np.sqrt(np.mean(ours["up"] ** 2))
        assert 0.5 * 0.2 * 0.02 < rms < 1.5 * 0.2 * 0.02, rms  # consistent RMS, near AdamW's (Moonlight)
