"""Checkpoints with orbax: async saves, keep-last-N, resume from the latest complete one, any mesh.

Orbax writes each step into a temporary directory and renames it into place only once every item is written, so
a process killed mid-save leaves the previous checkpoint as the latest complete one; ``latest_step`` never sees the
partial one. Restoring takes an abstract state carrying the *target* shardings, so a run can resume on a
different mesh or rule set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

ITEMS = ("state", "data", "meta")


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message says which and what to do."""


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

    def latest_step(self) -> int | None:
        self.manager.reload()
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        self.manager.reload()
        return list(self.manager.all_steps())

    def save(self, step: int, module: nnx.Module, *, data_state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Start saving (returns at once when async); the previous complete checkpoint stays valid meanwhile."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(module))),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta),
        )
        self.manager.save(step, args=args, force=True)

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
                f"checkpoint step {step} in {self.directory} cannot be restored ({type(err).__name__}: {err}). "
                "It may be corrupt or from a different model; delete that step's directory to resume from an "
                "earlier one, or start a new run directory."
            ) from err
        state = nnx.state(module)
        nnx.replace_by_pure_dict(state, restored.state)
        nnx.update(module, state)
        return step, dict(restored.data), dict(restored.meta)

    def wait(self) -> None:
        """Block until the last async save is complete on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
