"""Pipeline parallelism (``stage`` mesh axis, ``nnx_zoo.layers.pipeline``) on a 4-layer tiny Llama, batch 8 x 32.

Two AdamW steps of the trainer (``train_step`` + ``make_optimizer``) with the layers pipelined over ``stage`` give
the losses, gradient norms, Adam moments and updated parameters of the un-pipelined model on one device (float32);
the parameters and moments stay on their resolved shardings (the layer dim on ``stage``). Gradient accumulation
composes with the pipeline's micro-batches (each accumulation step is pipelined in turn).

Every schedule: GPipe (``pipeline_stack`` differentiated by the trainer), 1F1B and interleaved 1F1B (2 virtual
stages: stage 0 runs layers 0 and 2, stage 1 layers 1 and 3; the head and loss on the last stage,
``loss_targets`` -> ``loss_sum``, gradients from the 1F1B program).

Cost: each case compiles one pipelined train step (~7 s here, the one-device reference once more), so CI runs three:
GPipe on stage 4 x FSDP 2, Auto, 2 accumulation steps; 1F1B on stage 4 x FSDP 2, Explicit, and on stage 2 x tensor
2 x FSDP 2, Auto. Interleaved runs in CI on Gemma 4 (``test_pipeline_gemma4``, stage 2 x FSDP 4, Explicit) and on
MiniMax-M2 (``test_pipeline_moe``, Auto), GPipe under Explicit on Gemma 3 (``test_pipeline_gemma3``) and MiniMax-M2:
the same ``CausalLM`` walk, which runs Llama's one stack as the one-kind case of its stacks by name, so Llama's GPipe
on stage 2 x FSDP 4, Explicit, is in the full matrix. ``NNX_ZOO_FULL_MATRIX=1`` runs stage 2 and 4, alone (on 2 and 4
devices), with FSDP, with tensor (stage 4 x tensor 2) and with both (stage 2 x tensor 2 x FSDP 2) (on 8), Auto and
Explicit, with and without accumulation, every schedule (interleaved where the 4 layers split into 2 chunks per
stage and the micro-batches into groups of the stages).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

import nnx_zoo.models.deepseek  # noqa: F401  (declares dense_layers / moe_layers, placed like layers)
from nnx_zoo import Llama3, Llama3Config
from nnx_zoo.layers.pipeline import check_stages
from nnx_zoo.sharding import (
    RULE_SETS,
    ShardingError,
    create_sharded,
    get_rules,
    iter_variables,
    logical_to_mesh_axes,
    make_mesh,
    state_shardings,
)
from nnx_zoo.train import OptimizerConfig, make_optimizer, train_step

BATCH, SEQ, VOCAB = 8, 32, 128
CONFIG = Llama3Config.preset("llama3-tiny", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             max_position_embeddings=64)
OPTIMIZER = OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant")
# name -> (mesh sizes, devices used); "alone": the stage axis on as many devices as it has stages.
MESHES = {"stage2": ({"stage": 2}, 2), "stage4": ({"stage": 4}, 4),
          "stage2-fsdp4": ({"stage": 2, "fsdp": 4}, 8), "stage4-fsdp2": ({"stage": 4, "fsdp": 2}, 8),
          "stage2-tensor2-fsdp2": ({"stage": 2, "tensor": 2, "fsdp": 2}, 8),  # heads, kv heads, MLP, vocab on tensor
          "stage4-tensor2": ({"stage": 4, "tensor": 2}, 8)}
# (mesh, mode, accumulation steps, pipeline micro-batches): each micro-batch's rows still divide over fsdp.
CASES = [(m, mode, accum, micro, schedule) for m in MESHES for mode in ("auto", "explicit") for accum in (1, 2)
         for micro in [{"stage2": 4, "stage4": 4, "stage2-fsdp4": 2, "stage4-fsdp2": 4, "stage2-tensor2-fsdp2": 4,
                       "stage4-tensor2": 4}[m] // accum]
         for schedule in ("gpipe", "1f1b", "interleaved")
         if schedule != "interleaved" or (MESHES[m][0]["stage"] == 2 and micro % 2 == 0)]
if os.environ.get("NNX_ZOO_FULL_MATRIX") != "1":
    CASES = [("stage4-fsdp2", "auto", 2, 2, "gpipe"), ("stage4-fsdp2", "explicit", 1, 4, "1f1b"),
             ("stage4-tensor2", "auto", 1, 4, "1f1b")]  # 1F1B with 4 devices in a stage: full matrix (README)


@functools.cache
def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    mask = np.ones((BATCH, SEQ), np.int32)
    mask[0, :5] = 0  # left padding: the mask is split into micro-batches with the rows
    return {"input_ids": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
            "attention_mask": mask, "loss_mask": mask}


def drawn_parts(make, norm_scale: float = 1.0) -> tuple[nnx.GraphDef, nnx.State]:
    """The model ``make()`` builds, with norm scales ``norm_scale`` + noise (0 for norms applied as ``1 + w``) and
    every other float Variable N(0, 0.1), drawn with numpy (gradients far from Adam's eps); integer Variables stay
    zero."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return jnp.zeros(leaf.shape, leaf.dtype)
        scale = norm_scale if "scale" in jax.tree_util.keystr(path) else 0.0
        return jnp.asarray(scale + rng.normal(0.0, 0.1, leaf.shape), leaf.dtype)

    return graphdef, jax.tree_util.tree_map_with_path(draw, abstract)


@functools.cache
def _model_parts() -> tuple[nnx.GraphDef, nnx.State]:
    return drawn_parts(lambda: Llama3(CONFIG, rngs=nnx.Rngs(0)))


def _step(graphdef, state, batch, **kwargs):
    model, optimizer = nnx.merge(graphdef, state)
    metrics = train_step(model, optimizer, batch, **kwargs)
    return nnx.state((model, optimizer)), metrics


def train_two_steps(mesh: jax.sharding.Mesh | None, accum_steps: int = 1, microbatches: int = 1,
                    schedule: str = "gpipe", *, parts=None, batch=None, metric_names=("loss", "grad_norm"),
                    model_kwargs=(), optimizer_config=None, **step_kwargs):
    """Two AdamW steps (one compiled step, called twice) of the model ``parts`` (``drawn_parts``'s; default this
    module's Llama) on ``batch`` (default ``_batch()``) with ``optimizer_config`` (default ``OPTIMIZER``): [(each of
    ``metric_names``)], the model, the optimizer."""
    graphdef, state = _model_parts() if parts is None else parts
    if mesh is not None:
        leaves = map(jax.device_put, jax.tree.leaves(state), state_shardings(state, mesh, get_rules("default")))
        state = jax.tree.unflatten(jax.tree.structure(state), list(leaves))
    kwargs = dict(accum_steps=accum_steps, model_kwargs=(*model_kwargs, ("pipeline_microbatches", microbatches),
                                                         ("pipeline_schedule", schedule)), **step_kwargs)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        model = nnx.merge(graphdef, state)
        optimizer = make_optimizer(optimizer_config or OPTIMIZER, model, total_steps=2)
        both_graph, both = nnx.split((model, optimizer))
        batch = {k: jnp.asarray(v) for k, v in (_batch() if batch is None else batch).items()}
        step = functools.partial(_step, **kwargs)
        compiled = jax.jit(step, static_argnums=0).lower(both_graph, both, batch).compile(
            compiler_options={"xla_backend_optimization_level": 0})
        history = []
        for _ in range(2):
            both, metrics = compiled(both, batch)
            history.append(tuple(float(metrics[name]) for name in metric_names))
    model, optimizer = nnx.merge(both_graph, both)
    return history, model, optimizer


@functools.cache
def _one_device():
    history, model, optimizer = train_two_steps(None)
    return history, _arrays(nnx.state(model, nnx.Param)), _arrays(nnx.state(optimizer, nnx.optimizer.OptState))


def _arrays(state: nnx.State) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(state)]


