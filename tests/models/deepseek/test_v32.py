"""DeepSeek-V3.2 (V3 plus DeepSeek Sparse Attention) against transformers' ``DeepseekV32ForCausalLM`` (CPU,
float32), and the sparse-attention kernel (``dsa.sparse_attention``) against a dense reference written here.

Exact: logits and every hidden state within 1e-5 relative when the indexer's top-k is smaller than the sequence
(a left-padded batch, YaRN) and when it covers it; export reloads in transformers; cached greedy decoding equals
the uncached argmax continuation and transformers' ``generate``. The kernel, run in blocks of 4 queries with
padding and packed documents, gives the reference's context, indexer KL and gradients.
"""

from __future__ import annotations

import gc
import inspect
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV32ForCausalLM

import nnx_zoo
from nnx_zoo import AutoModelForCausalLM, DeepSeekV3, DeepSeekV3Config, generate
from nnx_zoo.layers.attention import AttentionMask
from nnx_zoo.models.deepseek import dsa
from nnx_zoo.sharding import iter_variables, make_mesh
from tests.models.deepseek.hf_reference import (
    YARN,
    case_builder,
    hf_outputs,
    load_recipe,
    make_hf_model,
    padded_inputs,
    rel_l2,
    save_hf,
)
from tests.models.deepseek.test_parity import forward

BATCH, SEQ = 2, 12
CASES = {
    # 5 of up to 12 keys: every query past the fifth attends to a strict subset; row 0 left-padded by 3; YaRN.
    "sparse-padded-yarn": dict(hf=dict(arch="v32", index_topk=5, rope_scaling=YARN), padded=True),
    # index_topk 16 >= 12 keys: every visible key is chosen (so the dense path runs); all layers MoE.
    "topk-covers-sequence": dict(hf=dict(arch="v32", index_topk=16, num_hidden_layers=2, first_k_dense_replace=0)),
}


