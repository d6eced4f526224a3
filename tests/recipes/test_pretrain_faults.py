"""Faults and mistakes, end to end through the pretraining recipe: divergence, changed settings on resume,
signals, a second run on a busy run directory, a crash after logging (and its lock taken over), a full disk. Each
checks that nothing good is lost and the message says what to do.

In-process runs call ``recipe.main``; runs that need signals, kills or their own stderr are subprocesses.
"""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "deepseek_pretrain.py"
spec = importlib.util.spec_from_file_location("deepseek_pretrain_faults", RECIPE)
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)

TINY = [
    "--model", "deepseek3-tiny", "--model.num_hidden_layers", "2", "--model.first_k_dense_replace", "1",
    "--model.vocab_size", "512", "--model.num_nextn_predict_layers", "0",
    "--batch", "8", "--seq-len", "16", "--no-progress", "--warmup-steps", "1",
]
EXIT_DIVERGED, EXIT_STOPPED = 3, 75
pytestmark = pytest.mark.usefixtures("subprocess_compile_cache")  # relaunched runs load their compiled programs


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def state_is_finite(run_dir: Path, step: int) -> bool:
    arrays = ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")
    leaves = [np.asarray(x) for x in jax.tree.leaves(arrays)]
    return all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.floating))


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """A finished two-step run of TINY, made once: the tests that start from one resume a copy (``copy_run``)."""
    run_dir = tmp_path_factory.mktemp("two-steps") / "run"
    assert recipe.main([*TINY, "--steps", "2", "--run-dir", str(run_dir)]) == 0
    return run_dir


def copy_run(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    assert (to / "run.lock").read_text() == ""  # released: the copy is free to resume
    return to


def main(capsys, *args: str) -> tuple[int, str, str]:
    code = recipe.main([*TINY, *args])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------------ divergence
def test_a_diverging_update_is_never_checkpointed_and_the_run_resumes_from_the_last_finite_one(tmp_path, capsys,
                                                                                              two_steps):
    run_dir = str(tmp_path / "run")
    # The very first update overflows (lr 1e39 is inf in float32): nothing to save, and the message says so.
    first = tmp_path / "first"
    code, _, err = main(capsys, "--steps", "3", "--lr", "1e39", "--warmup-steps", "0", "--run-dir", str(first))
    assert code == EXIT_DIVERGED
    assert "step 1: the updated parameters or optimizer state is not finite" in err
    assert "Nothing was saved" in err and "None" not in err
    assert not checkpoint_steps(first) and not rows(first)

    # Two sane steps, then the same run goes on with an overflowing learning rate: step 3 is not applied.
    copy_run(two_steps, tmp_path / "run")
    code, _, err = main(capsys, "--steps", "6", "--override-settings", "--lr", "1e39", "--schedule", "constant",
                        "--warmup-steps", "0", "--run-dir", run_dir)
    assert code == EXIT_DIVERGED, err
    assert "step 3: the updated parameters or optimizer state is not finite" in err
    assert "checkpoint step 2 in" in err and "--override-settings" in err
    assert checkpoint_steps(tmp_path / "run") == [2] and state_is_finite(tmp_path / "run", 2)
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2]

    # Resuming from it with the run's own learning rate works. --extend keeps the schedule: the added steps run at
    # its final learning rate (the floor, lr * min_lr_ratio). How the model computes (here the MoE path) may change
    # on resume.
    code, out, err = main(capsys, "--steps", "4", "--extend", "--moe-impl", "dense", "--run-dir", run_dir)
    assert code == 0, err
    assert "steps 2 -> 4 (resumed)" in out
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in rows(tmp_path / "run"))
    lrs = [r["lr"] for r in rows(tmp_path / "run")]
    assert lrs[0] == 0.0 and lrs[2:] == pytest.approx([3e-3 * 0.1] * 2)


