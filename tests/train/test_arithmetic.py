"""Training arithmetic against independent references: the trainer's step (``train_step`` with the optimizer of
``make_optimizer``) against a hand-written forward pass of the toy model differentiated with ``jax.grad`` and a
hand-written AdamW in float64 numpy; the weight-decay mask against explicit lists of paths.

The AdamW ``eps`` is set near the gradients' size, so an update depends on the gradient's scale (with a tiny
``eps`` the first AdamW step is ``lr * sign(g)`` and could not tell a clipped or mis-normalised gradient from the
right one).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3
from nnx_zoo.layers import Linear
from nnx_zoo.layers.scan import create_stack
from nnx_zoo.sharding import iter_variables
from nnx_zoo.train import OptimizerConfig, make_optimizer, train_step
from nnx_zoo.train.optim import decay_mask
from tests.models.deepseek.small import small_config
from tests.train.toy_lm import ToyLM

VOCAB, WIDTH, ROWS, SEQ = 16, 8, 8, 6
# Tokens each row's loss mask keeps. Row i goes to micro-batch i % accum_steps: with 2 micro-batches they hold 20
# and 6 tokens, with 4 they hold 12, 0, 8 and 6 (one micro-batch has no token at all).
TOKENS_PER_ROW = [(6, 0, 5, 2, 6, 0, 3, 4), (1, 6, 6, 2, 0, 5, 4, 3)]  # step 1, step 2
OPT = dict(lr=0.1, warmup_steps=0, schedule="constant", b1=0.9, b2=0.95, eps=2e-2, weight_decay=0.2)
CLIP = 0.5  # the gradient norms here are 2-3
NO_DECAY = {"scale"}  # ToyLM: the norm scale (logical name "norm")


def _batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    batches = []
    for counts in TOKENS_PER_ROW:
        ids = rng.integers(0, VOCAB, (ROWS, SEQ + 1))
        mask = np.zeros((ROWS, SEQ), np.float32)
        for row, count in enumerate(counts):  # kept positions scattered along the row, not a prefix
            mask[row, rng.permutation(SEQ)[:count]] = 1.0
        batches.append({"input_ids": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
                        "loss_mask": mask})
    return batches


# ------------------------------------------------------------------ the independent reference
def _gelu_tanh(u):
    return 0.5 * u * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))


def reference_logits(params, input_ids):
    """ToyLM's forward pass written out by hand."""
    h = params["embed"][input_ids]  # a gather, where the model multiplies by one-hot rows
    h = h + _gelu_tanh(h @ params["up"]) @ params["down"]
    return (h * params["scale"]) @ params["head"]


def _mean_nll(logits, targets, mask):
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.sum(mask)


def reference_loss(params, batch):
    """The mean next-token NLL over every kept token of the batch."""
    return _mean_nll(reference_logits(params, batch["input_ids"]), batch["targets"], batch["loss_mask"])


def _global_norm(tree: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in tree.values()))


def reference_run(params, batches, *, clip_norm, weight_decay=OPT["weight_decay"], no_decay=NO_DECAY,
                  loss_fn=reference_loss):
    """Per step ``(loss, gradient norm before clipping)`` and the final parameters: ``jax.grad`` of ``loss_fn``,
    then global-norm clipping and AdamW written out in float64 numpy."""
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in params.items()}
    nu = {k: np.zeros_like(v) for k, v in params.items()}
    b1, b2, eps, lr = OPT["b1"], OPT["b2"], OPT["eps"], OPT["lr"]
    history = []
    for t, batch in enumerate(batches, start=1):
        as_f32 = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
        loss, grads = jax.value_and_grad(loss_fn)(as_f32, {k: jnp.asarray(v) for k, v in batch.items()})
        grads = {k: np.asarray(g, np.float64) for k, g in grads.items()}
        norm = _global_norm(grads)
        history.append((float(loss), norm))
        if clip_norm and norm > clip_norm:
            grads = {k: g * (clip_norm / norm) for k, g in grads.items()}
        for k, g in grads.items():
            mu[k] = b1 * mu[k] + (1 - b1) * g
            nu[k] = b2 * nu[k] + (1 - b2) * g * g
            update = (mu[k] / (1 - b1**t)) / (np.sqrt(nu[k] / (1 - b2**t)) + eps)
            if k not in no_decay:
                update = update + weight_decay * params[k]
            params[k] = params[k] - lr * update
    return history, params