def _inputs(padded: bool, vocab: int, seq: int = SEQ) -> tuple[np.ndarray, np.ndarray | None]:
    return padded_inputs(BATCH, seq, vocab, padded)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case name -> (checkpoint dir, HF model, HF outputs, ids, mask); each HF model built and run once."""
    return case_builder(CASES, tmp_path_factory, batch=BATCH, seq=SEQ, first_seed=10)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(built, name):
    path, hf, ref, ids, mask = built(name)
    model = AutoModelForCausalLM.from_pretrained(path, moe_impl="dense")
    assert isinstance(model, DeepSeekV3) and model.config.index_topk == CASES[name]["hf"]["index_topk"]
    out = forward(model, jnp.asarray(ids), None if mask is None else jnp.asarray(mask))
    # Real tokens only: a left-pad query sees no key (transformers averages all values there, we the chosen ones).
    real = np.ones((BATCH, SEQ), bool) if mask is None else mask.astype(bool)
    assert rel_l2(np.asarray(out.logits)[real], ref["logits"][real]) < 1e-5
    assert len(out.hidden_states) == len(ref["hidden_states"])
    for i, (a, b) in enumerate(zip(out.hidden_states, ref["hidden_states"])):
        assert rel_l2(np.asarray(a)[real], b[real]) < 1e-5, f"hidden state {i}"
    for layer, (a, b) in enumerate(zip(np.asarray(out.expert_indices), ref["experts"], strict=True)):
        np.testing.assert_array_equal(np.sort(a, -1)[real], np.sort(b.reshape(a.shape), -1)[real], f"layer {layer}")
    if model.config.index_topk < SEQ:  # the sparsity shows: choosing every key gives other logits
        for layer in hf.model.layers:
            layer.self_attn.indexer.index_topk = 10 * SEQ
        try:
            dense = hf_outputs(hf, ids, mask)["logits"]
        finally:
            for layer in hf.model.layers:
                layer.self_attn.indexer.index_topk = model.config.index_topk
        assert rel_l2(dense[real], ref["logits"][real]) > 1e-2


def test_export_reloads_in_transformers(built, tmp_path):
    path, _, ref, ids, mask = built("sparse-padded-yarn")
    model = DeepSeekV3.from_pretrained(path, moe_impl="gmm")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "deepseek_v32"
    reloaded = DeepseekV32ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = reloaded(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    real = mask.astype(bool)
    assert rel_l2(logits[real], ref["logits"][real]) < 1e-5


def test_cached_greedy_equals_uncached_and_transformers(built):
    path, hf, _, _, _ = built("sparse-padded-yarn")
    model = DeepSeekV3.from_pretrained(path, moe_impl="dense")
    prompt, new = 7, 8  # the cache (15 slots) and the late prompts hold more keys than index_topk (5)
    ids, mask = _inputs(True, hf.config.vocab_size, prompt)
    out = generate(model, jnp.asarray(ids), jnp.asarray(mask), max_new_tokens=new)
    # The uncached argmax continuation, by teacher forcing: one full forward over prompt and generated tokens (at
    # the positions generate gives them) must predict each generated token from the tokens before it.
    tokens = np.asarray(out.tokens)
    full_mask = np.concatenate([mask, np.ones((BATCH, new), np.int32)], axis=1)
    positions = np.maximum(np.cumsum(full_mask, axis=1) - 1, 0)
    logits = np.asarray(model.forward(jnp.asarray(tokens), jnp.asarray(full_mask),
                                      position_ids=jnp.asarray(positions)).logits)
    np.testing.assert_array_equal(logits[:, prompt - 1:-1].argmax(-1), tokens[:, prompt:])
    with torch.no_grad():
        expected = hf.generate(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), max_new_tokens=new,
                               do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, prompt:], expected.numpy()[:, prompt:])


# ---------------------------------------------------------------------------------------------------------------
# The kernel against a dense reference: the [q, k] masks built whole, the top-k as a threshold on the scores.

def _reference(qa, qr, iq, iw, lat, kr, ik, visible, topk, scale, mode):
    index = jnp.einsum("bqh,bqhk->bqk", iw, jax.nn.relu(jnp.einsum("bqhd,bkd->bqhk", iq, ik) * iq.shape[-1] ** -0.5))
    index = jnp.where(visible, index, -jnp.inf)
    if mode == "dense":
        chosen = visible
    else:  # the topk largest visible scores (every visible key where fewer are visible)
        kth = jax.lax.top_k(index, topk)[0][..., -1:]
        chosen = visible & (index >= kth)
    scores = (jnp.einsum("bqhc,bkc->bqhk", qa, lat) + jnp.einsum("bqhr,bkr->bqhk", qr, kr)) * scale
    probs = jax.nn.softmax(jnp.where(chosen[:, :, None], scores, -1e30), axis=-1)
    context = jnp.einsum("bqhk,bkc->bqhc", probs, lat)
    p = jax.lax.stop_gradient(jnp.sum(probs, axis=2))
    p = jnp.where(chosen, p, 0) / jnp.sum(jnp.where(chosen, p, 0), axis=-1, keepdims=True)
    log_q = jax.nn.log_softmax(jnp.where(chosen, index, -1e30), axis=-1)
    kl = jnp.sum(jnp.where(chosen, p * (jnp.log(jnp.where(chosen, p, 1.0)) - log_q), 0.0), axis=-1)
    return context, kl


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_kernel_matches_dense_reference(monkeypatch, mode):
    monkeypatch.setattr(dsa, "_MAX_BLOCK", 4)  # 13 queries: 4 blocks, the last one padded
    b, s, h, c, r, hi, d, topk = 2, 13, 3, 8, 4, 4, 8, 5
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in (
        (b, s, h, c), (b, s, h, r), (b, s, hi, d), (b, s, hi), (b, s, c), (b, s, r), (b, s, d))]
    valid = np.ones((b, s), bool)
    valid[0, :3] = False  # left padding
    segments = np.zeros((b, s), np.int32)
    segments[1, 7:] = 1  # row 1 packs two documents
    mask = AttentionMask(kv_valid=jnp.asarray(valid), segment_ids=jnp.asarray(segments))
    pos = np.arange(s)
    visible = ((pos[None, :] <= pos[:, None])[None] & valid[:, None, :]
               & (segments[:, :, None] == segments[:, None, :]))
    real = jnp.asarray(valid, jnp.float32)  # left-pad queries see no key: left out, as no real token reads them
    weights = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((b, s, h, c), (b, s))]

    def loss(fn, *xs):
        context, kl = fn(*xs)
        total = jnp.sum(kl * real * weights[1])
        return total if context is None else total + jnp.sum(context * real[:, :, None, None] * weights[0])

    def ours(*xs):
        return dsa.sparse_attention(*xs, mask, topk=topk, scale=0.3, loss=mode)

    def ref(*xs):
        context, kl = _reference(*xs, jnp.asarray(visible), topk, 0.3, mode)
        return (None if mode == "dense" else context), kl

    (got_context, got_kl), (want_context, want_kl) = ours(*arrays), ref(*arrays)
    keep = valid.reshape(-1)
    np.testing.assert_allclose(np.asarray(got_kl).reshape(-1)[keep], np.asarray(want_kl).reshape(-1)[keep],
                               rtol=1e-5, atol=1e-6)
    assert float(np.max(np.asarray(got_kl).reshape(-1)[keep])) > 1e-2  # a KL that says something
    if mode == "sparse":
        np.testing.assert_allclose(np.asarray(got_context).reshape(b * s, -1)[keep],
                                   np.asarray(want_context).reshape(b * s, -1)[keep], rtol=1e-5, atol=1e-5)
    got = jax.grad(lambda *xs: loss(ours, *xs), argnums=tuple(range(7)))(*arrays)
    want = jax.grad(lambda *xs: loss(ref, *xs), argnums=tuple(range(7)))(*arrays)
    for i, (g, w) in enumerate(zip(got, want)):
        if float(jnp.linalg.norm(w)) == 0:  # dense mode: no context, no gradient to the attention's inputs
            assert float(jnp.linalg.norm(g)) == 0, f"gradient {i}"
            continue
        assert rel_l2(g, w) < 1e-5, f"gradient {i}"


@pytest.mark.parametrize("rules, sizes", [("ep-as-cp", {"fsdp": 2, "expert": 2}),
                                          ("default", {"fsdp": 2, "tensor": 2})])
def test_kernel_on_a_mesh_equals_one_device(monkeypatch, rules, sizes):
    """Queries split over the sequence (ep-as-cp: 'expert') or the heads over 'tensor' (default), left padding and
    packed documents that cross the split: the context, both KL modes (the sparse stage's and the warm-up's dense
    one) and every gradient equal the one-device call (the mesh matrix has no segments and trains no indexer)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nnx_zoo.sharding import make_mesh, use_rules

    monkeypatch.setattr(dsa, "_MAX_BLOCK", 4)  # 8 queries per device: 2 blocks each
    b, s, h, c, r, hi, d, topk = 2, 16, 2, 8, 4, 4, 8, 5
    rng = np.random.default_rng(1)
    arrays = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in (
        (b, s, h, c), (b, s, h, r), (b, s, hi, d), (b, s, hi), (b, s, c), (b, s, r), (b, s, d))]
    valid = np.ones((b, s), bool)
    valid[0, :3] = False
    segments = np.zeros((b, s), np.int32)
    segments[:, 5:] += 1
    segments[1, 11:] += 1  # documents [0, 5), [5, 11), [11, 16) in row 1: two cross the split at 8
    weights = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((b, s, h, c), (b, s), (b, s))]
    real = jnp.asarray(valid, jnp.float32)

    def run(xs, valid, segments):
        def loss(xs):
            mask = AttentionMask(kv_valid=valid, segment_ids=segments)
            context, kl = dsa.sparse_attention(*xs, mask, topk=topk, scale=0.3, loss="sparse")
            _, dense_kl = dsa.sparse_attention(*xs, mask, topk=topk, scale=0.3, loss="dense")
            return jnp.sum(context * real[:, :, None, None] * weights[0]) + jnp.sum(kl * real * weights[1]) + (
                jnp.sum(dense_kl * real * weights[2])), (context, kl, dense_kl)

        return jax.grad(loss, has_aux=True)(xs)

    want = jax.jit(run)(arrays, jnp.asarray(valid), jnp.asarray(segments))
    mesh = make_mesh(sizes, shard_mode="explicit", devices=jax.devices()[:4])
    with jax.set_mesh(mesh), use_rules(rules):
        got = jax.jit(run)(*jax.device_put((arrays, jnp.asarray(valid), jnp.asarray(segments)),
                                            NamedSharding(mesh, P())))
    keep = valid.reshape(-1)
    (got_grads, got_outputs), (want_grads, want_outputs) = got, want
    for name, atol, g, w in zip(("context", "sparse KL", "dense KL"), (1e-5, 1e-6, 1e-6), got_outputs, want_outputs):
        np.testing.assert_allclose(np.asarray(g).reshape(b * s, -1)[keep], np.asarray(w).reshape(b * s, -1)[keep],
                                   rtol=1e-5, atol=atol, err_msg=name)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert rel_l2(g, w) < 1e-5, f"gradient {i}"


