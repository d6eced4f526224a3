"""One run directory, one run: a lock file that a second run is refused by, and that a dead run leaves behind.

``<run dir>/run.lock`` is held with ``fcntl.flock`` for as long as the run lives and names its holder (pid, host,
start time, command). The kernel drops a ``flock`` when its process dies, however it dies (``kill -9``, OOM), so a
lock whose file still names a holder but that nobody holds was left by a dead run: it is taken over, with one line
saying so.

A holder on another host is judged differently, because ``flock`` on a network filesystem may only lock against
processes of the same host (NFSv4 locks across clients, others do not) and that host's pid cannot be checked from
here. The holder touches the file every ``HEARTBEAT_S`` seconds (a daemon thread, so long compiles beat too); a lock
naming another host is taken over only once its heartbeat is older than ``STALE_AFTER_S`` (a crashed or rebooted
host's run can thus block its directory for up to that long; the refusal says so and how to clear it at once).

In a multi-process run only the coordinating process (``jax.process_index() == 0``) takes the lock; it tells the
others whether it got it, so all of them stop together with the same message when it did not.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
_MESSAGE_BYTES = 4096


class RunDirLockedError(RuntimeError):
    """The run directory belongs to another live run; the message names it, how to stop it, or what to use instead."""


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def _read(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"unreadable": text[:200]}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder or "pid" not in holder:
        return "another process (it has not written its details yet)"
    return (f"pid {holder['pid']} on host {holder.get('host', '?')}, started {holder.get('started', '?')}, "
            f"command: {holder.get('command', '?')}")


class RunLock:
    """Holds ``<run_dir>/run.lock`` from ``acquire()`` to ``release()`` (or as a context manager).

    >>> with RunLock("runs/llama3-tiny"):
    ...     ...  # train; a second RunLock on the same directory raises RunDirLockedError meanwhile
    """

    def __init__(self, run_dir: str | Path, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.run_dir = Path(run_dir).absolute()
        self.path = self.run_dir / LOCK_NAME
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.took_over: str | None = None  # the line printed when a dead run's lock was taken over

    def acquire(self) -> None:
        """Take the lock, or raise ``RunDirLockedError`` at once (never waits for the other run)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flocked = self._flock(fd)
            previous = _read(self.path)
            self._judge(previous, flocked)
            me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
                  "command": shlex.join([sys.executable, *sys.argv])}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="nnx_zoo run lock heartbeat", daemon=True)
        self._beat.start()

    def _flock(self, fd: int) -> bool:
        """True when the kernel granted the lock; False when this filesystem has no flock (then only the
        recorded holder is judged). A lock held by a live process raises the refusal."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = None
            for _ in range(20):  # the holder may be between taking the lock and writing its details
                holder = _read(self.path)
                if holder and "pid" in holder:
                    break
                time.sleep(0.05)
            raise RunDirLockedError(self._refusal(holder)) from None
        except OSError as err:
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise

    def _judge(self, previous: dict[str, Any] | None, flocked: bool) -> None:
        """Whether the holder recorded in the file (which did not hold the kernel lock, or no kernel lock exists) is
        gone: refuse if it may still be alive, else note the takeover."""
        if not previous:
            return  # a fresh directory, or a run that ended cleanly (it empties the file)
        pid, host = previous.get("pid"), previous.get("host")
        if host is None or (host == socket.gethostname() and isinstance(pid, int)):
            if not flocked and isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid):
                raise RunDirLockedError(self._refusal(previous))
            why = f"pid {pid} is no longer running" if isinstance(pid, int) else "nobody holds it"
        else:
            age = time.time() - self.path.stat().st_mtime
            if age < self.stale_after_s:
                raise RunDirLockedError(self._refusal(previous, age=age))
            why = (f"host {host} is not this one and its heartbeat stopped {age:.0f} s ago (a lock of another host is "
                   f"taken over after {self.stale_after_s:.0f} s without one)")
        self.took_over = (f"took over the run directory lock {self.path}, left by a run that did not end cleanly "
                          f"({_describe(previous)}): {why}")

    def _refusal(self, holder: dict[str, Any] | None, age: float | None = None) -> str:
        text = f"the run directory {self.run_dir} is in use by another run: {_describe(holder)}."
        pid, host = (holder or {}).get("pid"), (holder or {}).get("host")
        if age is not None:  # another host's run, judged by its heartbeat
            text += (f" Its last heartbeat was {age:.0f} s ago; a lock of another host is taken over once it is "
                     f"{self.stale_after_s:.0f} s old. If that run is gone (its host crashed or rebooted), wait that "
                     f"long or delete {self.path}.")
        if pid is not None:
            where = f" on host {host}" if host and host != socket.gethostname() else ""
            text += (f" To stop it, run `kill {pid}`{where} (SIGTERM: it saves a checkpoint and exits; rerunning its "
                     "command resumes it).")
        return text + " To start a separate run, use another --run-dir (TrainConfig.run_dir)."

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the directory went away; the run reports its own errors

    def release(self) -> None:
        """Empty the file (a clean end: the next run takes it over silently) and drop the lock."""
        if self._fd is None:
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


_HELD: dict[Path, list[Any]] = {}  # run dir -> [its RunLock, how many holds] in this process


class _Hold:
    """One hold of a run directory's lock in this process; the lock is released with the last hold."""

    def __init__(self, key: Path):
        self.key = key

    def release(self) -> None:
        entry = _HELD.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[self.key]
            entry[0].release()


def lock_run_dir(run_dir: str | Path) -> _Hold | None:
    """Lock ``run_dir`` for this run: the coordinating process takes the lock and every process learns whether it
    did; all raise the same ``RunDirLockedError`` when it did not. Returns the hold to ``release()`` (None in the
    other processes). A process that already holds the directory (a recipe locks it first, then ``train`` does)
    holds it again. A takeover of a dead run's lock is printed once, by the coordinator.
    """
    hold, problem = None, ""
    if jax.process_index() == 0:
        key = Path(run_dir).absolute()
        if key not in _HELD:
            lock = RunLock(key)
            try:
                lock.acquire()
            except RunDirLockedError as err:
                problem = str(err)
            else:
                _HELD[key] = [lock, 0]
                if lock.took_over:
                    print(f"nnx_zoo: {lock.took_over}", file=sys.stderr)
        if not problem:
            _HELD[key][1] += 1
            hold = _Hold(key)
    if jax.process_count() > 1:
        problem = broadcast_text(problem)
    if problem:
        if hold is not None:  # this process got it but another refused (cannot happen today: only process 0 locks)
            hold.release()
        raise RunDirLockedError(problem)
    return hold


def broadcast_text(text: str) -> str:
    """Process 0's ``text`` in every process (a fixed-size byte buffer, one collective; every process calls it)."""
    buffer = np.zeros(_MESSAGE_BYTES, np.uint8)
    data = text.encode()[:_MESSAGE_BYTES]
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return bytes(got[got != 0].tolist()).decode(errors="replace")
