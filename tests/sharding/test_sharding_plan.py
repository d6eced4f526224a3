"""Plans for thousands of devices: divisibility fallbacks (reported, strict when asked), the memory plan of
DeepSeek-V3 671B on 256 / 2,048 / 8,192 devices under every rule set, and the activation estimate against XLA's
buffer assignment on configurations that compile here."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM, DeepSeekV3, DeepSeekV3Config
from nnx_zoo.layers.attention import causal_mask
from nnx_zoo.layers.kernel_choices import kernel_choices
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.rope import rope_cos_sin, rope_frequencies
from nnx_zoo.models.deepseek.mla import MLA
from nnx_zoo.sharding import (
    RULE_SETS,
    ShardingError,
    create_sharded,
    logical_to_mesh_axes,
    make_abstract_mesh,
    make_mesh,
    named_sharding,
    sharding_report,
    use_rules,
)
from nnx_zoo.sharding.create import abstract_module
from nnx_zoo.sharding.plan import (
    KIND_MAX_PERIOD,
    PART_PHASES,
    V4_BLOCK,
    V4_CSA,
    V4_HASH,
    V4_HCA,
    V4_SLIDING,
    V4_XLA_MAX_SCORES,
    DecoderShapes,
    Local,
    V4Shapes,
    activation_peak,
    attention_bytes,
    gathered_weight_bytes,
    memory_plan,
    periodic_runs,
    tiled_grouped_matmul_bytes,
    v4_stack_name,
)
from nnx_zoo.sharding.resolve import resolve
from nnx_zoo.train.loss import chunked_head_cross_entropy
from nnx_zoo.train.step import token_cross_entropy

V3 = DeepSeekV3Config.preset("deepseek3-671b", dtype="bfloat16", param_dtype="bfloat16")
MESHES = {  # 256, 2,048 and 8,192 devices; `data` is the slow cross-slice axis (parameters replicate over it)
    256: {"fsdp": 32, "expert": 8},
    2048: {"fsdp": 256, "expert": 8},
    8192: {"data": 4, "fsdp": 256, "expert": 8},
}


@pytest.mark.parametrize("devices", sorted(MESHES))
@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_671b_plans_succeed_on_thousands_of_devices(devices, rules):
    mesh = make_abstract_mesh(MESHES[devices])
    assert mesh.size == devices
    plan = memory_plan(lambda: DeepSeekV3(V3, rngs=nnx.Rngs(0)), V3, mesh, rules, seq_len=4096, batch_per_device=1)
    report = plan.report
    assert report.num_parameters == 682_636_472_320
    # Every device's share: at least the even split, at most that plus what the fallbacks replicate.
    even = report.param_bytes / devices
    data = MESHES[devices].get("data", 1)  # parameters are replicated over `data` (pure data parallelism)
    assert report.param_bytes_per_device >= even * data * (0.99 if rules != "pure-fsdp" else 1)
    assert plan.optimizer_bytes == 4 * report.param_bytes_per_device  # bf16 params, two f32 moments
    # The routers' selection biases (58 MoE layers' and the MTP layer's, 256 float32 each, not trained,
    # replicated) are buffers beside the parameters.
    assert plan.buffer_bytes == report.bytes_per_device - report.param_bytes_per_device == 59 * 256 * 4
    for remat in ("none", "full"):
        assert plan.total(remat) == (2 * plan.param_bytes + plan.optimizer_bytes + plan.buffer_bytes
                                     + plan.activation_bytes(remat))
        assert plan.activation_bytes(remat) < sum(plan.activations[remat].values())  # the phases do not add up
    assert plan.activation_bytes("full") < plan.activation_bytes("none")
    assert "remat none" in plan.table() and "AdamW state" in plan.table()


def test_the_2048_device_fallback_is_reported_and_strict_mode_still_refuses():
    mesh = make_abstract_mesh(MESHES[2048])
    with pytest.raises(ShardingError, match=r"dimension 1 \(logical 'embed', size 7168\) cannot be split over mesh "
                                            r"axes \('fsdp', 'expert'\) \(2048 shards\).*allow_partial=True"):
        sharding_report(lambda: DeepSeekV3(V3, rngs=nnx.Rngs(0)), mesh, "default", allow_partial=False)
    report = sharding_report(lambda: DeepSeekV3(V3, rngs=nnx.Rngs(0)), mesh, "default")
    rows = {r.path: r for r in report.rows}
    q_b = rows["moe_layers.attn.q_b_proj.kernel"]  # q_lora 1536 = 2**9 * 3: 256 divides it, 2048 does not
    assert q_b.spec == (None, "fsdp", None, None)
    assert [(f.name, f.wanted, f.placed) for f in q_b.fallbacks] == [("q_lora", ("fsdp", "expert"), ("fsdp",))]
    # Replicated 8x over `expert` instead of split 2048 ways: it holds 8x the even split.
    assert q_b.bytes_per_device == 8 * q_b.wanted_bytes_per_device
    assert q_b.fallback_bytes_per_device == 7 * q_b.wanted_bytes_per_device
    names = {f.name for f in report.fallbacks}
    assert names == {"embed", "q_lora", "kv_lora"}
    assert report.fallback_bytes_per_device == sum(r.fallback_bytes_per_device for r in report.rows) > 0
    assert "'embed' (size 7168) does not divide over fsdp,expert (2048 shards): placed on fsdp (256 shards)" in (
        report.table())


def test_dropped_axes_stay_free_for_later_rules():
    # shard-exp-on-fsdp asks exp -> (expert, fsdp) = 2048 shards of 256 experts: it falls back to `expert`, and
    # fsdp, released, shards the expert width instead of leaving the experts replicated 256 ways.
    mesh = make_abstract_mesh(MESHES[2048])
    names, shape = ("moe_layers", "exp", "embed_no_exp", "moe_mlp"), (58, 256, 7168, 2048)
    r = resolve(names, "shard-exp-on-fsdp", mesh, shape=shape, allow_partial=True)
    assert tuple(r.spec) == (None, "expert", "fsdp", None)
    assert [(f.name, f.placed) for f in r.fallbacks] == [("exp", ("expert",))]
    assert r.wanted_shards == 2048  # as many pieces as the rule asked for: the fallback cost nothing here
    with pytest.raises(ShardingError, match=r"logical 'exp', size 256"):
        logical_to_mesh_axes(names, "shard-exp-on-fsdp", mesh, shape=shape)


@pytest.mark.parametrize("rules", sorted(RULE_SETS))
def test_partial_equals_strict_when_everything_divides(rules):
    mesh = make_abstract_mesh({"data": 2, "fsdp": 4, "tensor": 2, "expert": 2})
    for names in [("embed", "mlp"), ("moe_layers", "exp", "embed_no_exp", "moe_mlp"), ("vocab", "embed"),
                  ("q_lora", "heads", "kv"), ("activation_batch", "activation_length", "activation_embed")]:
        shape = (64,) * len(names)
        strict = resolve(names, rules, mesh, shape=shape)
        partial = resolve(names, rules, mesh, shape=shape, allow_partial=True)
        assert partial == strict and not partial.fallbacks


def test_unknown_names_stay_errors_with_allow_partial():
    mesh = make_abstract_mesh(MESHES[2048])
    with pytest.raises(ShardingError, match=r"unknown logical axis name 'embd'"):
        logical_to_mesh_axes(("embd", "mlp"), "default", mesh, shape=(7168, 64), allow_partial=True)


class _Odd(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones((12, 16)), out_sharding=("embed", "mlp"), eager_sharding=False)


def test_create_sharded_is_strict_unless_asked_and_then_warns():
    mesh = make_mesh({"fsdp": 4, "expert": 2})
    with pytest.raises(ShardingError, match=r"w: dimension 0 \(logical 'embed', size 12\)"):
        create_sharded(lambda: _Odd(nnx.Rngs(0)), mesh, "default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = create_sharded(lambda: _Odd(nnx.Rngs(0)), mesh, "default", allow_partial=True)
    assert model.w.get_value().sharding.spec == jax.sharding.PartitionSpec("fsdp", None)  # 12 = 4 x 3
    assert any("w: dimension 0 (logical 'embed', size 12) does not divide over ('fsdp', 'expert')" in str(w.message)
               for w in caught)


# ---- the activation estimate against XLA's buffer assignment ----
# The estimate is of the gradient computation's temporaries: what the backward keeps plus the transient gathered
# weights and gradients, held parts + the larger of the output-head and one-layer phases (plan.py's docstring).
# XLA's temp bytes of the compiled gradient (parameters are arguments, gradients outputs) are the same quantity.
# Measured estimate / XLA (KiB): 1 device none 45528/47348 = 0.96 (now 0.99); FSDP 8 looped full, vocab 512, 1.14
# (one-layer phase; the score term counts 14 bytes a score, about 8 are live then); FSDP 4 x EP 2 one-layer stacks
# full gmm 9161/9797 = 0.94 (now 1.00); FSDP 4 x EP 2 looped none dense, vocab 512, 8849/8975 = 0.99 (now 1.04; the
# layers dominate). Not tested (each a compile, ~15 s): FSDP 8 looped full 5600/5389 = 1.04 (head phase), looped none
# 11990/11527 = 1.04, vocab 512 9205/8975 = 1.03, 3 + 3 layers 12464/12213 = 1.02 (one layer more per stack: XLA +1134
# dense / +2104 MoE, the estimate +1128 / +2131).
# Under none a looped stack stores every residual autodiff saves (6 [T, I] per SwiGLU, 7 [T, E, I] on the dense
# MoE path, the gathered expert weights of every layer); compiled whole, XLA fuses some away (4), and the
# estimate before it counted 4 everywhere and no expert weights: 0.63-0.90 on the looped none cases.
# Tolerance 0.85-1.15: the formulas count the buffers autodiff keeps, not XLA's fusion and reuse (the one-layer
# phase's gathered weights are not all live at once: 1.10). Outside it, not tested here: gmm in a looped
# one-layer phase on CPU (0.53 at vocab 512: XLA:CPU computes ragged_dot densely over all experts; ep 0.91).
CASES = [  # (mesh, layers, first dense layers, remat, moe_impl, vocab); small models to keep CI's compiles short
    # stacks of one layer each (no loops): the one-layer stacks are kept whole, the output head phase dominates
    ({"fsdp": 1}, 2, 1, "none", "dense", 4096),
    # gmm runs the portable tiled grouped matmul here: its per-tile weight copies count (without them 0.84)
    ({"fsdp": 4, "expert": 2}, 2, 1, "full", "gmm", 4096),
    # two stacks of 2 layers (scan loops), small vocab: the one-layer phase (the head phase: the cases above)
    ({"fsdp": 8}, 4, 2, "full", "dense", 512),
    # remat none with looped stacks: every layer's residuals held, the expert dim left whole (the tokens take
    # `expert`), the one-layer phase (cotangents) on top
    ({"fsdp": 4, "expert": 2}, 4, 2, "none", "dense", 512),
]
# Long sequences, one device, where the attention kernel decides the memory: (preset, layers, remat, attention,
# batch x seq, vocab, loss chunk tokens, config overrides). Measured estimate / XLA: the einsum path's quadratic
# scores in the recomputed layer 0.90 at the a + 10 bytes per score the plan uses (a + 12: 1.01; without the score
# gradients, a + 4: 0.56). Blockwise attention with tiled gmm, one-layer stacks: 0.92. Blockwise in a looped stack
# under remat none with the chunked loss, its logits 256 tokens at a time: 1.09 (XLA 183 MiB; counting every token's
# logits instead: 4.7; the whole-logits loss takes 839 MiB, estimated at 1.02).
# DeepSeek-V3.2's sparse attention, its indexer trained by its own loss, one layer's scratch the larger phase: at 1,024
# positions (top 64 keys, a 16 x 32 indexer) one query block's forward, the indexer's float32 score tiles against all
# keys, 1.06 (XLA 100.1 MiB; one tile counted instead of two: 0.74); at 2,048 (top 512, a 4 x 32 indexer) its
# backward, the chosen keys' gathered latents and their cotangents, 1.01 (146.1 MiB; without it: 0.58). Counted as
# the old flash-style kernel (a log-sum-exp per row, no indexer): 0.42 and 0.39. Not tested (a compile each), with
# either phase larger: untrained indexers, 1,024-4,096 positions, a looped stack under remat full and none, 0.94-1.09;
# bfloat16 0.90-0.94; two rows 0.94. The small terms (the chosen indices, the indexer's key) are held to what
# autodiff saves instead (test_sparse_attention_keeps_what_autodiff_saves).
# One device, a looped stack under remat full, small vocab (the one-layer phase): the MLP's backward holds its
# cotangents beside the recomputed layer (8 [T, I] live, not 4), and Qwen3's per-head q/k norms keep 3 widths each:
# 1.03 (without the cotangents 0.83, without the q/k norms 0.88, before both 0.67), held to 0.95-1.10.
LONG = [
    ("llama3-tiny", 3, "full", "xla", (1, 2048), 4096, None, {}),
    ("deepseek3-mini", 2, "full", "blockwise", (2, 1024), 4096, None, {}),
    ("llama3-tiny", 3, "none", "blockwise", (1, 2048), 32000, 256, {}),
    ("deepseek3.2-tiny", 2, "full", "sparse-top64", (1, 1024), 4096, 256, dict(index_n_heads=16,
                                                                              indexer_training="sparse")),
    ("deepseek3.2-tiny", 2, "full", "sparse-top512", (1, 2048), 512, 256, dict(indexer_training="sparse")),
    ("qwen3-tiny", 4, "full", "xla", (8, 64), 512, None, {}),
    # Several layer kinds, a window or chunk of 128 at 1,024 positions (blockwise skips the blocks outside it; its
    # memory is the log-sum-exp per row whatever the span), remat full: GPT-OSS (sliding / full with sinks, all
    # MoE) and Gemma 3 (sliding / global, sandwich norms, tanh GELU) scan one (sliding, full) step twice, the step
    # the recomputed unit: 0.93 and 0.96 (counted as one layer of one stack, the plan before: 0.56 and 0.45; Gemma 3
    # without its two extra norms and GELU residuals 0.84). Llama 4 (chunked dense, chunked MoE, chunked dense, NoPE
    # MoE; no repeat: every layer kept whole): 0.96 (as two looped stacks: 0.38; without the dense layers'
    # intermediate_size_mlp, the L2 q/k norm and NoPE temperature: 0.86).
    ("gpt-oss-tiny", 4, "full", "blockwise", (1, 1024), 512, 256, dict(sliding_window=128)),
    ("gemma3-tiny", 4, "full", "blockwise", (1, 1024), 512, 256, dict(sliding_window=128)),
    ("llama4-tiny", 4, "full", "blockwise", (1, 1024), 512, 256, dict(attention_chunk_size=128)),
    # Gemma 4 (sliding / global with its own head width and K = V, sandwich norms, tanh GELU, the MoE block beside
    # the MLP in every layer, per-layer inputs; the per-layer table at vocab 512 too) scans one (sliding, full) step
    # twice: 1.07 (its MoE unread, the config answering none of the MoE names: 0.77; the MLP's and MoE's cotangents
    # added, not the larger: 1.12).
    ("gemma4-tiny", 4, "full", "blockwise", (1, 1024), 512, 256, dict(sliding_window=128,
                                                                       vocab_size_per_layer_input=512)),
]


def _xla_temp(model: nnx.Module, mesh, batch: int, seq: int, chunk: int | None) -> int:
    """XLA's temp bytes of the gradient of the loss on ``batch x seq`` token ids: the whole batch's logits, or
    (``chunk``) the trainer's chunked head + cross-entropy."""
    graphdef, state = nnx.split(model)

    def loss(state: nnx.State, ids: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, state)
        mask = jnp.ones_like(ids, jnp.float32)
        if chunk is None:
            total, count = token_cross_entropy(model(ids), ids, mask)
        else:
            with model.sharding_scope():
                out = model.forward(ids, with_logits=False)
                total, count = chunked_head_cross_entropy(out.final_hidden, model.output_head(), ids, mask,
                                                          chunk_tokens=chunk)
            if getattr(out, "indexer_loss", None) is not None:  # as the trainer adds a sparse indexer's own loss
                return total / count + out.indexer_loss
        return total / count

    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                               sharding=named_sharding(("activation_batch", None), "default", mesh))
    return jax.jit(jax.grad(loss)).lower(state, ids).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(("sizes", "layers", "first_dense", "remat", "impl", "vocab"), CASES)
