"""Every registered family on a pipeline mesh: its tiny preset either runs the pipelined GPipe forward or is refused
with an error that names the fix (which ``pipeline_layers`` / layer count fits) or the reason.

- ``PIPELINED``: per family, the tiny preset and the overrides it needs (``pipeline_layers``: only the last layers
  pipelined, the ones before in ``prefix_*`` stacks; or a layer count of whole pattern periods). The model is
  created abstractly on stage 2 x expert 2 x fsdp 2 (Explicit) and its forward traced (``jax.make_jaxpr``, nothing
  compiled): the logits' shape, a ``ppermute`` between stages (it ran pipelined, not silently un-pipelined) and a
  stack placed on ``stage``.
- ``REFUSED``: families that do not pipeline on any setting yet, matched on the reason.
- ``NAMED_FIXES``: tiny presets as they are (or with a setting that breaks the split), refused naming the fix that
  ``PIPELINED`` applies.
- ``test_registry_is_covered_exactly``: every family of the registry is in ``PIPELINED`` or ``REFUSED``, once.
- Numerics: the pipelined GPipe forward's logits equal the un-pipelined ones for the families that pipeline with
  a prefix or a pattern period (GLM-4.5's dense prefix in CI; Llama 4, Kimi Linear and Qwen3-MoE's
  ``mlp_only_layers`` under ``NNX_ZOO_FULL_MATRIX=1``), one jitted forward pair each, widths shrunk.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.models.deepseek4.config import CSA, HCA, SLIDING, hash_schedule
from nnx_zoo.models.registry import MODEL_TYPES, AutoConfig, AutoModelForCausalLM
from nnx_zoo.sharding import get_rules, make_mesh, state_shardings
from tests.models.dense_reference import rel_err
from tests.models.test_pipeline import drawn_parts

MESH = {"stage": 2, "expert": 2, "fsdp": 2}
BATCH, SEQ = 8, 16
KIMI_5 = dict(num_hidden_layers=5, layer_types=("linear_attention", "full_attention") * 2 + ("linear_attention",))

# family -> (tiny preset, overrides): what its tiny preset needs to pipeline on 2 stages.
PIPELINED: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama3": ("llama3-tiny", {}),
    "Qwen3": ("qwen3-tiny", {}),
    "Gemma3": ("gemma3-tiny", {}),
    "Gemma4": ("gemma4-tiny", {}),  # (sliding, global) twice, per-layer inputs, no K/V sharing
    "Mixtral": ("mixtral-tiny", {}),
    "MiniMaxM2": ("minimax-m2-tiny", {}),
    "GptOss": ("gpt-oss-tiny", {}),
    "Qwen3Next": ("qwen3-next-tiny", {}),
    "Qwen35": ("qwen3.5-tiny", {}),
    "Qwen35MoE": ("qwen3.5-moe-tiny", {}),
    "Mistral4": ("mistral4-tiny", {}),
    "DeepSeekV3": ("deepseek2-tiny", dict(pipeline_layers=2)),  # 1 dense + 3 MoE: the first MoE layer before
    # Layer 0 dense (first_k_dense_replace / mlp_only_layers), 3 MoE: the dense and the first MoE layer before.
    "Glm4MoE": ("glm4.5-tiny", dict(pipeline_layers=2)),
    "Qwen3MoE": ("qwen3-moe-tiny", dict(mlp_only_layers=(0,), pipeline_layers=2)),
    # (chunked dense, chunked MoE, chunked dense, NoPE MoE): a period of 4, so 2 stages take 8 layers.
    "Llama4": ("llama4-tiny", dict(num_hidden_layers=8)),
    # A dense KDA layer, then (MLA, KDA) MoE pairs: the dense layer before the pipeline, two pairs in it.
    "KimiLinear": ("kimi-linear-tiny", dict(KIMI_5, pipeline_layers=4)),
    # The hash-routed first layer runs before the pipeline; the top-k layers (CSA, HCA) twice in it.
    # MoE layers (full, shared) twice: each stage's chunk starts with the layer that chooses the top-k.
    "Glm5": ("glm5-tiny", dict(num_hidden_layers=5, indexer_types=("full", "full", "shared", "full", "shared"))),
    "DeepSeekV4": ("deepseek4-tiny", dict(num_hidden_layers=5, layer_types=(SLIDING, CSA, HCA, CSA, HCA),
                                          mlp_layer_types=hash_schedule(5, 1))),
}
# family -> (tiny preset, overrides, the refusal).
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {}
# (tiny preset, overrides, the refusal naming the fix).
NAMED_FIXES: list[tuple[str, dict[str, Any], str]] = [
    ("glm4.5-tiny", {}, r"the 4 layers \(stack of each, in model order: dense_layers x1, layers x3\) do not split "
                        r"into 2 identical chunks.*--model.pipeline_layers 2 \(the first 2 layers run before"),
    ("qwen3-moe-tiny", dict(mlp_only_layers=(0,)), r"dense_layers x1, layers x3.*--model.pipeline_layers 2 "),
    ("llama4-tiny", {}, r"no chunk count above 1 fits.*a layer count that is a multiple of 8 \(its kinds repeat "
                        r"every 4 layers\)"),
    ("kimi-linear-tiny", {}, r"the 4 layers .*no chunk count above 1 fits.*a layer count of 1 \+ a multiple of 4 "
                             r"\(the first 1 layers' kinds never recur, the rest repeat every 2 layers\) with "
                             r"--model.pipeline_layers that multiple"),
    ("kimi-linear-tiny", KIMI_5, r"the 5 layers .* do not split into 2 identical chunks.*--model.pipeline_layers 4 "
                                 r"\(the first 1 layers run before"),
    # Real presets, refused by create's check before anything is built.
    ("glm4.5", {}, r"the 92 layers .*a layer count of 3 \+ a multiple of 2 \(the first 3 layers' kinds never recur, "
                   r"the rest repeat every 1 layers\).*--model.pipeline_layers 88 \(the first 4 layers run before"),
    ("kimi-linear-48b-a3b", {}, r"the 27 layers .*--model.pipeline_layers 6 \(the first 21 layers run before"),
    ("deepseek2-tiny", {}, r"the 3 pipelined MoE layers .* do not split into 2 equal chunks.*"
                           r"--model.pipeline_layers 2: the first 1 MoE layers run before the pipeline"),
    ("deepseek4-tiny", {}, r"DeepSeek-V4 pipelines its 3 top-k routed layers \(num_hidden_layers 4 after 1 "
                           r"hash-routed ones.*a layer count that is a multiple of 4 \(its kinds repeat every 2"),
    ("gemma4-small", {}, r"Gemma 4 with K/V sharing \(num_kv_shared_layers=3: layers 3..5 attend to the keys and "
                         r"values of layers .*\) does not run pipelined"),
    # GLM-5's own tiny: MoE layers (shared, full, shared) do not split, and a chunk may not start with a shared one.
    ("glm5-tiny", {}, r"the 3 layers \(stack of each, in model order: shared_topk_moe_layers x1, moe_layers x1, "
                      r"shared_topk_moe_layers x1\) do not split into 2 identical chunks"),
]


def _families() -> set[str]:
    return {model_cls.__name__ for _, model_cls in MODEL_TYPES.values()}


def _traced(preset: str, overrides: dict[str, Any]) -> tuple[Any, nnx.Module, list[Any]]:
    """The pipelined GPipe forward's jaxpr and output shape, the abstract model and its leaves' shardings, created
    on ``MESH`` (Explicit)."""
    config = AutoConfig.preset(preset, **overrides)
    cls = AutoModelForCausalLM.model_class(config)
    mesh = make_mesh(MESH, shard_mode="explicit")
    model = nnx.eval_shape(lambda: cls.create(config, mesh=mesh))  # create's checks, traced: no weights drawn
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)  # what create places them on (eval_shape keeps no shardings)
    state = jax.tree.unflatten(jax.tree.structure(state), [
        jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        for leaf, sharding in zip(jax.tree.leaves(state), shardings, strict=True)])
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), np.int32)
    with jax.set_mesh(mesh):
        traced = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s).forward(
            x, pipeline_microbatches=2, pipeline_schedule="gpipe").logits, return_shape=True)(state, ids)
    return traced, model, shardings


def test_registry_is_covered_exactly():
    assert not set(PIPELINED) & set(REFUSED)
    assert set(PIPELINED) | set(REFUSED) == _families()
    for preset, _ in PIPELINED.values():  # each family's own tiny preset
        assert preset.endswith("-tiny")


@pytest.mark.parametrize("family", sorted(PIPELINED))
def test_family_runs_pipelined(family):
    preset, overrides = PIPELINED[family]
    (jaxpr, out), model, shardings = _traced(preset, overrides)
    assert AutoModelForCausalLM.model_class(model.config).__name__ == family
    assert out.shape == (BATCH, SEQ, model.config.vocab_size)
    assert "ppermute" in str(jaxpr)  # the layers ran in the pipeline, handed between stages
    assert any(s.spec and s.spec[0] == "stage" for s in shardings)  # a stack's layers split over the stages


@pytest.mark.parametrize(("preset", "overrides", "message"), list(REFUSED.values()) + NAMED_FIXES,
                         ids=[f"{p}{'+' if o else ''}" for p, o, _ in list(REFUSED.values()) + NAMED_FIXES])
def test_family_is_refused_naming_the_fix(preset, overrides, message):
    with pytest.raises(ValueError, match=message):
        _traced(preset, overrides)


SHRUNK = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16)
# family -> what NUMERICS shrinks on top of PIPELINED's overrides (fields each config has).
NUMERICS = {"Glm4MoE": dict(SHRUNK)}
if os.environ.get("NNX_ZOO_FULL_MATRIX") == "1":
    NUMERICS |= {"Qwen3MoE": dict(SHRUNK), "Llama4": {k: v for k, v in SHRUNK.items() if k != "moe_intermediate_size"},
                 "KimiLinear": dict(SHRUNK)}


@pytest.mark.parametrize("family", sorted(NUMERICS))
def test_pipelined_logits_equal_unpipelined(family):
    preset, overrides = PIPELINED[family]
    config = AutoConfig.preset(preset, **overrides, **NUMERICS[family])
    cls = AutoModelForCausalLM.model_class(config)
    graphdef, state = drawn_parts(lambda: cls(config, rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, SEQ)).astype(np.int32)
    want = jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x).logits)(state, ids)
    mesh = make_mesh(MESH, shard_mode="explicit")
    state = jax.tree.unflatten(jax.tree.structure(state), list(map(
        jax.device_put, jax.tree.leaves(state), state_shardings(state, mesh, get_rules("default")))))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x, pipeline_microbatches=2).logits)(state, ids)
    # The measure of the pipeline tests (max error over max value); plain FSDP against one device differs ~1e-6.
    assert rel_err(got, want) < 1e-5


def test_a_family_without_pipeline_layers_is_not_advised_it():
    """DeepSeek-V4 runs only its hash-routed layers before the pipeline (no ``pipeline_layers`` setting): its
    refusal names the stage counts that fit, not a setting the config would reject."""
    with pytest.raises(ValueError, match=r"one of \[2, 4, 5, 10, 20\], the chunk counts that fit") as caught:
        AutoConfig.preset("deepseek4-flash").check_pipeline(8)
    assert "pipeline_layers" not in str(caught.value)
