"""DeepSeek-V3.2's lightning indexer trains as the V3.2 report trains it (issue 24), through the generic trainer.

- Sparse stage (``indexer_training='sparse'``): the indexer's loss reaches the indexer's parameters and nothing
  else, and the language-model loss (main head and MTP head) reaches everything but the indexer: both shown with
  ``jax.grad`` against every parameter, exact zeros where the graphs are cut.
- Dense warm-up (``'dense_warmup'``): ``model.trainable()`` narrows the optimizer to the indexer, so ``train_step``
  with AdamW lowers the indexer's loss while every other Variable (routing biases included) stays bit-identical,
  and the model's cross-entropy on a fixed batch does not move at all.
- ``train_step`` adds an ``indexer_loss`` like an ``aux_loss`` (a mean over the step's real sequences) and logs it:
  exact under gradient accumulation (a toy model, so no further DeepSeek compile). With ``'off'`` the indexer is
  frozen (it has no signal; weight decay alone would move its top-k).

A tiny config (2 layers, top-8 of 32 positions, so attention really is sparse), one compile per DeepSeek case.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.train import OptimizerConfig, make_optimizer, train_step
from nnx_zoo.train.step import head_losses
from tests.train.toy_lm import ToyLM

SEQ, VOCAB = 32, 256


def _config(stage: str) -> DeepSeekV3Config:
    return DeepSeekV3Config.preset("deepseek3-mini", vocab_size=VOCAB, num_hidden_layers=2, index_topk=8,
                                   index_n_heads=4, index_head_dim=32, indexer_training=stage)


def _batch(rows: int = 2, seed: int = 1) -> dict[str, jax.Array]:
    ids = jax.random.randint(jax.random.key(seed), (rows, SEQ + 1), 0, VOCAB)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": jnp.ones((rows, SEQ), jnp.int32)}


def _path(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def _max_abs(tree: nnx.State) -> dict[str, float]:
    """'/'-joined parameter path -> max |gradient|."""
    return {_path(p): float(jnp.max(jnp.abs(v))) for p, v in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(tree))}


def test_sparse_stage_indexer_loss_and_lm_loss_reach_disjoint_parameters():
    """``jax.grad`` of the indexer loss is exactly zero outside ``attn/indexer`` and non-zero on every main-stack
    indexer parameter; ``jax.grad`` of the LM cross-entropy (with the MTP head's) is exactly zero on every indexer
    parameter and non-zero on the rest."""
    model = DeepSeekV3(_config("sparse"), rngs=nnx.Rngs(0))
    batch = _batch()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def losses(p):  # (indexer loss, LM cross-entropy of the main and the MTP head), from one forward pass
        out, head = head_losses(nnx.merge(graphdef, p, rest), batch, (("with_mtp", True),))
        return out.indexer_loss, sum(ce_sum / tokens for ce_sum, tokens in head)

    def grads(p):
        (indexer_loss, lm_loss), vjp = jax.vjp(losses, p)
        one, zero = jnp.ones_like(indexer_loss), jnp.zeros_like(indexer_loss)
        return indexer_loss, vjp((one, zero))[0], vjp((zero, one))[0]

    loss, from_indexer, from_lm = jax.jit(grads)(params)
    assert float(loss) > 0
    from_indexer, from_lm = _max_abs(from_indexer), _max_abs(from_lm)
    indexer = {name for name in from_lm if "attn/indexer/" in name}
    assert len(indexer) == 15  # wq_b, wk, k_norm scale and bias, weights_proj; dense, MoE and MTP layers
    leaks = {name: g for name, g in from_indexer.items() if name not in indexer and g != 0.0}
    assert not leaks, f"the indexer loss reaches the main model: {leaks}"
    dead = {name for name in indexer if from_indexer[name] == 0.0}  # the MTP layer's indexer included
    assert not dead, f"the indexer loss does not reach {dead}"
    leaks = {name: g for name, g in from_lm.items() if name in indexer and g != 0.0}
    assert not leaks, f"the LM loss reaches the indexer: {leaks}"
    dead = {name for name, g in from_lm.items() if name not in indexer and g == 0.0}
    assert not dead, f"the LM loss does not reach {dead}"


def _not_indexer(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every Variable outside the indexers (parameters, routing biases, ...), as numpy copies."""
    state = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.PathContains("indexer"))))
    return {_path(p): np.array(v) for p, v in jax.tree_util.tree_leaves_with_path(state)}