# ------------------------------------------------------------------ the trainer
def _toy() -> ToyLM:
    """ToyLM with its embedding and head scaled up: logits far from uniform, so tokens' losses differ (at the
    default init every loss is about ln 16 and any weighting of them gives the same mean)."""
    model = ToyLM(VOCAB, WIDTH, nnx.Rngs(3))
    for weight in (model.embed, model.head):
        weight[...] = 20.0 * weight[...]
    return model


def _params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {path: np.asarray(variable[...]) for path, variable in iter_variables(nnx.state(model, nnx.Param))}


_step = nnx.jit(train_step, static_argnames=("accum_steps", "mtp_weight", "model_kwargs"))


def trainer_run(batches, *, accum_steps, clip_norm, weight_decay=OPT["weight_decay"], model=None, mtp_weight=0.0):
    """The trainer's metrics per step and its final parameters, from the same initial parameters."""
    model = _toy() if model is None else model
    config = OptimizerConfig(**{**OPT, "weight_decay": weight_decay}, clip_norm=clip_norm)
    optimizer = make_optimizer(config, model, total_steps=len(batches))
    metrics = []
    for batch in batches:
        out = _step(model, optimizer, {k: jnp.asarray(v) for k, v in batch.items()}, accum_steps=accum_steps,
                    mtp_weight=mtp_weight)
        metrics.append({k: float(v) for k, v in out.items()})
    return metrics, _params(model)


def _assert_params_close(got, want, what=""):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-7, err_msg=f"{what}{name}")


def _mean_of_micro_batch_means(batch, accum_steps) -> float:
    """What a trainer that averaged micro-batch means (the mistake) would report: micro-batch ``j`` holds rows
    ``j, j + accum, ...``; an empty micro-batch counts as 0."""
    params = {k: jnp.asarray(v) for k, v in _params(_toy()).items()}
    means = []
    for j in range(accum_steps):
        rows = {k: jnp.asarray(v[j::accum_steps]) for k, v in batch.items()}
        means.append(float(reference_loss(params, rows)) if rows["loss_mask"].sum() else 0.0)
    return float(np.mean(means))


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("accum_steps", [1, 2, 4])
def test_accumulated_step_equals_one_step_on_the_whole_batch(accum_steps):
    """Loss, gradient norm and updated parameters (two AdamW steps) equal the whole-batch reference, with the
    per-token mean over all tokens of the step although the micro-batches hold very different token counts."""
    batches = _batches()
    want_history, want_params = reference_run(_params(_toy()), batches, clip_norm=0.0)
    metrics, params = trainer_run(batches, accum_steps=accum_steps, clip_norm=0.0)
    for step, (m, (loss, norm), batch) in enumerate(zip(metrics, want_history, batches)):
        assert m["tokens"] == batch["loss_mask"].sum()
        assert m["loss"] == pytest.approx(loss, rel=1e-5), step
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-5), step
    _assert_params_close(params, want_params)
    if accum_steps > 1:  # the case tells a per-token mean from a mean of micro-batch means
        for (loss, _), batch in zip(want_history, batches):
            assert abs(_mean_of_micro_batch_means(batch, accum_steps) - loss) > 0.02 * loss


def test_reported_grad_norm_is_the_norm_of_the_per_token_mean_gradient():
    """With clipping active and 2 micro-batches: the reported norm is that of the gradient of the per-token mean
    loss before clipping (not of the summed loss, nor of the clipped gradient)."""
    batches = _batches()
    want_history, _ = reference_run(_params(_toy()), batches, clip_norm=CLIP)
    metrics, _ = trainer_run(batches, accum_steps=2, clip_norm=CLIP)
    for m, (_, norm), batch in zip(metrics, want_history, batches):
        assert norm > 2 * CLIP  # clipping was active
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert m["grad_norm"] * batch["loss_mask"].sum() > 2 * norm  # the summed loss's norm is far off


def test_clipping_clips_when_the_norm_exceeds_the_threshold():
    batches = _batches()
    clip = CLIP
    want_history, want_params = reference_run(_params(_toy()), batches, clip_norm=clip)
    assert all(norm > 2 * clip for _, norm in want_history)
    _, unclipped = reference_run(_params(_toy()), batches, clip_norm=0.0)
    assert max(np.abs(unclipped[k] - want_params[k]).max() for k in want_params) > 1e-3  # clipping matters here
    _, params = trainer_run(batches, accum_steps=2, clip_norm=clip)
    _assert_params_close(params, want_params)
    # A threshold above the norm leaves the step as it was.
    _, params = trainer_run(batches, accum_steps=2, clip_norm=10.0)
    _assert_params_close(params, unclipped)


