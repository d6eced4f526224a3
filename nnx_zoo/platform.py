"""XLA:CPU settings that nnx_zoo measured to be faster, applied through ``XLA_FLAGS`` before JAX starts.

XLA reads ``XLA_FLAGS`` once, when JAX creates its first backend, so these cannot be switched on from inside a
running program; entry points call ``use_cpu_xla_flags()`` first thing (the pretraining recipe and the
benchmarks do).

>>> from nnx_zoo.platform import use_cpu_xla_flags
>>> use_cpu_xla_flags()            # before the first JAX computation
"""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping

# Each entry: (flag, why). Measured with benchmarks/deepseek_train_step.py (benchmarks/README.md).
CPU_XLA_FLAGS: tuple[tuple[str, str], ...] = (
    (
        "--xla_cpu_experimental_ynn_fusion_type=-reduce",
        "XLA:CPU hands reductions to YNNPACK by default; on the small per-layer tensors of a DeepSeek layer each "
        "one then costs ~0.1-0.4 ms (an RMSNorm-backward row sum of a [128, 64] tensor: 0.41 ms). XLA's own "
        "fused reductions are several times cheaper: the deepseek3-tiny train step runs ~10% faster. Dots stay "
        "on YNNPACK.",
    ),
)


def use_cpu_xla_flags(environ: MutableMapping[str, str] | None = None) -> str:
    """Append ``CPU_XLA_FLAGS`` to ``XLA_FLAGS`` in ``environ`` (default ``os.environ``) and return the result.

    A flag the user already set (same name, any value) is left as it is, and nothing is added twice. Call it
    before JAX creates a backend: afterwards XLA would not read the flags, so this warns and changes nothing.
    The flags only concern the CPU backend; on GPU/TPU they are ignored.
    """
    env = os.environ if environ is None else environ
    if environ is None and _backends_started():
        warnings.warn("use_cpu_xla_flags() was called after JAX started a backend; XLA_FLAGS are read only once, "
                      "so call it before the first JAX computation", stacklevel=2)
        return env.get("XLA_FLAGS", "")
    current = env.get("XLA_FLAGS", "").split()
    present = {flag.split("=", 1)[0] for flag in current}
    added = [flag for flag, _ in CPU_XLA_FLAGS if flag.split("=", 1)[0] not in present]
    env["XLA_FLAGS"] = " ".join(current + added)
    return env["XLA_FLAGS"]


def _backends_started() -> bool:
    try:  # no public API says whether a backend exists yet
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - a JAX without that module: assume not started
        return False
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else False