def test_activation_estimate_within_tolerance_of_xla(sizes, layers, first_dense, remat, impl, vocab):
    config = DeepSeekV3Config.preset("deepseek3-mini", num_hidden_layers=layers, first_k_dense_replace=first_dense,
                                     remat_policy=remat, moe_impl=impl, num_nextn_predict_layers=0,
                                     vocab_size=vocab)
    devices = math.prod(sizes.values())
    mesh = make_mesh(sizes, shard_mode="explicit", devices=jax.devices()[:devices])
    batch, seq = 8, 64
    with jax.set_mesh(mesh), use_rules("default"):
        model = create_sharded(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0)), mesh, "default")
        xla = _xla_temp(model, mesh, batch, seq, None)
    kernels = kernel_choices(config, seq_len=seq, platform="cpu")
    plan = memory_plan(model, config, mesh, "default", seq_len=seq, batch_per_device=batch // devices,
                       kernels=kernels)
    parts = plan.activations[remat]
    estimate = plan.activation_bytes(remat)
    # A looped stack under none stores exactly what autodiff saves (no fusion can drop a stacked residual): the
    # per-layer slope matched XLA within 1.5%, so the case is held tighter. Counting 4 [T, I] per SwiGLU (0.88)
    # or leaving out the kept expert weights (0.87) fails it.
    low, high = (0.95, 1.10) if remat == "none" and layers - first_dense > 1 else (0.85, 1.15)
    assert low <= estimate / xla <= high, (estimate, xla, parts)
    head = sum(v for k, v in parts.items() if PART_PHASES[k] == "output head")
    layer = sum(v for k, v in parts.items() if PART_PHASES[k] == "one layer")
    if vocab == 512:  # the case is there for its one-layer phase: it must be the larger one
        assert layer > head and parts["gathered gradient, one weight"] > 0
    if first_dense == 1 and devices > 1:  # one-layer stacks: gathered once, kept to the backward
        assert parts["gathered weights, one-layer stacks"] > 0 and parts["gathered weights, one layer"] == 0
    if remat == "none" and layers - first_dense > 1:  # a looped MoE stack under none keeps its gathered experts
        assert parts["expert weights, every layer"] > 0 and parts["cotangents, one layer"] > 0
    if impl == "gmm":  # the experts' non-FSDP dims are gathered too
        assert kernels["grouped_matmul"] == "tiled"
        assert gathered_weight_bytes(plan.report, "all") > gathered_weight_bytes(plan.report, "fsdp")


