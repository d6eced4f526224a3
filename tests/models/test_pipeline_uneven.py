"""Layer counts that do not divide the stages: ``pipeline_layers`` (MaxText's ``pipeline_parallel_layers``).

Only the last ``pipeline_layers`` decoder layers (DeepSeek: MoE layers) form the pipelined stacks; the layers
before them live in stacks of their own (``prefix_*``, placed like ``unpipelined_layers``: whole on every stage) and
run before the pipeline. Checked here:
- two AdamW steps of a pipelined run equal the one-device run of the same config: a tiny DeepSeek-V3 (1 dense + 5
  MoE layers, ``pipeline_layers`` 4: the first MoE layer runs before the pipeline with the dense one; MTP, balance
  loss, routing-bias balancing), a 5-layer MiniMax-M2 (every layer MoE, the Switch balance loss, ``pipeline_layers``
  4: the ``MoECausalLM`` path) and a 5-layer Llama (``pipeline_layers`` 4) on stage 2 (x fsdp / expert); the
  expert loads (routing biases) and the balance loss stay in model order across the two MoE stacks;
- the split model is the same model: an HF export loads into the unsplit one with the same logits, and back into
  the split one exactly (the key tables map both stacks to their HF layers; ``pipeline_layers`` is not written to
  config.json);
- the errors: a layer count that does not split says which ``pipeline_layers`` fit; a ``pipeline_layers`` that
  does not fit is refused.

Cost: CI runs DeepSeek GPipe (Explicit) and MiniMax-M2 GPipe (Explicit) on stage 2 x expert 2 x fsdp 2 (one compiled
step each plus the one-device references); DeepSeek's 1F1B with a prefix runs in the full matrix (1F1B's DeepSeek
code is in CI through ``test_pipeline_deepseek``'s tensor case, the prefix through GPipe's). The DeepSeek GPipe case
took over, as a superset (the same mesh, mode and schedule, with an MoE layer before the pipeline),
``test_pipeline_deepseek``'s GPipe Explicit CI case, which moved to the full matrix. ``NNX_ZOO_FULL_MATRIX=1`` adds
the other modes, interleaved for DeepSeek (4 MoE layers in 2 x 2 chunks), and Llama (the same walk as MiniMax-M2's,
without stats) on stage 2 x fsdp 4, GPipe and 1F1B in both modes.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3, Llama3, Llama3Config
from nnx_zoo.models.minimax_m2 import MiniMaxM2
from nnx_zoo.sharding import ShardingError, create_sharded, make_mesh
from tests.models import test_pipeline as dense
from tests.models import test_pipeline_deepseek as ds
from tests.models import test_pipeline_moe as moe

DS_CONFIG = ds.CONFIG.with_overrides(num_hidden_layers=6, pipeline_layers=4)
LLAMA_CONFIG = dense.CONFIG.with_overrides(num_hidden_layers=5, pipeline_layers=4)
MOE_CONFIG = moe.CONFIGS["aux"].with_overrides(num_hidden_layers=5, pipeline_layers=4)  # Switch loss on

DS_CASES = [("explicit", "gpipe")]
# CausalLM's walk: (family, mode, schedule); MiniMax-M2's MoE stats (Switch loss: GPipe only), Llama's none.
CAUSAL_CASES = [("minimax", "explicit", "gpipe")]
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    DS_CASES += [("auto", "gpipe"), ("auto", "1f1b"), ("explicit", "1f1b"), ("auto", "interleaved"),
                 ("explicit", "interleaved")]
    CAUSAL_CASES += [("minimax", "auto", "gpipe")] + [("llama", mode, schedule) for mode in ("auto", "explicit")
                                                      for schedule in ("gpipe", "1f1b")]


@functools.cache
def _ds_parts():
    return dense.drawn_parts(lambda: DeepSeekV3(DS_CONFIG, rngs=nnx.Rngs(0)))


@functools.cache
def _llama_parts():
    return dense.drawn_parts(lambda: Llama3(LLAMA_CONFIG, rngs=nnx.Rngs(0)))


@functools.cache
def _moe_parts():
    return dense.drawn_parts(lambda: MiniMaxM2(MOE_CONFIG, rngs=nnx.Rngs(0)))


@functools.cache
def _moe_one_device():
    history, model, optimizer = dense.train_two_steps(None, parts=_moe_parts(), batch=moe._batch(),
                                                      metric_names=moe.METRICS, **moe.STEP)
    return (history, dense._arrays(nnx.state(model, nnx.Param)),
            dense._arrays(nnx.state(optimizer, nnx.optimizer.OptState)), moe._biases(model))


@functools.cache
def _ds_one_device():
    history, model, optimizer = dense.train_two_steps(None, parts=_ds_parts(), batch=ds._batch(), **ds.STEP)
    return (history, dense._arrays(nnx.state(model, nnx.Param)),
            dense._arrays(nnx.state(optimizer, nnx.optimizer.OptState)), ds._biases(model))


@functools.cache
def _llama_one_device():
    history, model, optimizer = dense.train_two_steps(None, parts=_llama_parts())
    return (history, dense._arrays(nnx.state(model, nnx.Param)),
            dense._arrays(nnx.state(optimizer, nnx.optimizer.OptState)), [])


def _assert_same_steps(got, want) -> None:
    """``(history, params, moments, buffers)`` of a pipelined run against the one-device run, with
    ``test_pipeline``'s tolerances (parameters to a tenth of lr; gradients sharply through the moments)."""
    (history, params, moments, buffers), (w_history, w_params, w_moments, w_buffers) = got, want
    np.testing.assert_allclose(history, w_history, rtol=1e-5)
    assert history[1][0] < history[0][0]  # it learns
    for g, w in zip(params, w_params, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=0.1 * dense.OPTIMIZER.lr)
    for g, w in zip(moments, w_moments, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * np.abs(w).max())
    for g, w in zip(buffers, w_buffers, strict=True):  # routing biases: moved by each layer's own expert load
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("mode", "schedule"), DS_CASES)
def test_deepseek_with_moe_layers_before_the_pipeline_matches_one_device(mode, schedule):
    mesh = make_mesh({"stage": 2, "expert": 2, "fsdp": 2}, shard_mode=mode)
    step = dict(ds.STEP)
    if schedule == "interleaved":
        step["model_kwargs"] += (("pipeline_virtual_stages", 2),)
    history, model, optimizer = dense.train_two_steps(mesh, 1, 2, schedule, parts=_ds_parts(), batch=ds._batch(),
                                                      **step)
    _assert_same_steps((history, dense._arrays(nnx.state(model, nnx.Param)),
                        dense._arrays(nnx.state(optimizer, nnx.optimizer.OptState)), ds._biases(model)),
                       _ds_one_device())
    assert min(h[3] for h in history) > 0  # the balance loss is on (both MoE stacks add to it)
    assert model.moe_layers.mlp.router[...].sharding.spec[0] == "stage"  # the last 4 MoE layers: pipelined
    assert model.prefix_moe_layers.mlp.router[...].sharding.spec[0] is None  # the first: whole on every stage


