"""Every registered family meets the causal-LM contract of docs/causal_lm.md: the signatures, ``model(ids, mask)``
-> logits, ``model.forward`` -> one ``CausalLMOutput`` (same fields always), the cache protocol (prefill logits
equal the plain call's), parameter counts equal to the Variables built, declared stack axes, and LoRA's
per-family default targets (exactly the intended projections; the adapted model starts equal to its base)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import AutoConfig, apply_lora
from nnx_zoo.layers.lora import LoRAParam
from nnx_zoo.models.causal_lm import CausalLMOutput
from nnx_zoo.models.registry import MODEL_TYPES
from nnx_zoo.sharding import logical_names
from nnx_zoo.sharding.axes import STACK_AXES

# One small preset per family, shrunk further (2 layers, 256 tokens) so the whole file runs in seconds.
PRESET_OF = {"DeepSeekV3": "deepseek3-mini", "DeepSeekV4": "deepseek4-tiny", "Llama3": "llama3-tiny",
             "Qwen3": "qwen3-tiny", "Qwen3MoE": "qwen3-moe-tiny", "Mixtral": "mixtral-tiny", "Glm4MoE": "glm4.5-tiny",
             "Glm5": "glm5-tiny", "Mistral4": "mistral4-tiny", "Llama4": "llama4-tiny",
             "MiniMaxM2": "minimax-m2-tiny", "GptOss": "gpt-oss-tiny", "Gemma3": "gemma3-tiny",
             "Gemma4": "gemma4-tiny", "Qwen3Next": "qwen3-next-tiny", "Qwen35": "qwen3.5-tiny",
             "Qwen35MoE": "qwen3.5-moe-tiny", "KimiLinear": "kimi-linear-tiny"}
FAMILIES = sorted({model_cls for _, model_cls in MODEL_TYPES.values()}, key=lambda c: c.__name__)
BATCH, SEQ, LAYERS, VOCAB = 2, 8, 2, 256

# The projections each family's default LoRA pattern must adapt (module paths), and nothing else.
_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")
_GQA_SWIGLU = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate", "mlp/up", "mlp/down")
_QWEN35_LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LORA_DEFAULT = {
    "DeepSeekV3": {f"{stack}/attn/{p}" for stack in ("dense_layers", "moe_layers", "mtp_layers/layer") for p in _MLA},
    # The tiny preset's first two layers: a sliding hash-routed one and a CSA one, plus the MTP layer.
    "DeepSeekV4": {f"{stack}/attn/{p}" for stack in ("stacks/sliding_hash", "stacks/csa_moe", "mtp_layers/layer")
                   for p in ("q_a_proj", "q_b_proj", "kv_proj", "output/o_b")},
    "Llama3": {f"layers/{p}" for p in _GQA_SWIGLU},
    "Qwen3": {f"layers/{p}" for p in _GQA_SWIGLU},
    # Every layer MoE: attention only (the routed experts are opt-in, as DeepSeek's).
    "Qwen3MoE": {f"layers/{p}" for p in _GQA_SWIGLU[:4]},
    "Mixtral": {f"layers/{p}" for p in _GQA_SWIGLU[:4]},
    "MiniMaxM2": {f"layers/{p}" for p in _GQA_SWIGLU[:4]},
    # Layer 0 dense (its SwiGLU too), then MoE layers (attention only).
    "Glm4MoE": {f"layers/{p}" for p in _GQA_SWIGLU[:4]} | {f"dense_layers/{p}" for p in _GQA_SWIGLU},
    # DeepSeek's MLA projections: layer 0 (dense, with an indexer), layer 1 (MoE, reusing layer 0's top-k), MTP.
    "Glm5": {f"{stack}/attn/{p}" for stack in ("dense_layers", "shared_topk_moe_layers", "mtp_layers/layer")
             for p in _MLA},
    "Mistral4": {f"moe_layers/attn/{p}" for p in _MLA},  # every layer MoE, no MTP
    # Layer 0 a dense chunked one (its SwiGLU too), layer 1 an MoE chunked one (attention only).
    "Llama4": {f"chunked_dense_layers/{p}" for p in _GQA_SWIGLU} | {f"chunked_layers/{p}" for p in _GQA_SWIGLU[:4]},
    # Every layer MoE, in two stacks (sliding-window and full attention): attention only.
    "GptOss": {f"{stack}/{p}" for stack in ("sliding_layers", "layers") for p in _GQA_SWIGLU[:4]},
    "Gemma3": {f"{stack}/{p}" for stack in ("sliding_layers", "layers") for p in _GQA_SWIGLU},  # a sliding, a global
    # A sliding layer, then a global one whose values are its keys (no v_proj); the MLP beside the experts too.
    "Gemma4": {f"sliding_layers/{p}" for p in _GQA_SWIGLU} | {f"layers/{p}" for p in _GQA_SWIGLU if p != "attn/v_proj"},
    # Layer 0 linear (its input and output projections), layer 1 full attention; the dense one's SwiGLUs too.
    "Qwen3Next": {f"linear_layers/attn/{p}" for p in ("in_proj_qkvz", "in_proj_ba", "out_proj")}
    | {f"layers/{p}" for p in _GQA_SWIGLU[:4]},
    "Qwen35": {f"linear_layers/attn/{p}" for p in _QWEN35_LINEAR} | {f"linear_layers/{p}" for p in _GQA_SWIGLU[4:]}
    | {f"layers/{p}" for p in _GQA_SWIGLU},
    "Qwen35MoE": {f"linear_layers/attn/{p}" for p in _QWEN35_LINEAR} | {f"layers/{p}" for p in _GQA_SWIGLU[:4]},
    # Layer 0 a dense KDA one (its q/k/v/o and SwiGLU), layer 1 an MoE MLA one (its projections; no q_lora).
    "KimiLinear": {f"linear_dense_layers/{p}" for p in _GQA_SWIGLU}
    | {f"layers/attn/{p}" for p in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj")},
}


def test_every_registered_family_is_covered_here():
    assert {cls.__name__ for cls in FAMILIES} == set(PRESET_OF) == set(LORA_DEFAULT)


# Fields that shrink with the vocabulary besides vocab_size (Gemma 4's per-layer input table has its own).
VOCAB_FIELDS = {"Gemma4": ("vocab_size_per_layer_input",)}


def _config(family: type):
    vocab = dict.fromkeys(("vocab_size", *VOCAB_FIELDS.get(family.__name__, ())), VOCAB)
    return AutoConfig.preset(PRESET_OF[family.__name__], num_hidden_layers=LAYERS, **vocab)


@pytest.fixture(scope="module")
def models():
    return {cls: cls.create(_config(cls), seed=0) for cls in FAMILIES}


def _keyword(fn, name: str) -> inspect.Parameter:
    params = inspect.signature(fn).parameters
    assert name in params, f"{fn.__qualname__} lacks {name!r}"
    return params[name]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c.__name__)
def test_signatures(family):
    for name in ("seed", "mesh", "rules"):
        assert _keyword(family.create, name).kind is inspect.Parameter.KEYWORD_ONLY
    for name in ("mesh", "rules", "dtype"):
        assert _keyword(family.from_pretrained, name).kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(family.save_pretrained).parameters)[:2] == ["self", "path"]
    call = inspect.signature(family.__call__).parameters
    assert list(call)[:3] == ["self", "input_ids", "attention_mask"] and call["attention_mask"].default is None
    for flag in ("segment_ids", "position_ids", "with_hidden_states", "with_mtp", "with_expert_load",
                 "with_routing", "with_logits"):
        assert _keyword(family.forward, flag).kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(family.init_cache).parameters) == ["self", "batch", "max_len"]
    assert list(inspect.signature(family.prefill).parameters) == ["self", "input_ids", "attention_mask", "cache"]
    assert list(inspect.signature(family.decode_step).parameters) == ["self", "tokens", "cache"]
    assert isinstance(family.lora_targets, str) and family.config_class is type(_config(family))
    config = _config(family)
    assert config.num_parameters().total > config.num_parameters().embedding > 0
    assert config.train_flops_per_token(SEQ) > 6 * config.num_parameters().embedding


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c.__name__)
def test_call_forward_and_cache_shapes(models, family):
    model, config = models[family], _config(family)
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    mask = jnp.ones((BATCH, SEQ), jnp.int32).at[0, :3].set(0)  # row 0 left-padded

    @nnx.jit
    def run(model, ids, mask):
        cache = model.init_cache(BATCH, SEQ + 1)
        prefill_logits, cache = model.prefill(ids, None, cache)
        step_logits, cache = model.decode_step(ids[:, -1], cache)
        headless = model.forward(ids, mask, with_logits=False)
        return model(ids, mask), model(ids), model.forward(ids, mask, with_hidden_states=True), prefill_logits, \
            step_logits, cache.length, headless, model.output_head()(headless.final_hidden)

    logits, unmasked, out, prefill_logits, step_logits, length, headless, head_logits = run(model, ids, mask)
    assert isinstance(logits, jax.Array) and logits.shape == (BATCH, SEQ, VOCAB)
    assert isinstance(out, CausalLMOutput) and out._fields == CausalLMOutput._fields
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(logits))
    # A hyper-connection model (DeepSeek-V4) records its streams: one more dim, hc_mult, before the width.
    streams = (getattr(config, "hc_mult", None),) if hasattr(config, "hc_mult") else ()
    assert out.hidden_states.shape == (LAYERS + 1, BATCH, SEQ, *streams, config.hidden_size)
    assert out.mtp_logits is None  # not asked for
    # Without the head: its input, which the trainer's chunked loss feeds to output_head() (the same logits).
    assert headless.logits is None and headless.final_hidden.shape == (BATCH, SEQ, config.hidden_size)
    last = out.hidden_states[-1] if not streams else out.hidden_states[-1][:, :, 0]
    np.testing.assert_allclose(np.asarray(headless.final_hidden), np.asarray(last), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(head_logits), np.asarray(logits), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(prefill_logits), np.asarray(unmasked), rtol=1e-5, atol=1e-5)
    assert step_logits.shape == (BATCH, VOCAB) and int(length) == SEQ + 1


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c.__name__)
def test_parameter_count_equals_the_variables_built(models, family):
    model, config = models[family], _config(family)
    built = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    has_mtp = getattr(model, "mtp_layers", None) is not None
    assert config.num_parameters(include_mtp=has_mtp).total == built


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c.__name__)
def test_every_stack_axis_is_declared(models, family):
    """A scanned stack (a top-level sub-module whose Variables all share one leading name) uses a name that
    ``STACK_AXES`` declares, so the optimizer sees each layer's matrices as a batch."""
    stacks = {}
    for name, child in vars(models[family]).items():
        if isinstance(child, nnx.Module):
            leading = {(logical_names(v) or (None,))[0] for v in jax.tree.leaves(
                nnx.state(child, nnx.Variable), is_leaf=lambda x: isinstance(x, nnx.Variable))}
            count = len(jax.tree.leaves(nnx.state(child, nnx.Variable)))
            if count > 1 and len(leading) == 1:
                stacks[name] = leading.pop()
    assert stacks and set(stacks.values()) <= STACK_AXES, stacks


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c.__name__)
def test_lora_default_targets_and_an_adapted_model_starts_equal(family):
    model = family.create(_config(family), seed=0)
    ids = jax.random.randint(jax.random.key(2), (BATCH, SEQ), 0, VOCAB)
    base = np.asarray(nnx.jit(lambda m, i: m(i))(model, ids))
    adapted = apply_lora(model, rank=2, alpha=4.0)
    assert set(adapted) == LORA_DEFAULT[family.__name__]
    assert len(jax.tree.leaves(nnx.state(model, LoRAParam))) == 2 * len(adapted)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, i: m(i))(model, ids)), base)