def test_weight_decay_skips_the_norm_scale_in_the_step():
    """Decay applies to every weight but ToyLM's norm scale: against the reference with decay on everything and
    off everywhere, only the scale follows the second."""
    batches = _batches()
    _, params = trainer_run(batches, accum_steps=1, clip_norm=0.0, weight_decay=0.5)
    _, want = reference_run(_params(_toy()), batches, clip_norm=0.0, weight_decay=0.5)
    _, decayed_everywhere = reference_run(_params(_toy()), batches, clip_norm=0.0, weight_decay=0.5, no_decay=set())
    _assert_params_close(params, want)
    assert np.abs(decayed_everywhere["scale"] - want["scale"]).min() > 1e-3


# ------------------------------------------------------------------ MTP and auxiliary losses
MTP_WEIGHT, AUX_WEIGHT = 0.3, 0.05


class _Out(NamedTuple):
    logits: jax.Array
    mtp_logits: jax.Array
    aux_loss: jax.Array


class ToyWithExtras(nnx.Module):
    """The toy model plus one multi-token-prediction head (``tanh(logits) @ mix``, for the token two ahead) and an
    auxiliary loss that, like DeepSeek's balance loss, is a mean over the sequences holding a real token
    (``attention_mask``): per sequence ``AUX_WEIGHT * mean(logits**2)``."""

    def __init__(self):
        self.lm = _toy()
        self.mix = nnx.Param(jax.random.normal(jax.random.key(5), (VOCAB, VOCAB)), out_sharding=(None, "vocab"),
                             eager_sharding=False)

    def __call__(self, input_ids, attention_mask=None):  # the contract: the call gives the logits
        return self.forward(input_ids, attention_mask).logits

    def forward(self, input_ids, attention_mask=None):  # what the trainer reads: logits and the extras
        logits = self.lm(input_ids)
        per_sequence = AUX_WEIGHT * jnp.mean(logits**2, axis=(1, 2))
        real = jnp.any(attention_mask != 0, axis=-1).astype(jnp.float32)
        aux = jnp.sum(per_sequence * real) / jnp.maximum(jnp.sum(real), 1.0)
        return _Out(logits, (jnp.tanh(logits) @ self.mix[...])[None], aux)


def reference_terms(params, batch):
    """(cross-entropy, MTP cross-entropy, aux) of the whole batch, each a mean over all of the step's tokens (or
    real sequences); the MTP head's logits at ``t`` are scored against the target at ``t + 1`` (sliced)."""
    logits = reference_logits({k.removeprefix("lm."): v for k, v in params.items()}, batch["input_ids"])
    ce = _mean_nll(logits, batch["targets"], batch["loss_mask"])
    mtp_logits = jnp.tanh(logits) @ params["mix"]
    mtp = _mean_nll(mtp_logits[:, :-1], batch["targets"][:, 1:], batch["loss_mask"][:, 1:])
    real = batch["attention_mask"].any(-1)
    aux = jnp.mean(AUX_WEIGHT * jnp.mean(logits**2, axis=(1, 2))[real])
    return ce, mtp, aux


def reference_total(params, batch):
    ce, mtp, aux = reference_terms(params, batch)
    return ce + MTP_WEIGHT * mtp + aux


@pytest.mark.parametrize("accum_steps", [1, 2, 4])
def test_accumulation_with_mtp_and_aux_losses_equals_the_whole_batch(accum_steps):
    """The MTP term is a per-token mean over all of the step's MTP tokens, the aux loss a mean over all of its real
    sequences, whatever the micro-batches hold (rows without a real token are padding, so micro-batches differ in
    tokens and in sequences). Metrics: ``mtp1`` and ``aux_loss`` are those whole-batch means."""
    batches = _batches()
    for batch in batches:  # rows without a loss token are padding rows
        batch["attention_mask"] = np.repeat(batch["loss_mask"].any(-1, keepdims=True), SEQ, axis=1).astype(np.int32)
    assert batches[0]["attention_mask"].any(-1).tolist() == [True, False, True, True, True, False, True, True]
    initial = _params(ToyWithExtras())
    want_history, want_params = reference_run(initial, batches, clip_norm=0.0, loss_fn=reference_total,
                                              no_decay={"lm.scale"})
    metrics, params = trainer_run(batches, accum_steps=accum_steps, clip_norm=0.0, model=ToyWithExtras(),
                                  mtp_weight=MTP_WEIGHT)
    as_f32 = {k: jnp.asarray(v) for k, v in initial.items()}
    ce, mtp, aux = reference_terms(as_f32, {k: jnp.asarray(v) for k, v in batches[0].items()})
    assert metrics[0]["loss"] == pytest.approx(float(ce), rel=1e-5)
    assert metrics[0]["mtp1"] == pytest.approx(float(mtp), rel=1e-5)
    assert metrics[0]["aux_loss"] == pytest.approx(float(aux), rel=1e-5)
    for m, (_, norm) in zip(metrics, want_history):
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
    _assert_params_close(params, want_params)


