"""Optimizers and learning-rate schedules.

AdamW (or Muon for the hidden weight matrices) with warmup + cosine or WSD schedules and global-norm clipping.
Weight decay skips parameters whose logical names say they are norm scales or biases, and Muon's matrix view of
each weight comes from its logical names too: the Variables carry that knowledge, so no path regexes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from nnx_zoo.sharding import logical_names, shard_mode_of
from nnx_zoo.sharding.axes import STACK_AXES

NO_DECAY_NAMES = frozenset({"norm", "bias"})
# Muon: the vocabulary's layer-stack axes and the expert index are batch dims (one matrix per layer and per
# expert); weights with a vocabulary dim (embedding, output head), norm scales and biases stay on AdamW, as in Muon
# practice.
MUON_BATCH_NAMES = STACK_AXES | {"exp"}
MUON_ADAMW_NAMES = frozenset({"vocab", "norm", "bias"})
# Dims that belong to the one before them in a kernel's matrix view: a head's features ride with its head.
MUON_JOINED_NAMES = {"kv": ("heads", "kv_heads")}
# Moonlight's consistent-RMS scale (Liu et al. 2025): Muon updates get AdamW's typical RMS, so one learning rate
# and one weight decay serve both halves of the optimizer.
MUON_CONSISTENT_RMS = 0.2


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """What the optimizer does; every field is a recipe flag (``--lr``, ``--schedule``, ...)."""

    name: Literal["adamw", "muon"] = "adamw"  # muon: Muon on hidden matrices, AdamW on the rest
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of ``lr``
    warmup_steps: int = 10
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    wsd_decay_fraction: float = 0.2  # WSD: fraction of the run spent decaying at the end
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global-norm clipping; 0 turns it off
    muon_beta: float = 0.95  # Muon's (Nesterov) momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per update

    def __post_init__(self) -> None:
        problems = []
        if self.name not in ("adamw", "muon"):
            problems.append(f"optimizer must be 'adamw' or 'muon', got {self.name!r}")
        if not 0 <= self.muon_beta < 1 or self.muon_ns_steps < 1:
            problems.append(f"muon_beta must be in [0, 1) and muon_ns_steps >= 1, got {self.muon_beta}, "
                            f"{self.muon_ns_steps}")
        if self.schedule not in ("cosine", "wsd", "constant"):
            problems.append(f"schedule must be 'cosine', 'wsd' or 'constant', got {self.schedule!r}")
        if not self.lr > 0:
            problems.append(f"lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            problems.append(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.wsd_decay_fraction <= 1:
            problems.append(f"wsd_decay_fraction must be in (0, 1], got {self.wsd_decay_fraction}")
        if self.weight_decay < 0 or self.clip_norm < 0:
            problems.append("weight_decay and clip_norm must be >= 0")
        if problems:
            raise ValueError("invalid optimizer settings: " + "; ".join(problems))


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to ``lr``, then cosine decay, WSD (stable, then linear decay), or constant."""
    peak, floor = config.lr, config.lr * config.min_lr_ratio
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1), floor)
    warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if config.schedule == "constant":
        return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
    decay_steps = max(1, int(round(config.wsd_decay_fraction * (total_steps - warmup))))
    stable_steps = max(0, total_steps - warmup - decay_steps)
    return optax.join_schedules(
        [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay_steps)],
        [warmup, warmup + stable_steps],
    )


def warmup_note(config: OptimizerConfig, total_steps: int) -> str | None:
    """A warning line when the warm-up is not shorter than the run (``learning_rate_schedule`` then cuts it to
    ``total_steps - 1`` steps, so the peak comes only at the last step); None otherwise.

    >>> warmup_note(OptimizerConfig(warmup_steps=10), 3)
    'warning: --warmup-steps 10 is not shorter than the 3 steps ...'
    """
    if config.warmup_steps < total_steps or total_steps < 2:
        return None
    return (f"warning: --warmup-steps {config.warmup_steps} (warmup_steps) is not shorter than the {total_steps} "
            f"steps the learning-rate schedule is planned for: the warm-up is cut to {total_steps - 1} steps, so "
            f"the peak learning rate {config.lr:g} is reached only at the last step and its {config.schedule} "
            f"schedule after the peak never runs; use --warmup-steps below {total_steps} (e.g. "
            f"--warmup-steps {max(1, total_steps // 10)})")


