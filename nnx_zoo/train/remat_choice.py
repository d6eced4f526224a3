"""``--remat auto``: the least recomputation whose planned memory fits the device.

Rematerialization trades compute for memory: ``none`` keeps every intermediate for the backward pass, ``full``
keeps each layer's input and recomputes the rest (about a quarter more FLOPs, which MFU does not count). ``auto``
asks the memory planner (``nnx_zoo.sharding.plan.memory_plan``) what the trainer's step needs per device under each
policy and picks the first, in order of recomputation, that fits the device's memory less a stated margin. The
planner's activation estimate is within 0.85-1.15 of XLA's (``tests/sharding/test_sharding_plan.py``); the margin
covers the rest and what the planner does not see (the runtime's own buffers, fragmentation).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from nnx_zoo.sharding.report import _human

MARGIN = 0.10  # of the device's memory left free
ORDER = ("none", "full")  # least recomputation first; the policies the planner estimates


def step_bytes(plan: Any, remat: str) -> int:
    """What the trainer's step holds per device under ``remat``: the plan's total (parameters, gradients,
    optimizer state, buffers, the activations' peak) plus the updated parameters and optimizer state beside the
    old ones (the step does not donate its input state, so a non-finite step can be dropped)."""
    return plan.total(remat) + plan.param_bytes + plan.optimizer_bytes


def device_memory() -> tuple[int, str]:
    """``(bytes, where from)``: the first local device's memory limit where the runtime reports one (GPU, TPU);
    on the CPU the host's physical memory shared by its local devices."""
    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        return int(limit), f"{device.device_kind} memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    count = jax.local_device_count()
    return host // count, "host memory" + (f" / {count} local devices" if count > 1 else "")


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """The policy ``auto`` chose and why: ``needed`` per policy (bytes per device), the device's ``budget`` and
    where it came from, the ``margin`` left free.

    >>> choice = choose_remat(plan, *device_memory())
    >>> choice.policy, choice.describe()
    ('none', "remat auto: 'none', planned 3.1 GiB of 72.0 GiB usable (80.0 GiB H100 memory less 10%) ...")
    """

    policy: str
    needed: dict[str, int]
    budget: int
    source: str
    margin: float

    def describe(self) -> str:
        usable = self.budget * (1 - self.margin)
        others = ", ".join(f"'{r}' {_human(b)}" for r, b in self.needed.items() if r != self.policy)
        why = ("the least recomputation" if self.policy == ORDER[0] else
               f"the least recomputation that fits ('{ORDER[0]}' would need {_human(self.needed[ORDER[0]])})")
        return (f"remat auto: '{self.policy}', planned {_human(self.needed[self.policy])} per device of "
                f"{_human(int(usable))} usable ({_human(self.budget)} {self.source} less {self.margin:.0%}); {why}"
                + (f"; planned: {others}" if others and self.policy == ORDER[0] else "")
                + ". Force a policy with --remat.")


def choose_remat(plan: Any, budget: int, source: str = "device memory", margin: float = MARGIN) -> RematChoice:
    """The first policy of ``ORDER`` whose ``step_bytes`` fit ``budget * (1 - margin)``; a ValueError saying what
    to change when none does."""
    if not 0 <= margin < 1:
        raise ValueError(f"the memory margin must be in [0, 1), got {margin}")
    needed = {remat: step_bytes(plan, remat) for remat in ORDER}
    usable = budget * (1 - margin)
    for remat in ORDER:
        if needed[remat] <= usable:
            return RematChoice(remat, needed, budget, source, margin)
    raise ValueError(
        f"remat auto: even '{ORDER[-1]}' rematerialization is planned at {_human(needed[ORDER[-1]])} per device, "
        f"more than the {_human(int(usable))} usable ({_human(budget)} {source} less {margin:.0%}). Lower --batch "
        "or --seq-len, shard over more devices (--mesh), or force --remat full to try anyway.")
