"""Per-step metrics: JSONL always, a live progress line in a terminal, and MFU against a stated peak (``Peak``)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
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


# How the CPU peak is measured. A single burst of matmuls measures whatever else the host runs at that moment (a
# peak cached under load once gave MFUs 2-3x too high for good), so we take the best of several rounds spread over
# about a second. 1024^3 already reaches XLA:CPU's matmul peak (768 to 2048 gave the same GFLOP/s within 2%).
CPU_PEAK_SIZE, CPU_PEAK_WARMUPS, CPU_PEAK_REPEATS, CPU_PEAK_ROUNDS, CPU_PEAK_GAP_S = 1024, 3, 6, 5, 0.2
# Cache entries of an older method (version 1: one burst of 30 matmuls) are measured again (keeping the max).
CPU_PEAK_METHOD_VERSION = 2


def cpu_peak_method(size: int = CPU_PEAK_SIZE, warmups: int = CPU_PEAK_WARMUPS, repeats: int = CPU_PEAK_REPEATS,
                    rounds: int = CPU_PEAK_ROUNDS, gap_s: float = CPU_PEAK_GAP_S) -> str:
    """The measurement method in words, as the cache entry and the peak's source state it."""
    return (f"best of {rounds} rounds {gap_s:g} s apart, each {repeats} float32 {size}^3 matmuls, "
            f"after {warmups} warm-ups")


def _time_matmul(matmul: Callable[[jax.Array], jax.Array], a: jax.Array) -> float:
    """Wall seconds of one matmul (its own function so that tests can feed timings)."""
    start = time.perf_counter()
    matmul(a).block_until_ready()
    return time.perf_counter() - start


def measure_cpu_peak_flops(size: int = CPU_PEAK_SIZE, warmups: int = CPU_PEAK_WARMUPS,
                           repeats: int = CPU_PEAK_REPEATS, rounds: int = CPU_PEAK_ROUNDS,
                           gap_s: float = CPU_PEAK_GAP_S) -> float:
    """Measured float32 matmul FLOP/s of this host (the CPU has no data-sheet peak): ``rounds`` rounds of
    ``repeats`` timed ``size``^3 matmuls, ``gap_s`` seconds apart, after ``warmups`` untimed ones; the result is
    the best round's rate (a round's rate: its fastest matmul). Spreading the rounds in time lets one of them
    miss a burst of other load, which would otherwise set the peak too low. About 1.5 s on a 2-core host.

    The matmul runs on a *local* device: in a multi-process run ``jax.devices()[0]`` belongs to process 0, and
    timing a computation on another process's device measures only the dispatch (it once gave 499,880 GFLOP/s).

    >>> measure_cpu_peak_flops()  # doctest: +SKIP
    214716584936.1
    """
    if warmups < 0 or repeats < 1 or rounds < 1 or gap_s < 0:
        raise ValueError(f"need warmups >= 0, repeats >= 1, rounds >= 1 and gap_s >= 0, got warmups={warmups}, "
                         f"repeats={repeats}, rounds={rounds}, gap_s={gap_s}")
    cpu = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), cpu)
    matmul = jax.jit(lambda x: x @ x)
    for _ in range(max(warmups, 1)):  # the first call compiles
        matmul(a).block_until_ready()
    best_round = 0.0
    for r in range(rounds):
        if r:
            time.sleep(gap_s)
        round_rate = 2 * size**3 / min(_time_matmul(matmul, a) for _ in range(repeats))
        best_round = max(best_round, round_rate)
    return best_round


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


def _write_cache(path: Path, cache: dict[str, Any]) -> OSError | None:
    """Replace the cache file atomically (a reader never sees half a file); the error, if it could not."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(cache, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        return err
    return None


def _entry_flops(entry: Any) -> float | None:
    """A cache entry's host FLOP/s, or None when the entry is missing or malformed."""
    if isinstance(entry, dict):
        flops = entry.get("flops")
        if isinstance(flops, (int, float)) and math.isfinite(flops) and flops > 0:
            return float(flops)
    return None