# The MoE families on the shared MoE layer, 8 x 64 tokens at vocab 512 (one layer's phase the larger one): Mixtral
# names its experts `num_local_experts` of width `intermediate_size` (read by HF names, the plan saw a dense model:
# 0.46 here, and --plan on the GPU platform crashed); GLM-4.5 adds shared experts and a dense first layer; `ep`
# all-gathers the tokens over the EP axes that split them and runs its experts by the platform's dropless path:
# every local expert on CPU (Mixtral here with 16 experts, 8 per device, top-2: counted as gmm without the gather,
# 0.70; as a grouped matmul over the gathered tokens, 0.66), a grouped matmul on GPU ("ep-gmm": that path forced
# here, with its tiled kernel). MiniMax-M2 (its q/k norm over all heads, the norm's memory as per head) on the
# dropless grouped matmul: 0.94.
MOE_FAMILIES = [  # (preset, mesh, layers, remat, moe_impl, config overrides)
    ("mixtral-tiny", {"fsdp": 4, "expert": 2}, 4, "none", "ep", dict(num_local_experts=16)),
    ("glm4.5-tiny", {"fsdp": 4, "expert": 2}, 4, "none", "dense", {}),
    ("qwen3-moe-tiny", {"fsdp": 4, "expert": 2}, 4, "none", "ep-gmm", {}),
    ("minimax-m2-tiny", {"fsdp": 4, "expert": 2}, 4, "none", "gmm", {}),
]


