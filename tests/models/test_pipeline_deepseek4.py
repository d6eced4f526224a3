"""DeepSeek-V4 (hyper-connection streams, hash-routed prefix, CSA / HCA attention with the indexer loss, MTP,
sequence-wise balance loss, routing-bias balancing) pipelined over the ``stage`` axis, every schedule.

A tiny DeepSeek-V4 (1 hash-routed sliding layer, then CSA, HCA, CSA, HCA top-k layers; 8 experts top-2, 2 streams,
MTP depth 1, the indexer's sparse stage, batch 8 x 16): two AdamW steps of the trainer with the top-k layers
pipelined give the main loss, the MTP loss, the balance loss, the indexer loss, the expert load balance, the
gradient norm, the Adam moments, the updated parameters and the routing biases moved by the expert loads of the
un-pipelined model on one device (float32). The hash-routed layer runs before the pipeline (its stack whole on
every stage, its batch split over 'stage'); the streams ``[batch, seq, 2, embed]`` go through the pipeline with each
micro-batch's tokens and context; the per-layer expert loads come out in model order, summed over the micro-batches.
GPipe: the stream collapse, head and MTP head after the pipeline. 1F1B and interleaved (2 virtual stages, on a
9-layer model whose (CSA, HCA) pairs make 4 chunks): on the last stage, the balance and indexer losses
differentiated in the layers' backward with the trainer's weights. Helpers are ``test_pipeline``'s; tolerances
``test_pipeline_deepseek``'s.

Cost: one pipelined train step compiled per case plus the one-device reference (~60 s of CPU for V4). CI runs only
the GPipe forward on stage 2 x expert 2 x fsdp 2 under Explicit against the one-device forward (logits, MTP logits,
per-layer expert loads and dropped tokens, balance and indexer losses: what V4's pipeline adds over the shared
GPipe walk, whose gradients the other families' CI cases check); ``NNX_ZOO_FULL_MATRIX=1`` runs the two AdamW steps
with GPipe in both modes, 1F1B and interleaved in both modes, and stage 2 x fsdp 2 (4 devices) with 2 accumulation
steps for GPipe and 1F1B in both modes.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV4, DeepSeekV4Config
from nnx_zoo.models.deepseek4.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, hash_schedule
from nnx_zoo.sharding import get_rules, iter_variables, make_mesh, state_shardings
from tests.models.test_pipeline import OPTIMIZER, _arrays, drawn_parts, train_two_steps

VOCAB, SEQ = 128, 16
LAYERS = (SLIDING, CSA, HCA, CSA, HCA)
CONFIG = DeepSeekV4Config.preset(
    "deepseek4-tiny", vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=len(LAYERS),
    layer_types=LAYERS, mlp_layer_types=hash_schedule(len(LAYERS), 1), num_attention_heads=2, head_dim=16,
    qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=2,
    compress_rate_hca=8, sliding_window=8, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
    hc_sinkhorn_iters=3, seq_aux_loss_alpha=0.01, indexer_training="sparse", moe_impl="dense")
# Interleaved (2 virtual stages on stage 2) needs 4 identical chunks of the pipelined layers: (CSA, HCA) four times.
INTERLEAVED = dataclasses.replace(CONFIG, num_hidden_layers=9, layer_types=(SLIDING,) + (CSA, HCA) * 4,
                                  mlp_layer_types=hash_schedule(9, 1))
CONFIGS = {"5": CONFIG, "9": INTERLEAVED}
METRICS = ("loss", "grad_norm", "mtp1", "aux_loss", "indexer_loss", "expert_max_over_mean")
STEP = dict(mtp_weight=0.3, routing_bias_rate=1e-3, metric_names=METRICS,
            model_kwargs=(("with_mtp", True), ("with_expert_load", True)))
# name -> (mesh sizes, pipeline micro-batches per step, devices)
MESHES = {"stage2-expert2-fsdp2": ({"stage": 2, "expert": 2, "fsdp": 2}, 2, 8),
          "stage2-fsdp2": ({"stage": 2, "fsdp": 2}, 4, 4)}
CASES = []
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    CASES += [("stage2-expert2-fsdp2", mode, 1, "gpipe") for mode in ("auto", "explicit")]
    CASES += [("stage2-expert2-fsdp2", mode, 1, "1f1b") for mode in ("auto", "explicit")]
    CASES += [("stage2-fsdp2", mode, 2, schedule) for mode in ("auto", "explicit") for schedule in ("gpipe", "1f1b")]
    CASES += [("stage2-expert2-fsdp2", mode, 1, "interleaved") for mode in ("auto", "explicit")]


@functools.cache
def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (8, SEQ + 1))
    mask = np.ones((8, SEQ), np.int32)
    mask[0, :5] = 0  # left padding
    mask[5, :] = 0  # an all-padding row: the balance and indexer losses are means over the sequences with a token
    return {"input_ids": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
            "attention_mask": mask, "loss_mask": mask}


@functools.cache
def _parts(layers: str = "5"):
    return drawn_parts(lambda: DeepSeekV4(CONFIGS[layers], rngs=nnx.Rngs(0)))


def _biases(model: DeepSeekV4) -> list[np.ndarray]:
    return _arrays(nnx.state(model, nnx.Not(nnx.Param)))


@functools.cache
def _one_device(layers: str = "5"):
    history, model, optimizer = train_two_steps(None, parts=_parts(layers), batch=_batch(), **STEP)
    moments = nnx.state(optimizer, nnx.optimizer.OptState)
    # Adam's first moment per parameter (the 'mu' subtree: the parameters' paths, in their order); an element is
    # noise where it is below 1e-6 of its tensor's largest.
    mu = [np.asarray(a) for path, a in jax.tree_util.tree_leaves_with_path(moments)
          if "'mu'" in jax.tree_util.keystr(path)]
    noise = [np.abs(m) < 1e-6 * np.abs(m).max() for m in mu]
    return (history, _arrays(nnx.state(model, nnx.Param)), _arrays(moments), _biases(model), noise)


@pytest.mark.parametrize(("mesh_name", "mode", "accum_steps", "schedule"), CASES)
def test_pipelined_deepseek4_adamw_steps_match_one_device(mesh_name, mode, accum_steps, schedule):
    sizes, micro, devices = MESHES[mesh_name]
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:devices])
    step, layers = dict(STEP), "5"
    if schedule == "interleaved":
        step["model_kwargs"] += (("pipeline_virtual_stages", 2),)
        layers = "9"
    history, model, optimizer = train_two_steps(mesh, accum_steps, micro // accum_steps, schedule,
                                                parts=_parts(layers), batch=_batch(), **step)
    want_history, want_params, want_moments, want_biases, want_noise = _one_device(layers)
    np.testing.assert_allclose(history, want_history, rtol=1e-5)
    assert history[1][0] < history[0][0] and min(min(h[3:5]) for h in history) > 0  # learns; aux losses are on
    # As in test_pipeline_deepseek, plus one V4 case: the first layer's attention hyper-connection reads identical
    # streams (the embedding copied into each), so some of its mixing parameters have a gradient that is zero but
    # for float32 noise (~1e-10 against ~1e-3: the streams' Sinkhorn-normalised mix sums to 1 whatever its logits);
    # Adam steps those by +-lr on the noise's sign, on an un-pipelined expert 2 x fsdp 4 mesh as here. They are
    # compared through the moments (below), the rest of every tensor to a tenth of lr.
    for got, want, noise in zip(_arrays(nnx.state(model, nnx.Param)), want_params, want_noise, strict=True):
        np.testing.assert_allclose(np.where(noise, want, got), want, rtol=1e-5, atol=0.1 * OPTIMIZER.lr)
    for got, want in zip(_arrays(nnx.state(optimizer, nnx.optimizer.OptState)), want_moments, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    # The routing biases moved by rate * sign(mean load - load): equal biases mean equal expert loads per layer
    # (and the hash tables, integers, unchanged).
    for got, want in zip(_biases(model), want_biases, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    rules = get_rules("default")
    for state in (nnx.state(model), nnx.state(optimizer, nnx.optimizer.OptState)):
        for (path, var), want in zip(iter_variables(state), state_shardings(state, mesh, rules)):
            assert var[...].sharding.is_equivalent_to(want, var.ndim), path
    assert model.stacks["csa_moe"].attn_hc.fn[...].sharding.spec[0] == "stage"  # each stage holds its layers
    assert model.stacks["sliding_hash"].attn_hc.fn[...].sharding.spec[0] is None  # the prefix: whole on each


if not CASES:  # CI runs V4's pipelined forward (below); its train steps run in the full matrix, never skipped
    del test_pipelined_deepseek4_adamw_steps_match_one_device


def test_pipelined_deepseek4_forward_matches_one_device():
    graphdef, state = _parts()
    batch = _batch()
    kwargs = dict(attention_mask=batch["attention_mask"], with_mtp=True, with_expert_load=True)
    fields = ("logits", "mtp_logits", "expert_load", "dropped_tokens", "aux_loss", "indexer_loss")

    def forward(state, ids, **extra):
        out = nnx.merge(graphdef, state).forward(ids, **kwargs, **extra)
        return {name: getattr(out, name) for name in fields}

    want = jax.jit(forward)(state, batch["input_ids"])
    mesh = make_mesh({"stage": 2, "expert": 2, "fsdp": 2}, shard_mode="explicit")
    leaves = map(jax.device_put, jax.tree.leaves(state), state_shardings(state, mesh, get_rules("default")))
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(forward, pipeline_microbatches=2, pipeline_schedule="gpipe"))(
            jax.tree.unflatten(jax.tree.structure(state), list(leaves)), batch["input_ids"])
    assert float(want["aux_loss"]) > 0 and float(want["indexer_loss"]) > 0  # both losses are on
    # float32 sums reordered by the sharded contractions: logits differ by ~2e-6 of their largest (~1).
    for name in fields:
        w = np.asarray(want[name])
        np.testing.assert_allclose(np.asarray(got[name]), w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=name)


def test_what_the_pipelined_deepseek4_forward_does_not_run_is_refused():
    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    ids = np.zeros((8, SEQ), np.int32)
    uneven = dict(num_hidden_layers=4, layer_types=LAYERS[:4], mlp_layer_types=hash_schedule(4, 1))
    hash_late = dict(mlp_layer_types=(TOPK_MOE, HASH_MOE) + (TOPK_MOE,) * 3)
    for overrides, kwargs, message in [
        # Checked before anything runs (traced abstractly).
        (uneven, {}, r"DeepSeek-V4 pipelines its 3 top-k routed layers \(num_hidden_layers 4 after 1 hash-routed ones, "
                     r"which run before the pipeline\): the 3 layers \(stack of each, in model order: csa_moe x1, "
                     r"hca_moe x1, csa_moe x1\) do not split into 2 identical chunks"),
        (hash_late, {}, r"hash-routed layers before the pipeline, so they must be the first layers; this config's "
                        r"layers \[1\] are hash-routed after top-k ones"),
        ({}, dict(with_routing=True), "with_hidden_states / with_routing are not supported on a mesh with a 'stage'"),
        ({}, dict(pipeline_schedule="interleaved", pipeline_virtual_stages=2, loss_targets=(ids, ids)),
         r"its 4 top-k routed layers .*do not split into 4 identical chunks \(2 pipeline stages x 2 virtual stages\)"),
        ({}, dict(pipeline_schedule="1f1b"), "pipeline_schedule='1f1b' runs the loss on the last stage: pass "
                                             "loss_targets"),
    ]:
        config = dataclasses.replace(CONFIG, **overrides)
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
            jax.eval_shape(lambda c=config, kw=kwargs: DeepSeekV4(c, rngs=nnx.Rngs(0)).forward(
                ids, pipeline_microbatches=2, **kw))
