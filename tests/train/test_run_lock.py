"""The run directory lock on its own (no training): a live holder refuses a second one and is named; a dead
holder's lock is taken over with one line; another host's lock is judged by its heartbeat. The recipe-level cases
(two recipe processes, ``kill -9``, a multi-process run) are in tests/recipes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from nnx_zoo.train import RunDirLockedError, RunLock


def test_a_second_lock_on_a_held_directory_is_refused_and_names_the_holder(tmp_path):
    with RunLock(tmp_path) as first:
        holder = json.loads(first.path.read_text())
        start = time.monotonic()
        with pytest.raises(RunDirLockedError) as refused:
            RunLock(tmp_path).acquire()
        assert time.monotonic() - start < 1  # at once, not after waiting for the holder
    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}, started {holder['started']}" in message
    assert holder["command"] in message and "another --run-dir" in message
    assert f"run `kill {os.getpid()}` (SIGTERM" in message
    # A clean release empties the file: the next run takes it without a word.
    assert first.path.read_text() == ""
    with RunLock(tmp_path) as again:
        assert again.took_over is None


def test_a_dead_processes_lock_is_taken_over_with_one_line(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                   "started": "then", "command": "python old.py"}))
    with RunLock(tmp_path) as lock:
        assert f"pid {dead.pid} is no longer running" in lock.took_over and "python old.py" in lock.took_over
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_another_hosts_lock_is_judged_by_its_heartbeat(tmp_path):
    path = tmp_path / "run.lock"
    path.write_text(json.dumps({"pid": 4242, "host": "node-7", "started": "then", "command": "python run.py"}))
    with pytest.raises(RunDirLockedError) as refused:  # fresh: that run may be alive, and its pid cannot be checked
        RunLock(tmp_path).acquire()
    message = str(refused.value)
    assert "pid 4242 on host node-7" in message and "run `kill 4242` on host node-7 (SIGTERM" in message
    assert "last heartbeat was 0 s ago" in message and f"delete {path}" in message
    old = time.time() - 301
    os.utime(path, (old, old))  # no heartbeat for longer than STALE_AFTER_S (300 s)
    with RunLock(tmp_path) as lock:
        assert "host node-7 is not this one and its heartbeat stopped 301 s ago" in lock.took_over


def test_the_holder_keeps_its_heartbeat(tmp_path):
    with RunLock(tmp_path, heartbeat_s=0.05) as lock:
        old = time.time() - 1000
        os.utime(lock.path, (old, old))
        time.sleep(0.3)
        assert time.time() - lock.path.stat().st_mtime < 5