def test_a_module_without_lora_targets_needs_a_pattern():
    holder = nnx.Dict(proj=nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="no default LoRA targets.*pass pattern="):
        apply_lora(holder)


def test_forward_asks_for_mtp_only_where_there_are_heads(models):
    for model in models.values():
        if getattr(model, "mtp_layers", None) is None:
            with pytest.raises(ValueError, match="with_mtp=True but .*MTP heads"):
                model.forward(jnp.zeros((1, 4), jnp.int32), with_mtp=True)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda c: c.__name__)
def test_out_of_range_ids_and_positions_are_refused(models, family):
    # Concrete ids are checked on the host before anything runs (no compile here); the embedding would clamp them.
    model = models[family]
    limit = model.config.max_position_embeddings
    for bad in (VOCAB, -1):
        ids = jnp.zeros((BATCH, SEQ), jnp.int32).at[1, 3].set(bad)
        for call, kwargs in ((model, {}), (model.forward, {}), (model.generate, {"max_new_tokens": 2})):
            with pytest.raises(ValueError, match=rf"outside the vocabulary 0\.\.{VOCAB - 1} \(e\.g\. {bad};"):
                call(ids, **kwargs)
    with pytest.raises(ValueError, match=f"{limit + 1} tokens exceed the model's max_position_embeddings={limit}"):
        model(jnp.zeros((1, limit + 1), jnp.int32))
    with pytest.raises(ValueError, match=f"a prompt of {SEQ} tokens \\+ max_new_tokens={limit - SEQ + 1} exceed"):
        model.generate(jnp.zeros((1, SEQ), jnp.int32), max_new_tokens=limit - SEQ + 1)
    with pytest.raises(ValueError, match=f"position_ids reach {limit}, past the model's max_position_embeddings"):
        model(jnp.zeros((1, SEQ), jnp.int32), position_ids=jnp.arange(SEQ)[None] + limit - SEQ + 1)


def test_ids_are_not_checked_inside_jit(models):
    # Traced ids are never pulled to the host (the train step must not sync): tracing with a bad id goes through.
    model = models[FAMILIES[0]]
    assert nnx.eval_shape(lambda m, ids: m(ids), model, jnp.full((1, 4), VOCAB, jnp.int32)).shape == (1, 4, VOCAB)
