"""Gemma 3 (text) against transformers (PyTorch, CPU, float32), on tiny random checkpoints with a 4-token window:
logits and every hidden state within relative 1e-5 on a batch with a left-padded row and unpadded ones, for a
``gemma3_text`` checkpoint (mixed layer_types, linear-scaled global rope, both soft caps) and the text model of a
``gemma3`` image-text checkpoint whose text_config is as terse as the hub's (legacy rope keys, a pattern instead
of layer_types); transformers reloads our save with the same logits; cached greedy decoding past the window (the
ring wraps) equals the uncached continuation and transformers' ``generate``; turning each of Gemma 3's parts off
moves the logits; the presets have transformers' and the published parameter counts.

transformers 5 reads ``attn_logit_softcapping`` but never applies it in Gemma 3's attention; nnx_zoo applies it
(``reference.gemma3_attention_softcap`` gives transformers' eager attention the cap, for comparison).
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM, Gemma3, Gemma3Config
from nnx_zoo.layers.mlp import Glu
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.models.gemma3.model import Gemma3DecoderLayer
from tests.models.gemma.reference import gemma3_attention_softcap, hf_outputs, make_gemma3, rel

TOL = 1e-5
BATCH, SEQ, PAD = 3, 12, 5
S, F = "sliding_attention", "full_attention"
CONFIGS = {
    # gemma3_text: an irregular schedule, the 4B-27B releases' linear rope on global layers, both soft caps.
    "text": dict(layer_types=[S, S, F, S, F], rope_scaling={"rope_type": "linear", "factor": 8.0},
                 attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # A gemma3 image-text checkpoint: global every second layer by the pattern, another rope; its config.json
    # rewritten to the hub's terse legacy form (see _as_hub_config).
    "multimodal": dict(multimodal=True, sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 4.0},
                       rope_theta=5e5, rope_local_base_freq=2e4),
}


def _as_hub_config(path) -> None:
    """Rewrite a saved gemma3 config.json as the hub's release files are: the text_config holds only what differs
    from transformers' defaults, its rope in the legacy keys (rope_theta, rope_local_base_freq, rope_scaling), the
    schedule as sliding_window_pattern without layer_types."""
    file = path / "config.json"
    config = json.loads(file.read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    terse = {k: text[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "vocab_size", "sliding_window",
                                  "query_pre_attn_scalar", "max_position_embeddings", "model_type")}
    full = dict(rope["full_attention"])
    terse.update(rope_theta=full.pop("rope_theta"), rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                 rope_scaling=full, sliding_window_pattern=text["sliding_window_pattern"])
    config["text_config"] = terse
    file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """config name -> (transformers model, checkpoint dir, our model, ids, mask, transformers' outputs, ours)."""
    out = {}
    rng = np.random.default_rng(0)
    for seed, (name, spec) in enumerate(CONFIGS.items()):
        hf = make_gemma3(seed, **spec)
        path = tmp_path_factory.mktemp(f"gemma3-{name}")
        hf.save_pretrained(path)
        if spec.get("multimodal"):
            _as_hub_config(path)
            with pytest.warns(UserWarning, match="multimodal checkpoint: loading its text model"):
                ours = AutoModelForCausalLM.from_pretrained(path, attention_impl="xla")
        else:
            with pytest.warns(UserWarning, match="attn_logit_softcapping=5.0 is applied here"):
                ours = AutoModelForCausalLM.from_pretrained(path, attention_impl="xla")
        assert type(ours) is Gemma3
        ids = rng.integers(1, ours.config.vocab_size, (BATCH, SEQ))
        mask = np.ones((BATCH, SEQ), np.int32)
        mask[0, :PAD] = 0
        with gemma3_attention_softcap():
            ref = hf_outputs(hf, ids, mask)
        mine = nnx.jit(lambda m, i, k: m.forward(i, k, with_hidden_states=True))(ours, jnp.asarray(ids),
                                                                                  jnp.asarray(mask))
        out[name] = (hf, path, ours, ids, mask, ref, mine)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_every_hidden_state(built, name):
    hf, _, ours, _, mask, ref, mine = built[name]
    if name == "multimodal":  # what the hub's terse text_config means to transformers
        text = hf.config.text_config
        assert ours.config.resolved_layer_types == tuple(text.layer_types)
        assert ours.config.rope_local_base_freq == text.rope_parameters["sliding_attention"]["rope_theta"] == 2e4
    errors = {}
    for what, a, b in [("logits", mine.logits, ref["logits"])] + [
            (f"hidden state {i}", mine.hidden_states[i], ref["hidden"][i]) for i in range(len(ref["hidden"]))]:
        errors[what] = (rel(a[1:], b[1:]), rel(a[:1], b[:1], keep=mask[0]))  # unpadded rows; the padded row
    worst = max(max(e) for e in errors.values())
    print(f"gemma3 {name}: worst relative error {worst:.2e}")
    assert worst < TOL, errors


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_reloads_our_save(built, tmp_path, name):
    import transformers

    _, _, ours, ids, mask, _, mine = built[name]
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "gemma3_text" and "lm_head.weight" not in json.dumps(
        json.loads((tmp_path / "model.safetensors.index.json").read_text()))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(again).__name__ == "Gemma3ForCausalLM"
    assert again.config.layer_types == list(ours.config.resolved_layer_types)
    with gemma3_attention_softcap():
        theirs = hf_outputs(again, ids, mask)["logits"]
    assert rel(theirs[1:], mine.logits[1:]) < TOL and rel(theirs[:1], mine.logits[:1], keep=mask[0]) < TOL
    assert Gemma3Config.from_hf(tmp_path) == ours.config.with_overrides(attention_impl="auto")


@pytest.fixture(scope="module")
def eager(built) -> Gemma3:
    """The text model unscanned, for op-by-op calls: its variants below (and the uncached continuation) reuse one
    set of compiled ops instead of compiling a program each."""
    return _with_config(built["text"][2], scan_layers=False)


def test_cached_greedy_decoding_past_the_window(built, eager):
    hf, _, ours, ids, _, _, _ = built["text"]
    prompt, new = ids[:, :4], SEQ - 4  # decoding runs past the 4-token window: its 3-slot ring wraps twice
    mask = np.ones(prompt.shape, np.int32)
    mask[0, :2] = 0
    cache = ours.init_cache(BATCH, prompt.shape[1] + new)
    assert cache.k["sliding_layers"].shape[2] == 3 and cache.k["layers"].shape[2] == prompt.shape[1] + new
    tokens = np.asarray(ours.generate(jnp.asarray(prompt), jnp.asarray(mask), max_new_tokens=new).tokens)
    # The uncached continuation: each step's argmax of a forward over the whole (right-padded) sequence at the
    # positions that count real tokens (causal: later slots do not change earlier logits).
    total = prompt.shape[1] + new
    seq = np.zeros((BATCH, total), prompt.dtype)
    seq[:, :prompt.shape[1]] = prompt
    seq_mask = np.concatenate([mask, np.ones((BATCH, new), np.int32)], axis=1)
    positions = jnp.asarray(np.maximum(np.cumsum(seq_mask, axis=1) - 1, 0))
    for t in range(prompt.shape[1], total):
        logits = eager(jnp.asarray(seq), jnp.asarray(seq_mask), position_ids=positions)
        seq[:, t] = np.asarray(logits)[:, t - 1].argmax(-1)
    np.testing.assert_array_equal(tokens, seq)
    with torch.no_grad(), gemma3_attention_softcap():
        theirs = hf.generate(torch.as_tensor(prompt), attention_mask=torch.as_tensor(mask), max_new_tokens=new,
                             do_sample=False, min_new_tokens=new, pad_token_id=0)
    np.testing.assert_array_equal(tokens, theirs.numpy())


# ---------------------------------------------------------------------------------- every part acts in the configs
def _with_config(model: Gemma3, **changes) -> Gemma3:
    """The same weights under a config with ``changes`` (shapes unchanged), built abstractly (no initializers run)."""
    config = model.config.with_overrides(**changes)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Gemma3(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def _each_layer(model: Gemma3, change) -> Gemma3:
    other = _with_config(model)
    for stack in other.layer_stacks().values():
        change(stack)
    return other


def _plain_norms(model: Gemma3) -> Gemma3:
    other = _with_config(model)
    for _, module in nnx.iter_graph(other):
        if isinstance(module, RMSNorm):
            module.offset = 0.0
    return other


def _no_embed_scale(model: Gemma3) -> Gemma3:
    other = _with_config(model)
    other.embed.scale = None
    return other


def _no_qk_norm(stack) -> None:
    stack.attn.q_norm = stack.attn.k_norm = None


def _silu(stack) -> None:
    stack.mlp.act = Glu()


def _without_post_norms(self, x, cos, sin, mask):  # the plain pre-norm block: no norms on the branch outputs
    h = x + self.attn(self.input_norm(x), cos, sin, mask)
    return h + self.mlp(self.pre_mlp_norm(h))


PARTS = {
    "sliding window": lambda m: _with_config(m, sliding_window=64),
    "local rope base": lambda m: _with_config(m, rope_local_base_freq=m.config.rope_theta),
    "global rope scaling": lambda m: _with_config(m, rope_scaling=None),
    "query_pre_attn_scalar": lambda m: _with_config(m, query_pre_attn_scalar=m.config.head_dim),
    "attention soft-cap": lambda m: _with_config(m, attn_logit_softcapping=None),
    "final logit soft-cap": lambda m: _with_config(m, final_logit_softcapping=None),
    "embedding scale": _no_embed_scale,
    "(1 + w) norms": _plain_norms,
    "q/k norms": lambda m: _each_layer(m, _no_qk_norm),
    "GELU-tanh": lambda m: _each_layer(m, _silu),
    "sandwich norms": None,  # a change of code: see below
}


@pytest.mark.parametrize("part", list(PARTS))
def test_turning_each_part_off_moves_the_logits(built, eager, monkeypatch, part):
    _, _, _, ids, mask, _, mine = built["text"]
    if part == "sandwich norms":
        monkeypatch.setattr(Gemma3DecoderLayer, "__call__", _without_post_norms)
        model = _with_config(eager)
    else:
        model = PARTS[part](eager)
    positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))  # the shapes of the continuation's calls
    moved = rel(model(jnp.asarray(ids), jnp.asarray(mask), position_ids=positions)[1:], mine.logits[1:])
    assert moved > 1e-3, f"{part} does not act in the test config ({moved:.1e})"


