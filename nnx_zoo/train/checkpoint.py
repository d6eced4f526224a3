"""Checkpoints with orbax: async saves, keep-last-N, resume from the latest complete one, any mesh.

Orbax writes each step into a temporary directory and renames it into place only once every item is written, so
a process killed mid-save leaves the previous checkpoint as the latest complete one; ``latest_step`` never sees the
partial one. Restoring takes an abstract state carrying the *target* shardings, so a run can resume on a
different mesh or rule set.

What is restored is verified, so that a checkpoint altered on disk is reported as damaged (naming the step, the file
and the command that resumes from the previous checkpoint) instead of training on, or diverging, from bad bytes:
- every save records a checksum of each array as saved (the ``checksums`` item, written with the checkpoint): two
  position-weighted sums of the array's bits, computed on the devices where the array lives (no host copy) by one
  global reduction, so the value does not depend on the sharding and a resume onto another mesh checks it too; in a
  multi-process run every process computes the same global sums and checks the whole;
- once a save is complete on disk (seen at the next save, or at the end), the coordinating process writes
  ``<step>/nnx_zoo_files.json`` in a thread beside the training: the size and SHA-256 of every file of the step (so
  a flipped byte, a truncated or a missing file is named by its path). A step whose run was killed before that has
  its arrays' checksums only;
- a restore checks the files first (the coordinator, which tells the other processes), then the arrays' checksums
  after reading them, before any of it reaches the model.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shlex
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from nnx_zoo.train.run_lock import broadcast_text

ITEMS = ("state", "data", "meta")  # every checkpoint has these
MANAGED_ITEMS = (*ITEMS, "checksums")  # checksums: absent in checkpoints of earlier versions
FILES_MANIFEST = "nnx_zoo_files.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message says which and what to do."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint that changed on disk after it was saved (a file altered, truncated or missing); the message
    names the step and the file and says how to resume from the previous checkpoint."""


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


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words (one per element; two per element of 8-byte types)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    """Two sums mod 2**32 of the array's words, each weighted by an odd function of the word's position: any single
    changed bit changes both (an odd weight times a power of two is never 0 mod 2**32), a moved value changes them,
    and integer addition makes them the same however the array is sharded."""
    words = _words(x)
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(words.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, words.shape, dim) * jnp.uint32(stride % 2**32)
        stride *= words.shape[dim]
    first = jnp.sum(words * (position * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
    mixed = (position * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)) | jnp.uint32(1)
    second = jnp.sum((words ^ (words >> 16)) * mixed, dtype=jnp.uint32)
    return jnp.stack([first, second])


@jax.jit
def _checksums_on_device(tree: Any) -> Any:
    return jax.tree.map(_checksum, tree)


def array_checksums(tree: Any) -> dict[str, str]:
    """``{"model/embed": "1a2b3c4d-5e6f7a8b", ...}``: each array's checksum (see ``_checksum``) by its path."""
    sums = jax.device_get(_checksums_on_device(tree))
    flat = jax.tree_util.tree_flatten_with_path(sums)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): f"{int(v[0]):08x}-{int(v[1]):08x}"
            for path, v in flat}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()


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
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=MANAGED_ITEMS)
        self._pending: int | None = None
        self._unsealed: list[int] = []  # saved steps whose file manifest is not written yet
        self._sealing: threading.Thread | None = None
        self._verified: set[int] = set()

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
        state = nnx.to_pure_dict(nnx.state(module))
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
            checksums=ocp.args.JsonSave({"arrays": array_checksums(state)}),
        )
        with self._write_errors():
            self.manager.wait_until_finished()  # an earlier save's failure is reported before this one starts
            self._seal()
            self._pending = step
            self._check_free_space(module)
            self.manager.save(step, args=args, force=True)
            self._unsealed.append(step)

    def _seal(self) -> None:
        """Start recording the size and SHA-256 of every file of each completed save (the coordinator; after
        ``wait_until_finished``), in a thread: hashing a large checkpoint takes a while and the training goes on
        meanwhile (hashlib releases the GIL). ``wait``, ``close`` and the next save wait for it."""
        self._join_seal()
        steps, self._unsealed = self._unsealed, []
        if steps and jax.process_index() == 0:
            self._sealing = threading.Thread(target=self._write_manifests, args=(steps,), daemon=True,
                                             name="nnx_zoo checkpoint file hashes")
            self._sealing.start()

    def _join_seal(self) -> None:
        if self._sealing is not None:
            self._sealing.join()
            self._sealing = None

    def _write_manifests(self, steps: list[int]) -> None:
        for step in steps:
            root = self.directory / str(step)
            try:
                files = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                         for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(FILES_MANIFEST)}
                temporary = root / (FILES_MANIFEST + ".tmp")
                temporary.write_text(json.dumps({"step": step, "files": files}, indent=0))
                os.replace(temporary, root / FILES_MANIFEST)  # whole or absent
            except OSError:
                continue  # dropped by keep-last-N meanwhile; a step without a manifest has its arrays' checksums

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
        self.verify_files(step)
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
        self.verify_files(step)
        target = abstract_with_shardings(module)
        items = {"state": ocp.args.StandardRestore(target), "data": ocp.args.JsonRestore(),
                 "meta": ocp.args.JsonRestore()}
        if (self.directory / str(step) / "checksums").is_dir():  # absent in checkpoints of older versions
            items["checksums"] = ocp.args.JsonRestore()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:  # orbax raises many types for unreadable files; name the checkpoint and the fix
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} cannot be restored ({_short(err)}). It is damaged or "
                f"from a different model. {self.resume_advice(step)}"
            ) from err
        if "checksums" in items:
            self._compare(step, dict(restored.checksums)["arrays"], restored.state)
        state = nnx.state(module)
        nnx.replace_by_pure_dict(state, restored.state)
        nnx.update(module, state)
        return step, dict(restored.data), dict(restored.meta)

    def verify_arrays(self, step: int, tree: Any) -> None:
        """Raise ``DamagedCheckpointError`` when an array of ``tree`` (read from ``step``'s state, whole or a part
        such as ``{"model": ...}``) differs from the checksum recorded when it was saved; a step of an earlier
        version without checksums passes."""
        if not (self.directory / str(step) / "checksums").is_dir():
            return
        restored = self.manager.restore(step, args=ocp.args.Composite(checksums=ocp.args.JsonRestore()))
        self._compare(step, dict(restored.checksums)["arrays"], tree)

    def _compare(self, step: int, expected: dict[str, str], tree: Any) -> None:
        got = array_checksums(tree)
        changed = sorted(k for k in got if expected.get(k) != got[k])
        if len(got) == len(expected):  # a whole state: an array it lacks has changed too
            changed = sorted({*changed, *(k for k in expected if k not in got)})
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise DamagedCheckpointError(
                f"checkpoint step {step} in {self.directory} is damaged: the arrays read from "
                f"{self.directory / str(step) / 'state'} differ from the checksums recorded when they were saved "
                f"({shown}). {self.resume_advice(step)}")

    def verify_files(self, step: int) -> None:
        """Raise ``DamagedCheckpointError`` when a file of ``step`` is missing, or differs in size or SHA-256 from
        its manifest (checked once per step, by the coordinator; a step without a manifest passes)."""
        if step in self._verified:
            return
        problem = self._file_problem(step) if jax.process_index() == 0 else ""
        problem = broadcast_text(problem) if jax.process_count() > 1 else problem
        if problem:
            raise DamagedCheckpointError(f"checkpoint step {step} in {self.directory} is damaged: {problem}. "
                                         f"{self.resume_advice(step)}")
        self._verified.add(step)

    def _file_problem(self, step: int) -> str:
        root = self.directory / str(step)
        try:
            manifest = json.loads((root / FILES_MANIFEST).read_text())["files"]
        except FileNotFoundError:
            return ""
        except (OSError, ValueError, KeyError) as err:
            return f"its file manifest {root / FILES_MANIFEST} is unreadable ({_short(err)})"
        for name, want in manifest.items():
            path = root / name
            if not path.is_file():
                return f"the file {path} is missing"
            size = path.stat().st_size
            if size != want["bytes"]:
                return f"the file {path} has {size} bytes, {want['bytes']} when saved (truncated or overwritten)"
            if _sha256(path) != want["sha256"]:
                return f"the file {path} changed after it was saved (its SHA-256 differs from the one recorded)"
        return ""

    def resume_advice(self, step: int) -> str:
        """How to go on without the unusable checkpoint ``step``: the exact command that moves it aside."""
        target = self._set_aside_target(step)
        command = (f"mkdir -p {shlex.quote(str(target.parent))} && mv {shlex.quote(str(self.directory / str(step)))} "
                   f"{shlex.quote(str(target))}")
        earlier = [s for s in self.all_steps() if s < step]
        if earlier:
            return (f"To resume from the previous checkpoint (step {max(earlier)}), move this one aside, then rerun "
                    f"the same command: {command}")
        return (f"No earlier checkpoint exists: move it aside ({command}) and rerun to start afresh here, or use "
                "another run directory (--run-dir).")

    def _set_aside_target(self, step: int) -> Path:
        target = self.directory.with_name(self.directory.name + "-set-aside") / str(step)
        suffix = 1
        while target.exists():  # set aside before, by an earlier attempt of the same run
            target, suffix = target.with_name(f"{step}.{suffix}"), suffix + 1
        return target

    def set_aside(self, step: int) -> Path:
        """Move checkpoint ``step`` out of the way of resumes (into ``<directory>-set-aside/<step>``) and return
        where it went: a state that proved bad (its loss exploded) must not be what a rerun resumes from, and a
        resumed run must be free to write that step again. Nothing is deleted. Every process calls it; process 0
        moves the files."""
        self.wait()
        target = self._set_aside_target(step)
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
            self._seal()
            self._join_seal()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()
