"""DeepSeek-V4 against transformers' ``DeepseekV4ForCausalLM`` (CPU, float32): logits, every hidden state and the
experts chosen, on schedules like V4-Flash's and V4-Pro's (``reference.SCHEDULES``); left-padded rows against
transformers on each row alone; cached greedy decoding against the uncached continuation and transformers'
``generate``; and that turning each of V4's parts off moves the logits, so the configs exercise every part."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from nnx_zoo import DeepSeekV4
from nnx_zoo.layers import routers
from nnx_zoo.models.deepseek4 import kernel
from nnx_zoo.models.deepseek4 import model as model_module
from nnx_zoo.models.deepseek4.attention import V4Attention
from tests.models.deepseek4.reference import hf_config, hf_outputs, make_hf_model, rel

BATCH, SEQ = 2, 23
TOL = 1e-5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """schedule -> (HF model, our model, ids, HF outputs); each built and run once."""
    out = {}
    for seed, schedule in enumerate(("flash", "pro", "parts")):
        hf = make_hf_model(hf_config(schedule), seed=10 + seed)
        path = tmp_path_factory.mktemp(f"v4-{schedule}")
        hf.save_pretrained(path)
        ours = DeepSeekV4.from_pretrained(path, attention_impl="xla")
        ids = np.random.default_rng(seed).integers(0, hf.config.vocab_size, (BATCH, SEQ))
        out[schedule] = (hf, ours, ids, hf_outputs(hf, ids), path)
    return out


@pytest.mark.parametrize("schedule", ["flash", "pro"])
def test_logits_every_hidden_state_and_the_experts_chosen(built, schedule):
    hf, ours, ids, ref, _ = built[schedule]
    out = nnx.jit(lambda m, i: m.forward(i, with_hidden_states=True, with_routing=True))(ours, jnp.asarray(ids))
    assert rel(out.logits, ref["logits"]) < TOL
    layers = len(ref["hidden"]) - 1
    for i in range(layers):  # each layer's input streams; the first is the embeddings copied into every stream
        assert rel(out.hidden_states[i], ref["hidden"][i]) < TOL, f"hidden state {i}"
    assert rel(out.final_hidden, ref["hidden"][-1]) < TOL
    np.testing.assert_array_equal(np.sort(np.asarray(out.expert_indices), axis=-1), ref["experts"])


def test_left_padded_rows_equal_each_row_run_alone(built):
    """Padding never enters a compressed entry: a left-padded row computes what transformers computes for the row
    alone (transformers' own left padding pools the padding into its windows; its unpadded rows are the
    reference). With rope's default positions and with positions counting the real tokens."""
    hf, ours, ids, _, _ = built["flash"]
    pad = 7
    mask = np.ones((BATCH, SEQ), np.int32)
    mask[0, :pad] = 0
    alone = [hf_outputs(hf, ids[:1, pad:])["logits"][0], hf_outputs(hf, ids[1:])["logits"][0]]
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    run = nnx.jit(lambda m, i, k, p: m(i, k, position_ids=p))
    for position_ids in (np.broadcast_to(np.arange(SEQ), (BATCH, SEQ)), positions):
        logits = np.asarray(run(ours, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(position_ids)))
        assert rel(logits[0, pad:], alone[0]) < TOL
        assert rel(logits[1], alone[1]) < TOL


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_packed_documents_equal_each_document_alone(built, impl, monkeypatch):
    """Two documents packed in a row (segment ids, positions restarting): each computes what transformers
    computes for it alone; windows, compressed entries and the indexer never cross the boundary. ``blockwise`` in
    blocks of 8 queries, so blocks straddle the boundary."""
    hf, ours, ids, _, _ = built["flash"]
    monkeypatch.setattr(kernel, "BLOCK", 8)
    cut = 10
    segments = np.where(np.arange(SEQ) < cut, 0, 1)[None].repeat(BATCH, 0)
    positions = np.where(np.arange(SEQ) < cut, np.arange(SEQ), np.arange(SEQ) - cut)[None].repeat(BATCH, 0)
    model = _with_config(ours, attention_impl=impl)
    logits = np.asarray(nnx.jit(lambda m, i, s, p: m(i, segment_ids=s, position_ids=p))(
        model, jnp.asarray(ids), jnp.asarray(segments), jnp.asarray(positions)))
    for row in range(BATCH):
        assert rel(logits[row, :cut], hf_outputs(hf, ids[row:row + 1, :cut])["logits"][0]) < TOL
        assert rel(logits[row, cut:], hf_outputs(hf, ids[row:row + 1, cut:])["logits"][0]) < TOL


