"""The training step: token cross-entropy, gradient accumulation, one optimizer update.

Works for any model that meets the causal-LM contract (``docs/causal_lm.md``): ``model.forward(input_ids,
attention_mask=None, *, segment_ids=None, **model_kwargs)`` returns one object with ``logits [batch, seq, vocab]``
and the aux fields (None when not computed). A model with ``output_head()`` (every ``CausalLMBase``) is asked for
its final hidden states instead (``with_logits=False``) and the head runs with the cross-entropy in chunks of
tokens (``chunked_head_cross_entropy``, ``loss_chunk_tokens``): no float32 logits of the whole batch. A model
without ``forward`` is called as ``model(input_ids, attention_mask)`` and its result taken as the logits. When the
output carries ``mtp_logits`` or ``mtp_hidden`` (a sequence whose k-th entry predicts the token ``k + 2`` places
ahead) the multi-token-prediction loss is added with ``mtp_weight``; an ``aux_loss`` scalar (e.g. a sequence-wise
balance loss, already weighted by the model, and a mean over the sequences holding a real token) is added as is,
and so is an ``indexer_loss`` scalar (a sparse-attention indexer's own loss, same reduction; the model keeps its
gradient away from everything but the indexer); an ``expert_load`` is summed into the metrics.

With gradient accumulation every term stays a mean over the whole step: the cross-entropy and each MTP head's loss
over all of the step's tokens, the aux and indexer losses over all of its real sequences (``step_counts``), so
``accum_steps`` micro-batches give the same loss, gradient and update as one step on the whole batch, whatever
their masks.

What is trained is the optimizer's ``wrt`` (``nnx.Optimizer(model, tx, wrt=...)``): only those parameters are
differentiated and updated; the training loop takes it from ``model.trainable()`` (e.g. only an indexer during
its warm-up), a notebook may pass ``wrt=LoRAParam``.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_zoo.layers.pipeline import SCHEDULES
from nnx_zoo.sharding import shard_mode_of
from nnx_zoo.train.loss import chunked_head_cross_entropy, token_cross_entropy

Batch = dict[str, jax.Array]
# The output's scalar loss terms that are means over the sequences holding a real token, each added to the loss as
# is and logged under its own name: a balance loss (``aux_loss``), a sparse-attention indexer's loss.
SEQUENCE_LOSSES = ("aux_loss", "indexer_loss")


def shift_left(x: jax.Array, shift: int) -> jax.Array:
    """``x[:, shift:]`` padded with zeros at the end: same shape and sharding as ``x``.

    Under an Explicit mesh a sequence dim sharded over devices (context parallelism) cannot be sliced by a few
    positions, so it is gathered along that dim first and resharded afterwards.
    """
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    explicit = mesh is not None and not mesh.empty and shard_mode_of(mesh) == "explicit"
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec)) if explicit else ()
    if explicit and spec[1] is not None:
        x = jax.reshard(x, PartitionSpec(spec[0], None, *spec[2:]))
    out = jnp.pad(x[:, shift:], [(0, 0), (0, min(shift, x.shape[1]))] + [(0, 0)] * (x.ndim - 2))
    return jax.reshard(out, PartitionSpec(*spec)) if explicit and spec[1] is not None else out


def real_sequences(batch: Batch) -> jax.Array:
    """How many rows of ``batch`` hold a real token: rows whose ``attention_mask`` has a 1 (every row when there is
    no mask). An ``aux_loss`` is a mean over these (DeepSeek's sequence-wise balance loss is)."""
    mask = batch.get("attention_mask")
    if mask is None:
        return jnp.asarray(batch["input_ids"].shape[0], jnp.float32)
    return jnp.sum(jnp.any(mask != 0, axis=-1).astype(jnp.float32))


def step_counts(batch: Batch, mtp_heads: int) -> dict[str, jax.Array]:
    """What the step's mean losses divide by, counted over the whole batch (every micro-batch): its loss tokens
    (``tokens``), each MTP head's loss tokens (``mtp{k}_tokens``) and its real sequences (``sequences``)."""
    mask = batch["loss_mask"].astype(jnp.float32)
    counts = {"tokens": jnp.sum(mask), "sequences": real_sequences(batch)}
    for k in range(1, mtp_heads + 1):
        counts[f"mtp{k}_tokens"] = jnp.sum(shift_left(mask, k))
    return counts


class _LogitsOnly(NamedTuple):
    """The output of a model without ``forward``: its call's logits, nothing else."""

    logits: jax.Array


def model_outputs(model: nnx.Module, batch: Batch, model_kwargs: tuple[tuple[str, Any], ...] = ()) -> Any:
    """The model's outputs on ``batch``: ``model.forward(...)`` with ``model_kwargs`` (e.g. ``with_mtp``) and, for
    packed documents, ``segment_ids``; a model without ``forward`` gives ``model(...)``'s logits."""
    kwargs = dict(model_kwargs)
    if "segment_ids" in batch:  # packed documents: attention stays within each one
        kwargs["segment_ids"] = batch["segment_ids"]
    forward = getattr(model, "forward", None)
    if forward is None:
        return _LogitsOnly(model(batch["input_ids"], attention_mask=batch.get("attention_mask"), **kwargs))
    return forward(batch["input_ids"], attention_mask=batch.get("attention_mask"), **kwargs)


def head_losses(model: nnx.Module, batch: Batch, model_kwargs: tuple[tuple[str, Any], ...] = (),
                loss_chunk_tokens: int | None = None, loss_scale: tuple[float, Any] | None = None
                ) -> tuple[Any, list[tuple[jax.Array, jax.Array]]]:
    """The model's outputs on ``batch`` and each head's (summed cross-entropy, loss tokens): the main head's
    first, then MTP depth ``k``'s against the targets shifted left by ``k`` (targets and mask are shifted, not the
    logits: the same sum, and only small integer arrays move).

    A model with ``output_head()`` gives its final hidden states (``with_logits=False``) and the head runs with
    the loss in chunks (``chunked_head_cross_entropy``; ``loss_chunk_tokens`` as its ``chunk_tokens``): the main
    and MTP hidden states stacked, one head matmul per chunk. Otherwise the model's logits go to
    ``token_cross_entropy``.

    A pipeline that runs the loss on its last stage gets ``loss_targets``, and, when its forward takes it,
    ``loss_scale = (mtp_weight, counts)`` (``loss_terms``' weights: the MTP and balance losses it differentiates
    beside the cross-entropy); it returns ``loss_sum`` (and ``mtp_loss_sums`` with MTP heads).
    """
    output_head = getattr(model, "output_head", None)
    if output_head is not None:
        model_kwargs = (*model_kwargs, ("with_logits", False))
    schedule = dict(model_kwargs).get("pipeline_schedule")
    if schedule is not None and SCHEDULES[schedule].loss_inside:
        # A pipeline that runs the head and loss on its last stage (each micro-batch's backward right after its
        # forward) gets the targets and returns the summed loss; without stages the model runs as usual.
        model_kwargs = (*model_kwargs, ("loss_targets", (batch["targets"], batch["loss_mask"])))
        forward = getattr(model, "forward", None)
        if forward is not None and "loss_scale" in inspect.signature(forward).parameters:
            model_kwargs = (*model_kwargs, ("loss_scale", loss_scale))
    out = model_outputs(model, batch, model_kwargs)
    if getattr(out, "loss_sum", None) is not None:
        # Its value is the main cross-entropy; its gradient is the whole loss's (the MTP and aux terms, weighted
        # by loss_scale, were differentiated in the pipeline; their values below carry no gradient).
        sums = [] if getattr(out, "mtp_loss_sums", None) is None else list(out.mtp_loss_sums)
        masks = [shift_left(batch["loss_mask"], k) if k else batch["loss_mask"] for k in range(len(sums) + 1)]
        return out, [(s, jnp.sum(m.astype(jnp.float32))) for s, m in zip([out.loss_sum, *sums], masks, strict=True)]
    depth_outputs = getattr(out, "mtp_hidden" if output_head is not None else "mtp_logits", None)
    depth = 0 if depth_outputs is None else depth_outputs.shape[0]
    targets = [shift_left(batch["targets"], k) if k else batch["targets"] for k in range(depth + 1)]
    masks = [shift_left(batch["loss_mask"], k) if k else batch["loss_mask"] for k in range(depth + 1)]
    if output_head is None:
        logits = [out.logits, *(() if depth_outputs is None else depth_outputs)]
        return out, [token_cross_entropy(lg, t, m) for lg, t, m in zip(logits, targets, masks, strict=True)]
    head = output_head()  # its weight gathered once for every chunk and depth
    hidden = out.final_hidden if depth == 0 else jnp.concatenate([out.final_hidden[None], depth_outputs])
    stack = (lambda xs: xs[0]) if depth == 0 else jnp.stack
    with model.sharding_scope():
        sums, tokens = chunked_head_cross_entropy(hidden, head, stack(targets), stack(masks),
                                                  chunk_tokens=loss_chunk_tokens)
    if depth == 0:
        return out, [(sums, tokens)]
    return out, [(sums[k], tokens[k]) for k in range(depth + 1)]


def loss_terms(
    model: nnx.Module, batch: Batch, mtp_weight: float, model_kwargs: tuple[tuple[str, Any], ...] = (),
    counts: dict[str, jax.Array] | None = None, loss_chunk_tokens: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This micro-batch's share of the step's loss, times the step's token count, and its summed metrics.

    The step's loss is the per-token cross-entropy over all of the step's tokens, plus ``mtp_weight`` times the
    mean over MTP heads of each head's per-token loss over all of the step's tokens for that head, plus the
    ``aux_loss`` and the ``indexer_loss`` (``SEQUENCE_LOSSES``), each as a mean over all of the step's real
    sequences. ``counts`` (``step_counts`` of the whole batch) are those totals; without them this micro-batch is
    the whole step. Summing the shares of all micro-batches and dividing by ``counts["tokens"]`` gives exactly the
    loss of one step on the whole batch. ``loss_chunk_tokens``: see ``head_losses``.
    """
    out, losses = head_losses(model, batch, model_kwargs, loss_chunk_tokens, (mtp_weight, counts))
    (ce_sum, tokens), mtp_losses = losses[0], losses[1:]
    step_tokens = tokens if counts is None else counts["tokens"]
    total = ce_sum
    metrics = {"ce_sum": ce_sum, "tokens": tokens}
    for k, (mtp_sum, mtp_tokens) in enumerate(mtp_losses):
        shift = k + 1  # head k predicts targets[t + shift]
        head_tokens = mtp_tokens if counts is None else counts[f"mtp{shift}_tokens"]
        # Scale so that the MTP term is mtp_weight * (mean over heads of the per-token MTP loss).
        total = total + mtp_weight / len(mtp_losses) * mtp_sum * step_tokens / jnp.maximum(head_tokens, 1.0)
        metrics[f"mtp{shift}_sum"] = mtp_sum
        metrics[f"mtp{shift}_tokens"] = mtp_tokens
    expert_load = getattr(out, "expert_load", None)
    if expert_load is not None:
        metrics["expert_load"] = jax.lax.stop_gradient(expert_load)
    present = {name: getattr(out, name) for name in SEQUENCE_LOSSES if getattr(out, name, None) is not None}
    if present:  # scalars, each a mean over this micro-batch's real sequences
        sequences = real_sequences(batch)
        step_sequences = sequences if counts is None else counts["sequences"]
        metrics["sequences"] = sequences
        for name, value in present.items():
            total = total + value * step_tokens * sequences / jnp.maximum(step_sequences, 1.0)
            metrics[f"{name}_sum"] = value * sequences
    return total, metrics


def split_microbatches(batch: Batch, accum_steps: int) -> Batch:
    """``[batch, ...]`` -> ``[accum_steps, batch // accum_steps, ...]`` (row i goes to micro-batch i % accum)."""
    def split(x: jax.Array) -> jax.Array:
        rows = x.shape[0]
        if rows % accum_steps:
            raise ValueError(f"batch of {rows} rows does not split into {accum_steps} accumulation steps")
        return jnp.swapaxes(x.reshape(rows // accum_steps, accum_steps, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: Batch,
    *,
    accum_steps: int = 1,
    mtp_weight: float = 0.0,
    model_kwargs: tuple[tuple[str, Any], ...] = (),
    routing_bias_rate: float = 0.0,
    loss_chunk_tokens: int | None = None,
) -> dict[str, Any]:
    """One optimizer step over ``batch``, accumulating gradients over ``accum_steps`` micro-batches.

    ``model_kwargs`` (pairs, static) are passed to ``model.forward``, e.g. ``(("with_mtp", True),)``. Jit it with
    ``nnx.jit(train_step, static_argnames=("accum_steps", "mtp_weight", "model_kwargs", "loss_chunk_tokens"))``;
    model and optimizer are updated in place. ``loss_chunk_tokens`` (static): tokens per device whose logits the
    head + cross-entropy computes at a time (``chunked_head_cross_entropy``; None: at most
    ``nnx_zoo.train.loss.DEFAULT_CHUNK_BYTES`` of float32 logits a chunk, one chunk under an Auto mesh that splits
    the tokens; 0: the whole micro-batch at once).
    When the model reports ``expert_load`` (MoE models called with ``with_expert_load``) and
    ``routing_bias_rate > 0``, ``model.update_routing_bias(load, rate)`` runs after the optimizer update
    (DeepSeek's aux-loss-free balancing).
    """
    # Differentiate only what the optimizer updates (e.g. LoRA adapters with ``wrt=LoRAParam``).
    graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)

    micro_batches = split_microbatches(batch, accum_steps)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    metric_shapes = jax.eval_shape(
        lambda p: loss_terms(nnx.merge(graphdef, p, rest), first, mtp_weight, model_kwargs,
                             loss_chunk_tokens=loss_chunk_tokens)[1], params)
    # Means over the whole step (all micro-batches), not means of micro-batch means.
    counts = step_counts(batch, sum(1 for name in metric_shapes if name.startswith("mtp") and name.endswith("_sum")))

    def micro_step(carry, micro_batch):
        grad_acc, metric_acc = carry

        def summed_loss(p):
            return loss_terms(nnx.merge(graphdef, p, rest), micro_batch, mtp_weight, model_kwargs, counts,
                              loss_chunk_tokens)

        (_, metrics), grads = jax.value_and_grad(summed_loss, has_aux=True)(params)
        return (jax.tree.map(jnp.add, grad_acc, grads), jax.tree.map(jnp.add, metric_acc, metrics)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    metric_zeros = jax.tree.map(jnp.zeros_like, metric_shapes)
    (grads, sums), _ = jax.lax.scan(micro_step, (zeros, metric_zeros), micro_batches)

    tokens = jnp.maximum(sums["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    lr_step = optimizer.step[...]
    optimizer.update(model, grads)
    if routing_bias_rate > 0 and "expert_load" in sums:
        model.update_routing_bias(sums["expert_load"], routing_bias_rate)
    metrics = {
        "loss": sums["ce_sum"] / tokens,
        "grad_norm": optax.tree.norm(grads),
        "tokens": sums["tokens"],
        "step_index": lr_step,
    }
    if "expert_load" in sums:  # max over mean load per MoE layer, averaged over layers (1 = perfectly balanced)
        load = sums.pop("expert_load")
        metrics["expert_max_over_mean"] = jnp.mean(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))
    for name, value in sums.items():  # per-token means over the step's tokens for each head
        if name.startswith("mtp") and name.endswith("_sum"):
            metrics[name.removesuffix("_sum")] = value / jnp.maximum(sums[name.replace("_sum", "_tokens")], 1.0)
    for name in SEQUENCE_LOSSES:  # the mean over the step's real sequences
        if f"{name}_sum" in sums:
            metrics[name] = sums[f"{name}_sum"] / jnp.maximum(sums["sequences"], 1.0)
    return metrics