# --------------------------------------------------------------------------------------- presets and HF configs
# Published totals: Gemma 3 270M's and 1B's model cards / the counts transformers reports for the hub checkpoints;
# the 4B-27B text models' non-embedding counts, in millions, from the Gemma 3 technical report's Table 1.
PUBLISHED_TOTAL = {"gemma3-270m": 268_098_176, "gemma3-1b": 999_885_952}
PUBLISHED_NON_EMBEDDING_M = {"gemma3-1b": 698, "gemma3-4b": 3_209, "gemma3-12b": 10_759, "gemma3-27b": 25_600}


@pytest.mark.parametrize("preset", ["gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"])
def test_preset_parameter_counts(preset):
    import transformers

    config = Gemma3Config.preset(preset)
    counts = config.num_parameters()
    with torch.device("meta"):  # transformers' model of our config.json, built without memory
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config.to_hf_dict()))
    assert counts.total == sum(p.numel() for p in hf.parameters())  # tied: the table counted once
    assert hf.config.layer_types == list(config.resolved_layer_types)
    if preset in PUBLISHED_TOTAL:
        assert counts.total == PUBLISHED_TOTAL[preset]
    if preset in PUBLISHED_NON_EMBEDDING_M:
        assert round((counts.total - counts.embedding) / 1e6) == PUBLISHED_NON_EMBEDDING_M[preset]