def decay_mask(model: nnx.Module, wrt: nnx.filterlib.Filter = nnx.Param) -> nnx.State:
    """True for parameters (those ``wrt`` selects) that get weight decay: all but norm scales and biases (by their
    logical names).

    The names alone decide, never the rank: a stacked norm scale ``[layers, width]`` skips decay like an unstacked
    one, and a vector named neither norm nor bias decays stacked or not, so scanning layers changes nothing. Only a
    parameter without logical names falls back to its rank (vectors skip decay).
    """

    def decays(variable: nnx.Variable) -> bool:
        names = [n for n in logical_names(variable) or () if n is not None]
        if not names:
            return variable.ndim > 1
        return not NO_DECAY_NAMES.intersection(names)

    return jax.tree.map(decays, nnx.state(model, wrt), is_leaf=lambda x: isinstance(x, nnx.Variable))


def muon_dimension_numbers(
    names: tuple[str | None, ...] | None, shape: tuple[int, ...] = (), path: str = "parameter"
) -> MuonDimensionNumbers | None:
    """How Muon sees a weight with these logical names as a batch of matrices, or None for AdamW.

    Batch dims: the layer-stack axes and ``exp``. The other dims of a kernel are laid out ``[inputs...,
    outputs...]``; ``kv`` joins the ``heads`` (or ``kv_heads``) dim before it, so ``[embed, heads, kv]`` is the matrix
    ``embed x (heads*kv)`` and ``[heads, kv, embed]`` is ``(heads*kv) x embed``. Weights with a ``vocab``, ``norm``
    or ``bias`` dim, no names, or fewer than two matrix dims return None (AdamW). The MoE router ``[embed,
    exp_router]`` is a hidden matrix like the others and takes Muon.
    """
    if not names or MUON_ADAMW_NAMES.intersection(names):
        return None
    if None in names:
        raise ValueError(f"{path}: Muon needs a logical name on every dim to find its matrix view, got {names}")
    groups: list[list[int]] = []  # runs of dims that form one side of the matrix
    for axis, name in enumerate(names):
        if name in MUON_BATCH_NAMES or name in STACK_AXES:  # STACK_AXES is live: stacks declared after import
            continue
        joins = groups and names[groups[-1][-1]] in MUON_JOINED_NAMES.get(name, ()) and groups[-1][-1] == axis - 1
        if joins:
            groups[-1].append(axis)
        else:
            groups.append([axis])
    if len(groups) < 2:
        return None  # a vector per batch entry (e.g. a stacked bias): nothing to orthogonalize
    if len(groups) > 2:
        raise ValueError(
            f"{path}: cannot tell the input dims from the output dims of a weight with logical names {names} "
            f"(shape {shape}): Muon expects [batch..., inputs..., outputs...] with multi-dim sides joined as in "
            f"{MUON_JOINED_NAMES}; extend MUON_JOINED_NAMES in nnx_zoo/train/optim.py (or, for a layer-stack axis, "
            "declare_axis(name, like='layers', ...) in the family's axes.py), or use "
            "--optimizer adamw"
        )
    return MuonDimensionNumbers(reduction_axis=tuple(groups[0]), output_axis=tuple(groups[1]))


def muon_weight_dimension_numbers(model: nnx.Module, wrt: nnx.filterlib.Filter = nnx.Param) -> nnx.State:
    """``muon_dimension_numbers`` of every parameter ``wrt`` selects (None where AdamW takes it), as a tree like
    those parameters."""
    def dims(path: tuple[Any, ...], variable: nnx.Variable) -> MuonDimensionNumbers | None:
        dotted = ".".join(str(getattr(k, "key", k)) for k in path)
        return muon_dimension_numbers(logical_names(variable), variable.shape, dotted)

    return jax.tree.map_with_path(dims, nnx.state(model, wrt), is_leaf=lambda x: isinstance(x, nnx.Variable))