def test_an_exploding_loss_stops_the_run_and_the_advice_resumes_from_a_healthy_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # lr 30 takes the loss from 6 to 1e4 in two finite steps: before, the run ended with exit 0 (or, once
    # it overflowed, checkpointed the blown-up weights, so that the advice to resume with a lower lr failed again).
    code, out, err = main(capsys, "--steps", "15", "--lr", "30", "--checkpoint-every", "1", "--run-dir",
                          str(run_dir))
    assert code == EXIT_DIVERGED, err
    bad = int(err.split("deepseek_pretrain.py: step ")[1].split(":")[0])
    assert bad >= 3 and "x the run's first loss" in err and "--override-settings" in err
    assert "(DIVERGED: see the message below; exit code 3)" in out
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == list(range(1, bad + 1))
    assert logged[-1]["exploding"] and logged[-1]["loss"] > 10 * logged[0]["loss"]
    assert not any(r["exploding"] for r in logged[:-1])
    # The state that measured the exploding loss (step bad-1's) is set aside, not deleted; the rest stay.
    assert checkpoint_steps(run_dir)[-1] == bad - 2 and f"checkpoint step {bad - 2} in" in err
    assert (tmp_path / "run" / "checkpoints-set-aside" / str(bad - 1)).is_dir()

    # The advice, followed: it resumes from the healthy checkpoint and goes on to the end.
    code, out, err = main(capsys, "--steps", "15", "--lr", "3e-3", "--override-settings", "--checkpoint-every", "1",
                          "--run-dir", str(run_dir))
    assert code == 0, err
    assert f"steps {bad - 2} -> 15 (resumed)" in out
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == list(range(1, 16))
    assert not any(r["exploding"] for r in logged) and logged[-1]["loss"] < logged[0]["loss"]


# --------------------------------------------------------------------------------------- changed settings
def test_a_resume_that_would_change_the_run_stops_and_names_each_difference(tmp_path, capsys, two_steps):
    run_dir = ["--run-dir", str(copy_run(two_steps, tmp_path / "run"))]

    code, _, err = main(capsys, "--steps", "2", "--seed", "1", *run_dir)
    assert code == 2 and "seed: 0 -> 1" in err and "data.seed: 0 -> 1" in err and "--override-settings" in err

    code, _, err = main(capsys, "--steps", "8", *run_dir)
    assert code == 2 and "planned for 2 steps" in err and "--extend" in err and "would jump from" in err

    code, _, err = main(capsys, "--steps", "2", "--model.num_hidden_layers", "3", *run_dir)
    assert code == 2 and "model.num_hidden_layers: 2 -> 3" in err and "new run directory" in err
    assert len(err) < 1500 and "Traceback" not in err

    code, _, err = main(capsys, "--steps", "2", "--optimizer", "muon", "--lr", "1e-2", *run_dir)
    assert code == 2 and "optimizer: 'adamw' -> 'muon'" in err and "optimizer.lr: 0.003 -> 0.01" in err
    assert len(err) < 1500 and "Traceback" not in err

    code, out, _ = main(capsys, "--steps", "2", *run_dir)  # a finished run says how to train further
    assert code == 0 and "already finished" in out and "--steps 4 --extend" in out
    code, _, err = main(capsys, "--steps", "1", *run_dir)  # fewer steps than done: the same advice (the divergence
    assert code == 2 and "nothing left to train" in err and "--steps 4 --extend" in err  # test follows it)