@pytest.mark.parametrize(("preset", "sizes", "layers", "remat", "impl", "extra"), MOE_FAMILIES)
def test_moe_families_estimate_within_tolerance_of_xla(preset, sizes, layers, remat, impl, extra, monkeypatch):
    import nnx_zoo.layers.moe as moe

    if impl == "ep-gmm":  # ep's local experts by the grouped matmul, as on GPU (the tiled kernel here)
        monkeypatch.setattr(moe, "default_moe_impl", lambda platform=None: "gmm")
    config = AutoConfig.preset(preset, num_hidden_layers=layers, remat_policy=remat, vocab_size=512,
                               moe_impl=impl.removesuffix("-gmm"), **extra)
    devices = math.prod(sizes.values())
    mesh = make_mesh(sizes, shard_mode="explicit", devices=jax.devices()[:devices])
    batch, seq = 8, 64
    with jax.set_mesh(mesh), use_rules("default"):
        model = create_sharded(lambda: AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0)), mesh,
                               "default")
        xla = _xla_temp(model, mesh, batch, seq, None)
    kernels = kernel_choices(config, seq_len=seq, platform="cpu")
    if impl == "ep-gmm":  # what kernel_choices reports on a GPU, with the grouped matmul that ran
        kernels["grouped_matmul"] = "tiled"
    plan = memory_plan(model, config, mesh, "default", seq_len=seq, batch_per_device=batch // devices,
                       kernels=kernels)
    assert (plan.shapes.experts, plan.shapes.moe_intermediate, plan.shapes.moe_layers) == (
        config.num_routed_experts, config.expert_intermediate_size, config.num_moe_layers)
    assert 0.90 <= plan.activation_bytes(remat) / xla <= 1.10, (plan.activation_bytes(remat), xla,
                                                               plan.activations[remat])