def _in_auto_axes(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with its update traced in Auto mode under an Explicit mesh, outputs keeping their input shardings.

    Newton-Schulz multiplies a sharded matrix by its transpose: under Explicit axes that dot has its contraction
    dim sharded on both sides and no single right output sharding, so JAX refuses it; ``auto_axes`` lets XLA pick
    the collectives inside and reshards the results back to the parameters' (and optimizer state's) layouts.
    """
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or shard_mode_of(mesh) != "explicit":
            return tx.update(updates, state, params)
        out_sharding = jax.tree.map(lambda x: jax.typeof(x).sharding, (updates, state))
        return jax.sharding.auto_axes(tx.update, out_sharding=out_sharding)(updates, state, params)

    return optax.GradientTransformation(tx.init, update)


def _muon(config: OptimizerConfig, model: nnx.Module, schedule: optax.Schedule, wrt: nnx.filterlib.Filter
          ) -> optax.GradientTransformation:
    """Muon (``optax.contrib.muon``) on the hidden matrices, the same AdamW as ``name='adamw'`` on the rest."""
    dims = muon_weight_dimension_numbers(model, wrt)
    is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)  # noqa: E731
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims, is_leaf=is_dims)

    def muon_dims(masked: Any) -> Any:  # optax hands the Muon half its params with the AdamW ones masked out
        return jax.tree.map(lambda d, x: x if d is None else d, dims, masked, is_leaf=is_dims)

    muon = optax.contrib.muon(
        schedule, ns_steps=config.muon_ns_steps, beta=config.muon_beta, weight_decay=config.weight_decay,
        muon_weight_dimension_numbers=muon_dims, consistent_rms=MUON_CONSISTENT_RMS,
    )
    adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay,
                        mask=decay_mask(model, wrt))
    return optax.partition({"muon": _in_auto_axes(muon), "adamw": adamw}, labels)


def make_tx(config: OptimizerConfig, model: nnx.Module, total_steps: int, wrt: nnx.filterlib.Filter = nnx.Param
            ) -> optax.GradientTransformation:
    """The full gradient transformation for the parameters ``wrt`` selects: global-norm clipping, then AdamW (or
    Muon + AdamW) on the schedule."""
    schedule = learning_rate_schedule(config, total_steps)
    if config.name == "muon":
        opt = _muon(config, model, schedule, wrt)
    else:
        opt = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay,
                          mask=decay_mask(model, wrt))
    if config.clip_norm:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), opt)
    return opt


def trainable_filter(model: nnx.Module) -> nnx.filterlib.Filter:
    """What a trainer updates in ``model``: ``model.trainable()`` when the model says (a ``CausalLMBase`` does,
    e.g. only DeepSeek-V3.2's indexer during its warm-up), else every ``nnx.Param``."""
    trainable = getattr(model, "trainable", None)
    return nnx.Param if trainable is None else trainable()


def trains_part(model: nnx.Module, wrt: nnx.filterlib.Filter) -> bool:
    """Whether ``wrt`` leaves some of ``model``'s parameters (``nnx.Param``) frozen."""
    return len(jax.tree.leaves(nnx.state(model, nnx.All(nnx.Param, wrt)))) < len(
        jax.tree.leaves(nnx.state(model, nnx.Param)))


def make_optimizer(config: OptimizerConfig, model: nnx.Module, total_steps: int,
                   wrt: nnx.filterlib.Filter | None = None) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=wrt)``: only trainable parameters (not routing biases) are updated. By
    default what the model says it trains (``trainable_filter``: every ``nnx.Param`` unless ``model.trainable()``
    narrows it); pass ``wrt=LoRAParam`` to train only LoRA adapters."""
    wrt = trainable_filter(model) if wrt is None else wrt
    return nnx.Optimizer(model, make_tx(config, model, total_steps, wrt), wrt=wrt)
