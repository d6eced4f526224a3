"""Keep-last-N: after every save the directory holds exactly the N newest complete checkpoints, each restorable
with the values it was saved with, and the dropped ones are gone from disk."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.train import Checkpointer, CheckpointError


class _Tiny(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros((3,)))


def _step_dirs(directory) -> set[str]:
    """Everything orbax left in the checkpoint directory (step directories, and any temporary ones)."""
    return {p.name for p in directory.iterdir()}


@pytest.mark.parametrize(("keep", "async_save"), [(1, False), (3, True)])
def test_keep_last_n_keeps_exactly_n(tmp_path, keep, async_save):
    directory = tmp_path / "checkpoints"
    module = _Tiny()
    ckpt = Checkpointer(directory, keep=keep, async_save=async_save)
    steps = [2, 4, 6, 8, 10, 12]
    for i, step in enumerate(steps):
        module.w[...] = jnp.full((3,), float(step))
        ckpt.save(step, module, data_state={"next": step}, meta={"step": step})
        ckpt.wait()
        expected = steps[max(0, i + 1 - keep) : i + 1]
        assert ckpt.all_steps() == expected
        assert _step_dirs(directory) == {str(s) for s in expected}
    ckpt.close()

    reopened = Checkpointer(directory, keep=keep)
    assert reopened.all_steps() == steps[-keep:] and reopened.latest_step() == steps[-1]
    for step in steps[-keep:]:  # every kept checkpoint holds what was saved at its step
        got, data, meta = reopened.restore_into(module, step)
        assert (got, data, meta) == (step, {"next": step}, {"step": step})
        np.testing.assert_array_equal(np.asarray(module.w[...]), np.full((3,), float(step)))
    with pytest.raises(CheckpointError):
        reopened.restore_into(module, steps[-keep - 1])  # dropped
    reopened.close()