@functools.cache
def _abstract_preset(name: str) -> nnx.Module:
    """The preset's model, shapes only, traced once for both platforms' plans (what ``memory_plan`` does with a
    factory)."""
    config = AutoConfig.preset(name)
    return abstract_module(lambda: AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_every_preset_plans(platform):
    """``--plan`` on every preset of every family (abstract, nothing allocated), on each platform's kernels: the MoE
    families' experts are read by the contract's names, not one family's HF names."""
    from nnx_zoo.models.registry import preset_names

    mesh = make_abstract_mesh({"fsdp": 8})
    for name in [n for names in preset_names().values() for n in names]:
        config = AutoConfig.preset(name)
        plan = memory_plan(_abstract_preset(name), config, mesh, "default", seq_len=4096, batch_per_device=1,
                           kernels=kernel_choices(config, seq_len=4096, platform=platform))
        shapes = plan.shapes
        assert shapes.moe_layers == getattr(config, "num_moe_layers", 0), name
        assert shapes.dense_layers + shapes.moe_layers == config.num_hidden_layers, name
        if shapes.moe_layers:
            assert (shapes.experts, shapes.moe_intermediate) == (config.num_routed_experts,
                                                                 config.expert_intermediate_size), name
        full, none = plan.activation_bytes("full"), plan.activation_bytes("none")
        # A schedule without a repeat (deepseek4-tiny's, llama4-small's) is segments of one layer each: kept whole
        # under either remat.
        segments = (shapes.v4.segments() if shapes.v4 is not None else
                    periodic_runs(shapes.schedule, KIND_MAX_PERIOD) if shapes.kinds else [((), 2)])
        if all(repeats == 1 for _, repeats in segments):
            assert 0 < full == none, name
        else:
            assert 0 < full < none, name


@pytest.mark.parametrize(("preset", "layers", "remat", "attention", "shape", "vocab", "chunk", "extra"), LONG)
def test_estimate_follows_the_attention_kernel_and_the_chunked_loss(preset, layers, remat, attention, shape, vocab,
                                                                     chunk, extra):
    overrides = dict(num_hidden_layers=layers, remat_policy=remat, vocab_size=vocab, **extra)
    if attention.startswith("sparse-top"):  # DeepSeek-V3.2: the indexer's top-k decides, not attention_impl
        overrides["index_topk"] = int(attention.removeprefix("sparse-top"))
    else:
        overrides["attention_impl"] = attention
    if preset.startswith("deepseek"):
        overrides.update(first_k_dense_replace=1, moe_impl="gmm", num_nextn_predict_layers=0)
    config = AutoConfig.preset(preset, **overrides)
    mesh = make_mesh({"fsdp": 1}, shard_mode="explicit", devices=jax.devices()[:1])
    batch, seq = shape
    with jax.set_mesh(mesh), use_rules("default"):
        model = create_sharded(lambda: AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0)), mesh,
                               "default")
        xla = _xla_temp(model, mesh, batch, seq, chunk)
    kernels = kernel_choices(config, seq_len=seq, platform="cpu")
    assert kernels["attention"] == attention
    plan = memory_plan(model, config, mesh, "default", seq_len=seq, batch_per_device=batch, kernels=kernels,
                       loss_chunk_tokens=chunk)
    estimate = plan.activation_bytes(remat)
    low, high = (0.95, 1.10) if preset == "qwen3-tiny" else (0.85, 1.15)  # the one-layer phase, modelled to 3%
    assert low <= estimate / xla <= high, (estimate, xla, plan.activations[remat])
    if extra.get("sliding_window") or extra.get("attention_chunk_size"):  # counted per kind, scanned as the model
        from nnx_zoo.layers.scan import periodic_runs as scan_runs

        kinds = plan.shapes.kinds
        assert len(kinds) > 1 and set(plan.shapes.schedule) == {k.stack for k in kinds}
        assert periodic_runs(plan.shapes.schedule, KIND_MAX_PERIOD) == scan_runs(plan.shapes.schedule, KIND_MAX_PERIOD)
        local = [k for k in kinds if k.span]
        span = extra.get("sliding_window") or extra["attention_chunk_size"]
        assert local and {k.span for k in local} == {span} and all(k.kernel == attention for k in kinds)
        assert all(f"{'window' if k.window else 'chunk'} {k.span}, {attention}" in plan.table() for k in local)
    if getattr(config, "num_moe_layers", 0):  # the MoE block is read, by the names every MoE config answers
        assert (plan.shapes.experts, plan.shapes.moe_layers) == (config.num_routed_experts, config.num_moe_layers)
    if attention.startswith("sparse-top"):  # its indexer's scratch is the one-layer phase, above the head's
        parts = plan.activations[remat]
        assert parts["sparse attention, one block"] > parts["embeddings and logits"]
        assert "chosen keys" in plan.table()
        # Not told the attention kernel, the plan asks the config: the same sparse attention.
        others = {k: v for k, v in kernels.items() if k != "attention"}
        assert memory_plan(model, config, mesh, "default", seq_len=seq, batch_per_device=batch, kernels=others,
                           loss_chunk_tokens=chunk).activation_bytes(remat) == estimate


def _saved_per_token(config: DeepSeekV3Config) -> float:
    """Bytes per token that autodiff saves for the backward of one input norm + MLA layer (the plan's attention):
    the residuals of ``jax.vjp`` at two lengths, differenced (the weights and constants cancel)."""
    norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    graphdef, state = nnx.split((norm, MLA(config, rngs=nnx.Rngs(0))))

    def saved(seq: int) -> int:
        cos, sin = rope_cos_sin(jnp.arange(seq)[None], rope_frequencies(config.qk_rope_head_dim, 1e4)[0])

        def layer(state: nnx.State, x: jax.Array) -> jax.Array:
            norm, attn = nnx.merge(graphdef, state)
            out, kl = attn.attend(norm(x), cos, sin, causal_mask(seq))
            return out.sum() + (0.0 if kl is None else kl.sum())

        x = jax.ShapeDtypeStruct((1, seq, config.hidden_size), jnp.float32)
        residuals = jax.eval_shape(lambda s, x: jax.tree.leaves(jax.vjp(layer, s, x)[1]), state, x)
        return sum(math.prod(r.shape) * r.dtype.itemsize for r in residuals)

    return (saved(256) - saved(128)) / 128


@pytest.mark.parametrize("stage", ["off", "sparse"])
def test_sparse_attention_keeps_what_autodiff_saves(stage):
    # The plan's per-layer count of DeepSeek-V3.2's sparse attention against the residuals of its vjp: growing the
    # chosen keys, the indexer, the latent and the heads changes both by the same bytes per token, to the byte
    # (the indexer's tensors only when its loss trains it). The absolute counts differ by what the formulas leave
    # out and no dimension here changes: the norms' per-row statistics, rope's cos/sin, the block positions, and
    # (trained) stop_gradient's copies of the layer input and query latent, which XLA does not make.
    def plan_per_token(config: DeepSeekV3Config) -> int:
        shapes = DecoderShapes.from_config(config, kernel_choices(config, seq_len=128, platform="cpu"))
        assert shapes.index_topk == config.index_topk and shapes.indexer_trained == (stage == "sparse")
        one = Local(batch=1, seq=1, keys=128, heads=config.num_attention_heads, kv_heads=0, mlp=0, moe_mlp=0,
                    vocab=0, experts=0, shared_mlp=0)
        return attention_bytes(shapes, one)

    small = DeepSeekV3Config.preset("deepseek3.2-tiny", index_topk=32, indexer_training=stage)
    large = small.with_overrides(index_topk=96, index_n_heads=8, index_head_dim=48, kv_lora_rank=64,
                                 num_attention_heads=8)
    assert plan_per_token(large) - plan_per_token(small) == _saved_per_token(large) - _saved_per_token(small)