@pytest.mark.parametrize(("mesh_name", "mode", "accum_steps", "microbatches", "schedule"), CASES)
def test_pipelined_adamw_steps_match_one_device(mesh_name, mode, accum_steps, microbatches, schedule):
    sizes, devices = MESHES[mesh_name]
    mesh = make_mesh(sizes, shard_mode=mode, devices=jax.devices()[:devices])
    history, model, optimizer = train_two_steps(mesh, accum_steps, microbatches, schedule)
    assert_matches_one_device(mesh, history, model, optimizer, _one_device())
    assert model.layers.mlp.up.kernel[...].sharding.spec[0] == "stage"  # each stage holds its own layers


def assert_matches_one_device(mesh, history, model, optimizer, want) -> None:
    """A pipelined run's ``train_two_steps`` result against the one-device run's ``(history, parameters,
    moments)``, with this module's tolerances, and every parameter and moment on its resolved sharding."""
    want_history, want_params, want_moments = want
    np.testing.assert_allclose(history, want_history, rtol=1e-5)
    assert history[1][0] < history[0][0]  # it learns
    # Adam's normalised update turns float32 reordering in near-cancelling gradient elements into parameter
    # differences up to ~6% of the learning rate: plain FSDP 8 against one device, un-pipelined, differs by up to
    # 5.8e-5 here (pipelined on stage 2 x FSDP 4: 6.6e-5). So parameters are compared to a tenth of lr; the sharp
    # checks are the losses and gradient norms above and the gradients (the moments) below.
    for got, want in zip(_arrays(nnx.state(model, nnx.Param)), want_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0.1 * OPTIMIZER.lr)
    # The Adam moments hold every element of both steps' gradients (float32 sums reordered by the split).
    for got, want in zip(_arrays(nnx.state(optimizer, nnx.optimizer.OptState)), want_moments, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    rules = get_rules("default")
    for state in (nnx.state(model), nnx.state(optimizer, nnx.optimizer.OptState)):
        for (path, var), want in zip(iter_variables(state), state_shardings(state, mesh, rules)):
            assert var[...].sharding.is_equivalent_to(want, var.ndim), path


def test_stage_axis_places_every_layer_stack_in_every_rule_set():
    mesh = make_mesh({"stage": 2, "fsdp": 4})
    assert dict(mesh.shape) == {"stage": 2, "data": 1, "fsdp": 4, "fsdp_transpose": 1, "context": 1, "tensor": 1,
                                "tensor_transpose": 1, "expert": 1}
    for name in RULE_SETS:
        for stack in ("layers", "moe_layers"):  # shared and family-declared stack axes
            spec = logical_to_mesh_axes((stack, "norm"), get_rules(name), mesh, shape=(4, 32))
            assert spec == PartitionSpec("stage", None), (name, stack)
        # DeepSeek's dense prefix and MTP heads run outside the pipeline: whole on every stage, whatever their count.
        for stack in ("unpipelined_layers", "dense_layers", "mtp_layers"):
            spec = logical_to_mesh_axes((stack, "norm"), get_rules(name), mesh, shape=(3, 32))
            assert spec == PartitionSpec(None, None), (name, stack)
        # The batch outside the pipeline (embedding, head, loss; DeepSeek's dense prefix and MTP heads): the
        # batch's axes, then stage; without a stage axis exactly the batch's.
        outside = ("activation_embed_and_logits_batch", None)
        inside = logical_to_mesh_axes(("activation_batch", None), get_rules(name), mesh, shape=(8, 4))[0]
        assert logical_to_mesh_axes(outside, get_rules(name), mesh, shape=(8, 4))[0] == (inside, "stage"), name
        plain = make_mesh({"fsdp": 4, "expert": 2})
        assert (logical_to_mesh_axes(outside, get_rules(name), plain)
                == logical_to_mesh_axes(("activation_batch", None), get_rules(name), plain)), name
    # Without a stage axis the stack stays replicated, as before.
    plain = logical_to_mesh_axes(("layers", "norm"), get_rules("default"), make_mesh({"fsdp": 8}))
    assert plain == PartitionSpec(None, None)


def test_layers_that_do_not_divide_the_stages_say_how_to_fix_it():
    config = Llama3Config.preset("llama3-tiny", num_hidden_layers=3)
    mesh = make_mesh({"stage": 2, "fsdp": 4})
    with pytest.raises(ValueError, match=r"3 layers .* do not split into 2 identical chunks.*pipeline_layers 2 "):
        Llama3.create(config, mesh=mesh)  # the layer sequence, checked before anything is built
    with pytest.raises(ShardingError, match=r"3 layers .* do not split into 2 pipeline stages.*one of \[1, 3\]"):
        create_sharded(lambda: Llama3(config, rngs=nnx.Rngs(0)), mesh)  # the resolver, below any model
    with pytest.raises(ValueError, match=r"6 layers, which do not split into 4 pipeline stages.*one of \[1, 2, 3, 6\]"):
        check_stages(6, 4)


def test_microbatches_that_do_not_divide_the_batch_are_refused():
    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    model = Llama3.create(CONFIG, mesh=mesh)
    ids = jnp.zeros((BATCH, SEQ), jnp.int32)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="3 pipeline micro-batches do not divide the batch of 8"):
        nnx.eval_shape(lambda m, x: m.forward(x, pipeline_microbatches=3), model, ids)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="micro-batch of 2 rows cannot be split over the 4"):
        nnx.eval_shape(lambda m, x: m.forward(x, pipeline_microbatches=4), model, ids)