# ------------------------------------------------------------------ the decay mask, by path
_LAYER_NORMS = ("input_norm.scale", "post_attn_norm.scale", "attn.q_a_norm.scale", "attn.kv_a_norm.scale")
_LAYER_WEIGHTS = ("attn.q_a_proj.kernel", "attn.q_b_proj.kernel", "attn.kv_a_proj.kernel", "attn.kv_b_proj.kernel",
                  "attn.o_proj.kernel")
_MOE_WEIGHTS = ("mlp.router", "mlp.experts.wi_gate", "mlp.experts.wi_up", "mlp.experts.wo",
                "mlp.shared_experts.gate.kernel", "mlp.shared_experts.up.kernel", "mlp.shared_experts.down.kernel")
DEEPSEEK_NO_DECAY = {
    "norm.scale",
    *(f"dense_layers.{n}" for n in _LAYER_NORMS),
    *(f"moe_layers.{n}" for n in _LAYER_NORMS),
    *(f"mtp_layers.layer.{n}" for n in _LAYER_NORMS),
    "mtp_layers.enorm.scale", "mtp_layers.hnorm.scale", "mtp_layers.final_norm.scale",
}
DEEPSEEK_DECAY = {
    "embed.embedding", "lm_head.kernel", "mtp_layers.eh_proj.kernel",
    *(f"dense_layers.{n}" for n in _LAYER_WEIGHTS + ("mlp.gate.kernel", "mlp.up.kernel", "mlp.down.kernel")),
    *(f"moe_layers.{n}" for n in _LAYER_WEIGHTS + _MOE_WEIGHTS),
    *(f"mtp_layers.layer.{n}" for n in _LAYER_WEIGHTS + _MOE_WEIGHTS),
}


def _mask_by_path(mask: nnx.State) -> dict[str, bool]:
    return {jax.tree_util.keystr(path, simple=True, separator="."): bool(value)
            for path, value in jax.tree_util.tree_leaves_with_path(mask)}


def test_decay_mask_of_deepseek_excludes_exactly_the_norm_scales_stacked_ones_included():
    """Every norm scale (stacked ``[layers, width]`` ones too: two dims, yet names say norm) skips decay; every
    other parameter decays; the routing bias is not a parameter at all."""
    model = nnx.eval_shape(lambda: DeepSeekV3(small_config(num_hidden_layers=3), rngs=nnx.Rngs(0)))
    assert model.moe_layers.input_norm.scale.shape == (2, 128)  # stacked: 2 MoE layers
    mask = _mask_by_path(decay_mask(model))
    assert {p for p, decays in mask.items() if not decays} == DEEPSEEK_NO_DECAY
    assert {p for p, decays in mask.items() if decays} == DEEPSEEK_DECAY


class _VectorsAndBiases(nnx.Module):
    """A biased projection, a per-channel gain vector (neither a norm nor a bias), and both again in a stack."""

    def __init__(self, rngs: nnx.Rngs):
        self.proj = Linear(4, 6, kernel_names=("embed", "mlp"), use_bias=True, rngs=rngs)
        self.gain = nnx.Param(jnp.ones((4,)), out_sharding=("embed",), eager_sharding=False)


class _Stacked(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.plain = _VectorsAndBiases(rngs)
        self.layers = create_stack(_VectorsAndBiases, 3, rngs, "dense_layers")


def test_decay_mask_follows_names_for_biases_and_vectors_stacked_or_not():
    """Biases (name ``bias``) skip decay, stacked or not; a vector whose names say neither norm nor bias decays,
    stacked (2 dims) or not (1 dim): the logical names decide, not the rank, so scanning layers changes nothing."""
    model = _Stacked(nnx.Rngs(0))
    assert model.layers.proj.bias.shape == (3, 6) and model.layers.gain.shape == (3, 4)
    mask = _mask_by_path(decay_mask(model))
    assert mask == {
        "plain.proj.kernel": True, "plain.proj.bias": False, "plain.gain": True,
        "layers.proj.kernel": True, "layers.proj.bias": False, "layers.gain": True,
    }
    assert {p for p, _ in iter_variables(nnx.state(model, nnx.Param))} == set(mask)