@pytest.mark.parametrize("rules", ["ep-as-cp"])  # the sequence split over 'expert' (default: the mesh matrix)
def test_sparse_mla_keeps_its_input_sharding(rules):
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nnx_zoo.layers.attention import causal_mask
    from nnx_zoo.models.deepseek.mla import MLA
    from nnx_zoo.sharding import get_rules, logical_to_mesh_axes, make_mesh, use_rules
    from tests.models.deepseek.small import small_config

    config = small_config(index_topk=4, index_n_heads=4, index_head_dim=32, indexer_training="sparse")
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode="explicit")
    mla = MLA(config, rngs=nnx.Rngs(0))
    positions = jnp.arange(16)[None]
    cos = sin = jnp.ones((1, 16, config.qk_rope_head_dim // 2)) * positions[..., None] / 16

    @nnx.jit
    def run(mla, x):
        with use_rules(rules):
            return mla.attend(x, cos, sin, causal_mask(16))

    spec = logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"), get_rules(rules), mesh)
    with jax.set_mesh(mesh):
        for in_spec in (spec, P(None, None, None)):
            x = jax.device_put(jnp.ones((8, 16, config.hidden_size)), NamedSharding(mesh, in_spec))
            out, kl = run(mla, x)
            assert jax.typeof(out).sharding.spec == jax.typeof(x).sharding.spec
            assert kl.shape == (8, 16)
    if rules == "ep-as-cp":  # the queries really were split over the sequence
        assert spec[1] == "expert"


def _peak_live_bytes(load):
    """``(load(), the most bytes of JAX arrays alive beyond those alive before)``, sampled each time a function of
    nnx_zoo returns while ``load`` runs (every array the package allocates is in hand by then)."""
    root = str(Path(nnx_zoo.__file__).parent)

    def live() -> int:
        return sum(a.nbytes for a in jax.live_arrays())

    gc.collect()
    base = peak = live()

    def sample(frame, event, arg):
        nonlocal peak
        if event == "return" and frame.f_code.co_filename.startswith(root):
            peak = max(peak, live())

    sys.setprofile(sample)
    try:
        result = load()
    finally:
        sys.setprofile(None)
    return result, peak - base


def _indexers(model) -> dict[str, jax.Array]:
    return {p: v[...] for p, v in iter_variables(model) if ".indexer." in p}


def test_a_v3_checkpoint_loads_with_new_indexers_for_the_warm_up(tmp_path):
    """``index_topk`` given for a DeepSeek-V3 checkpoint (no indexer weights; DeepSeek started V3.2 from V3.1):
    every weight it has is loaded, the indexers start from a random init with a warning, and while the top-k
    covers the sequence the logits are the V3 model's. One model is built, not a V3 one beside it: the indexers
    alone are initialized (as ``create`` initializes them) and the rest read into place. A V3.2 checkpoint missing
    its indexers is still refused."""
    from nnx_zoo.hf import CheckpointMismatchError

    hf = make_hf_model(seed=3, num_hidden_layers=2)
    path = save_hf(hf, tmp_path / "v3")
    ids, _ = _inputs(False, hf.config.vocab_size)
    small = dict(index_n_heads=4, index_head_dim=32)  # indexers of 2% of this tiny model, not most of it
    with pytest.warns(UserWarning, match="no lightning-indexer weights"):
        model, peak = _peak_live_bytes(
            lambda: DeepSeekV3.from_pretrained(path, moe_impl="dense", index_topk=SEQ, **small))
    assert model.config.index_topk == SEQ and model.moe_layers.attn.indexer is not None
    # At most one model's bytes alive while loading (measured 1.06x); loading the V3 model and then creating the
    # V3.2 one beside it, as this loader once did, held 1.83x.
    model_bytes = sum(v[...].nbytes for _, v in iter_variables(model))
    assert peak < 1.25 * model_bytes, (peak, model_bytes)
    v3 = DeepSeekV3.from_pretrained(path, moe_impl="dense")
    loaded = dict(iter_variables(model))
    for p, v in iter_variables(v3):  # every weight outside the indexers is the checkpoint's
        np.testing.assert_array_equal(np.asarray(loaded.pop(p)[...]), np.asarray(v[...]), err_msg=p)
    assert loaded and all(".indexer." in p for p in loaded)
    # The indexers: on a mesh, exactly what create(config) gives them, where it places them; without one, the same
    # values (create() without a mesh initializes eagerly, unjitted: within a float32's last bit of these).
    mesh = make_mesh({"fsdp": 4, "expert": 2})
    with pytest.warns(UserWarning, match="no lightning-indexer weights"):
        on_mesh = DeepSeekV3.from_pretrained(path, moe_impl="dense", index_topk=SEQ, mesh=mesh, **small)
    created = _indexers(DeepSeekV3.create(on_mesh.config, mesh=mesh))
    for p, value in _indexers(on_mesh).items():
        assert value.sharding == created[p].sharding, p
        np.testing.assert_array_equal(np.asarray(value), np.asarray(created[p]), err_msg=p)
        np.testing.assert_array_equal(np.asarray(loaded[p][...]), np.asarray(created[p]), err_msg=p)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), np.asarray(v3(jnp.asarray(ids))), rtol=1e-6,
                               atol=1e-6)
    model.save_pretrained(tmp_path / "v32")  # then its indexer weights are taken out of the files
    import safetensors.numpy

    weights = tmp_path / "v32" / "model-00001-of-00001.safetensors"
    tensors = {k: v for k, v in safetensors.numpy.load_file(weights).items() if ".indexer." not in k}
    safetensors.numpy.save_file(tensors, weights)
    index = tmp_path / "v32" / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    d["weight_map"] = {k: v for k, v in d["weight_map"].items() if ".indexer." not in k}
    index.write_text(json.dumps(d))
    with pytest.raises(CheckpointMismatchError, match="indexer"):
        DeepSeekV3.from_pretrained(tmp_path / "v32")