@pytest.mark.parametrize(("family", "mode", "schedule"), CAUSAL_CASES)
def test_causal_lm_with_layers_before_the_pipeline_matches_one_device(family, mode, schedule):
    """MiniMax-M2 (every layer MoE, the Switch balance loss on, ``MoECausalLM``): the prefix layer's expert load and
    balance sums join the pipelined layers' in model order (``_pipeline_outputs``), the balance loss pooled over all
    five. Llama: the same walk, no stats."""
    if family == "minimax":
        mesh = make_mesh({"stage": 2, "expert": 2, "fsdp": 2}, shard_mode=mode)
        run = dict(parts=_moe_parts(), batch=moe._batch(), metric_names=moe.METRICS, **moe.STEP)
        want, biases, weight = _moe_one_device(), moe._biases, "router"
    else:
        mesh = make_mesh({"stage": 2, "fsdp": 4}, shard_mode=mode)
        run, want, biases, weight = dict(parts=_llama_parts()), _llama_one_device(), lambda _: [], "up"
    history, model, optimizer = dense.train_two_steps(mesh, 1, 2, schedule, **run)
    _assert_same_steps((history, dense._arrays(nnx.state(model, nnx.Param)),
                        dense._arrays(nnx.state(optimizer, nnx.optimizer.OptState)), biases(model)), want)
    if family == "minimax":
        assert min(h[2] for h in history) > 0  # the balance loss is on
    pick = (lambda m: m.mlp.router) if weight == "router" else (lambda m: m.mlp.up.kernel)
    assert pick(model.layers)[...].sharding.spec[0] == "stage"  # the last 4 layers: pipelined
    assert pick(model.prefix_layers)[...].sharding.spec[0] is None  # the first: whole on every stage


