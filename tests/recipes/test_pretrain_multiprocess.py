"""The pretraining recipe itself as 2 processes on loopback (4 CPU devices each, gloo) == 1 process of 8 devices."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "deepseek_pretrain.py"
ARGS = [
    "--model", "deepseek3-tiny", "--model.num_hidden_layers", "2", "--model.first_k_dense_replace", "1",
    "--model.vocab_size", "256", "--model.num_nextn_predict_layers", "0", "--mtp-weight", "0",
    "--batch", "8", "--seq-len", "16", "--steps", "3", "--warmup-steps", "1", "--no-progress",
    "--mesh", "fsdp=4,expert=2", "--shard-mode", "explicit", "--sync-checkpoints",
    "--optimizer", "muon", "--model.seq_aux_loss_alpha", "0.001",  # the new training options, across hosts too
]


def launch(run_dir: Path, devices: int, **env_vars: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNX_ZOO_")}
    env.update(XLA_FLAGS=f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT), **env_vars)
    return subprocess.Popen([sys.executable, str(RECIPE), *ARGS, "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["aux_loss"] > 0 for r in records)  # the balance loss is on
    return [r["loss"] for r in records]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_recipe_processes_match_one(tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [launch(tmp_path / "multi", 4, NNX_ZOO_NUM_PROCESSES="2", NNX_ZOO_PROCESS_ID=str(i),
                    NNX_ZOO_COORDINATOR=coordinator) for i in range(2)]
    single = launch(tmp_path / "single", 8)
    # Only the coordinating process holds the run directory's lock (were process 1 to try too, it would be refused
    # and the run would fail): the lock names process 0 while they run, and is released when they end.
    lock = tmp_path / "multi" / "run.lock"
    while not (lock.exists() and lock.read_text()) and procs[0].poll() is None:
        time.sleep(0.01)
    holder = json.loads(lock.read_text())
    outs = [finish(p) for p in procs]
    assert holder["pid"] == procs[0].pid
    assert lock.read_text() == ""
    finish(single)
    expected = losses(tmp_path / "single")
    assert len(expected) == 3
    np.testing.assert_allclose(losses(tmp_path / "multi"), expected, rtol=1e-5)  # written by process 0
    # Process 1 writes no metrics (process 0 does), but prints the same summary: first and last loss.
    for out in outs:
        first, last = map(float, re.search(r"loss (\S+) -> (\S+)", out).groups())
        np.testing.assert_allclose([first, last], [expected[0], expected[-1]], atol=1e-4)
    assert sorted(p.name for p in (tmp_path / "multi" / "checkpoints").iterdir()) == ["3"]