def _lock(f: Any) -> None:
    """Exclusive lock on an open file until it is closed (POSIX): processes of one run on one host then measure one
    at a time, and the later ones reuse the first one's result instead of measuring while it loads the cores."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock, each process may measure
        return
    fcntl.flock(f, fcntl.LOCK_EX)


def _open_lock(path: Path) -> TextIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_suffix(".lock").open("a")


def _gflops(flops: float) -> str:
    return f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e13 else f"{flops / 1e9:.0f} GFLOP/s"


def cpu_peak_flops() -> tuple[float, str]:
    """(this host's float32 matmul FLOP/s, where it came from): measured once per machine (``machine_key``) and
    cached in ``peak_cache_path()``, so that runs on one machine divide by the same peak. The cached value may
    since have been raised by ``raise_cpu_peak_flops``. Without a writable cache it is measured on every call."""
    path, key = peak_cache_path(), machine_key()
    try:
        lock = _open_lock(path)
    except OSError as err:
        return measure_cpu_peak_flops(), f"measured now (not cached: {err})"
    with lock:
        _lock(lock)
        entry = _read_cache(path).get(key)
        cached = _entry_flops(entry)
        if cached is not None and entry.get("method_version") == CPU_PEAK_METHOD_VERSION:
            raised = f", raised on {entry['raised_on']} ({entry.get('raised_by', '?')})" if "raised_on" in entry else ""
            return cached, f"measured on {entry.get('measured_on', '?')}{raised}, cached in {path}"
        # None, or an entry of an older method (one burst, possibly under load): measure now, keep the higher one
        measured = measure_cpu_peak_flops()
        flops = max(measured, cached or 0.0)
        cache = _read_cache(path)
        cache[key] = {"flops": flops, "measured_flops": measured, "measured_on": datetime.date.today().isoformat(),
                      "method": cpu_peak_method(), "method_version": CPU_PEAK_METHOD_VERSION}
        if flops > measured:
            cache[key]["kept_from_older_method"] = cached
        err = _write_cache(path, cache)
        if err is not None:
            return flops, f"measured now (not cached: {err})"
        kept = f" (kept the older cached {_gflops(flops)} over {_gflops(measured)} now)" if flops > measured else ""
        return flops, f"measured now{kept}, cached in {path}"


def raise_cpu_peak_flops(achieved: float, *, remeasure: bool = True, step: int | None = None) -> tuple[float, str]:
    """(this host's raised peak FLOP/s, what raised it) after a training step ran at ``achieved`` model FLOP/s on
    this host, above the peak it divided by: the max of the cached peak, a fresh measurement (with ``remeasure``)
    and ``achieved`` itself, written back to the cache so that later runs on this machine start from it.

    Under the cache's lock: when another process (of this run, or another) has meanwhile cached a peak at least
    ``achieved``, that one is taken without measuring again.
    """
    path, key = peak_cache_path(), machine_key()
    at = f" at step {step}" if step is not None else ""
    why = f"a training step ran at {_gflops(achieved)} on this host"
    try:
        lock = _open_lock(path)
    except OSError as err:
        measured = measure_cpu_peak_flops() if remeasure else 0.0
        return max(measured, achieved), f"raised{at} after {why} (not cached: {err})"
    with lock:
        _lock(lock)
        cache = _read_cache(path)
        entry = cache.get(key) if isinstance(cache.get(key), dict) else {}
        cached = _entry_flops(entry) or 0.0
        if cached >= achieved:  # raised meanwhile by another process: no second measurement
            return cached, f"raised{at} to the {_gflops(cached)} another process cached in {path}"
        measured = measure_cpu_peak_flops() if remeasure else 0.0
        flops = max(cached, measured, achieved)
        if measured:
            why += f" (re-measured now: {_gflops(measured)})"
            entry["measured_flops"] = max(measured, entry.get("measured_flops") or 0.0)
        today = datetime.date.today().isoformat()
        entry.update(flops=flops, raised_on=today, raised_by=why)
        entry.setdefault("measured_on", today)
        entry.setdefault("method", cpu_peak_method())
        entry.setdefault("method_version", CPU_PEAK_METHOD_VERSION)
        cache[key] = entry
        err = _write_cache(path, cache)
        where = f"not cached: {err}" if err is not None else f"cached in {path}"
        return flops, f"raised{at} after {why}, {where}"


def _cpu_source(host: float, devices: int, origin: str) -> str:
    return f"float32 matmul peak of this host ({cpu_peak_method()}), {_gflops(host)} / {devices} devices, {origin}"


@dataclass
class Peak:
    """The peak FLOP/s per device that MFU divides by, and where it came from (``resolve_peak`` builds one).

    ``kind`` is ``"given"`` (``--peak-flops``), ``"data sheet"``, ``"measured"`` (a CPU host's cached matmul peak)
    or ``"unknown"`` (``value`` is NaN and ``mfu`` gives None). ``mfu`` never exceeds 1.0: a step whose model
    FLOP/s beats a *measured* peak shows that the measurement was low (taken under load), so the peak is raised
    (re-measured at most once per ``recheck_interval_s``, and at least to the step's rate), the cache too, and
    ``source`` says so; a step that beats a given or data-sheet peak means the FLOP count or that peak is wrong:
    MFU is clamped to 1.0, ``exceeded_by`` keeps the highest such rate, and a warning is issued once.

    >>> peak = resolve_peak(None)          # or resolve_peak(989e12) for a stated peak
    >>> mfu = peak.mfu(achieved_flops_per_device, step=step)   # per logged step; None when the peak is unknown
    >>> summary.update(peak_flops_per_device=peak.value, peak_source=peak.source)   # at the end: may be raised
    """

    value: float
    source: str
    kind: str = "given"
    devices: int = 1  # local devices a measured host peak is split over
    recheck_interval_s: float = 300.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    exceeded_by: float | None = None  # highest per-device rate above a given / data-sheet peak
    raises: int = 0
    _last_recheck: float | None = field(default=None, repr=False)
    _base_source: str = field(default="", repr=False)
    _exceeded_at: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        self._base_source = self._base_source or self.source

    def mfu(self, achieved_flops_per_device: float, step: int | None = None) -> float | None:
        """``achieved_flops_per_device / value``, at most 1.0; None when the peak or the rate is unknown."""
        achieved = achieved_flops_per_device
        if not (math.isfinite(self.value) and self.value > 0) or achieved is None or not math.isfinite(achieved):
            return None
        if achieved > self.value:
            if self.kind == "measured":
                self._raise(achieved, step)
            else:
                self._exceeded(achieved, step)
        return min(achieved / self.value, 1.0)

    def _raise(self, achieved: float, step: int | None) -> None:
        now = self.clock()
        # A measurement costs ~1.5 s of the run: at most one per interval; in between, raise to the step's rate.
        remeasure = self._last_recheck is None or now - self._last_recheck >= self.recheck_interval_s
        if remeasure:
            self._last_recheck = now
        host, origin = raise_cpu_peak_flops(achieved * self.devices, remeasure=remeasure, step=step)
        self.value = max(self.value, host / self.devices, achieved)  # max: no rounding puts MFU above 1
        self.raises += 1
        self.source = _cpu_source(self.value * self.devices, self.devices, origin)

    def _exceeded(self, achieved: float, step: int | None) -> None:
        if self.exceeded_by is None:  # warn once; the source keeps the highest rate
            self._exceeded_at = f" at step {step}" if step is not None else ""
            warnings.warn(f"a step{self._exceeded_at} ran at {_gflops(achieved)} per device, above the peak MFU "
                          f"divides by ({_gflops(self.value)}, {self._base_source}): the model FLOP count or the "
                          f"peak is wrong; MFU is clamped to 100%", RuntimeWarning, stacklevel=3)
        self.exceeded_by = max(achieved, self.exceeded_by or 0.0)
        self.source = (f"{self._base_source}; steps ran above it (up to {_gflops(self.exceeded_by)} per device, "
                       f"first{self._exceeded_at}): the model FLOP count or this peak is wrong, MFU clamped to 100%")


def resolve_peak(given: float | None = None, *, recheck_interval_s: float = 300.0) -> Peak:
    """The ``Peak`` per device that MFU divides by: ``given`` when set (``--peak-flops``), else the data-sheet
    dense bf16 peak of a known accelerator, else on CPU the cached host matmul peak split over the local devices.
    Only this process's (local) devices count: every process of a multi-process run measures its own host.

    >>> peak = resolve_peak(100e9)
    >>> peak.mfu(40e9, step=10)
    0.4
    """
    if given is not None:
        if not (isinstance(given, (int, float)) and math.isfinite(given) and given > 0):
            raise ValueError(f"the peak FLOP/s per device must be a positive number, got {given!r}")
        return Peak(float(given), "given by --peak-flops", kind="given")
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        # Fake CPU devices share the host's cores, so each gets an equal part of the host peak.
        host, origin = cpu_peak_flops()
        n = jax.local_device_count()
        return Peak(host / n, _cpu_source(host, n, origin), kind="measured", devices=n,
                    recheck_interval_s=recheck_interval_s)
    for name, flops in PEAK_FLOPS_PER_DEVICE.items():
        if device.device_kind.startswith(name):
            return Peak(flops, f"data sheet: dense bf16 peak of {device.device_kind}", kind="data sheet")
    return Peak(math.nan, f"unknown device kind {device.device_kind!r}: MFU not reported (give one with "
                "--peak-flops)", kind="unknown")


def peak_flops_per_device(given: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from) at the start of a run: ``resolve_peak(given)``'s value and
    source, for callers that do not need the MFU clamp or the raise of a measured peak."""
    peak = resolve_peak(given)
    return peak.value, peak.source


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