# ------------------------------------------------------------------------------------- subprocess helpers
def launch(run_dir: Path, *args: str, devices: int = 1, **env_vars: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNX_ZOO_")}
    env.update(XLA_FLAGS=f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT), **env_vars)
    return subprocess.Popen([sys.executable, str(RECIPE), *TINY, "--run-dir", str(run_dir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_rows(proc: subprocess.Popen, run_dir: Path, count: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while len(rows(run_dir)) < count:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "the run did not log in time"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- signals
def read_until(proc: subprocess.Popen, text: str) -> list[str]:
    """The stderr lines up to the first that holds ``text``."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"the run ended (exit {proc.wait()}) before printing {text!r}")


def test_sigterm_saves_and_exits_75_and_a_second_signal_exits_at_once(tmp_path):
    run_dir = tmp_path / "run"
    # The real 129k vocabulary: ~200 MB of state, so that a save lasts long enough to be interrupted.
    args = ("--steps", "500", "--model.vocab_size", "129280")
    proc = launch(run_dir, *args)
    wait_for_rows(proc, run_dir, 2)
    # One run directory, one run: a second run on it is refused before it builds anything, naming the first and the
    # ways out, and the first goes on unaffected (each step logged once, its checkpoint its own).
    second = launch(run_dir, *args)
    _, err = second.communicate(timeout=120)
    assert second.returncode == 2, err[-3000:]
    assert f"is in use by another run: pid {proc.pid} on host {socket.gethostname()}, started " in err
    assert f"run `kill {proc.pid}` (SIGTERM" in err and "another --run-dir" in err and "Traceback" not in err
    assert "compiling" not in err and "parameters" not in err  # refused before the model was even described
    wait_for_rows(proc, run_dir, len(rows(run_dir)) + 1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    assert "SIGTERM: stopping after this step" in err and "Traceback" not in err
    assert "checkpoint saved; rerun to resume" in out
    last = rows(run_dir)[-1]["step"]
    assert [r["step"] for r in rows(run_dir)] == list(range(1, last + 1))
    assert checkpoint_steps(run_dir) == [last]
    assert (run_dir / "run.lock").read_text() == ""  # a clean end releases the lock

    # A second signal while it stops: exit now (128 + 15), no traceback; the last complete checkpoint is kept.
    proc = launch(run_dir, *args)
    wait_for_rows(proc, run_dir, last + 2)
    proc.send_signal(signal.SIGTERM)
    read_until(proc, "SIGTERM: stopping after this step")  # the first one was handled
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "second SIGTERM: exiting now" in err and "Traceback" not in err
    kept = checkpoint_steps(run_dir)[-1]
    assert kept >= last

    proc = launch(run_dir, *args)  # and it resumes from the last complete checkpoint
    wait_for_rows(proc, run_dir, len(rows(run_dir)) + 1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED
    assert f"steps {kept} -> " in out


def test_sigterm_to_one_of_two_processes_stops_both_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = ("--steps", "500", "--mesh", "fsdp=2", "--sync-checkpoints")
    coordinator = f"127.0.0.1:{free_port()}"

    def start() -> list[subprocess.Popen]:
        return [launch(run_dir, *args, NNX_ZOO_NUM_PROCESSES="2", NNX_ZOO_PROCESS_ID=str(i),
                       NNX_ZOO_COORDINATOR=coordinator) for i in range(2)]

    procs = start()
    wait_for_rows(procs[0], run_dir, 2)
    procs[1].send_signal(signal.SIGTERM)  # process 1 only
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [EXIT_STOPPED, EXIT_STOPPED], [e[-2000:] for _, e in results]
    last = rows(run_dir)[-1]["step"]
    assert checkpoint_steps(run_dir) == [last]
    procs = start()  # both resume from it
    wait_for_rows(procs[0], run_dir, last + 1)
    procs[0].send_signal(signal.SIGTERM)
    for p in procs:
        p.communicate(timeout=300)
    assert [p.returncode for p in procs] == [EXIT_STOPPED, EXIT_STOPPED]
    assert [r["step"] for r in rows(run_dir)] == list(range(1, rows(run_dir)[-1]["step"] + 1))


# -------------------------------------------------------------------------------- crash after logging
def test_a_hard_kill_under_the_default_cadence_loses_little_and_resumes_bit_exactly(tmp_path):
    """The default cadence (every 1000 steps or 30 minutes) with its wall-time interval made small: a SIGKILL mid-
    run (frozen first, so that the kill may land inside an async save) leaves a recent checkpoint, and the resumed
    run logs the uninterrupted run's losses and ends with its weights, bit for bit."""
    steps = ("--steps", "40")
    whole = launch(tmp_path / "whole", *steps)
    assert whole.communicate(timeout=300)[0] and whole.returncode == 0

    run_dir = tmp_path / "run"
    proc = launch(run_dir, *steps, "--checkpoint-minutes", "0.002")
    wait_for_rows(proc, run_dir, 12)
    proc.send_signal(signal.SIGSTOP)
    proc.kill()
    _, err = proc.communicate()
    assert "checkpoints: every 1000 steps and every 0.002 min, whichever comes first" in err
    before = rows(run_dir)
    resumed_from = checkpoint_steps(run_dir)[-1]
    # Checkpoints came by wall time alone (the step cadence is 1000): more than the first one, which the compile's
    # seconds made due.
    assert 2 <= resumed_from <= before[-1]["step"] < 40
    killed = proc.pid
    assert f'"pid": {killed}' in (run_dir / "run.lock").read_text()  # kill -9 left its lock file behind
    proc = launch(run_dir, *steps, "--checkpoint-minutes", "0.002")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert f"steps {resumed_from} -> 40 (resumed)" in out
    # The dead run's lock is taken over, with one line saying so.
    took_over = [line for line in err.splitlines() if "took over the run directory lock" in line]
    assert len(took_over) == 1 and f"(pid {killed} on host" in took_over[0], err[-3000:]
    assert f"pid {killed} is no longer running" in took_over[0]
    after = rows(run_dir)
    assert [r["step"] for r in after] == list(range(1, 41))
    assert after[:resumed_from] == before[:resumed_from]  # the rows up to the checkpoint are the first run's
    assert [r["loss"] for r in after] == [r["loss"] for r in rows(tmp_path / "whole")]
    final = [ocp.StandardCheckpointer().restore(d / "checkpoints" / "40" / "state") for d in (run_dir,
                                                                                              tmp_path / "whole")]
    for resumed, uninterrupted in zip(jax.tree.leaves(final[0]), jax.tree.leaves(final[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(resumed), np.asarray(uninterrupted))


# ------------------------------------------------------------------------------------------- disk full
@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs (the tests run as root, as CI does); unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    assert done.returncode == 0, f"this test mounts a small tmpfs to fill it and needs root: {done.stderr}"
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_one_clear_line_and_keeps_the_previous_checkpoint(small_disk, two_steps):
    run_dir = copy_run(two_steps, small_disk / "run")  # written on 8 devices, resumed below on 1
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints" / "2").rglob("*") if f.is_file())
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * max(free - size // 3, 0))  # room for a third of a checkpoint

    proc = launch(run_dir, "--steps", "4", "--extend")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    message = err.strip().splitlines()[-1]
    assert "could not write checkpoint step 4" in message and "MiB free" in message  # checked before writing
    assert "the previous checkpoint (step 2) is intact" in message
    assert checkpoint_steps(run_dir) == [2] and state_is_finite(run_dir, 2)

    filler.unlink()  # with space again, the run resumes from step 2
    proc = launch(run_dir, "--steps", "4", "--extend")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "steps 2 -> 4 (resumed)" in out


def test_a_full_disk_reported_by_the_writer_is_named_as_such(tmp_path):
    """When the disk fills during a write (after the free-space check), tensorstore reports ENOSPC inside a
    ValueError's text; the error still says what happened and which checkpoint is kept."""
    from nnx_zoo.train.checkpoint import Checkpointer

    checkpoints = Checkpointer(tmp_path / "checkpoints")
    checkpoints._pending = 4
    err = checkpoints.write_error(ValueError(
        'RESOURCE_EXHAUSTED: Error writing "w/0.0": Failed to write 4526080 bytes to file 4: No space left on '
        "device [os_error_code='28']"))
    assert str(err).startswith(f"could not write checkpoint step 4 to {checkpoints.directory}: no space left on the "
                               "device; no earlier checkpoint exists")
    checkpoints.close()