def test_recipe_trains_the_v32_tiny_preset_in_its_sparse_stage(tmp_path, capsys):
    recipe = load_recipe()
    run_dir = tmp_path / "run"
    args = ["--model", "deepseek3.2-tiny", "--model.num_hidden_layers", "1", "--model.first_k_dense_replace", "0",
            "--model.vocab_size", "256", "--model.index_topk", "4", "--indexer-stage", "sparse", "--batch", "8",
            "--seq-len", "16", "--steps", "2", "--no-progress", "--warmup-steps", "1", "--peak-flops", "1e11",
            "--run-dir", str(run_dir)]
    assert recipe.main(args) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["indexer_loss"]) and r["indexer_loss"] > 0 for r in rows)
    assert "nnx_zoo: indexer sparse stage: each query attends to its top 4 keys" in capsys.readouterr().err


def test_the_recipe_says_what_each_indexer_stage_trains():
    """The config's words for its stage, with the trained / frozen counts of an abstract model; the warm-up
    freezes the routers, so routing-bias balancing is switched off (and said so); the other stages keep it."""
    recipe = load_recipe()
    for stage in ("dense_warmup", "sparse", "off"):
        config = DeepSeekV3Config.preset("deepseek3.2-tiny", indexer_training=stage)
        trained, total = recipe.trained_parameters(config, DeepSeekV3)
        extras, lines = recipe.what_trains(config, DeepSeekV3, recipe.Extras(0.0, 0.01), pretrained=False)
        indexer = total - trained if stage == "off" else trained if stage == "dense_warmup" else None
        assert trained < total if stage != "sparse" else trained == total
        if stage == "dense_warmup":
            assert lines[0].startswith(f"indexer warm-up: dense attention, training the indexer only ({indexer:,}")
            assert "starts from a random initialization" in lines[0]
            assert lines[1].startswith("routing-bias balancing off") and extras.routing_bias_rate == 0
        else:
            assert len(lines) == 1 and extras.routing_bias_rate == 0.01
            assert lines[0].startswith("indexer sparse stage" if stage == "sparse" else "indexer: each query")
            assert stage == "sparse" or f"the indexer is frozen ({indexer:,} parameters" in lines[0]
    plain = DeepSeekV3Config.preset("deepseek3-tiny")
    assert recipe.what_trains(plain, DeepSeekV3, recipe.Extras(0.0, 0.01), pretrained=False) == (
        recipe.Extras(0.0, 0.01), [])