def test_dense_warmup_trains_the_indexer_alone_and_its_loss_falls():
    """``make_optimizer`` takes ``model.trainable()``: only the indexers' parameters (and their AdamW state). Ten
    ``train_step``s on a fixed batch (routing-bias balancing asked for: the warm-up's routers stay frozen) cut the
    indexer's KL to dense attention by more than half; every other Variable is bit-identical afterwards, so the
    cross-entropy of the fixed batch is the same at every step."""
    model = DeepSeekV3(_config("dense_warmup"), rngs=nnx.Rngs(0))
    optimizer = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=0, schedule="constant"), model, 10)
    trained = {_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(
        nnx.state(model, optimizer.wrt)))}
    assert trained and all("attn/indexer/" in name for name in trained)
    assert len(trained) == 15
    before, indexer_before = _not_indexer(model), nnx.to_pure_dict(nnx.state(model, optimizer.wrt))
    step = nnx.jit(functools.partial(train_step, routing_bias_rate=1e-2, model_kwargs=(("with_expert_load", True),)))
    batch = _batch(rows=4)
    metrics = [jax.device_get(step(model, optimizer, batch)) for _ in range(10)]
    losses = [float(m["indexer_loss"]) for m in metrics]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(np.isfinite(losses))
    assert len({float(m["loss"]) for m in metrics}) == 1  # the frozen model's cross-entropy never moves
    after = _not_indexer(model)
    assert after.keys() == before.keys()
    changed = [name for name in before if not np.array_equal(before[name], after[name])]
    assert not changed, f"frozen Variables moved in the warm-up: {changed}"
    indexer_after = nnx.to_pure_dict(nnx.state(model, optimizer.wrt))
    still = [_path(p) for p, same in jax.tree_util.tree_leaves_with_path(jax.tree.map(
        lambda a, b: bool(jnp.all(a == b)), indexer_before, indexer_after)) if same]
    # The MTP head runs only with with_mtp (its loss's test is the sparse one above); here it has no KL.
    assert not [name for name in still if not name.startswith("mtp_layers/")], still


def test_off_freezes_the_indexer_and_sparse_trains_everything():
    """Stage ``off``: the optimizer leaves out exactly the 15 indexer parameters (no signal reaches them, and weight
    decay alone would shrink them and move their top-k); ``sparse`` trains every parameter."""
    for stage, frozen in (("off", 15), ("sparse", 0)):
        model = nnx.eval_shape(lambda stage=stage: DeepSeekV3(_config(stage), rngs=nnx.Rngs(0)))
        trained = nnx.to_pure_dict(nnx.state(model, nnx.All(nnx.Param, model.trainable())))
        every = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        left_out = {_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(every)} - {
            _path(p) for p, _ in jax.tree_util.tree_leaves_with_path(trained)}
        assert len(left_out) == frozen and all("attn/indexer/" in name for name in left_out), (stage, left_out)


# ------------------------------------------------------------------ the trainer's reduction (a toy model)
class _Out(NamedTuple):
    logits: jax.Array
    indexer_loss: jax.Array


class ToyWithIndexerLoss(nnx.Module):
    """The toy model plus a per-sequence loss term on its own parameter, reported as ``indexer_loss``: the mean
    over the sequences holding a real token of ``(w * mean(logits))**2``."""

    def __init__(self):
        self.lm = ToyLM(VOCAB, 16, nnx.Rngs(0))
        self.w = nnx.Param(jnp.ones(()))

    def forward(self, input_ids, attention_mask=None):
        logits = self.lm(input_ids)
        per_sequence = (self.w[...] * jnp.mean(logits, axis=(1, 2)) * 100.0) ** 2
        real = jnp.any(attention_mask != 0, axis=-1).astype(jnp.float32)
        return _Out(logits, jnp.sum(per_sequence * real) / jnp.maximum(jnp.sum(real), 1.0))


def test_indexer_loss_is_a_mean_over_real_sequences_exact_under_accumulation():
    """The ``indexer_loss`` metric is the whole step's mean over its real sequences, and the update the same, with
    1 or 2 micro-batches whose real-sequence counts differ (one is half padding)."""
    batch = {k: np.array(v) for k, v in _batch(rows=4, seed=3).items()}
    batch["attention_mask"] = np.ones((4, SEQ), np.int32)
    batch["attention_mask"][2] = batch["loss_mask"][2] = 0  # row 2 is padding: micro-batch 0 holds rows 0 and 2
    step = nnx.jit(train_step, static_argnames=("accum_steps",))
    results = []
    for accum in (1, 2):
        model = ToyWithIndexerLoss()
        optimizer = make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=0, schedule="constant"), model, 1)
        metrics = step(model, optimizer, batch, accum_steps=accum)
        results.append((float(metrics["indexer_loss"]), float(metrics["grad_norm"]),
                        nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    (one, norm_one, params_one), (two, norm_two, params_two) = results
    assert norm_two == pytest.approx(norm_one, rel=1e-5)
    real = [0, 1, 3]
    logits = ToyWithIndexerLoss().lm(jnp.asarray(batch["input_ids"]))
    want = float(jnp.mean((jnp.mean(logits, axis=(1, 2)) * 100.0)[jnp.asarray(real)] ** 2))
    assert one == pytest.approx(want, rel=1e-5) and two == pytest.approx(want, rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params_one, params_two)