@pytest.mark.parametrize("family", ["deepseek", "llama"])
def test_split_model_is_the_same_model_through_hf(family, tmp_path):
    cls, parts = (DeepSeekV3, _ds_parts) if family == "deepseek" else (Llama3, _llama_parts)
    split = nnx.merge(*parts())
    split.save_pretrained(tmp_path)
    unsplit = cls.from_pretrained(tmp_path)
    assert unsplit.config.pipeline_layers is None  # an nnx_zoo setting: not in config.json
    ids = np.random.default_rng(0).integers(0, ds.VOCAB, (2, 16)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(unsplit(ids)), np.asarray(split(ids)))  # same layers, same order
    again = cls.from_pretrained(tmp_path, pipeline_layers=4)
    for got, want in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(split)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_layer_counts_that_do_not_split_say_which_pipeline_layers_fit():
    v3 = ds.CONFIG.with_overrides(num_hidden_layers=61, first_k_dense_replace=3)  # V3's 3 dense + 58 MoE layers
    with pytest.raises(ValueError, match=r"58 pipelined MoE layers .* do not split into 16 equal chunks.*"
                                         r"--model.pipeline_layers 48: the first 10 MoE layers run before the "
                                         r"pipeline"):
        v3.check_pipeline(16)
    v3.with_overrides(pipeline_layers=48).check_pipeline(16)  # fits
    with pytest.raises(ValueError, match=r"pipeline_layers=50\) do not split into 16.*pipeline_layers 48"):
        v3.with_overrides(pipeline_layers=50).check_pipeline(16)
    for bad in (0, 59, 2.0):
        with pytest.raises(ValueError, match=rf"pipeline_layers={bad!r} must be None .* in \[1, 58\]"):
            v3.with_overrides(pipeline_layers=bad)
    llama = Llama3Config.preset("llama3-tiny", num_hidden_layers=5)
    with pytest.raises(ValueError, match=r"5 layers .* do not split into 2 identical chunks.*"
                                         r"--model.pipeline_layers 4 \(the first 1 layers run before the pipeline\)"):
        llama.check_pipeline(2)
    with pytest.raises(ValueError, match=r"4 pipelined layers \(of 5\) .* do not split into 3 .*pipeline_layers 3 "):
        llama.with_overrides(pipeline_layers=4).check_pipeline(3)
    with pytest.raises(ValueError, match=r"pipeline_layers=6 must be None .* \[1, num_hidden_layers=5\]"):
        llama.with_overrides(pipeline_layers=6)
    # Creating the model on the mesh checks the layer sequence first (CausalLMBase.create); the resolver, below any
    # model, refuses the stack that does not divide, pointing at pipeline_layers too.
    small = llama.with_overrides(hidden_size=32, intermediate_size=64, head_dim=8, vocab_size=128)
    mesh = make_mesh({"stage": 2, "fsdp": 4})
    with pytest.raises(ValueError, match=r"5 layers .* do not split into 2 identical chunks.*pipeline_layers 4 "):
        Llama3.create(small, mesh=mesh)
    with pytest.raises(ShardingError, match=r"5 layers .* do not split into 2 pipeline stages.*pipeline_layers "
                                            r"with a multiple of 2 \(e.g. 4"):
        create_sharded(lambda: Llama3(small, rngs=nnx.Rngs(0)), mesh)