# ---------------------------------------------------------------------------------------------------------------
# The indexer itself against transformers' DeepseekV32Indexer, and its KL against a hand-written one.

def _hf_indexer_calls(hf, ids, mask, monkeypatch) -> tuple[list[dict], object]:
    """Run transformers' model once (attention probabilities out); each layer's indexer call: its inputs and its
    raw scores, the tensor whose top-k it takes (transformers returns only the indices)."""
    calls, recording = [], []
    topk = torch.Tensor.topk

    def recording_topk(self, *args, **kwargs):
        if recording:
            calls[-1]["scores"] = self.detach().clone()
        return topk(self, *args, **kwargs)

    def before(module, args, kwargs):
        calls.append(dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments))
        recording.append(True)

    def after(module, args, output):
        recording.clear()

    monkeypatch.setattr(torch.Tensor, "topk", recording_topk)
    hooks = [h for layer in hf.model.layers for h in (
        layer.self_attn.indexer.register_forward_pre_hook(before, with_kwargs=True),
        layer.self_attn.indexer.register_forward_hook(after))]
    try:
        with torch.no_grad():
            out = hf(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask),
                     output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == len(hf.model.layers) and all("scores" in c for c in calls)
    return calls, out


def test_indexer_raw_scores_equal_transformers(built, monkeypatch):
    """Every layer's indexer, given transformers' inputs (hidden states, query latent, YaRN cos/sin) and its
    weights, scores every visible key as transformers does before its top-k (a left-padded row included)."""
    path, hf, _, ids, mask = built("sparse-padded-yarn")
    calls, _ = _hf_indexer_calls(hf, ids, mask, monkeypatch)
    config = DeepSeekV3Config.from_hf(path)
    assert not config.index_rope_interleave  # transformers' indexer ropes halves, whatever MLA does
    for layer, call in zip(hf.model.layers, calls, strict=True):
        theirs = layer.self_attn.indexer
        ours = dsa.LightningIndexer(config, rngs=nnx.Rngs(0))
        t = {k: v.detach().numpy() for k, v in theirs.state_dict().items()}
        ours.wq_b.kernel[...] = jnp.asarray(t["wq_b.weight"].T.reshape(config.q_lora_rank, config.index_n_heads,
                                                                      config.index_head_dim))
        ours.wk.kernel[...] = jnp.asarray(t["wk.weight"].T)
        ours.k_norm.scale[...], ours.k_norm.bias[...] = jnp.asarray(t["k_norm.weight"]), jnp.asarray(t["k_norm.bias"])
        ours.weights_proj.kernel[...] = jnp.asarray(t["weights_proj.weight"].T)
        x, q_latent = (jnp.asarray(call[k].numpy()) for k in ("hidden_states", "q_resid"))
        cos, sin = (jnp.asarray(a.numpy()[..., : config.qk_rope_head_dim // 2]) for a in call["position_embeddings"])
        q, w = ours.queries(x, q_latent, cos, sin)
        scores = np.asarray(dsa.index_scores(q, w, ours.keys(x, cos, sin)))
        want = call["scores"].numpy()
        visible = np.isfinite(want) & (want > -1e30)
        assert visible.sum() > BATCH * SEQ and np.ptp(want[visible]) > 0.1  # scores that say something
        np.testing.assert_allclose(scores[visible], want[visible], rtol=1e-5, atol=1e-5)


def test_indexer_kl_equals_a_hand_written_reference(built, monkeypatch):
    """The dense warm-up's indexer loss on transformers' weights equals a numpy KL built from transformers' own
    attention probabilities and indexer scores: per layer and query, KL(p || softmax(scores)) over the visible keys,
    ``p`` the attention summed over heads and normalized; each sequence's mean over its queries, summed over the
    layers, averaged over the sequences."""
    path, hf, _, ids, mask = built("topk-covers-sequence")  # every key chosen: transformers' attention is dense
    calls, out = _hf_indexer_calls(hf, ids, mask, monkeypatch)
    visible = np.tril(np.ones((SEQ, SEQ), bool))
    total = np.zeros(BATCH)
    for call, attention in zip(calls, out.attentions, strict=True):
        p = attention.numpy().astype(np.float64).sum(axis=1)  # [batch, query, key]
        p = np.where(visible, p, 0.0)
        p /= p.sum(-1, keepdims=True)
        scores = np.where(visible, call["scores"].numpy().astype(np.float64), -np.inf)
        log_q = scores - scores.max(-1, keepdims=True)
        log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
        terms = np.where(visible & (p > 0), p * (np.log(np.where(p > 0, p, 1.0)) - log_q), 0.0)
        total += terms.sum(-1).mean(-1)
    want = total.mean()
    model = AutoModelForCausalLM.from_pretrained(path, moe_impl="dense", indexer_training="dense_warmup")
    got = float(model.forward(jnp.asarray(ids), with_logits=False).indexer_loss)
    assert want > 1e-2 and abs(got - want) <= 1e-5 * want, (got, want)