def test_the_plans_tiled_grouped_matmul_rules_are_the_kernels():
    from nnx_zoo.layers.grouped_matmul import _MIN_CHUNK_ELEMENTS, default_tile

    for rows, groups in [(12288, 64), (128, 8), (16, 16), (100000, 8)]:
        tile = default_tile(rows, groups)
        bound = -(-rows // tile) + groups  # the kernel's static tile bound and chunk of tiles per scan step
        chunk = max(1, min(bound, max(_MIN_CHUNK_ELEMENTS, rows * 2048) // (2048 * 1408)))
        assert tiled_grouped_matmul_bytes(rows, groups, 2048, 1408, 2) == (chunk * 2048 * 1408 * 6
                                                                          + groups * 2048 * 1408 * 4)


def test_activation_peak_is_held_plus_the_larger_phase():
    parts = {"layer inputs": 5, "embedding gradient": 1, "embeddings and logits": 20,
             "gathered weights, outside the stacks": 4, "one layer recomputed": 10, "gathered weights, one layer": 7,
             "gathered gradient, one weight": 3}
    assert activation_peak(parts) == 6 + max(24, 20)
    assert activation_peak({**parts, "gathered gradient, one weight": 9}) == 6 + 26


# ---- DeepSeek-V4: its own parts, against XLA's buffers of the trainer's gradient ----
# Small V4 layers with every dim distinct (so a wrong width shows): 4 hyper-connection streams (Flash's), a 16-token
# window, CSA every 4 tokens (indexer 4 x 24 keeping 8) and HCA every 16, the clamped SwiGLU, 4 Sinkhorn steps
# (Flash: 20; each is two tiny [T, 4, 4] divisions, counted per step).
V4_BASE = dict(hidden_size=96, num_attention_heads=8, head_dim=40, qk_rope_head_dim=8, q_lora_rank=56, o_groups=2,
               o_lora_rank=24, hc_mult=4, hc_sinkhorn_iters=4, sliding_window=16, n_routed_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=36, index_n_heads=4, index_head_dim=24, index_topk=8,
               compress_rate_csa=4, compress_rate_hca=16, vocab_size=512, num_nextn_predict_layers=0)
# Schedules as V4-Flash's, short: 's' sliding, 'c' CSA, 'h' HCA. 'schch' is one sliding layer (hash-routed; a
# segment of one repeat, compiled whole) then (CSA, HCA) twice (one scan of two-layer steps), 'chch' only the scan.
# (mesh, schedule, remat, attention_impl, batch x seq, overrides). Measured plan / XLA, in order: 1.09, 0.96, 1.08,
# 1.07, 1.04. Each V4 part decides a case: without the hyper-connection streams 0.87 / 0.62 / 0.80 / 0.62 / 0.91;
# without the xla scores (every token and entry) case 1 0.64; without the indexer's block scratch case 5 0.67;
# without the MTP layer case 2 0.67; counted as a generic MoE decoder (the plan before V4's parts) 0.84 / 1.67 /
# 0.48 / 0.45 / 1.18. Each case compiles in 15-60 s here (2 shared cores).
V4_CASES = [
    # remat none, the xla path: every layer's residuals held (looped: what autodiff saves; the sliding layer
    # compiled whole: XLA's buffers), scores over every token and entry
    ({"fsdp": 1}, "schch", "none", "xla", (1, 256), {}),
    # remat full without a loop (segments of one layer are kept whole), auto picks blockwise at 1,024 positions
    # (every layer type), with the MTP layer (kept whole; its backward, right after the head's, is the larger phase)
    ({"fsdp": 1}, "sch", "full", "auto", (1, 1024), dict(num_nextn_predict_layers=1)),
    # 8-way FSDP, remat full, the xla path: a step's two layers recomputed with their weights gathered
    ({"fsdp": 8}, "chch", "full", "xla", (8, 64), {}),
    # FSDP 4 x TP 2, remat none, blockwise on each device's heads
    ({"fsdp": 4, "tensor": 2}, "chch", "none", "blockwise", (4, 256), {}),
    # one device, remat full, a wide indexer over CSA entries every 2 tokens: a block's indexer scores (128 heads x
    # 512 entries per query, float32, twice) are the one-layer phase's largest part
    ({"fsdp": 1}, "chch", "full", "auto", (1, 1024), dict(index_n_heads=128, compress_rate_csa=2, index_topk=16,
                                                         n_routed_experts=4, moe_intermediate_size=16)),
]


def _v4_config(schedule: str, remat: str, attention: str, extra: dict):
    from nnx_zoo.models.deepseek4.config import CSA, HCA, SLIDING, hash_schedule

    types = tuple({"s": SLIDING, "c": CSA, "h": HCA}[k] for k in schedule)
    return AutoConfig.preset("deepseek4-tiny", **{
        **V4_BASE, "num_hidden_layers": len(types), "layer_types": types,
        "mlp_layer_types": hash_schedule(len(types), int(schedule[0] == "s")), "remat_policy": remat,
        "attention_impl": attention, **extra})


def _v4_xla_temp(model: nnx.Module, mesh, batch: int, seq: int) -> int:
    """XLA's temp bytes of the trainer's gradient (``loss_terms``: the chunked head + cross-entropy, the MTP heads'
    loss when the model has them) with respect to what it trains (``model.trainable()``: the CSA indexers are
    frozen by default; the hash tables are not parameters). The batch carries an attention mask (the blockwise
    kernel's ``[1, s]`` mask of a batch without one does not split over a batch-sharded mesh)."""
    from nnx_zoo.train.step import loss_terms

    mtp = bool(model.config.num_nextn_predict_layers)
    graphdef, params, rest = nnx.split(model, model.trainable(), ...)
    kwargs = (("with_mtp", True),) if mtp else ()

    def loss(params: nnx.State, rest: nnx.State, ids: jax.Array) -> jax.Array:
        batch = {"input_ids": ids, "targets": ids, "loss_mask": jnp.ones_like(ids, jnp.float32),
                 "attention_mask": jnp.ones_like(ids)}
        return loss_terms(nnx.merge(graphdef, params, rest), batch, 0.3 if mtp else 0.0, kwargs)[0]

    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32,
                               sharding=named_sharding(("activation_batch", None), "default", mesh))
    return jax.jit(jax.grad(loss)).lower(params, rest, ids).compile().memory_analysis().temp_size_in_bytes


def _v4_plan(sizes, schedule, remat, attention, shape, extra):
    config = _v4_config(schedule, remat, attention, extra)
    devices = math.prod(sizes.values())
    mesh = make_mesh(sizes, shard_mode="explicit", devices=jax.devices()[:devices])
    batch, seq = shape
    with jax.set_mesh(mesh), use_rules("default"):
        # Abstract (shapes and shardings, nothing initialised): the compile and the plan need no values.
        model = nnx.eval_shape(lambda: create_sharded(
            lambda: AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0)), mesh, "default"))
        xla = _v4_xla_temp(model, mesh, batch, seq)
    shards = math.prod(v for k, v in sizes.items() if k in ("data", "fsdp"))
    plan = memory_plan(model, config, mesh, "default", seq_len=seq, batch_per_device=batch // shards,
                       kernels=kernel_choices(config, seq_len=seq, platform="cpu"))
    return config, plan, xla


