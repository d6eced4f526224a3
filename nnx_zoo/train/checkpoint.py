"""Checkpoints with orbax: async saves, keep-last-N, resume from the latest complete one, any mesh.

Orbax writes each step into a temporary directory and renames it into place only once every item is written, so
a process killed mid-save leaves the previous checkpoint as the latest complete one; ``latest_step`` never sees the
partial one. Restoring takes an abstract state carrying the *target* shardings, so a run can resume on a
different mesh or rule set.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

ITEMS = ("state", "data", "meta")


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message says which and what to do."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (e.g. the disk is full); the previous complete one is intact."""


def _os_error(err: BaseException) -> OSError | None:
    """The OSError that caused ``err`` (orbax wraps the writers' errors), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        err = err.__cause__ or err.__context__
    return None


def _short(err: BaseException, limit: int = 300) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[:limit] + " ..."


def abstract_with_shardings(module: nnx.Module) -> dict[str, Any]:
    """The pure-dict state of ``module`` as ShapeDtypeStructs carrying each array's current sharding."""
    def spec(x: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(spec, nnx.to_pure_dict(nnx.state(module)))


class Checkpointer:
    """Saves and restores ``{state: module state, data: iterator state, meta: json}`` under ``directory``.

    >>> ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    >>> ckpt.save(step, train_state, data_state={"next_index": step}, meta={"step": step})
    >>> ckpt.restore_into(train_state)  # the latest complete step, onto train_state's own shardings
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint path {self.directory} exists and is not a directory; choose another")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._pending: int | None = None

    def latest_step(self) -> int | None:
        self.manager.reload()
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        self.manager.reload()
        return list(self.manager.all_steps())

    def save(self, step: int, module: nnx.Module, *, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start saving (returns at once when async); the previous complete checkpoint stays valid meanwhile.

        A failed write (of this save, or of an earlier async one that it waits for) raises
        ``CheckpointWriteError`` naming the step, the directory and the cause.
        """
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(module))),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        )
        self._pending = step
        with self._write_errors():
            self.manager.wait_until_finished()  # an earlier save's failure is reported before this one starts
            self._check_free_space(module)
            self.manager.save(step, args=args, force=True)

    def _check_free_space(self, module: nnx.Module) -> None:
        """Refuse a save that cannot fit, before any byte is written: a write that runs out of space midway
        fails inside orbax's writer threads, which print pages of tracebacks before the error reaches us."""
        needed = sum(
            shard.data.nbytes
            for x in jax.tree.leaves(nnx.state(module)) if isinstance(x, jax.Array)
            for shard in x.addressable_shards if shard.replica_id == 0
        )
        needed = int(needed * 1.05) + 2**20  # OCDBT's index and the metadata files
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            raise CheckpointWriteError(self.write_error_message(
                f"it needs about {needed / 2**20:.1f} MiB and the device has {free / 2**20:.1f} MiB free"))

    @contextlib.contextmanager
    def _write_errors(self) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as err:  # orbax raises its writers' errors wrapped, from whichever save failed
            raise self.write_error(err) from err

    def write_error(self, err: BaseException) -> CheckpointWriteError:
        """The one-line error for a failed save: what failed, why, and which checkpoint is still there."""
        cause = _os_error(err)
        if (cause is not None and cause.errno == errno.ENOSPC) or "No space left on device" in str(err):
            why = "no space left on the device"  # tensorstore reports it inside a ValueError's text
        elif cause is not None:
            why = cause.strerror or _short(cause)
        else:
            why = _short(err)
        return CheckpointWriteError(self.write_error_message(why))

    def write_error_message(self, why: str) -> str:
        try:
            previous = [s for s in self.all_steps() if s != self._pending]
        except Exception:  # the directory itself may be unreadable now
            previous = []
        kept = (f"the previous checkpoint (step {max(previous)}) is intact" if previous
                else "no earlier checkpoint exists")
        return (f"could not write checkpoint step {self._pending} to {self.directory}: {why}; {kept}. Free space or "
                "fix the directory (or use another run directory), then rerun to resume.")

    def read_meta(self, step: int) -> dict[str, Any]:
        """The ``meta`` item of ``step`` alone (read before building the state, e.g. to check the run's settings)."""
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as err:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} has no readable metadata ({_short(err)}); delete that "
                "step's directory to resume from an earlier one, or start a new run directory."
            ) from err
        return dict(restored.meta)

    def restore_into(self, module: nnx.Module, step: int | None = None) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """Load ``step`` (default: the latest complete one) into ``module`` in place, on its current shardings.

        Returns ``(step, data_state, meta)``.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        target = abstract_with_shardings(module)
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as err:  # orbax raises many types for unreadable files; name the checkpoint and the fix
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} cannot be restored ({_short(err)}). "
                "It may be corrupt or from a different model; delete that step's directory to resume from an "
                "earlier one, or start a new run directory."
            ) from err
        state = nnx.state(module)
        nnx.replace_by_pure_dict(state, restored.state)
        nnx.update(module, state)
        return step, dict(restored.data), dict(restored.meta)

    def set_aside(self, step: int) -> Path:
        """Move checkpoint ``step`` out of the way of resumes (into ``<directory>-set-aside/<step>``) and return
        where it went: a state that proved bad (its loss exploded) must not be what a rerun resumes from, and a
        resumed run must be free to write that step again. Nothing is deleted. Every process calls it; process 0
        moves the files."""
        self.wait()
        target = self.directory.with_name(self.directory.name + "-set-aside") / str(step)
        suffix = 1
        while target.exists():  # set aside before, by an earlier attempt of the same run
            target, suffix = target.with_name(f"{step}.{suffix}"), suffix + 1
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"nnx_zoo set aside checkpoint {step}")
        self.manager.reload()
        return target

    def wait(self) -> None:
        """Block until the last async save is complete on disk (``CheckpointWriteError`` if it failed)."""
        with self._write_errors():
            self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()
