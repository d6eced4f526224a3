"""One process of a two-process run on loopback that prints its MFU peak (for tests/train/test_peak_flops.py).

python tests/train/peak_flops_process.py COORDINATOR PROCESS_ID   (4 CPU devices per process)
Prints one JSON line {"peak": FLOP/s per device, "source": "...", "mfu": ..., "raised_peak": ...,
"raised_source": "..."}: the peak at the start, then after a step that ran at 3x it.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))

from jax.experimental import multihost_utils  # noqa: E402

from nnx_zoo.train.metrics import resolve_peak  # noqa: E402

peak = resolve_peak()
start = {"peak": peak.value, "source": peak.source}
# Both have their starting peak before either raises it (else the later one could start from the raised cache).
multihost_utils.sync_global_devices("both resolved their peak")
mfu = peak.mfu(3 * peak.value, step=1)
print(json.dumps({**start, "mfu": mfu, "raised_peak": peak.value, "raised_source": peak.source}), flush=True)
