"""What defines a training run, stored with every checkpoint and checked on resume.

A run is its model, its optimizer, its data stream, its seed and its learning-rate schedule. Resuming must
continue that run, not quietly start a different one: a changed ``--seed`` would switch the data stream, a larger
``--steps`` would re-plan the cosine schedule mid-run (the learning rate jumps at the resume step), another model
size or optimizer cannot load at all. So each checkpoint stores the definition, and on resume every difference is
named in one message that says how to proceed:

- ``structure`` (the model's architecture and the optimizer's kind): never changes within a run directory;
- ``settings`` (seed, data, optimizer hyper-parameters, loss weights): may change only when asked
  (``override_settings=True``, the recipe's ``--override-settings``), e.g. a lower learning rate after divergence;
- ``schedule_steps`` (the step count the schedule was planned for): a longer run either keeps the schedule
  (``extend=True``: the added steps run at its final learning rate) or re-plans it (``override_settings``).

Settings that change how, not what, is computed (mesh, rule set, MoE path, remat, logging, checkpoint cadence,
gradient-accumulation micro-batches) are free to change on resume.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

# Exit codes of the recipes; ``train`` raises, the recipe maps. Documented in ``--help`` and the README.
EXIT_DONE = 0
EXIT_BAD_INPUT = 2  # bad settings or files: nothing was trained or changed
EXIT_DIVERGED = 3  # a step was not finite: it was not applied; the last finite state is checkpointed
EXIT_STOPPED = 75  # stopped early by SIGTERM/SIGINT, checkpoint saved: rerun to resume (sysexits' EX_TEMPFAIL)


class RunMismatchError(ValueError):
    """Resuming would silently change the run; the message names each difference and how to proceed."""


def jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON (dataclasses and tuples become dicts and lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, default=_default))


def _default(value: Any) -> Any:
    if hasattr(value, "_asdict"):
        return value._asdict()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value
    return out


def run_definition(
    *,
    model_structure: Mapping[str, Any],
    model_settings: Mapping[str, Any],
    optimizer: Any,
    data: Any,
    seed: int,
    loss_settings: Mapping[str, Any],
    steps: int,
    schedule_steps: int | None = None,
) -> dict[str, Any]:
    """The JSON-ready definition of a run (see the module docstring for what each part may do on resume).

    ``steps``: the run's length as last asked for; ``schedule_steps``: what the schedule is planned for
    (default ``steps``; an extended run keeps its original plan)."""
    optimizer = jsonable(optimizer)
    kind = optimizer.pop("name", None)
    return {
        "structure": {"model": jsonable(dict(model_structure)), "optimizer": kind},
        "settings": {
            "seed": seed,
            "data": jsonable(data),
            "optimizer": optimizer,
            "loss": jsonable(dict(loss_settings)),
            "model": jsonable(dict(model_settings)),
        },
        "steps": steps,
        "schedule_steps": steps if schedule_steps is None else schedule_steps,
    }


def _differences(stored: Any, current: Any) -> list[str]:
    old, new = _flatten("", stored, {}), _flatten("", current, {})
    # A key one side lacks reads as None: a setting added since a checkpoint was written, left at its default None
    # (say DataConfig.eos_token), is no difference.
    return [f"{key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def reconcile(
    stored: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    resume_step: int,
    steps: int,
    extend: bool,
    override_settings: bool,
    lr_at: Callable[[int, int], float] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Check a resume against the checkpoint's run definition.

    Returns ``(definition to store from now on, notes to print)``, or raises ``RunMismatchError`` naming every
    difference. ``lr_at(step, schedule_steps)`` lets the message say what a re-planned schedule would do.
    """
    problems, notes = [], []
    structure = _differences(stored["structure"], current["structure"])
    if structure:
        problems.append(
            "the model or optimizer differs from the checkpoint's, so it cannot be resumed:\n    "
            + "\n    ".join(structure)
            + "\n  Use the checkpoint's settings to resume, or a new run directory (--run-dir) for a new run."
        )
    settings = _differences(stored["settings"], current["settings"])
    if settings and not override_settings:
        problems.append(
            "these settings differ from the checkpoint's:\n    " + "\n    ".join(settings)
            + "\n  Resume with the checkpoint's values, or pass --override-settings (override_settings=True) to "
            "continue this run with the new ones from the resume step on, or use a new --run-dir."
        )
    elif settings:
        notes.append("resuming with changed settings (--override-settings): " + "; ".join(settings))

    planned = int(stored["schedule_steps"])
    schedule_steps = planned
    if steps == int(stored.get("steps", planned)):  # the length this run already had (extended or not)
        pass
    elif steps <= resume_step:  # nothing left to train, whatever the flags: say how to train further
        problems.append(
            f"--steps {steps} is not more than the {resume_step} steps this run has done already, so there is "
            f"nothing left to train. To train further on the same schedule, rerun with more steps and --extend "
            f"(e.g. --steps {resume_step + planned} --extend; extend=True); for a new run, use another --run-dir."
        )
    elif not override_settings:
        if extend and steps > planned:
            notes.append(f"extending the run from {planned} to {steps} steps (--extend): the learning-rate schedule "
                         f"planned for {planned} steps is kept; steps after {planned} use its final value")
        elif extend:
            problems.append(f"--extend needs more steps than the run was planned for ({planned}); got --steps {steps}"
                            f". To finish the run as planned, rerun with --steps {planned} and without --extend.")
        elif steps < planned:
            problems.append(
                f"this run's learning-rate schedule was planned for {planned} steps; --steps {steps} would end it "
                f"early and re-plan its schedule mid-run. To finish it as planned, rerun with --steps {planned}; to "
                f"end it at step {steps} on a re-planned schedule, add --override-settings; or use a new --run-dir."
            )
        else:
            jump = ""
            if lr_at is not None:
                jump = (f" (at step {resume_step + 1} the learning rate would jump from "
                        f"{lr_at(resume_step, planned):.4g} to {lr_at(resume_step, steps):.4g})")
            problems.append(
                f"this run's learning-rate schedule was planned for {planned} steps; --steps {steps} would re-plan "
                f"it mid-run{jump}. To train further on the same schedule (the added steps at its final learning "
                f"rate), add --extend (extend=True); to re-plan it, add --override-settings; or use a new --run-dir."
            )
    else:
        schedule_steps = steps
        notes.append(f"re-planning the learning-rate schedule for {steps} steps (was {planned}; "
                     "--override-settings)")
    if problems:
        raise RunMismatchError("cannot resume this run:\n  - " + "\n  - ".join(problems))
    return {**current, "schedule_steps": schedule_steps}, notes