@pytest.mark.parametrize(("sizes", "schedule", "remat", "attention", "shape", "extra"), V4_CASES)
def test_deepseek4_estimate_within_tolerance_of_xla(sizes, schedule, remat, attention, shape, extra):
    config, plan, xla = _v4_plan(sizes, schedule, remat, attention, shape, extra)
    parts = plan.activations[remat]
    estimate = plan.activation_bytes(remat)
    assert 0.85 <= estimate / xla <= 1.15, (estimate / xla, estimate, xla, parts)
    v4, seq = plan.shapes.v4, shape[1]
    assert v4 is not None and plan.shapes.index_topk == 0  # V4's indexer is its own, not V3.2's sparse attention
    impls = {v4.impl(t, seq) for t in config.layer_types}
    assert impls == ({"blockwise"} if attention == "auto" else {attention})
    if remat == "full":  # the looped (CSA, HCA) steps: their carried streams and one recomputed step
        steps = sum(r for kinds, r in v4.segments() if r > 1)
        assert parts["layer inputs"] == steps * shape[0] // math.prod(
            v for k, v in sizes.items() if k in ("data", "fsdp")) * seq * 4 * config.hc_mult * config.hidden_size
    if "index_n_heads" in extra:  # the indexer's block scratch decides the one-layer phase
        assert parts["attention scratch, one layer"] > parts["one layer recomputed"] / 2
    if config.num_nextn_predict_layers:
        assert parts["mtp layers"] > parts["embeddings and logits"]  # its phase is the MTP layer's
    if sizes.get("fsdp", 1) > 1 and remat == "full":  # a step's pattern gathers both of its layers' weights
        assert parts["gathered weights, one layer"] > 0 and parts["gathered gradient, one weight"] > 0
    # Held beside the parameters, not trained: each hash layer's [vocab, k] int32 table, each routed layer's (the
    # MTP layer's too) float32 selection bias; the total counts them.
    hashed = config.mlp_layer_types.count(V4_HASH)
    routed = config.num_hidden_layers - hashed + config.num_nextn_predict_layers
    assert plan.buffer_bytes == 4 * (hashed * config.vocab_size * config.num_experts_per_tok
                                     + routed * config.n_routed_experts)
    assert plan.total(remat) == 2 * plan.param_bytes + plan.optimizer_bytes + plan.buffer_bytes + estimate
    assert f"{config.hc_mult} hyper-connection streams" in plan.table() and "buffers" in plan.table()


def test_deepseek4_plan_follows_the_models_rules():
    """The plan's copies of V4's names and rules (the sharding package imports no model code) are the model's: its
    layer types, the kernel's 'auto' threshold and block, the schedule's segments and the stacks' names."""
    from nnx_zoo.layers.scan import periodic_runs
    from nnx_zoo.models.deepseek4 import kernel
    from nnx_zoo.models.deepseek4.config import CSA, HASH_MOE, HCA, SLIDING, DeepSeekV4Config, kind_name

    assert (V4_SLIDING, V4_CSA, V4_HCA, V4_HASH) == (SLIDING, CSA, HCA, HASH_MOE)
    assert (V4_XLA_MAX_SCORES, V4_BLOCK) == (kernel.XLA_MAX_SCORES, kernel.BLOCK)
    for name in DeepSeekV4Config.PRESETS:
        config = DeepSeekV4Config.preset(name)
        v4 = V4Shapes.from_config(config)
        assert v4.segments() == periodic_runs(config.layer_kinds), name
        assert all(v4_stack_name(k) == f"stacks.{kind_name(k)}" for k in config.layer_kinds), name
        for seq in (64, 448, 512, 4096):  # kernel.attend's 'auto': xla while s * (s + entries) fits
            for layer_type in set(config.layer_types):
                entries = seq // config.compress_rate(layer_type) if config.compress_rate(layer_type) else 0
                fits = seq * (seq + entries) <= kernel.XLA_MAX_SCORES
                assert v4.impl(layer_type, seq) == ("xla" if fits else "blockwise"), (name, seq, layer_type)