def _head_flops_per_device(rules) -> float:
    """Per-device FLOPs of the head's dots (those with the vocab dim) in the compiled pipelined forward of this
    module's Llama on stage 2 x fsdp 4 (Explicit), read as ``benchmarks/pipeline_schedules.py`` reads them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import pipeline_schedules as ps

    mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode="explicit")
    config = CONFIG.with_overrides(num_hidden_layers=2)  # one layer a stage
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama3(config, rngs=nnx.Rngs(0), rules=rules)))
    state = jax.tree.unflatten(jax.tree.structure(state), [  # abstract parameters on their shardings: no init
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(jax.tree.leaves(state), state_shardings(state, mesh, get_rules(rules)))])
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x, pipeline_microbatches=2).logits).lower(
            state, ids).compile(compiler_options={"xla_backend_optimization_level": 0})
    return ps.dot_flops(compiled.as_text(), VOCAB)["head"]


def test_the_head_runs_on_each_stages_share_of_the_batch():
    # The batch outside the pipeline (embedding, final norm, head, loss) is split over 'stage' too, so the head's
    # per-device FLOPs are 1/S of those of the same rules with that batch placed without 'stage' (every stage
    # computing the whole batch's head, as before the name existed).
    replicated = tuple((name, ("data", "fsdp", "fsdp_transpose", "expert"))
                       if name == "activation_embed_and_logits_batch" else (name, axes)
                       for name, axes in get_rules("default"))
    split, whole = _head_flops_per_device("default"), _head_flops_per_device(replicated)
    assert whole == 2 * (BATCH // 4) * SEQ * CONFIG.hidden_size * VOCAB  # fsdp 4 splits the rows, stage does not
    assert split == whole / 2
