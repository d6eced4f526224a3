"""DeepSeek-V4 trains: through the recipe (MTP, sequence-wise balance loss, aux-loss-free balancing, indexer
stage); the CSA indexers follow V3.2's stages (sparse: the indexer loss reaches the indexers alone and the LM loss
everything else; dense warm-up: only the indexers move); the hash tables stay frozen while the top-k layers'
selection biases move; gradient accumulation is exact. One small config, few compiles."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV4, DeepSeekV4Config
from nnx_zoo.train import OptimizerConfig, make_optimizer, train_step
from nnx_zoo.train.step import head_losses

ROOT = Path(__file__).resolve().parents[3]
SEQ, VOCAB = 32, 256


def _config(stage: str = "off", **overrides) -> DeepSeekV4Config:
    # 2 layers (sliding + hash, CSA: every trained part these tests separate; HCA's training is in the mesh and
    # notebook tests); 8 CSA entries at 32 tokens, of which the indexer keeps 4.
    return DeepSeekV4Config.preset("deepseek4-tiny", vocab_size=VOCAB, num_hidden_layers=2, index_topk=4,
                                   indexer_training=stage, moe_impl="dense", **overrides)


def _batch(rows: int = 2, seed: int = 1) -> dict[str, jax.Array]:
    ids = jax.random.randint(jax.random.key(seed), (rows, SEQ + 1), 0, VOCAB)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((rows, SEQ), jnp.int32)}


def _flat(state) -> dict[str, np.ndarray]:
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.array(v)
            for path, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))}


def test_the_recipe_trains_v4_with_every_extra(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("pretrain", ROOT / "recipes" / "pretrain.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    run_dir = tmp_path / "run"
    # 2 layers (sliding + hash, CSA: the indexer's sparse stage needs the CSA layer); HCA's are in the other tests.
    args = ["--model", "deepseek4-tiny", "--model.vocab_size", str(VOCAB), "--model.num_hidden_layers", "2",
            "--model.index_topk", "4",
            "--model.seq_aux_loss_alpha", "0.01", "--indexer-stage", "sparse", "--batch", "8", "--seq-len", str(SEQ),
            "--steps", "2", "--warmup-steps", "1", "--no-progress", "--peak-flops", "1e11", "--routing-bias-rate",
            "0.01", "--moe-impl", "dense", "--run-dir", str(run_dir)]
    assert recipe.main(args) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("mtp1", "aux_loss", "indexer_loss", "expert_max_over_mean"):
        assert all(np.isfinite(r[key]) and r[key] > 0 for r in rows), (key, rows)
    err = capsys.readouterr().err
    assert "deepseek4-tiny (DeepSeekV4)" in err and "indexer sparse stage" in err


def test_sparse_stage_indexer_loss_and_lm_loss_reach_disjoint_parameters():
    model = DeepSeekV4(_config("sparse"), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = _batch()

    def losses(p):
        out, head = head_losses(nnx.merge(graphdef, p, rest), batch, (("with_mtp", True),))
        return out.indexer_loss, sum(ce_sum / tokens for ce_sum, tokens in head)

    def grads(p):
        # Each loss's gradient: one backward pass, batched over the two cotangents (reverse-mode Jacobian), so the
        # backward is traced and compiled once, not once per loss.
        (indexer_loss, _), vjp = jax.vjp(losses, p)
        one, zero = jnp.ones_like(indexer_loss), jnp.zeros_like(indexer_loss)
        both = jax.vmap(lambda c: vjp(c)[0])((jnp.stack([one, zero]), jnp.stack([zero, one])))
        return indexer_loss, jax.tree.map(lambda g: g[0], both), jax.tree.map(lambda g: g[1], both)

    loss, from_indexer, from_lm = jax.jit(grads)(params)
    assert float(loss) > 0
    from_indexer = {k: np.abs(v).max() for k, v in _flat(from_indexer).items()}
    from_lm = {k: np.abs(v).max() for k, v in _flat(from_lm).items()}
    indexer = {name for name in from_lm if "/indexer/" in name}
    assert len(indexer) == 6  # its compressor (kv, gate, ape, norm), q_b_proj, weights_proj
    assert not {n: g for n, g in from_indexer.items() if n not in indexer and g != 0}, "indexer loss leaks"
    assert not {n for n in indexer if from_indexer[n] == 0}, "the indexer loss misses an indexer parameter"
    assert not {n: g for n, g in from_lm.items() if n in indexer and g != 0}, "the LM loss reaches the indexer"
    assert not {n for n, g in from_lm.items() if n not in indexer and g == 0}, "the LM loss misses a parameter"


def test_dense_warmup_moves_the_indexers_alone():
    model = DeepSeekV4(_config("dense_warmup"), rngs=nnx.Rngs(0))
    optimizer = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=0, schedule="constant"), model, 4)
    trained = _flat(nnx.state(model, optimizer.wrt))
    assert trained and all("/indexer/" in name for name in trained)
    before = _flat(nnx.state(model, nnx.Not(nnx.PathContains("indexer"))))
    step = nnx.jit(functools.partial(train_step, routing_bias_rate=1e-2, model_kwargs=(("with_expert_load", True),)))
    losses = [float(jax.device_get(step(model, optimizer, _batch(rows=4)))["indexer_loss"]) for _ in range(4)]
    assert losses[-1] < losses[0] and all(np.isfinite(losses)), losses
    after = _flat(nnx.state(model, nnx.Not(nnx.PathContains("indexer"))))
    assert not [n for n in before if not np.array_equal(before[n], after[n])], "frozen Variables moved"


def test_hash_tables_stay_frozen_the_biases_move_and_accumulation_is_exact():
    """Two micro-batches give the one-batch step's loss, gradient norm and updated weights (AdamW with a large eps,
    so that weights whose gradient is near 0 do not amplify rounding into an update); the step's routing-bias
    balancing moves the top-k layers' selection biases and never the hash-routed layers' tables."""
    config = _config()
    batch = _batch(rows=4, seed=5)
    results = []
    for accum in (1, 2):
        model = DeepSeekV4(config, rngs=nnx.Rngs(0))
        tables = np.array(jax.random.randint(jax.random.key(9), model.stacks["sliding_hash"].mlp.tid2eid.shape, 0, 8))
        model.stacks["sliding_hash"].mlp.tid2eid[...] = jnp.asarray(tables)
        optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", clip_norm=1.0,
                                                   eps=1e-3), model, 1)
        biases = {k: np.array(v.mlp.e_score_correction_bias[...]) for k, v in model.stacks.items()
                  if v.mlp.e_score_correction_bias is not None}
        step = nnx.jit(functools.partial(train_step, accum_steps=accum, routing_bias_rate=1e-2,
                                         model_kwargs=(("with_expert_load", True),)))
        metrics = jax.device_get(step(model, optimizer, batch))
        np.testing.assert_array_equal(np.asarray(model.stacks["sliding_hash"].mlp.tid2eid[...]), tables)
        assert all(not np.array_equal(b, np.asarray(model.stacks[k].mlp.e_score_correction_bias[...]))
                   for k, b in biases.items())
        results.append((metrics, _flat(nnx.state(model, nnx.Param))))
    (one, params_one), (two, params_two) = results
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
    np.testing.assert_allclose(two["grad_norm"], one["grad_norm"], rtol=1e-5)
    for name in params_one:
        np.testing.assert_allclose(params_two[name], params_one[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("stage", ["off", "sparse"])
def test_off_freezes_the_indexers_and_sparse_trains_everything(stage):
    model = nnx.eval_shape(lambda: DeepSeekV4(_config(stage), rngs=nnx.Rngs(0)))
    trained = set(_flat(nnx.state(model, nnx.All(nnx.Param, model.trainable()))))
    left_out = set(_flat(nnx.state(model, nnx.Param))) - trained
    assert all("/indexer/" in name for name in left_out) and len(left_out) == (6 if stage == "off" else 0)
