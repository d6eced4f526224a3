"""The training loop: sharded state, resume, steps, metrics, checkpoints, clean stops.

Model-agnostic: it takes a function that builds the model, and the model's FLOPs per token for MFU.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from nnx_zoo.sharding import ShardingError, create_sharded, get_rules, logical_to_mesh_axes, make_mesh, use_rules
from nnx_zoo.sharding.create import ShardingFallbackWarning
from nnx_zoo.train.checkpoint import Checkpointer
from nnx_zoo.train.data import DataConfig, make_iterator
from nnx_zoo.train.metrics import MetricsWriter, ProgressLine, device_peak_memory_gib, resolve_peak
from nnx_zoo.train.optim import (
    OptimizerConfig,
    learning_rate_schedule,
    make_optimizer,
    trainable_filter,
    trains_part,
    warmup_note,
)
from nnx_zoo.train.run_lock import lock_run_dir
from nnx_zoo.train.run_spec import RunMismatchError, reconcile, run_definition
from nnx_zoo.train.step import train_step

BATCH_NAMES = ("activation_batch", "activation_length")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to run: length, parallelism, checkpoints, logging. Optimizer and data settings nest inside."""

    steps: int = 20
    run_dir: str = "runs/deepseek3-tiny"
    mesh: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"fsdp": -1})
    shard_mode: str = "auto"
    rules: str = "default"
    # A parameter dimension that does not divide over its rule's mesh axes goes on the longest dividing prefix of
    # them (more replication; every fallback printed at start) instead of failing (nnx_zoo.sharding.resolve).
    allow_partial: bool = False
    accum_steps: int = 1
    mtp_weight: float = 0.3
    model_kwargs: tuple[tuple[str, Any], ...] = ()  # extra keyword arguments of the model call, as pairs
    # aux-loss-free balancing step (DeepSeek-V3 used 0.001); 0 turns it off. The model applies it
    # (update_routing_bias) and leaves frozen routers alone (e.g. in DeepSeek-V3.2's indexer warm-up).
    routing_bias_rate: float = 0.0
    # Tokens per device whose logits the output head + cross-entropy computes at a time (nnx_zoo.train.loss
    # chunked_head_cross_entropy): None = chunks of at most 512 MiB of float32 logits (a batch that fits is one
    # chunk: no recompute; an Auto mesh splitting the tokens: one chunk, as XLA would reduce the head's gradient
    # once per chunk there), 0 = the whole micro-batch at once. Same loss and gradients either way.
    loss_chunk_tokens: int | None = None
    log_every: int = 1
    # A checkpoint every `checkpoint_every` steps and every `checkpoint_minutes` of wall time, whichever comes
    # first, besides the end and a signal's stop: a hard kill (OOM, preemption without SIGTERM) loses at most that
    # much work. 0 turns either off.
    checkpoint_every: int = 1000
    checkpoint_minutes: float = 30.0
    # A loss above this many times the run's first loss (and above this many nats) stops the run as diverged; the
    # state it measured is never kept as a checkpoint. 0 turns the check off.
    exploding_loss_factor: float = 10.0
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    seed: int = 0
    tensorboard: bool = False
    profile_steps: tuple[int, int] | None = None  # (first, last) step, 1-based, inclusive: JAX trace in run_dir/profile
    progress: bool = True
    extend: bool = False  # resume: train past the planned steps on the same schedule (the rest at its final lr)
    override_settings: bool = False  # resume: accept changed seed/data/optimizer settings (and a re-planned schedule)
    peak_flops_per_device: float | None = None  # for MFU; None: data sheet, or on CPU a matmul peak cached per host
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        problems = []
        if self.steps < 1:
            problems.append(f"steps must be >= 1, got {self.steps}")
        if self.accum_steps < 1 or self.data.global_batch % self.accum_steps:
            problems.append(
                f"accum_steps={self.accum_steps} must be >= 1 and divide the global batch {self.data.global_batch}"
            )
        if self.log_every < 1:
            problems.append(f"log_every must be >= 1, got {self.log_every}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            problems.append("checkpoint_every must be >= 0 and keep_checkpoints >= 1")
        if not 0 <= self.checkpoint_minutes < math.inf:
            problems.append(f"checkpoint_minutes must be >= 0 (0: no wall-time checkpoints), got "
                            f"{self.checkpoint_minutes}")
        if not (self.exploding_loss_factor == 0 or 1 < self.exploding_loss_factor < math.inf):
            problems.append(f"exploding_loss_factor must be > 1 (or 0: no check), got {self.exploding_loss_factor}")
        if self.shard_mode not in ("auto", "explicit"):
            problems.append(f"shard_mode must be 'auto' or 'explicit', got {self.shard_mode!r}")
        if self.routing_bias_rate < 0:
            problems.append(f"routing_bias_rate must be >= 0, got {self.routing_bias_rate}")
        if self.mtp_weight < 0:
            problems.append(f"mtp_weight must be >= 0, got {self.mtp_weight}")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 0:
            problems.append(f"loss_chunk_tokens must be >= 0 (0: no chunking) or None, got {self.loss_chunk_tokens}")
        if self.profile_steps is not None and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            problems.append(f"profile_steps must be (first, last) with 1 <= first <= last, got {self.profile_steps}")
        elif self.profile_steps is not None and self.profile_steps[1] > self.steps:
            first, last = self.profile_steps
            problems.append(f"profile_steps {first}:{last} ends past the run's last step {self.steps}, so the trace "
                            f"would never be written whole; profile steps within 1:{self.steps} (recipes: "
                            f"--profile-steps {min(first, self.steps)}:{self.steps})")
        if self.peak_flops_per_device is not None and not 0 < self.peak_flops_per_device < math.inf:
            problems.append(f"peak_flops_per_device must be a positive number (FLOP/s per device), got "
                            f"{self.peak_flops_per_device}")
        if problems:
            raise ValueError("invalid training settings: " + "; ".join(problems))


def _create_state(make_state: Callable[[], TrainState], mesh: Mesh, rules: Any, allow_partial: bool,
                  primary: bool) -> TrainState:
    """``create_sharded`` of the train state. A dimension that does not divide fails naming ``allow_partial``;
    with it, the fallbacks taken are printed once, at start (other warnings pass through unchanged)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state = create_sharded(make_state, mesh, rules, allow_partial=allow_partial)
        except ShardingError as err:
            if allow_partial:
                raise
            raise ShardingError(
                f"{err}\nTo train on this mesh anyway, set TrainConfig(allow_partial=True) (recipes: "
                "--allow-partial): such dimensions go on the longest dividing prefix of their mesh axes, and --plan "
                "lists each one with the bytes it replicates.") from err
    for w in caught:
        if issubclass(w.category, ShardingFallbackWarning):
            if primary:
                print(f"nnx_zoo: allow_partial: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return state


def _batch_spec(config: TrainConfig, rules: Any, mesh: Any) -> Any:
    """The batch's PartitionSpec, after checking that every micro-batch splits evenly over its shards."""
    spec = logical_to_mesh_axes(BATCH_NAMES, rules, mesh)
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
    shards = math.prod(mesh.shape[a] for a in axes)
    micro = config.data.global_batch // config.accum_steps
    if micro % shards:
        raise ValueError(
            f"the batch is not divisible over its shards: {micro} rows per step"
            + (f" (global batch {config.data.global_batch} / {config.accum_steps} accumulation steps)"
               if config.accum_steps > 1 else "")
            + f" cannot be split over the {shards} data-parallel shards of mesh axes {axes}; use a global batch "
            f"that is a multiple of {shards * config.accum_steps}, or a mesh with fewer data-parallel devices"
        )
    return spec


class TrainState(nnx.Module):
    """The model and its optimizer: everything a checkpoint must hold besides the data position."""

    def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer):
        self.model = model
        self.optimizer = optimizer


