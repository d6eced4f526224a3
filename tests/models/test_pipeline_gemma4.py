"""Pipeline parallelism of Gemma 4: its own layer (sliding and global stacks, the MoE block beside the MLP) and its
per-layer inputs, through the core's pipeline path (``CausalLM._pipeline_parts`` with Gemma 4's layer hook).

A tiny Gemma 4 of 8 layers, sliding then global, four times (``sliding_window_pattern`` 2, an 8-token window on
32-token rows), with per-layer inputs (8 wide) and the MoE block in every layer (4 experts, all chosen: a top-k
choice is a discontinuity that float32 reordering alone flips at near-ties, FSDP 8 against one device included; with
k = E the router, its weights and per-expert scales and the experts all still run), global layers with wider heads
whose values are their keys: its layer sequence is 2 or 4 identical chunks (``pipeline_chunk``),
so it pipelines on 2 and 4 stages and interleaved on 2 stages x 2 virtual stages. The per-layer inputs ride beside
the hidden state in the pipeline's carry (``Gemma4._pipeline_carry``), each layer taking its own off the front.
Two AdamW steps pipelined equal one device, as ``test_pipeline`` checks Llama (its helpers and tolerances); the
gradients of the per-layer input tables (``embed_per_layer``, ``per_layer_proj``, ``per_layer_norm``) are among the
moments compared, so an input handed to the wrong layer, or one whose gradient does not flow back through the
pipeline, fails.

Cost: one pipelined train step compiled per case plus the one-device reference. CI: GPipe on stage 4 x FSDP 2 (Auto,
2 accumulation steps). ``NNX_ZOO_FULL_MATRIX=1`` adds interleaved on stage 2 x FSDP 4 (Explicit: 1F1B's program,
chunks moved to their stages, the carry crossing the ring; ~40 s), 1F1B on stage 4 x FSDP 2 and on stage 2 alone,
GPipe on stage 2 x FSDP 4, the other mode of each CI case, and GPipe (Explicit) and 1F1B (Auto) on stage 2 x FSDP 4
with ``pipeline_layers`` 4 (the first 4 layers ahead of the pipeline, taking their per-layer inputs off the carry).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from nnx_zoo import Gemma4, Gemma4Config
from nnx_zoo.sharding import make_mesh
from tests.models.test_pipeline import OPTIMIZER, _arrays, assert_matches_one_device, drawn_parts, train_two_steps

VOCAB = 128
CONFIG = Gemma4Config.preset("gemma4-tiny", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             global_head_dim=16, num_global_key_value_heads=1, sliding_window=8,
                             sliding_window_pattern=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                             num_experts=4, top_k_experts=4, moe_intermediate_size=16, max_position_embeddings=64)
# Gemma 4's attention scale is 1 (queries and keys RMS-normed): drawn near 1, the query and key norm scales give
# scores of about +-head_dim, a near one-hot softmax whose float32 rounding moved the second step's gradients by up
# to 1e-3 of their largest (FSDP 8 against one device, un-pipelined). Drawn near 1/2 each: scores a quarter of that.
QK_NORM_DRAW = 0.5
# The branches whose outputs a norm rescales (post_attn_norm: attention's; post_dense_norm: the MLP's;
# post_experts_norm: the experts'; post_per_layer_norm: the per-layer input branch's) drawn 3x larger at their output
# projections: drawn alike, such an output is ~0.06-0.2 RMS, its norm scales the gradient through it up 5-17x, and
# the second step's gradient norm differed by 1.8e-5 of itself between a pipelined and the one-device run.
BRANCH_OUT_DRAW = 3.0
# test_pipeline's AdamW with eps 1e-6: a gradient element near 0 gets an update g / (|g| + eps), which float32
# reordering flips at eps 1e-8 (one element of the per-layer input table moved by 0.3 lr between the pipelined and
# the one-device runs); at 1e-6 such updates stay linear in g. Other elements still take sign-like lr steps.
OPTIMIZER = dataclasses.replace(OPTIMIZER, eps=1e-6)
# name -> (mesh sizes, devices used)
MESHES = {"stage2": ({"stage": 2}, 2), "stage2-fsdp4": ({"stage": 2, "fsdp": 4}, 8),
          "stage4-fsdp2": ({"stage": 4, "fsdp": 2}, 8)}
# (mesh, mode, accumulation steps, pipeline micro-batches per step, schedule): each micro-batch's rows divide
# over fsdp; interleaved runs micro-batches in groups of the stages.
# A sixth entry: config.pipeline_layers (the layers before them run ahead of the pipeline, on the carry too).
CASES = [("stage4-fsdp2", "auto", 2, 2, "gpipe")]
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    CASES += [("stage2-fsdp4", mode, 1, 2, "interleaved") for mode in ("auto", "explicit")]
    CASES += [("stage4-fsdp2", "explicit", 2, 2, "gpipe"), ("stage2-fsdp4", "explicit", 1, 2, "gpipe"),
              ("stage2", "auto", 1, 4, "1f1b")]
    CASES += [("stage4-fsdp2", mode, 1, 4, "1f1b") for mode in ("auto", "explicit")]
    CASES += [("stage2-fsdp4", "explicit", 1, 2, "gpipe", 4), ("stage2-fsdp4", "auto", 1, 2, "1f1b", 4)]
CASES = [case if len(case) == 6 else (*case, None) for case in CASES]


@functools.cache
def _parts(pipeline_layers=None):
    config = CONFIG.with_overrides(pipeline_layers=pipeline_layers)
    graphdef, state = drawn_parts(lambda: Gemma4(config, rngs=nnx.Rngs(0)))  # Gemma 4's norms apply w as stored

    def redraw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "layer_scalar" in name:  # each layer's output multiplier (a buffer): 1 + noise, as the norm scales
            return leaf + 1.0
        if "q_norm" in name or "k_norm" in name:
            return leaf * QK_NORM_DRAW
        if any(k in name for k in ("['down']", "['wo']", "['o_proj']", "layers']['per_layer_proj']")):
            return leaf * BRANCH_OUT_DRAW
        return leaf

    return graphdef, jax.tree_util.tree_map_with_path(redraw, state)


@functools.cache
def _one_device(pipeline_layers=None):  # the same config (its parameter tree) on one device
    history, model, optimizer = train_two_steps(None, parts=_parts(pipeline_layers), optimizer_config=OPTIMIZER)
    return history, _arrays(nnx.state(model, nnx.Param)), _arrays(nnx.state(optimizer, nnx.optimizer.OptState))


@pytest.mark.parametrize(("mesh_name", "mode", "accum_steps", "microbatches", "schedule", "pipeline_layers"), CASES)
def test_pipelined_gemma4_adamw_steps_match_one_device(mesh_name, mode, accum_steps, microbatches, schedule,
                                                       pipeline_layers):
    sizes, devices = MESHES[mesh_name]
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:devices])
    history, model, optimizer = train_two_steps(mesh, accum_steps, microbatches, schedule,
                                                parts=_parts(pipeline_layers), optimizer_config=OPTIMIZER)
    assert_matches_one_device(mesh, history, model, optimizer, _one_device(pipeline_layers))  # test_pipeline's
    for stack in (model.sliding_layers, model.layers):  # each stage holds its block of both stacks
        assert stack.mlp.experts.wo[...].sharding.spec[0] == "stage"


def test_kv_sharing_is_refused_with_the_reason_and_what_to_do():
    # gemma4-small's last three layers attend to the keys and values of layers 1 (sliding) and 2 (global): no
    # pipeline can hand those across stages, and the storing layers (stacks of one) never split into identical
    # chunks. Refused before anything is built: create, the forward (an abstract model), the recipe's settings.
    config = Gemma4Config.preset("gemma4-small")
    message = (r"Gemma 4 with K/V sharing \(num_kv_shared_layers=3: layers 3\.\.5 attend to the keys and values of "
               r"layers 1 \(sliding\), 2 \(full\)\) does not run pipelined: .*The edge presets \(gemma4-e2b, "
               r"gemma4-e4b\) share K/V: train them on a mesh without 'stage'")
    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    with pytest.raises(ValueError, match=message):
        Gemma4.create(config, mesh=mesh)
    model = nnx.eval_shape(lambda: Gemma4(config, rngs=nnx.Rngs(0)))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
        nnx.eval_shape(lambda m, x: m.forward(x, pipeline_microbatches=2), model, jnp.zeros((8, 16), jnp.int32))
    spec = importlib.util.spec_from_file_location("pretrain", Path(__file__).resolve().parents[2] / "recipes"
                                                  / "pretrain.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    pipeline_settings = recipe.pipeline_settings
    args = argparse.Namespace(virtual_stages=None, pipeline_schedule="1f1b", mesh={"stage": 2, "fsdp": 4},
                              microbatches=None, batch=8, accum_steps=1)
    e2b = (r"--mesh stage=2: Gemma 4 with K/V sharing \(num_kv_shared_layers=20: layers 15\.\.34 attend to the keys "
           r"and values of layers 13 \(sliding\), 14 \(full\)\) does not run pipelined")
    with pytest.raises(ValueError, match=e2b):
        pipeline_settings(Gemma4, args, Gemma4Config.preset("gemma4-e2b"))
    # Without sharing (the large presets' shape) nothing is refused.
    assert Gemma4.pipeline_problem(Gemma4Config.preset("gemma4-26b-a4b")) is None
    assert pipeline_settings(Gemma4, args, CONFIG) == (("pipeline_microbatches", 2), ("pipeline_schedule", "1f1b"))


def test_pipelined_outputs_it_cannot_give_are_refused():
    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    model = nnx.eval_shape(lambda: Gemma4(CONFIG, rngs=nnx.Rngs(0)))
    ids = jnp.zeros((8, 16), jnp.int32)
    for kwargs in (dict(with_routing=True), dict(with_expert_load=True), dict(with_hidden_states=True)):
        with jax.set_mesh(mesh), pytest.raises(ValueError, match="not supported on a mesh with a 'stage' axis"):
            nnx.eval_shape(lambda m, x, kw=kwargs: m.forward(x, pipeline_microbatches=2, **kw), model, ids)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="runs the loss on the last stage: pass loss_targets"):
        nnx.eval_shape(lambda m, x: m.forward(x, pipeline_microbatches=2, pipeline_schedule="1f1b"), model, ids)
