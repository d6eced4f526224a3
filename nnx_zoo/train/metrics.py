"""Per-step metrics: JSONL always, a live progress line in a terminal, and MFU against a stated peak."""

from __future__ import annotations

import json
import math
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


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """Measured float32 matmul FLOP/s of one host (best of ``repeats``); the CPU has no data-sheet peak."""
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), cpu)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_per_device() -> tuple[float, str]:
    """(peak FLOP/s per device, how it was obtained)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        # Fake CPU devices share the host's cores, so each gets an equal part of the measured host peak.
        host = measure_cpu_peak_flops()
        per = host / jax.local_device_count()
        return per, f"measured f32 1024^3 matmul on this host ({host / 1e9:.0f} GFLOP/s) / {jax.local_device_count()}"
    for name, flops in PEAK_FLOPS_PER_DEVICE.items():
        if device.device_kind.startswith(name):
            return flops, f"data-sheet dense bf16 peak of {device.device_kind}"
    return math.nan, f"unknown device kind {device.device_kind!r}: MFU not reported"


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