class _StopSignal:
    """SIGTERM/SIGINT -> a flag checked between steps, so the loop can checkpoint and exit cleanly.

    In a multi-process run the processes agree after every step (one tiny all-gather), so a signal that reaches
    any one of them stops all of them after the same step, and all take part in the checkpoint's collective save.
    A second signal exits at once (exit code 128 + signal number) without waiting for a save in flight: orbax
    renames a checkpoint into place only when it is complete, so a resume still picks the last complete one.
    """

    def __init__(self, checkpoint_dir: Path) -> None:
        self.received: int | None = None  # set by the handler, in this process
        self.agreed_signal: int | None = None  # what every process acts on, set between steps only
        self.checkpoint_dir = checkpoint_dir
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            sys.stdout.flush()
            sys.stderr.write(f"\n{self.second_signal_message(name)}\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.received = signum
        sys.stderr.write(f"\n{name}: stopping after this step and saving a checkpoint (send it again to exit at "
                         "once)\n")
        sys.stderr.flush()

    def second_signal_message(self, name: str) -> str:
        """What a second signal's exit keeps: the newest complete checkpoint (orbax renames one to its bare step
        number only when it is whole), or nothing, when none was written yet."""
        try:
            steps = [int(p.name) for p in self.checkpoint_dir.iterdir() if p.name.isdigit() and p.is_dir()]
        except OSError:
            steps = []
        if not steps:
            return (f"second {name}: exiting now, before any checkpoint of this run was complete, so no step of it "
                    f"is kept; rerun the same command to start it again from the beginning")
        return (f"second {name}: exiting now, without waiting for a checkpoint in progress; the last complete "
                f"checkpoint (step {max(steps)} in {self.checkpoint_dir}) is kept and rerunning the same command "
                "resumes from it")

    def agree(self, save_due: bool = False) -> bool:
        """After a step: sets ``agreed_signal`` to the signal any process received (or None) and returns whether
        any process found a checkpoint due, the same answers in every process.

        The loop acts on these, never on ``received`` or its own clock directly: a signal arriving between two
        agreements would otherwise stop one process before a step that the others go on to run (and a wall-time
        checkpoint would be due in one process and not yet in another), and their collectives would hang.
        """
        received, due = self.received or 0, int(save_due)
        if jax.process_count() > 1:
            received, due = (int(v) for v in np.max(
                multihost_utils.process_allgather(np.array([received, due], np.int32)), axis=0))
        self.agreed_signal = received or None
        return bool(due)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Profiler:
    """Runs a JAX profiler trace (``jax.profiler.start_trace``) around steps ``first..last`` (1-based)."""

    def __init__(self, steps: tuple[int, int] | None, directory: Path):
        self.steps, self.directory, self.active = steps, directory, False

    def before(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0]:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.steps[1]:
            self.stop()

    def stop(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


class DivergenceError(RuntimeError):
    """The run diverged and stopped; the newest checkpoint is the last state known to be healthy (one whose loss
    was measured finite and not exploding was never replaced by a worse one), and the message names it and how to
    resume. ``summary`` is what ``train`` would have returned, up to the last step logged."""

    def __init__(self, message: str, summary: dict[str, Any] | None = None):
        super().__init__(message)
        self.summary = summary


class NonFiniteLossError(DivergenceError):
    """A step's loss, gradient norm or updated state was not finite. That update was not applied."""


class ExplodingLossError(DivergenceError):
    """A step's loss rose above ``TrainConfig.exploding_loss_factor`` times the run's first loss."""


class _LossWatch:
    """Judges each step's loss against the run's first one (kept in every checkpoint's meta, so a resumed run
    judges by the same reference). The loss a step reports is that of the state *before* its update: the state
    it measures is the one a checkpoint of the previous step holds."""

    def __init__(self, factor: float, reference: float | None):
        self.factor, self.reference = factor, reference

    def limit(self) -> float:
        # At least `factor` nats: a run that starts near zero loss (memorized data) may wobble by more than 10x.
        return self.factor * max(self.reference or 0.0, 1.0) if self.factor else math.inf

    def exploding(self, loss: float) -> bool:
        if self.reference is None and math.isfinite(loss):
            self.reference = loss
        return math.isfinite(loss) and loss > self.limit()


def train(
    make_model: Callable[[], nnx.Module],
    config: TrainConfig,
    *,
    vocab_size: int,
    flops_per_token: float,
    after_step: Callable[[TrainState, dict[str, Any]], None] | None = None,
    model_structure: Mapping[str, Any] | None = None,
    model_settings: Mapping[str, Any] | None = None,
    init_model: Callable[[nnx.Module, Mesh], None] | None = None,
) -> dict[str, Any]:
    """Train (or resume) a model; returns a summary. Metrics go to ``<run_dir>/metrics.jsonl``.

    ``init_model(model, mesh)``, when given, sets the starting weights of a new run in place (e.g. from a
    pretrained checkpoint, read onto ``mesh``) after ``make_model``'s model was created sharded; a resumed run
    takes its weights from its checkpoint instead.

    What is trained is what the model says (``model.trainable()``, ``nnx_zoo.train.optim.trainable_filter``; every
    ``nnx.Param`` by default): the optimizer and its state cover only that, the rest stays as created (or loaded).
    A run directory keeps training the same part: a checkpoint records it and a resume that would train another
    part (say the indexer's warm-up continued as its sparse stage) stops, as its optimizer state cannot carry over.

    ``model_structure`` (e.g. the model config's architecture fields) and ``model_settings`` (fields that change
    the numbers but not the parameters, such as a loss weight) join the run's definition, which every checkpoint
    stores and a resume checks (``nnx_zoo.train.run_spec``).

    The run directory is this run's alone while it trains (``nnx_zoo.train.run_lock``): a second run on it raises
    ``RunDirLockedError`` at once, naming this one.
    """
    lock = lock_run_dir(config.run_dir)
    try:
        return _train(make_model, config, vocab_size=vocab_size, flops_per_token=flops_per_token,
                      after_step=after_step, model_structure=model_structure, model_settings=model_settings,
                      init_model=init_model)
    finally:
        if lock is not None:
            lock.release()


def _train(
    make_model: Callable[[], nnx.Module],
    config: TrainConfig,
    *,
    vocab_size: int,
    flops_per_token: float,
    after_step: Callable[[TrainState, dict[str, Any]], None] | None,
    model_structure: Mapping[str, Any] | None,
    model_settings: Mapping[str, Any] | None,
    init_model: Callable[[nnx.Module, Mesh], None] | None,
) -> dict[str, Any]:
    run_dir = Path(config.run_dir)
    mesh = make_mesh(config.mesh, shard_mode=config.shard_mode)
    rules = get_rules(config.rules)
    primary = jax.process_index() == 0
    batch_sharding = NamedSharding(mesh, _batch_spec(config, rules, mesh))  # fail fast on a bad batch size
    checkpoints = Checkpointer(run_dir / "checkpoints", keep=config.keep_checkpoints,
                               async_save=config.async_checkpoints)
    resume_step = checkpoints.latest_step()
    # What the model trains, checked before the run's settings: a stage change (say the indexer's warm-up resumed
    # as its sparse stage) cannot be resumed with any flag, so the first message must say what to do instead.
    trained = _trained_part(make_model)
    if resume_step is not None:
        stored_trained = checkpoints.read_meta(resume_step).get("trained", trained)  # older runs: not recorded
        if stored_trained != trained:
            checkpoints.close()
            run = Path(config.run_dir)
            out = Path("exports") / run.name
            raise RunMismatchError(
                f"cannot resume this run: its checkpoint step {resume_step} trained {stored_trained}, this model "
                f"trains {trained} (model.trainable(); e.g. another indexer_training stage), and the optimizer "
                "state does not carry over. Start a new run from this one's weights instead: export them with "
                f"`python recipes/export_hf.py {run} {out}`, then rerun this command with --from-pretrained {out} "
                f"in place of its --model (or --from-pretrained) and a new run directory, e.g. --run-dir {run}-next.")
    definition, notes = _run_definition(config, checkpoints, resume_step, model_structure, model_settings)
    schedule_steps = definition["schedule_steps"]

    def make_state() -> TrainState:
        model = make_model()
        return TrainState(model, make_optimizer(config.optimizer, model, schedule_steps, wrt=trainable_filter(model)))

    state = _create_state(make_state, mesh, rules, config.allow_partial, primary)
    if init_model is not None and resume_step is None:
        init_model(state.model, mesh)
    data = make_iterator(config.data, vocab_size)
    start_step, reference_loss = 0, None
    if resume_step is not None:
        start_step, data_state, meta = checkpoints.restore_into(state, resume_step)
        data.set_state(data_state)
        reference_loss = meta.get("first_loss")
    if config.profile_steps is not None and config.profile_steps[0] <= start_step < config.steps:
        checkpoints.close()
        first, last = config.profile_steps
        raise ValueError(f"profile_steps {first}:{last}: this run resumes after step {start_step}, so step {first} "
                         f"has run already and no trace would be written; profile steps within "
                         f"{start_step + 1}:{config.steps} (recipes: --profile-steps {start_step + 1}:"
                         f"{min(max(last, start_step + 1), config.steps)})")
    warmup = warmup_note(config.optimizer, schedule_steps)
    if warmup is not None:
        notes.append(warmup)
    for note in notes if primary else ():
        print(f"nnx_zoo: {note}", file=sys.stderr)

    schedule = learning_rate_schedule(config.optimizer, schedule_steps)
    summary: dict[str, Any] = {"start_step": start_step, "end_step": start_step, "losses": [], "first": None,
                               "last": None,
                               "stopped_by_signal": None, "schedule_steps": schedule_steps, "diverged": None}
    writer = MetricsWriter(run_dir, tensorboard=config.tensorboard, enabled=primary)
    writer.drop_after(start_step)  # rows a crashed run logged after its last checkpoint are trained again
    if start_step >= config.steps:
        writer.close()
        checkpoints.close()
        summary.update(already_finished=True, peak_flops_per_device=math.nan, peak_source="not measured")
        return summary

    step_fn = _pinned_step(state, rules, config.allow_partial, accum_steps=config.accum_steps,
                           mtp_weight=config.mtp_weight, model_kwargs=config.model_kwargs,
                           routing_bias_rate=config.routing_bias_rate, loss_chunk_tokens=config.loss_chunk_tokens)
    peak = resolve_peak(config.peak_flops_per_device)  # a measured CPU peak a step beats is raised (MFU <= 100%)
    summary.update(peak_flops_per_device=peak.value, peak_source=peak.source)
    if primary:
        print(f"nnx_zoo: checkpoints: {checkpoint_cadence(config)}, in {checkpoints.directory}", file=sys.stderr)
    progress = ProgressLine(config.steps, enabled=config.progress and primary)
    profiler = _Profiler(config.profile_steps, run_dir / "profile")
    state_is_finite = jax.jit(_all_finite)
    watch = _LossWatch(config.exploding_loss_factor, reference_loss)
    saved = [start_step]
    last_save_time = [time.monotonic()]

    def save(step: int, data_state: dict[str, Any]) -> None:
        if saved[-1] == step:
            return
        if not bool(state_is_finite(nnx.state(state))):  # e.g. changed by an after_step hook
            checkpoints.wait()
            raise NonFiniteLossError(
                f"the state after step {step} is not finite; not saving it. The last finite checkpoint is "
                f"{_latest(checkpoints)} in {checkpoints.directory}.", summary)
        meta = {"step": step, "seed": config.seed, "run": definition, "first_loss": watch.reference,
                "trained": trained}
        checkpoints.save(step, state, data_state=data_state, meta=meta)
        saved.append(step)
        last_save_time[0] = time.monotonic()

    def diverged(error: type[DivergenceError], step: int, loss: float, grad_norm: float) -> DivergenceError:
        """The state of ``step`` measured a bad loss: a checkpoint of it is set aside, never resumed from."""
        checkpoints.wait()
        set_aside = checkpoints.set_aside(step) if step in checkpoints.all_steps() else None
        summary["diverged"] = _diverged_message(step + 1, loss, grad_norm, checkpoints, watch, set_aside)
        return error(summary["diverged"], summary)

    step, losses = start_step, summary["losses"]
    window_start, window_tokens = time.perf_counter(), 0.0
    try:
        with _StopSignal(checkpoints.directory) as stop, jax.set_mesh(mesh):
            while step < config.steps and stop.agreed_signal is None:
                profiler.before(step + 1)
                data_before = data.get_state()  # the position to resume from if this step must be undone
                local = next(data)
                batch = {k: jax.make_array_from_process_local_data(batch_sharding, v) for k, v in local.items()}
                first = step == start_step
                if first and primary:  # the first call compiles, silently, for up to minutes
                    print("compiling the train step ...", file=sys.stderr, flush=True)
                    compile_start = time.perf_counter()
                metrics = step_fn(state, batch)
                loss = float(metrics["loss"])
                if first and primary:
                    print(f"compiled and ran step {step + 1} in {time.perf_counter() - compile_start:.1f} s",
                          file=sys.stderr, flush=True)
                exploding = watch.exploding(loss)
                if not bool(metrics["finite"]):
                    # The step kept the previous state. Its loss (this step's) tells whether it is worth keeping: a
                    # finite, sane loss with an overflowing gradient or update still resumes with a lower lr.
                    if math.isfinite(loss) and not exploding:
                        if step > start_step:
                            save(step, data_before)
                        checkpoints.wait()
                        summary["diverged"] = _diverged_message(step + 1, loss, float(metrics["grad_norm"]),
                                                                checkpoints, watch, None)
                        raise NonFiniteLossError(summary["diverged"], summary)
                    raise diverged(NonFiniteLossError, step, loss, float(metrics["grad_norm"]))
                step += 1
                profiler.after(step)  # float(loss) above waited for the step, so the trace holds all of it
                losses.append(loss)
                window_tokens += float(metrics["tokens"])
                if after_step is not None:
                    after_step(state, metrics)
                if step % config.log_every == 0 or step == config.steps or exploding:
                    elapsed = time.perf_counter() - window_start
                    tokens_per_s = window_tokens / elapsed
                    tflops = flops_per_token * tokens_per_s / jax.device_count() / 1e12
                    record = {
                        "step": step,
                        "loss": loss,
                        "grad_norm": float(metrics["grad_norm"]),
                        "lr": float(schedule(int(metrics["step_index"]))),
                        "tokens_per_s": tokens_per_s,
                        "tflops_per_device": tflops,
                        "mfu": peak.mfu(tflops * 1e12, step=step),
                        "exploding": exploding,
                        **{k: float(v) for k, v in metrics.items()
                           if k.startswith(("mtp", "aux", "expert", "indexer"))},
                    }
                    peak_memory = device_peak_memory_gib()
                    if peak_memory is not None:  # accelerators report it; XLA:CPU does not
                        record["peak_memory_gib"] = peak_memory
                    writer.write(record)
                    # An indexer warm-up trains only the indexer: its loss is the one that moves.
                    shown = {"indexer_loss": record["indexer_loss"]} if "indexer_loss" in record else {}
                    progress.update(step, {"loss": loss, **shown, "tok/s": tokens_per_s})
                    summary["first"] = summary["first"] or record
                    summary["last"] = record
                    window_start, window_tokens = time.perf_counter(), 0.0
                if exploding:
                    raise diverged(ExplodingLossError, step - 1, loss, float(metrics["grad_norm"]))
                since_save = time.monotonic() - last_save_time[0]
                due = bool(config.checkpoint_every and step % config.checkpoint_every == 0) or bool(
                    config.checkpoint_minutes and since_save >= 60 * config.checkpoint_minutes)
                if stop.agree(due) and step < config.steps:
                    save(step, data.get_state())
            if step > start_step and (stop.agreed_signal is not None or step == config.steps):
                save(step, data.get_state())
            summary["stopped_by_signal"] = stop.agreed_signal
            checkpoints.wait()  # inside the handler's scope: a second signal here exits at once
    finally:
        summary.update(end_step=step, peak_flops_per_device=peak.value, peak_source=peak.source)
        profiler.stop()
        progress.close()
        writer.close()
        checkpoints.close()
    return summary


def checkpoint_cadence(config: TrainConfig) -> str:
    """How often ``config`` checkpoints, in words (printed at the start of a run)."""
    every = [f"every {config.checkpoint_every} steps"] if config.checkpoint_every else []
    if config.checkpoint_minutes:
        every.append(f"every {config.checkpoint_minutes:g} min")
    when = " and ".join(every) + ", whichever comes first, and " if every else ""
    lost = ("" if every else "; a hard kill (OOM, preemption) loses the whole run: set checkpoint_every or "
            "checkpoint_minutes (--checkpoint-every, --checkpoint-minutes)")
    return f"{when}at the end and on SIGTERM/SIGINT, keeping the newest {config.keep_checkpoints}{lost}"


def _latest(checkpoints: Checkpointer) -> str:
    latest = checkpoints.latest_step()
    return "none (no checkpoint was written)" if latest is None else f"step {latest}"


def _fmt_loss(loss: float) -> str:
    return f"{loss:.6g}"


def _diverged_message(step: int, loss: float, grad_norm: float, checkpoints: Checkpointer, watch: _LossWatch,
                      set_aside: Path | None) -> str:
    """What went wrong at ``step`` (1-based), what was kept, and how to go on from it."""
    if math.isfinite(loss) and loss > watch.limit():
        what = (f"the loss {_fmt_loss(loss)} is {loss / watch.reference:.3g}x the run's first loss "
                f"{_fmt_loss(watch.reference)} (the limit is {watch.factor:g}x, at least {watch.factor:g} nats: "
                "exploding_loss_factor, --exploding-loss-factor); the run stopped")
    else:
        part = ("the loss" if not math.isfinite(loss) else "the gradient norm" if not math.isfinite(grad_norm)
                else "the updated parameters or optimizer state")
        what = (f"{part} is not finite (loss {_fmt_loss(loss)}, gradient norm {grad_norm:.6g}); that update was not "
                "applied and the run stopped")
    aside = (f" Checkpoint step {step - 1} measured that loss, so it was moved to {set_aside}, where a resume does "
             "not look." if set_aside is not None else "")
    latest = checkpoints.latest_step()
    if latest is None:
        kept = ("Nothing was saved: no earlier state of this run was checkpointed, so this run directory has no "
                "checkpoint and a rerun starts afresh.")
        fix = "Lower the learning rate (or check the data and the model settings), then rerun."
    else:
        kept = (f"The last healthy state is checkpoint step {latest} in {checkpoints.directory}; it is what a rerun "
                "resumes from.")
        fix = ("Lower the learning rate (or check the data), then rerun with --override-settings "
               "(override_settings=True) to resume from it with the new settings.")
    return f"step {step}: {what}.{aside} {kept} {fix}"


def _run_definition(
    config: TrainConfig,
    checkpoints: Checkpointer,
    resume_step: int | None,
    model_structure: Mapping[str, Any] | None,
    model_settings: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], list[str]]:
    """This run's definition, reconciled with the checkpoint's when resuming (see ``run_spec``)."""
    current = run_definition(
        model_structure=model_structure or {}, model_settings=model_settings or {}, optimizer=config.optimizer,
        data=config.data, seed=config.seed, steps=config.steps,
        loss_settings={"mtp_weight": config.mtp_weight, "routing_bias_rate": config.routing_bias_rate},
    )
    if resume_step is None:
        return current, []
    stored = checkpoints.read_meta(resume_step).get("run")
    if stored is None:  # written before runs stored their definition: nothing to compare with
        return current, [f"checkpoint step {resume_step} does not record its run's settings; they are not checked"]

    def lr_at(step: int, total: int) -> float:
        return float(learning_rate_schedule(config.optimizer, total)(step))

    return reconcile(stored, current, resume_step=resume_step, steps=config.steps, extend=config.extend,
                     override_settings=config.override_settings, lr_at=lr_at)


def _trained_part(make_model: Callable[[], nnx.Module]) -> str:
    """What ``make_model``'s model trains (``trainable_filter``), as a checkpoint records it; from an abstract model
    (nothing allocated)."""
    model = nnx.eval_shape(make_model)
    wrt = trainable_filter(model)
    return _trained(wrt) if trains_part(model, wrt) else "all parameters"


def _trained(wrt: Any) -> str:
    """The optimizer's ``wrt`` filter as a string, for a model that trains part of itself (stored in each
    checkpoint, compared on resume; a model that trains all of itself stores 'all parameters')."""
    return str(nnx.filterlib.to_predicate(wrt))


def _all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point number in ``tree`` is finite (one fused reduction per array)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves])) if leaves else jnp.bool_(True)


