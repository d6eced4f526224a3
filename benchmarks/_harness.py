"""Shared timing harness for the benchmark scripts (not a public module).

Method (the machine is small, shared and noisy): every contender of one comparison is compiled and warmed up
first, then timed side by side in the same process, interleaved over several rounds with the order rotated each
round. A round times `iters` back-to-back calls of one contender and records the mean seconds per call. We report
the median over rounds, and ratios both as the ratio of medians and as the median of the per-round ratios (the
latter cancels slow drifts of machine load that hit both contenders of a round alike).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def calibrate_iters(fn: Callable[[], object], target_s: float, max_iters: int = 200) -> tuple[int, float]:
    """Calls `fn` once (already warm) and returns (iters so that one round takes about target_s, seconds/call)."""
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return max(1, min(max_iters, math.ceil(target_s / max(dt, 1e-9)))), dt


def interleaved(
    contenders: dict[str, Callable[[], object]],
    *,
    rounds: int,
    target_s: float = 0.3,
    warmup: int = 1,
    warm_each_round: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Times blocking zero-argument callables side by side; returns seconds per call, one entry per round.

    ``warm_each_round`` runs each contender once, untimed, right before its timed calls in every round, so that
    no contender pays for the state the previous one left behind (caches, freed pages, idle thread pools)."""
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    iters = {}
    for name in names:
        iters[name], _ = calibrate_iters(contenders[name], target_s)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                fn, n = contenders[name], iters[name]
                if warm_each_round:
                    fn()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times[name].append((time.perf_counter() - t0) / n)
            if log:
                log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{k}={1e3 * v[-1]:.2f}ms" for k, v in times.items()))
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """num/den as ratio of medians and as median of per-round ratios (rounds are paired)."""
    per_round = [a / b for a, b in zip(num, den, strict=True)]
    return {"ratio_of_medians": median(num) / median(den), "median_round_ratio": median(per_round),
            "min_round_ratio": min(per_round), "max_round_ratio": max(per_round)}


def environment() -> dict[str, object]:
    import jax

    env: dict[str, object] = {
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    }
    try:
        import flax

        env["flax"] = flax.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        env["git_commit"] = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # pragma: no cover
        pass
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            if v == 0 or 0.01 <= abs(v) < 1e5:
                return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(stem: str, payload: dict, markdown: str, out_dir: Path | None = None) -> tuple[Path, Path]:
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    tmp = jpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    tmp.replace(jpath)
    tmp = mpath.with_suffix(".md.tmp")
    tmp.write_text(markdown.rstrip() + "\n")
    tmp.replace(mpath)
    return jpath, mpath


def compiled_flops(compiled) -> float | None:
    """XLA's flop count for a compiled executable (None when the backend does not report it)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - cost analysis is best-effort
        return None
    if isinstance(ca, list | tuple):
        ca = ca[0] if ca else None
    if not ca:
        return None
    f = ca.get("flops")
    return float(f) if f is not None else None


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its source `op_name` metadata, from `compiled.as_text()`."""
    import re

    pattern = re.compile(r'\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"')
    out = {}
    for line in hlo_text.splitlines():
        m = pattern.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


_CONTROL_FLOW = ("while", "call", "conditional")


def profile_ops(compiled, call: Callable[[], object], steps: int = 3) -> dict:
    """Per-HLO-instruction wall time of `call` (which runs `compiled`) from a jax.profiler trace.

    XLA:CPU records one trace event per executed thunk, named after its HLO instruction; instructions inside a
    scanned layer body are summed over iterations. Control-flow thunks (while/call) are skipped so nothing is
    counted twice. Returns ms per step for every instruction with its source op_name, largest first.
    """
    import glob
    import gzip
    import tempfile

    import jax

    meta = hlo_op_names(compiled.as_text())
    call()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(steps):
                call()
            wall = (time.perf_counter() - t0) / steps
        files = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        if not files:
            return {"error": "no perfetto trace written"}
        events = json.load(gzip.open(files[0]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in events:
        name = e.get("name")
        if e.get("ph") != "X" or name not in meta or name.split(".")[0] in _CONTROL_FLOW:
            continue
        total[name] = total.get(name, 0.0) + e.get("dur", 0.0)
        count[name] = count.get(name, 0) + 1
    ops = [{"hlo": k, "op_name": meta[k], "ms": v / steps / 1e3, "calls_per_step": count[k] / steps}
           for k, v in sorted(total.items(), key=lambda kv: -kv[1])]
    return {"wall_ms_per_step": 1e3 * wall, "op_ms_per_step": sum(o["ms"] for o in ops), "ops": ops}
