"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention: the lightning indexer, its KL loss, GLM-5's layers reusing
an earlier layer's top-k) pipelined over ``stage``.

A tiny V3.2 (``test_pipeline_deepseek``'s 1 dense + 4 MoE layers, MTP depth 1, balance loss on, plus an indexer of
2 heads choosing 4 of the 16 keys, ``indexer_training='sparse'``): two AdamW steps of the trainer with the MoE
stack pipelined give the main, MTP, balance and indexer losses, the gradient norm, the Adam moments and the
updated parameters of the un-pipelined model on one device (float32, tolerances as ``test_pipeline_deepseek``'s).
GPipe: each pipelined layer's indexer KL leaves the pipeline as a sum over the micro-batch's real rows (the
micro-batches add up); the dense prefix's and the MTP head's (run outside the pipeline) join it, and the total is
divided by the real sequence count, as un-pipelined (batch row 5 is all padding, so a mean over all rows would
differ). 1F1B / interleaved: the same sums weighed inside the program with the trainer's weights. GLM-5 (the same
dims, MoE layers full, shared, full, shared): both MoE stacks pipeline by name, each stage's chunk (full, shared)
handing its top-k on inside.

Cost: one pipelined train step compiled plus the one-device reference. CI: V3.2 GPipe on stage 2 x expert 2 x
fsdp 2, Explicit. ``NNX_ZOO_FULL_MATRIX=1`` adds it under Auto, 1F1B and interleaved in both modes, stage 2 x fsdp 4
with 2 accumulation steps (GPipe, 1F1B) in both modes, and GLM-5 GPipe and 1F1B on stage 2 x fsdp 4 in both modes.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3
from nnx_zoo.models.glm5 import Glm5, Glm5Config
from nnx_zoo.sharding import make_mesh
from tests.models.test_pipeline import OPTIMIZER, _arrays, drawn_parts, train_two_steps
from tests.models.test_pipeline_deepseek import CONFIG as V3_CONFIG
from tests.models.test_pipeline_deepseek import _batch

CONFIG = V3_CONFIG.with_overrides(index_topk=4, index_n_heads=2, index_head_dim=16, indexer_training="sparse",
                           indexer_loss_weight=0.5)
METRICS = ("loss", "grad_norm", "mtp1", "aux_loss", "indexer_loss")
STEP = dict(mtp_weight=0.3, routing_bias_rate=1e-3, metric_names=METRICS,
            model_kwargs=(("with_mtp", True), ("with_expert_load", True)))
MESHES = {"stage2-expert2-fsdp2": {"stage": 2, "expert": 2, "fsdp": 2}, "stage2-fsdp4": {"stage": 2, "fsdp": 4}}
# (model, mesh, mode, accumulation steps, pipeline micro-batches per accumulation step, schedule)
CASES = [("v32", "stage2-expert2-fsdp2", "explicit", 1, 2, "gpipe")]
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    CASES += [("v32", "stage2-expert2-fsdp2", "auto", 1, 2, "gpipe")]
    CASES += [("v32", "stage2-expert2-fsdp2", mode, 1, 2, schedule) for mode in ("auto", "explicit")
              for schedule in ("1f1b", "interleaved")]
    CASES += [("v32", "stage2-fsdp4", mode, 2, 1, schedule) for mode in ("auto", "explicit")
              for schedule in ("gpipe", "1f1b")]
    # GLM-5's shared layers (each stage's chunk (full, shared) hands its top-k on inside).
    CASES += [("glm5", "stage2-fsdp4", mode, 1, 2, schedule) for mode in ("auto", "explicit")
              for schedule in ("gpipe", "1f1b")]