def _jitted_step(state: TrainState, rules: Any, allow_partial: bool, **step_kwargs: Any) -> Any:
    """The jitted ``(state values, batch) -> (updated values, metrics)`` that ``_pinned_step`` runs."""
    graphdef, _ = nnx.split(state)
    shardings = jax.tree.map(lambda x: x.sharding, nnx.state(state))

    def step(values: nnx.State, batch: dict[str, jax.Array]) -> tuple[nnx.State, dict[str, jax.Array]]:
        live = nnx.merge(graphdef, values)
        with use_rules(rules, allow_partial=allow_partial):
            metrics = train_step(live.model, live.optimizer, batch, **step_kwargs)
        updated = nnx.state(live)
        # A finite loss can come with an overflowing update, so the whole updated state is checked.
        return updated, {**metrics, "finite": _all_finite((metrics["loss"], metrics["grad_norm"], updated))}

    return jax.jit(step, out_shardings=(shardings, None))


def step_peak_bytes(make_model: Callable[[], nnx.Module], config: TrainConfig, vocab_size: int) -> int:
    """Per-device peak bytes of the trainer's compiled step for ``config``, from XLA's buffer assignment:
    arguments (the state and a batch) + outputs (the updated state; the input state is not donated, so a non-finite
    step can be dropped) - aliased + temporaries. It creates the state (allocating it) and compiles the step
    without running it: tests check ``--remat auto``'s choice against it.

    >>> step_peak_bytes(lambda: Llama(config, rngs=nnx.Rngs(0)), TrainConfig(mesh={"fsdp": 8}), config.vocab_size)
    """
    mesh = make_mesh(config.mesh, shard_mode=config.shard_mode)
    rules = get_rules(config.rules)

    def make_state() -> TrainState:
        model = make_model()
        return TrainState(model, make_optimizer(config.optimizer, model, config.steps, wrt=trainable_filter(model)))

    state = _create_state(make_state, mesh, rules, config.allow_partial, primary=False)
    sharding = NamedSharding(mesh, _batch_spec(config, rules, mesh))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
             for k, v in next(make_iterator(config.data, vocab_size)).items()}
    step = _jitted_step(state, rules, config.allow_partial, accum_steps=config.accum_steps,
                        mtp_weight=config.mtp_weight, model_kwargs=config.model_kwargs,
                        routing_bias_rate=config.routing_bias_rate, loss_chunk_tokens=config.loss_chunk_tokens)
    with jax.set_mesh(mesh):
        memory = step.lower(nnx.state(state), batch).compile().memory_analysis()
    return int(memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
               + memory.temp_size_in_bytes)


def _pinned_step(state: TrainState, rules: Any, allow_partial: bool,
                 **step_kwargs: Any) -> Callable[[TrainState, dict[str, jax.Array]], Any]:
    """``train_step`` on ``state`` (updated in place), compiled once, with the updated state pinned to the
    shardings it came in with. It is traced under ``use_rules(rules, allow_partial=allow_partial)``: a model
    entering its own rules keeps that setting, so with ``allow_partial`` its activations fall back (Explicit
    meshes) the way ``_create_state`` placed its weights.

    Under Auto meshes XLA otherwise picks new layouts for part of the updated state (e.g. norm scales came back
    split like the activations they scale): the next step then sees different input shardings and compiles again,
    and the state drifts away from the rule set's layout. Under Explicit meshes the pin changes nothing.
    """
    compiled = _jitted_step(state, rules, allow_partial, **step_kwargs)

    def run(state: TrainState, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        values, metrics = compiled(nnx.state(state), batch)
        # A step that is not finite is not applied: the state (not donated to the step) stays the last finite
        # one, so it can still be checkpointed. The loop waits for this step's loss right after anyway.
        if bool(metrics["finite"]):
            nnx.update(state, values)
        return metrics

    return run