def test_cached_greedy_decoding_equals_the_uncached_continuation_and_transformers(built):
    hf, ours, ids, _, _ = built["flash"]
    prompt, new = ids[:, :9], 14  # past the 5-token window, several CSA and HCA entries closed while decoding
    ours_tokens = np.asarray(ours.generate(jnp.asarray(prompt), max_new_tokens=new).tokens)
    with torch.no_grad():
        theirs = hf.generate(torch.as_tensor(prompt), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    np.testing.assert_array_equal(ours_tokens, theirs.numpy())
    # A left-padded batch: each step's argmax of the whole sequence's uncached forward.
    mask = np.ones(prompt.shape, np.int32)
    mask[0, :3] = 0
    cached = np.asarray(ours.generate(jnp.asarray(prompt), jnp.asarray(mask), max_new_tokens=new).tokens)
    # One compiled forward for every step: the sequence right-padded to its final length (causal: the padding after
    # a position does not change its logits).
    total = prompt.shape[1] + new
    seq = np.zeros((BATCH, total), ids.dtype)
    seq[:, :prompt.shape[1]] = prompt
    seq_mask = np.concatenate([mask, np.ones((BATCH, new), np.int32)], axis=1)
    positions = np.maximum(np.cumsum(seq_mask, axis=1) - 1, 0)
    run = nnx.jit(lambda m, i, k, p: m(i, k, position_ids=p))
    for t in range(prompt.shape[1], total):
        logits = np.asarray(run(ours, jnp.asarray(seq), jnp.asarray(seq_mask), jnp.asarray(positions)))
        seq[:, t] = logits[:, t - 1].argmax(-1)
    np.testing.assert_array_equal(cached, seq)


# ---------------------------------------------------------------------------------- every part acts in the configs
def _with_config(model: DeepSeekV4, **changes):
    """The same weights under a config with ``changes`` (shapes unchanged): the new config's modules, traced (no
    weights drawn), holding ``model``'s Variables."""
    config = model.config.with_overrides(**changes)
    return nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: DeepSeekV4(config, rngs=nnx.Rngs(0)))), nnx.state(model))


def _with_state(model: DeepSeekV4, path_part: str, change):
    """A copy of ``model`` with every Variable whose path contains ``path_part`` replaced by ``change(value)``."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    hit = 0
    for key, var in flat.items():
        if path_part in "/".join(map(str, key)):
            flat[key] = var.replace(change(var[...]))
            hit += 1
    assert hit, path_part
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _swap_groups(a):
    return jnp.roll(a, 1, axis=1)  # [stack, groups, ...]: each group's block moves to the next group


PARTS = {
    "sliding window": lambda m: _with_config(m, sliding_window=64),
    "attention sinks": lambda m: _with_state(m, "sinks", lambda a: jnp.full_like(a, -1e4)),
    "indexer top-k": lambda m: _with_config(m, index_topk=64),
    "compressed rope base": lambda m: _with_config(m, compress_rope_theta=10000.0),
    "YaRN": lambda m: _with_config(m, rope_scaling=None),
    "grouped output projection": lambda m: _with_state(m, "output/o_a", _swap_groups),
    "Sinkhorn mixing": lambda m: _with_config(m, hc_sinkhorn_iters=1),
    "final stream collapse": lambda m: _with_state(m, "head_hc/fn", jnp.zeros_like),
    "hash table": lambda m: _with_state(m, "tid2eid", lambda a: jnp.roll(a, 1, axis=1)),
    "selection bias": lambda m: _with_state(m, "e_score_correction_bias", jnp.zeros_like),
    "clamped SwiGLU": lambda m: _with_config(m, swiglu_limit=1e6),
}
# Parts whose off switch is a change of code, not of config or weights.
PATCHES = {
    "overlapping CSA windows": (model_module, "windows",
                                lambda f: lambda *a, **k: f(*a, **k)._replace(previous=jnp.zeros((1, 1), bool))),
    "heavily compressed entries": (kernel.Compressed, "visible",
                                   lambda f: lambda self, *a: f(self, *a) & (self.indexer is not None)),
    "conjugate rotation of the output": (V4Attention, "unrotate", lambda f: lambda self, out, rope: out),
    "sqrt(softplus) scores": (routers, "sqrt_softplus", lambda f: lambda logits: jax.nn.sigmoid(logits)),
}


def test_turning_each_part_off_moves_the_logits(built, monkeypatch):
    _, ours, ids, ref, _ = built["parts"]
    ids = jnp.asarray(ids)
    run = nnx.jit(lambda m, i: m(i))
    base = np.asarray(run(ours, ids))
    assert rel(base, ref["logits"]) < TOL
    moved = {name: rel(run(change(ours), ids), base) for name, change in PARTS.items()}
    for name, (owner, attr, wrap) in PATCHES.items():
        with monkeypatch.context() as patch:
            patch.setattr(owner, attr, wrap(getattr(owner, attr)))
            if owner is routers:  # the router table holds the function itself
                patch.setitem(routers.SCORES, "sqrtsoftplus", routers.sqrt_softplus)
            moved[name] = rel(nnx.jit(lambda m, i: m(i))(ours, ids), base)
    still = {name: d for name, d in moved.items() if d < 1e-3}
    assert not still, f"these parts do not act in the test config: {still}"


def test_the_selection_bias_moves_the_choice_not_the_weights():
    logits = jnp.array([[0.3, -0.2, 1.1, 0.5]])
    bias = jnp.array([0.0, 5.0, 0.0, 0.0])  # expert 1 is always chosen, weighted by its own unbiased score
    routing = routers.route("sqrtsoftplus_bias", logits, 2, renormalize=True, bias=bias, scale=1.5)
    scores = np.sqrt(np.log1p(np.exp(np.asarray(logits[0], np.float64))))
    assert sorted(np.asarray(routing.expert_indices[0])) == [1, 2]
    want = scores[[1, 2]] / scores[[1, 2]].sum() * 1.5
    order = np.argsort(np.asarray(routing.expert_indices[0]))
    np.testing.assert_allclose(np.asarray(routing.weights[0])[order], want, rtol=1e-6)


def test_config_fields_for_the_test_schedules_round_trip(built):
    for _, ours, *_ in built.values():
        config = ours.config
        again = type(config).from_hf(config.to_hf_dict())
        assert dataclasses.asdict(again) == dataclasses.asdict(config.with_overrides(attention_impl="auto"))
