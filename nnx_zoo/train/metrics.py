"""Per-step metrics: JSONL always, a live progress line in a terminal, and MFU against a stated peak."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per device from vendors' data sheets (no sparsity).
PEAK_FLOPS_PER_DEVICE: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
}


def measure_cpu_peak_flops(size: int = 1024, warmups: int = 3, repeats: int = 30) -> float:
    """Measured float32 matmul FLOP/s of this host: the best of ``repeats`` timed ``size``^3 matmuls after
    ``warmups`` untimed ones (the CPU has no data-sheet peak).

    The matmul runs on a *local* device: in a multi-process run ``jax.devices()[0]`` belongs to process 0, and
    timing a computation on another process's device measures only the dispatch (it once gave 499,880 GFLOP/s).
    """
    if warmups < 0 or repeats < 1:
        raise ValueError(f"need warmups >= 0 and repeats >= 1, got warmups={warmups}, repeats={repeats}")
    cpu = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), cpu)
    matmul = jax.jit(lambda x: x @ x)
    for _ in range(max(warmups, 1)):  # the first call compiles
        matmul(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_cache_path() -> Path:
    """The per-user JSON file of measured host peaks: ``$XDG_CACHE_HOME/nnx_zoo/peak_flops.json`` (by default
    ``~/.cache/nnx_zoo/peak_flops.json``). Delete it to measure again."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nnx_zoo" / "peak_flops.json"


def machine_key() -> str:
    """What a measured peak belongs to: host name, CPU model, usable cores and jax version (a change in any of
    them can change the peak, so it gets its own measurement)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:  # not Linux
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.node()} | {model} | {cores} cores | jax {jax.__version__}"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, unreadable or corrupt: measure again and rewrite it
        return {}
    return data if isinstance(data, dict) else {}


def _lock(f: Any) -> None:
    """Exclusive lock on an open file until it is closed (POSIX): processes of one run on one host then measure one
    at a time, and the later ones reuse the first one's result instead of measuring while it loads the cores."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock, each process may measure
        return
    fcntl.flock(f, fcntl.LOCK_EX)


def cpu_peak_flops() -> tuple[float, str]:
    """(this host's float32 matmul FLOP/s, where it came from): measured once per machine (``machine_key``) and
    cached in ``peak_cache_path()``, so that runs on one machine divide by the same peak. Without a writable
    cache it is measured on every call."""
    path, key = peak_cache_path(), machine_key()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_suffix(".lock").open("a")
    except OSError as err:
        return measure_cpu_peak_flops(), f"measured now (not cached: {err})"
    with lock:
        _lock(lock)
        entry = _read_cache(path).get(key)
        if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
            return float(entry["flops"]), f"cached on {entry.get('measured_on', '?')} in {path}"
        flops = measure_cpu_peak_flops()
        cache = _read_cache(path)
        cache[key] = {"flops": flops, "measured_on": datetime.date.today().isoformat(),
                      "method": "best of 30 float32 1024^3 matmuls after 3 warmups"}
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(cache, indent=1) + "\n")
            os.replace(tmp, path)  # atomic: a reader never sees half a file
        except OSError as err:
            return flops, f"measured now (not cached: {err})"
        return flops, f"measured now, cached in {path}"


def peak_flops_per_device(given: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from): ``given`` when set (``--peak-flops``), else the data-sheet
    dense bf16 peak of a known accelerator, else on CPU the cached host matmul peak split over the local devices.
    Only this process's (local) devices count: every process of a multi-process run measures its own host."""
    if given is not None:
        if not (isinstance(given, (int, float)) and math.isfinite(given) and given > 0):
            raise ValueError(f"the peak FLOP/s per device must be a positive number, got {given!r}")
        return float(given), "given by --peak-flops"
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        # Fake CPU devices share the host's cores, so each gets an equal part of the host peak.
        host, origin = cpu_peak_flops()
        n = jax.local_device_count()
        return host / n, f"f32 1024^3 matmul peak of this host, {host / 1e9:.0f} GFLOP/s / {n} devices, {origin}"
    for name, flops in PEAK_FLOPS_PER_DEVICE.items():
        if device.device_kind.startswith(name):
            return flops, f"data sheet: dense bf16 peak of {device.device_kind}"
    return math.nan, f"unknown device kind {device.device_kind!r}: MFU not reported (give one with --peak-flops)"


def device_peak_memory_gib() -> float | None:
    """The most memory any local device has held so far, in GiB (XLA's ``peak_bytes_in_use``), or None where the
    backend does not report it (XLA:CPU).

    >>> device_peak_memory_gib()  # on a CPU
    """
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) / 2**30 if peaks else None


class MetricsWriter:
    """Appends one JSON object per logged step to ``<run dir>/metrics.jsonl``; with ``tensorboard``, also writes
    every finite number of it as a TensorBoard scalar (tag = the JSON key) under ``<run dir>/tensorboard``.

    >>> writer = MetricsWriter("runs/demo", tensorboard=True)
    >>> writer.write({"step": 1, "loss": 5.2})
    >>> writer.close()
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False, enabled: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                try:
                    from tensorboardX import SummaryWriter  # the optional `tensorboard` extra
                except ImportError as err:
                    raise RuntimeError(
                        "--tensorboard needs tensorboardX: pip install 'nnx-zoo[tensorboard]' (or tensorboardX)"
                    ) from err
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def drop_after(self, step: int) -> int:
        """Remove the rows of steps after ``step`` (and a torn last line), returning how many went.

        A run that crashed after its last checkpoint logged steps that the resumed run trains again; without this
        the file would hold two rows for each of them. The file is replaced atomically.
        """
        if not self.enabled or not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                keep = json.loads(line)["step"] <= step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line)
            else:
                dropped += 1
        if dropped:
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        return dropped

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class ProgressLine:
    """A one-line live progress display (rewritten in place on a terminal, a line per update otherwise)."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True):
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()

    def update(self, step: int, fields: dict[str, float]) -> None:
        if not self.enabled:
            return
        width = 24
        done = int(width * step / max(self.total, 1))
        bar = "#" * done + "." * (width - done)
        text = f"[{bar}] {step}/{self.total} " + " ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        self.stream.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt(value: float) -> str:
    if isinstance(value, int) or (abs(value) >= 100 and value == int(value)):
        return f"{int(value)}"
    return f"{value:.4g}"
