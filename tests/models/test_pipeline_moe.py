"""The MoE families built on ``MoECausalLM`` pipelined over the ``stage`` axis, through ``CausalLM``'s pipeline walk.

A tiny MiniMax-M2 (4 layers, all MoE, 8 experts top-2; sigmoid routing with a selection bias, so the routing-bias
update has something to move; batch 8 x 16 with a padded and an all-padding row): two AdamW steps of the trainer
with the layers pipelined give the losses, the expert load balance, the gradient norm, the Adam moments, the
updated parameters and the routing biases (moved by the per-layer expert loads, summed over the micro-batches) of
the un-pipelined model on one device (float32). GPipe runs with the Switch balance loss on (``output_router_logits``,
coefficient 0.1: the per-layer ``BalanceSums`` summed over the micro-batches, pooled over the layers, give the whole
batch's loss and gradient); 1F1B and interleaved refuse that loss (its gradient needs the whole batch's expert
counts before the first backward) and run with it off. Helpers and tolerances are ``test_pipeline``'s. And a tiny
Qwen3-Next (gated delta-rule and full layers, MoE MLPs, MTP depth 1): its pipelined GPipe forward (the MTP depth
after the pipeline) gives the logits and MTP logits of the un-pipelined model.

Cost: one pipelined train step compiled per case plus a one-device reference per config. CI runs stage 2 x expert
2 x fsdp 2, interleaved (V = 2: stage 0 runs layers 0 and 2) under Auto; GPipe under Explicit with the Switch loss
runs in CI in ``test_pipeline_uneven`` (the same MiniMax-M2 with a layer before the pipeline, a superset).
``NNX_ZOO_FULL_MATRIX=1`` adds the other mode of each, 1F1B in both modes, and stage 4 x fsdp 2 with and without 2
accumulation steps (GPipe and 1F1B; against one device with the same accumulation steps).
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import Qwen3Next, Qwen3NextConfig
from nnx_zoo.models.minimax_m2 import MiniMaxM2, MiniMaxM2Config
from nnx_zoo.sharding import get_rules, iter_variables, make_mesh, state_shardings
from tests.models.dense_reference import rel_err
from tests.models.test_pipeline import OPTIMIZER, _arrays, drawn_parts, train_two_steps

VOCAB = 128
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
# aux: the Switch loss on (GPipe); plain: off (the loss-inside schedules refuse it).
CONFIGS = {"aux": MiniMaxM2Config.preset("minimax-m2-tiny", **SIZES, output_router_logits=True,
                                         router_aux_loss_coef=0.1),
           "plain": MiniMaxM2Config.preset("minimax-m2-tiny", **SIZES)}
METRICS = ("loss", "grad_norm", "aux_loss", "expert_max_over_mean")
STEP = dict(routing_bias_rate=1e-3, model_kwargs=(("with_expert_load", True),))
MESHES = {"stage2-expert2-fsdp2": ({"stage": 2, "expert": 2, "fsdp": 2}, 2, 8),
          "stage4-fsdp2": ({"stage": 4, "fsdp": 2}, 4, 8)}
CASES = [("stage2-expert2-fsdp2", "auto", 1, "interleaved")]
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    CASES += [("stage2-expert2-fsdp2", mode, 1, "gpipe") for mode in ("auto", "explicit")]
    CASES += [("stage2-expert2-fsdp2", "explicit", 1, "interleaved")]
    CASES += [("stage2-expert2-fsdp2", mode, 1, "1f1b") for mode in ("auto", "explicit")]
    CASES += [("stage4-fsdp2", mode, accum, schedule) for mode, accum, schedule in
              (("auto", 2, "gpipe"), ("explicit", 1, "gpipe"), ("explicit", 2, "1f1b"), ("auto", 1, "1f1b"))]


@functools.cache
def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    ids = rng.integers(0, VOCAB, (8, 17))
    mask = np.ones((8, 16), np.int32)
    mask[0, :5] = 0  # left padding: the balance sums count real tokens only
    mask[5, :] = 0  # an all-padding row
    return {"input_ids": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
            "attention_mask": mask, "loss_mask": mask}


def _config_of(schedule: str) -> str:
    return "aux" if schedule == "gpipe" else "plain"


@functools.cache
def _parts(config: str):
    return drawn_parts(lambda: MiniMaxM2(CONFIGS[config], rngs=nnx.Rngs(0)))


def _metrics(config: str) -> tuple[str, ...]:
    return METRICS if config == "aux" else tuple(m for m in METRICS if m != "aux_loss")


def _biases(model: MiniMaxM2) -> list[np.ndarray]:
    return _arrays(nnx.state(model, nnx.Not(nnx.Param)))


@functools.cache
def _one_device(config: str, accum_steps: int = 1):
    # With the accumulation steps of the pipelined run: the Switch loss is a product of means over one forward's
    # tokens, so accumulation counts it per accumulation step (moe_causal_lm's docstring), where the pipeline's
    # micro-batches pool it exactly.
    history, model, optimizer = train_two_steps(None, accum_steps, parts=_parts(config), batch=_batch(),
                                                metric_names=_metrics(config), **STEP)
    return (history, _arrays(nnx.state(model, nnx.Param)), _arrays(nnx.state(optimizer, nnx.optimizer.OptState)),
            _biases(model))


@pytest.mark.parametrize(("mesh_name", "mode", "accum_steps", "schedule"), CASES)
def test_pipelined_moe_adamw_steps_match_one_device(mesh_name, mode, accum_steps, schedule):
    sizes, micro, devices = MESHES[mesh_name]
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:devices])
    config = _config_of(schedule)
    step = dict(STEP)
    if schedule == "interleaved":
        step["model_kwargs"] += (("pipeline_virtual_stages", 2),)
    history, model, optimizer = train_two_steps(mesh, accum_steps, micro // accum_steps, schedule,
                                                parts=_parts(config), batch=_batch(), metric_names=_metrics(config),
                                                **step)
    want_history, want_params, want_moments, want_biases = _one_device(config, accum_steps)
    np.testing.assert_allclose(history, want_history, rtol=1e-5)
    assert history[1][0] < history[0][0]  # it learns
    if config == "aux":
        assert min(h[2] for h in history) > 0  # the balance loss is on
    for got, want in zip(_arrays(nnx.state(model, nnx.Param)), want_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0.1 * OPTIMIZER.lr)
    for got, want in zip(_arrays(nnx.state(optimizer, nnx.optimizer.OptState)), want_moments, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    # The routing biases moved by rate * sign(mean load - load): equal biases mean equal expert loads per layer.
    assert any(np.abs(b).max() > 0 for b in want_biases)
    for got, want in zip(_biases(model), want_biases, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    rules = get_rules("default")
    for state in (nnx.state(model), nnx.state(optimizer, nnx.optimizer.OptState)):
        for (path, var), want in zip(iter_variables(state), state_shardings(state, mesh, rules)):
            assert var[...].sharding.is_equivalent_to(want, var.ndim), path
    assert model.layers.mlp.router[...].sharding.spec[0] == "stage"  # each stage holds its layers


def test_what_the_pipelined_moe_forward_does_not_run_is_refused():
    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    ids = np.zeros((8, 16), np.int32)
    model = nnx.merge(*_parts("aux"))
    for kwargs, message in [
        (dict(pipeline_schedule="1f1b", loss_targets=(ids, ids)),
         r"pipeline_schedule='1f1b' with the Switch balance loss .* Use pipeline_schedule='gpipe'"),
        (dict(pipeline_schedule="interleaved", loss_targets=(ids, ids)),
         r"pipeline_schedule='interleaved' with the Switch balance loss"),
        (dict(with_routing=True), "with_hidden_states / with_routing are not supported on a mesh with a 'stage'"),
    ]:
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
            nnx.eval_shape(lambda m, x, kw=kwargs: m.forward(x, pipeline_microbatches=2, **kw), model, ids)
    # Qwen3-Next's MTP depth runs after the GPipe pipeline only.
    config = Qwen3NextConfig.preset("qwen3-next-tiny", mtp_num_hidden_layers=1)
    next_model = nnx.eval_shape(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"'1f1b' with the MTP depth .* not supported yet"):
        nnx.eval_shape(lambda m, x: m.forward(x, with_mtp=True, pipeline_microbatches=2, pipeline_schedule="1f1b",
                                              loss_targets=(x, x)), next_model, ids)


def test_qwen3_next_mtp_depth_runs_after_the_gpipe_pipeline():
    # Qwen3-Next (gated delta-rule and full layers, MoE MLPs) pipelined with its MTP depth after the pipeline: the
    # logits and the MTP logits of the un-pipelined model; the MTP stack stays whole on every stage.
    config = Qwen3NextConfig.preset("qwen3-next-tiny", vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16,
                                    shared_expert_intermediate_size=16, mtp_num_hidden_layers=1)
    graphdef, state = drawn_parts(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    ids = _batch()["input_ids"]
    want = nnx.merge(graphdef, state).forward(ids, with_mtp=True)
    mesh = make_mesh({"stage": 2, "expert": 2, "fsdp": 2}, shard_mode="explicit")
    state = jax.tree.unflatten(jax.tree.structure(state), list(map(
        jax.device_put, jax.tree.leaves(state), state_shardings(state, mesh, get_rules("default")))))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x, with_mtp=True, pipeline_microbatches=2)[:3])(
            state, ids)
    # The Qwen3-Next tests' measure (max error over max value): plain FSDP 4 x expert 2 against one device,
    # un-pipelined, differs as much (3e-6 here).
    assert rel_err(got[0], want.logits) < 1e-5 and rel_err(got[2], want.mtp_logits) < 1e-5
    model = nnx.merge(graphdef, state)
    assert model.mtp.layers.attn.q_proj.kernel[...].sharding.spec[0] is None
    assert model.linear_layers.attn.out_proj.kernel[...].sharding.spec[0] == "stage"