VIRTUAL_STAGES = 2  # interleaved: 4 MoE layers in 4 chunks of 1
# GLM-5: the same dims, layers 2 and 4 reusing the top-k of layers 1 and 3 (the pipelined MoE layers full, shared,
# full, shared: each stage's chunk starts with the layer that chooses).
GLM5_CONFIG = Glm5Config.preset(
    "glm5-tiny", **{k: getattr(CONFIG, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "first_k_dense_replace", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
        "num_nextn_predict_layers", "seq_aux_loss_alpha", "max_position_embeddings", "index_topk",
        "index_n_heads", "index_head_dim", "indexer_training", "indexer_loss_weight")},
    indexer_types=("full", "full", "shared", "full", "shared"))


@functools.cache
def _parts():
    return drawn_parts(lambda: DeepSeekV3(CONFIG, rngs=nnx.Rngs(0)))


@functools.cache
def _glm5_parts():
    return drawn_parts(lambda: Glm5(GLM5_CONFIG, rngs=nnx.Rngs(0)))


@functools.cache
def _one_device(accum_steps: int, glm5: bool = False):
    parts = _glm5_parts() if glm5 else _parts()
    history, model, optimizer = train_two_steps(None, accum_steps, parts=parts, batch=_batch(), **STEP)
    return history, _arrays(nnx.state(model, nnx.Param)), _arrays(nnx.state(optimizer, nnx.optimizer.OptState))


@pytest.mark.parametrize(("model_name", "mesh_name", "mode", "accum_steps", "micro", "schedule"), CASES)
def test_pipelined_sparse_attention_adamw_steps_match_one_device(model_name, mesh_name, mode, accum_steps, micro,
                                                                 schedule):
    glm5 = model_name == "glm5"
    mesh = make_mesh(MESHES[mesh_name], shard_mode=mode)
    step = dict(STEP)
    if schedule == "interleaved":
        step["model_kwargs"] += (("pipeline_virtual_stages", VIRTUAL_STAGES),)
    history, model, optimizer = train_two_steps(mesh, accum_steps, micro, schedule,
                                                parts=_glm5_parts() if glm5 else _parts(), batch=_batch(), **step)
    want_history, want_params, want_moments = _one_device(accum_steps, glm5)
    np.testing.assert_allclose(history, want_history, rtol=1e-5)
    assert min(h[4] for h in history) > 0 and min(h[3] for h in history) > 0  # the indexer and balance losses on
    for got, want in zip(_arrays(nnx.state(model, nnx.Param)), want_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0.1 * OPTIMIZER.lr)
    for got, want in zip(_arrays(nnx.state(optimizer, nnx.optimizer.OptState)), want_moments, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    assert model.moe_layers.attn.indexer.wq_b.kernel[...].sharding.spec[0] == "stage"  # indexers on their stage
    if glm5:
        assert model.shared_topk_moe_layers.mlp.router[...].sharding.spec[0] == "stage"


def test_what_the_pipelined_sparse_attention_does_not_run_is_refused():
    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    ids = np.zeros((8, 16), np.int32)
    v32 = nnx.merge(*_parts())
    # Chunks (shared, full) would hand the top-k across the stages: the config says so (the recipe asks it before
    # building; the forward asks the same check).
    late = GLM5_CONFIG.with_overrides(indexer_types=("full", "shared", "full", "shared", "full"))
    with pytest.raises(ValueError, match=r"each of the 2 pipeline chunks of 2 MoE layers starts with a layer that "
                       r"reuses an earlier layer's top-k \(indexer 'shared': layers \[1, 3\] start the chunks\)"
                       r".*give each chunk's first layer its own indexer"):
        late.check_pipeline(2)
    with pytest.raises(ValueError, match=r"pipeline_layers=2: a model whose layers reuse an earlier layer's top-k "
                       r"pipelines every MoE layer after the dense prefix"):
        GLM5_CONFIG.with_overrides(pipeline_layers=2)
    for model, kwargs, message in [
        # 1F1B weighs the indexer loss inside the pipeline with the trainer's weights: it needs them.
        (v32, dict(pipeline_schedule="1f1b", loss_targets=(ids, ids)),
         r"pipeline_schedule='1f1b' with MTP heads, a balance loss or an indexer loss needs loss_scale="),
    ]:
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
            model.forward(ids, pipeline_microbatches=2, **kwargs)
