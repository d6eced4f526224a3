"""Optimizers and learning-rate schedules.

AdamW with warmup + cosine or WSD schedules and global-norm clipping. Weight decay skips parameters
whose logical names say they are norm scales or biases: the Variables carry that knowledge, so no path regexes.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import optax
from flax import nnx

NO_DECAY_NAMES = frozenset({"norm", "bias"})


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """What the optimizer does; every field is a recipe flag (``--lr``, ``--schedule``, ...)."""

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

    def __post_init__(self) -> None:
        problems = []
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


def decay_mask(model: nnx.Module, wrt: nnx.filterlib.Filter = nnx.Param) -> nnx.State:
    """True for parameters (those ``wrt`` selects) that get weight decay: all but norm scales and biases (by their
    logical names)."""

    def decays(variable: nnx.Variable) -> bool:
        names = variable.get_metadata().get("out_sharding") or ()
        return not NO_DECAY_NAMES.intersection(n for n in names if n is not None) and variable.ndim > 1

    return jax.tree.map(decays, nnx.state(model, wrt), is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_tx(config: OptimizerConfig, model: nnx.Module, total_steps: int, wrt: nnx.filterlib.Filter = nnx.Param
            ) -> optax.GradientTransformation:
    """The full gradient transformation for the parameters ``wrt`` selects: global-norm clipping, then AdamW on
    the schedule."""
    schedule = learning_rate_schedule(config, total_steps)
    opt = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay,
                      mask=decay_mask(model, wrt))
    if config.clip_norm:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), opt)
    return opt


def make_optimizer(config: OptimizerConfig, model: nnx.Module, total_steps: int,
                   wrt: nnx.filterlib.Filter = nnx.Param) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=wrt)``: only trainable parameters (not routing biases) are updated; pass
    ``wrt=LoRAParam`` to train only LoRA adapters."""
    return nnx.Optimizer(model, make_tx(config, model, total_steps, wrt), wrt=wrt)