def test_cpu_presets_and_the_registry():
    for name in ("gemma3-tiny", "gemma3-small"):
        config = AutoConfig.preset(name)
        assert type(config) is Gemma3Config and config.num_parameters().total < 15e6
        assert {k.attention for k in config.layer_kinds()} == {"sliding", "full"}
    assert AutoModelForCausalLM.model_class("gemma3") is AutoModelForCausalLM.model_class("gemma3_text") is Gemma3
    # A layer-count override keeps the pattern's schedule.
    assert AutoConfig.preset("gemma3-tiny", num_hidden_layers=2).resolved_layer_types == (S, F)


def test_hf_config_forms_read_as_transformers_reads_them():
    import transformers

    legacy = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 7, "rope_theta": 2e6,
              "rope_local_base_freq": 3e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "sliding_window": 256, "sliding_window_pattern": 3}
    ours = Gemma3Config.from_hf(legacy)
    theirs = transformers.AutoConfig.for_model(**legacy)
    assert ours.resolved_layer_types == tuple(theirs.layer_types)
    assert (ours.rope_theta, ours.rope_scaling.factor) == (2e6, 8.0)
    assert ours.rope_local_base_freq == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 3e4
    assert (ours.vocab_size, ours.num_attention_heads, ours.head_dim, ours.query_pre_attn_scalar) == (
        theirs.vocab_size, theirs.num_attention_heads, theirs.head_dim, theirs.query_pre_attn_scalar)
    assert dataclasses.asdict(Gemma3Config.from_hf(ours.to_hf_dict())) == dataclasses.asdict(ours)
    refused = [({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
               ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
               ({"layer_types": [S, F]}, "layer_types has 2 entries but num_hidden_layers=7"),
               ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
                "sliding layers' rope")]
    for change, message in refused:
        with pytest.raises(ValueError, match=message):
            Gemma3Config.from_hf({**legacy, **change})
