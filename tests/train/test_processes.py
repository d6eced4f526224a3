"""SIGKILL during an async save, in a whole process. (Two processes == one: the recipe itself does it, in
tests/recipes/test_pretrain_multiprocess.py.)"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nnx_zoo.train import Checkpointer

SCRIPT = Path(__file__).with_name("run_toy.py")
pytestmark = pytest.mark.usefixtures("subprocess_compile_cache")  # relaunched runs load their compiled programs


def launch(run_dir, *args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(run_dir), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def result(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_sigkill_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    # A wide toy model (~100 MB of state with the optimizer) so that a save takes long enough to be interrupted.
    args = ("--steps", 6, "--width", 1024, "--checkpoint-every", 1)
    whole = result(launch(tmp_path / "whole", *args))["losses"]
    proc = launch(tmp_path / "killed", *args)
    for line in proc.stdout:
        if line.strip() == "step 4":  # the async save of step 3 is in flight
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    checkpoints = tmp_path / "killed" / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    partial = [n for n in names if not n.isdigit()]
    latest = Checkpointer(checkpoints).latest_step()
    assert latest is not None and 1 <= latest <= 3, names
    for name in partial:  # a half-written step (seen here: "3.orbax-checkpoint-tmp") is never the latest
        assert int(name.split(".")[0]) > latest, names
    # Resume picks the latest complete checkpoint, whatever was left half-written, and repeats the losses.
    resumed = result(launch(tmp_path / "killed", *args))
    assert resumed["start_step"] == latest, (names, partial)
    np.testing.assert_allclose(resumed["losses"], whole[latest:], rtol=1e-5)