@pytest.mark.parametrize(("preset", "mesh_shape"), [
    ("gemma3-tiny", {"fsdp": 2, "tensor": 2}),  # window rings beside full layers, kv heads split
    ("gemma4-tiny", {"fsdp": 4}),  # shared K/V stored once (num_kv_shared_layers below), global layers' own width
    ("llama4-tiny", {"fsdp": 1}),  # chunk rings, NoPE layers in full
    ("gpt-oss-tiny", {"fsdp": 1}),
    ("qwen3-tiny", {"fsdp": 2}),  # one kind: every layer full
])
def test_the_plans_decoding_cache_is_the_models(preset, mesh_shape):
    """The plan's decoding-cache line counts exactly the per-device bytes of the keys and values that
    ``init_cache`` lays out (rings for windowed and chunked layers, nothing for shared K/V), at a context past
    every ring; a family whose cache it does not model (MLA, linear attention) gets no line."""
    config = AutoConfig.preset(preset, **({"num_kv_shared_layers": 2} if preset == "gemma4-tiny" else {}))
    spans = [v for k in config.layer_kinds() for v in (config.attention_options(k).get("window"),
                                                        config.attention_options(k).get("chunk")) if v] \
        if hasattr(config, "attention_options") else []
    seq = 2 * max(spans, default=16)
    mesh = make_mesh(mesh_shape, shard_mode="explicit", devices=jax.devices()[:math.prod(mesh_shape.values())])
    make = lambda: AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0))  # noqa: E731
    plan = memory_plan(make, config, mesh, "default", seq_len=seq, batch_per_device=2)
    with jax.set_mesh(mesh), use_rules("default"):
        cache = jax.eval_shape(lambda: make().init_cache(plan.global_batch, seq))
    kv = jax.tree.leaves((cache.k, cache.v))
    actual = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in kv)
    assert plan.cache_bytes == actual, (plan.cache_bytes, actual)
    assert (min(a.shape[2] for a in kv) < seq) == bool(spans)  # the rings are smaller than the context
    assert "decoding cache" in plan.table()
    mla = AutoConfig.preset("deepseek3-tiny")
    assert memory_plan(lambda: DeepSeekV3(mla, rngs=nnx.Rngs(0)), mla, mesh, "default", seq_len=seq).cache_bytes is None


# The linear-attention hybrids (nnx_zoo.sharding.plan_linear): a (linear, full) step scanned twice, 256 tokens in
# four chunks of 64, vocab 512 (the layers' phases decide). Measured estimate / XLA: Qwen3.5 (gated delta rule, gated
# full attention) 1.04 under none, 1.00 under full; Kimi Linear (KDA's per-channel decay, MLA full layers, MoE on the
# dense path) 0.95 and 1.07. Before (the linear layers counted as softmax attention): 1.12, 0.62, 0.87, 0.53; the
# step's whole pattern as the none case's cotangents: 1.19 and 1.07; KDA's chunk scratch without its [c, c, d_k]
# decays 0.92 under full, with four of them 1.38.
# CI compiles one remat per family (each case ~25 s of CPU); NNX_ZOO_FULL_MATRIX=1 runs both for both.
HYBRIDS = [("qwen3.5-tiny", {}, "none"), ("kimi-linear-tiny", dict(first_k_dense_replace=0, moe_impl="dense"), "full"),
           ("qwen3.5-tiny", {}, "full"), ("kimi-linear-tiny", dict(first_k_dense_replace=0, moe_impl="dense"), "none")]
if os.environ.get("NNX_ZOO_FULL_MATRIX") != "1":
    HYBRIDS = HYBRIDS[:2]


@pytest.mark.parametrize(("preset", "extra", "remat"), HYBRIDS)
def test_linear_attention_hybrids_estimate_within_tolerance_of_xla(preset, extra, remat):
    config = AutoConfig.preset(preset, remat_policy=remat, vocab_size=512, **extra)
    mesh = make_mesh({"fsdp": 1}, shard_mode="explicit", devices=jax.devices()[:1])
    seq = 256
    with jax.set_mesh(mesh), use_rules("default"):
        model = create_sharded(lambda: AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0)), mesh,
                               "default")
        xla = _xla_temp(model, mesh, 1, seq, None)
    plan = memory_plan(model, config, mesh, "default", seq_len=seq, batch_per_device=1,
                       kernels=kernel_choices(config, seq_len=seq, platform="cpu"))
    estimate = plan.activation_bytes(remat)
    # Held tighter than the issue's 0.85-1.15: the linear layers' terms are modelled to a few percent (without the
    # convolution's residuals and half the outputs' widths, Qwen3.5 under full: 0.91).
    assert 0.93 <= estimate / xla <= 1.10, (estimate / xla, estimate, xla, plan.activations[remat])
    linear = [k for k in plan.shapes.kinds if k.attention == "linear"]
    assert len(linear) == 1 and linear[0].linear.chunk == config.delta_rule_chunk_size
    assert plan.activations[remat]["delta rule, one chunk"] > 0
    state = linear[0].linear.state_bytes(1)
    assert f"state [{linear[0].linear.value_heads} heads x 32 x 32] float32 per row ({state:,} bytes)" in plan.table()
    assert f"kept at every chunk of {config.delta_rule_chunk_size}" in plan.table()
    if remat == "none":  # every layer keeps its state at each chunk boundary: a smaller chunk keeps more
        smaller = dataclasses.replace(config, delta_rule_chunk_size=32)
        finer = memory_plan(model, smaller, mesh, "default", seq_len=seq, batch_per_device=1,
                            kernels=kernel_choices(config, seq_len=seq, platform="cpu"))
        assert finer.activations[remat]["moe layers"] - plan.activations[remat]["moe layers"] == 2 * 4 * state
