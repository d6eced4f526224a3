"""DeepSeek-V3 (MoE, MTP, sequence-wise balance loss, routing-bias balancing) pipelined over the ``stage`` axis.

A tiny DeepSeek-V3 (1 dense + 4 MoE layers, 8 experts top-2, MTP depth 1, batch 8 x 16): two AdamW steps of the
trainer with the MoE stack pipelined give the main loss, the MTP loss, the balance loss, the expert load balance,
the gradient norm, the Adam moments, the updated parameters and the routing biases moved by the expert loads of
the un-pipelined model on one device (float32). The dense prefix runs before the pipeline, whole on every stage;
the MoE layers' per-layer aux terms come out of the pipeline summed over the micro-batches. GPipe
(``pipeline_stack(..., with_aux=True)``): the MTP head and head after it, on every stage. 1F1B
(``pipeline_1f1b_value_and_grad(..., with_aux=True)``): the MTP head and head on the last stage, the MTP and
balance losses differentiated inside the program with the trainer's weights. Interleaved 1F1B (2 virtual stages
on stage 2: stage 0 runs MoE layers 0 and 2, stage 1 layers 1 and 3): the same, with the per-layer expert loads
moved back into model order (the routing biases they move would differ otherwise). Helpers are
``test_pipeline``'s.

Cost: one pipelined train step compiled per case plus the one-device reference. CI runs stage 2 x expert 2 x
fsdp 2, no case: interleaved (V = 2) under Auto (10-11 s here after the reference) is in the full matrix, paying for
``test_pipeline_deepseek4``'s CI case (interleaved runs DeepSeek's 1F1B code below with ``V`` passed on; its chunk
moves with per-layer expert loads back in model order and the routing biases they move are in CI on MiniMax-M2,
``test_pipeline_moe``, Auto, and per stack in ``tests/layers/test_pipeline_stacks.py``); GPipe under Explicit there
runs in CI in ``test_pipeline_uneven`` (on a model with an MoE layer before the pipeline), and here in the full
matrix. 1F1B is interleaved's ``V = 1`` case: the
DeepSeek code (``DeepSeekV3._one_f_one_b``: layer aux terms, MTP heads and losses on the last stage) is one path
for both, ``V`` only passed on, and what ``V`` changes (chunks moved to their stages and back) is inside
``pipeline_1f1b_value_and_grad``, whose 1F1B case CI covers in ``test_pipeline`` and ``test_pipeline_1f1b``.
CI also runs 1F1B on stage 2 x tensor 2 x fsdp 2 under Explicit: with the vocabulary on ``tensor`` the MTP tokens'
embedding inside the pipeline is ``Embed``'s per-vocab-shard lookup (XLA:CPU's partitioner aborts on the plain
gather there, ``benchmarks/repro_vocab_gather_abort.py``), and heads, MLP widths and experts' widths are split over
``tensor`` inside each stage.
``NNX_ZOO_FULL_MATRIX=1`` adds the other mode of each, 1F1B in both modes, stage 4 x fsdp 2 in both modes with
and without 2 accumulation steps for GPipe and 1F1B (4 MoE layers do not split into 2 chunks on 4 stages),
interleaved on stage 2 x fsdp 2 (4 devices) in both modes with and without 2 accumulation steps, and the tensor
meshes: stage 2 x tensor 2 x fsdp 2 (every schedule, both modes), stage 2 x tensor 2 x expert 2 (1F1B and
interleaved, both modes), stage 4 x tensor 2 (GPipe and 1F1B, both modes).
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.sharding import get_rules, iter_variables, make_mesh, state_shardings
from tests.models.test_pipeline import OPTIMIZER, _arrays, drawn_parts, train_two_steps

VOCAB = 128
CONFIG = DeepSeekV3Config.preset(
    "deepseek3-mini", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=5, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
    topk_group=1, num_nextn_predict_layers=1, seq_aux_loss_alpha=0.01, max_position_embeddings=64)
METRICS = ("loss", "grad_norm", "mtp1", "aux_loss", "expert_max_over_mean")
STEP = dict(mtp_weight=0.3, routing_bias_rate=1e-3, metric_names=METRICS,
            model_kwargs=(("with_mtp", True), ("with_expert_load", True)))
# name -> (mesh sizes, pipeline micro-batches per step, devices): interleaved needs a multiple of the 2 stages per
# accumulation step, and each micro-batch's rows must divide over the batch's mesh axes (fsdp, expert).
MESHES = {"stage2-expert2-fsdp2": ({"stage": 2, "expert": 2, "fsdp": 2}, 2, 8),
          "stage4-fsdp2": ({"stage": 4, "fsdp": 2}, 4, 8),
          "stage2-fsdp2": ({"stage": 2, "fsdp": 2}, 4, 4),
          "stage2-tensor2-fsdp2": ({"stage": 2, "tensor": 2, "fsdp": 2}, 2, 8),
          "stage2-tensor2-expert2": ({"stage": 2, "tensor": 2, "expert": 2}, 2, 8),
          "stage4-tensor2": ({"stage": 4, "tensor": 2}, 4, 8)}
# GPipe Explicit on stage 2 x expert 2 x fsdp 2 runs in CI in test_pipeline_uneven (the same mesh, mode and
# schedule, on 1 dense + 5 MoE layers with the first MoE layer before the pipeline); interleaved under Auto is in the
# full matrix, paying for test_pipeline_deepseek4's CI case (module docstring).
# 1F1B with 4 devices inside a stage (stage 2 x tensor 2 x fsdp 2) intermittently aborts in XLA:CPU's collective
# rendezvous when compiled steps alternate in one process (README: idle ticks), so CI runs stage 4 x tensor 2.
CASES = [("stage4-tensor2", "explicit", 1, "1f1b")]
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    CASES += [("stage2-expert2-fsdp2", mode, 1, "interleaved") for mode in ("auto", "explicit")]
    CASES += [("stage2-expert2-fsdp2", mode, 1, "gpipe") for mode in ("auto", "explicit")]
    CASES += [("stage2-expert2-fsdp2", mode, 1, "1f1b") for mode in ("auto", "explicit")]
    CASES += [("stage4-fsdp2", mode, accum, schedule) for mode in ("auto", "explicit") for accum in (1, 2)
              for schedule in ("gpipe", "1f1b")]
    CASES += [("stage2-fsdp2", mode, accum, "interleaved") for mode in ("auto", "explicit") for accum in (1, 2)]
    CASES += [("stage2-tensor2-fsdp2", mode, 1, schedule) for mode in ("auto", "explicit")
              for schedule in ("gpipe", "1f1b", "interleaved")]
    CASES += [("stage2-tensor2-expert2", mode, 1, schedule) for mode in ("auto", "explicit")
              for schedule in ("1f1b", "interleaved")]
    CASES += [("stage4-tensor2", mode, 1, schedule) for mode in ("auto", "explicit") for schedule in ("gpipe", "1f1b")
              if (mode, schedule) != ("explicit", "1f1b")]
VIRTUAL_STAGES = 2  # interleaved: 4 MoE layers in 4 chunks of 1, stage s holding chunks s and 2 + s


@functools.cache
def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (8, 17))
    mask = np.ones((8, 16), np.int32)
    mask[0, :5] = 0  # left padding
    mask[5, :] = 0  # an all-padding row: the balance loss is a mean over the sequences holding a real token
    return {"input_ids": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
            "attention_mask": mask, "loss_mask": mask}


@functools.cache
def _parts():
    return drawn_parts(lambda: DeepSeekV3(CONFIG, rngs=nnx.Rngs(0)))


def _biases(model: DeepSeekV3) -> list[np.ndarray]:
    return _arrays(nnx.state(model, nnx.Not(nnx.Param)))


@functools.cache
def _one_device():
    history, model, optimizer = train_two_steps(None, parts=_parts(), batch=_batch(), **STEP)
    return (history, _arrays(nnx.state(model, nnx.Param)), _arrays(nnx.state(optimizer, nnx.optimizer.OptState)),
            _biases(model))


@pytest.mark.parametrize(("mesh_name", "mode", "accum_steps", "schedule"), CASES)
def test_pipelined_deepseek_adamw_steps_match_one_device(mesh_name, mode, accum_steps, schedule):
    sizes, micro, devices = MESHES[mesh_name]
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:devices])
    step = dict(STEP)
    if schedule == "interleaved":
        step["model_kwargs"] += (("pipeline_virtual_stages", VIRTUAL_STAGES),)
    history, model, optimizer = train_two_steps(mesh, accum_steps, micro // accum_steps, schedule, parts=_parts(),
                                                batch=_batch(), **step)
    want_history, want_params, want_moments, want_biases = _one_device()
    np.testing.assert_allclose(history, want_history, rtol=1e-5)
    assert history[1][0] < history[0][0] and min(h[3] for h in history) > 0  # it learns; the balance loss is on
    # As in test_pipeline: parameters to a tenth of lr (Adam's normalised update of near-cancelling gradient
    # elements), the gradients themselves sharply through the moments.
    for got, want in zip(_arrays(nnx.state(model, nnx.Param)), want_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0.1 * OPTIMIZER.lr)
    for got, want in zip(_arrays(nnx.state(optimizer, nnx.optimizer.OptState)), want_moments, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    # The routing biases moved by rate * sign(mean load - load): equal biases mean equal expert loads per layer.
    for got, want in zip(_biases(model), want_biases, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    rules = get_rules("default")
    for state in (nnx.state(model), nnx.state(optimizer, nnx.optimizer.OptState)):
        for (path, var), want in zip(iter_variables(state), state_shardings(state, mesh, rules)):
            assert var[...].sharding.is_equivalent_to(want, var.ndim), path
    assert model.moe_layers.mlp.router[...].sharding.spec[0] == "stage"  # each stage holds its MoE layers
    assert model.dense_layers.mlp.up.kernel[...].sharding.spec[0] is None  # the dense prefix: whole on every stage


def test_what_the_pipelined_deepseek_forward_does_not_run_is_refused():
    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    graphdef, state = _parts()
    model = nnx.merge(graphdef, state)
    ids = np.zeros((8, 16), np.int32)
    for kwargs, message in [
        # 4 MoE layers do not split into 8 chunks; checked before anything runs.
        (dict(pipeline_schedule="interleaved", pipeline_virtual_stages=4, loss_targets=(ids, ids)),
         r"the 4 pipelined MoE layers \(num_hidden_layers 5 - first_k_dense_replace 1\) do not split into 8 equal "
         r"chunks \(2 stages x 4 virtual stages\); use --virtual-stages one of \[1, 2\]"),
        (dict(with_routing=True), "with_hidden_states / with_routing are not supported on a mesh with a 'stage'"),
    ]:
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
            model.forward(ids, pipeline_microbatches=2, **kwargs)
