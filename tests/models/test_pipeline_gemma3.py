"""Pipeline parallelism of a model with several layer stacks: Gemma 3 (sliding and global layers, two stacks).

A tiny Gemma 3 of 12 layers, two sliding then a global one, four times (``sliding_window_pattern`` 3, an 8-token
window on 32-token rows): the layer sequence is ``S V`` identical chunks for 2 and 4 of them, so it pipelines
(``nnx_zoo.layers.pipeline.pipeline_chunk``): stage ``s`` holds a contiguous block of each stack (8 sliding, 4
global layers), exactly chunk ``s``'s layers, and runs them as that chunk's scan segments. On stage 2 a chunk
(s, s, g, s, s, g) is one segment whose pattern takes every other local sliding layer (strided slices); on stage 4,
and in interleaved's 4 chunks on stage 2, a chunk (s, s, g) is two segments. Two AdamW steps pipelined equal one
device, as ``test_pipeline`` checks Llama (its helpers and tolerances).

Cost: one pipelined train step compiled per case plus the one-device reference. CI: GPipe on stage 4 x FSDP 2
(Explicit, 2 accumulation steps; chunks of two segments); the strided segment of a stage-2 chunk and interleaved
stacks of different lengths (each stack's chunks moved to their stages) are in CI in
``tests/layers/test_pipeline_stacks.py``, and interleaved through the model's stacks by name in
``test_pipeline_gemma4``. ``NNX_ZOO_FULL_MATRIX=1`` adds interleaved (2 virtual stages: 2 sliding and 1 global layer
per chunk) on stage 2 x FSDP 4 in both modes, GPipe on stage 2 x FSDP 4 (the strided segment) in both modes, GPipe
on stage 4 x FSDP 2 under Auto, and 1F1B on stage 4 x FSDP 2 in both modes and on stage 2 alone.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from nnx_zoo import Gemma3, Gemma3Config
from nnx_zoo.layers.pipeline import pipeline_chunk
from nnx_zoo.sharding import make_mesh
from tests.models.test_pipeline import _arrays, assert_matches_one_device, drawn_parts, train_two_steps

VOCAB = 128
CONFIG = Gemma3Config.preset("gemma3-small", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=12, sliding_window_pattern=3, sliding_window=8, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=64)
# name -> (mesh sizes, devices used)
MESHES = {"stage2": ({"stage": 2}, 2), "stage2-fsdp4": ({"stage": 2, "fsdp": 4}, 8),
          "stage4-fsdp2": ({"stage": 4, "fsdp": 2}, 8)}
# (mesh, mode, accumulation steps, pipeline micro-batches per step, schedule): each micro-batch's rows divide
# over fsdp; interleaved runs micro-batches in groups of the stages.
CASES = [("stage4-fsdp2", "explicit", 2, 2, "gpipe")]
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    CASES += [("stage2-fsdp4", "auto", 1, 2, "interleaved")]
    CASES += [("stage2-fsdp4", mode, 1, 2, "gpipe") for mode in ("auto", "explicit")]
    CASES += [("stage4-fsdp2", "auto", 2, 2, "gpipe"), ("stage2-fsdp4", "explicit", 1, 2, "interleaved"),
              ("stage2", "auto", 1, 4, "1f1b")]
    CASES += [("stage4-fsdp2", mode, 1, 4, "1f1b") for mode in ("auto", "explicit")]


@functools.cache
def _parts():
    return drawn_parts(lambda: Gemma3(CONFIG, rngs=nnx.Rngs(0)), norm_scale=0.0)  # Gemma norms apply 1 + w


@functools.cache
def _one_device():
    history, model, optimizer = train_two_steps(None, parts=_parts())
    return history, _arrays(nnx.state(model, nnx.Param)), _arrays(nnx.state(optimizer, nnx.optimizer.OptState))


@pytest.mark.parametrize(("mesh_name", "mode", "accum_steps", "microbatches", "schedule"), CASES)
def test_pipelined_gemma3_adamw_steps_match_one_device(mesh_name, mode, accum_steps, microbatches, schedule):
    sizes, devices = MESHES[mesh_name]
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:devices])
    history, model, optimizer = train_two_steps(mesh, accum_steps, microbatches, schedule, parts=_parts())
    assert_matches_one_device(mesh, history, model, optimizer, _one_device())  # test_pipeline's tolerances
    for stack in (model.sliding_layers, model.layers):  # each stage holds its block of both stacks
        assert stack.mlp.up.kernel[...].sharding.spec[0] == "stage"


def test_a_layer_sequence_that_does_not_split_into_identical_chunks_is_refused():
    # Gemma 3 1B's 26 layers (five sliding, one global, four times, then two sliding): 2 x 13 layers are not
    # alike, and no other chunk count is either. The stacks (22 sliding, 4 global layers) divide over 2 stages,
    # so only the pipeline's own check can refuse it; it says so before the layers are traced.
    config = CONFIG.with_overrides(num_hidden_layers=26, sliding_window_pattern=6)
    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    model = nnx.eval_shape(lambda: Gemma3(config, rngs=nnx.Rngs(0)))  # abstract: the check needs no weights
    ids = jnp.zeros((8, 16), jnp.int32)
    message = (r"the 26 layers \(stack of each, in model order: sliding_layers x5, layers x1, .*\) do not split "
               r"into 2 identical chunks, one per pipeline stage .*no chunk count above 1 fits; train this model on "
               r"a mesh without 'stage', or use a layer count that is a multiple of 12")
    for kwargs in (dict(), dict(pipeline_schedule="1f1b", loss_targets=(ids, ids))):
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=message):
            nnx.eval_shape(lambda m, x, kw=kwargs: m.forward(x, pipeline_microbatches=2, **kw), model, ids)
    # Chunk counts that fit are named: this module's 12 layers split into 2 or 4 chunks of (s, s, g) repeats.
    kinds = ("s", "s", "g") * 4
    assert pipeline_chunk(kinds, 4) == ("s", "s", "g")
    with pytest.raises(ValueError, match=r"do not split into 3 identical chunks.*one of \[2, 4\]"):
        pipeline_chunk(kinds, 3)
    with pytest.raises(ValueError, match=r"into 6 identical chunks \(2 pipeline stages x 3 virtual stages\).*"
                                         r"use --virtual-stages one of \[1, 2\]"):
        pipeline_chunk(kinds, 2, 3)
