"""Idle pipeline ticks: skipped (``lax.cond``) against masked (``jnp.where``), per schedule, in one process.

``nnx_zoo.layers.pipeline.IDLE_TICKS`` forces how a stage spends a tick it has no work for: ``"skip"`` runs its
layers (and 1F1B's head and backward) under ``jax.lax.cond`` on the tick's validity, ``"mask"`` computes them and
drops the result (the program before idle skipping; what ``"auto"`` picks on the CPU with FSDP inside a stage,
where XLA:CPU's collectives deadlock inside branches: so ``--stage-only``, a mesh ``{"stage": S}`` on S devices, is
the comparison that runs here). For a small Llama (8 layers, hidden 128, seq 128, batch 32, vocab 1000), meshes
``{"stage": S, "fsdp": 8 / S}`` (S = 4, 2; Auto) and M = S, 4S pipeline micro-batches, every schedule (gpipe, 1f1b,
interleaved V = 2) is compiled both ways (the trainer's ``train_step``: forward, backward, AdamW) and reported:

- **the compiled program**: how many ``conditional`` instructions it holds, its matmul FLOPs per device counted
  statically (every ``dot`` times the trip counts of the loops around it, and *both* branches of every
  conditional, as XLA's ``cost_analysis()`` counts them: the skipped program reads the same as the masked one),
  the share of those FLOPs that sit inside a conditional's branches (work that runs only on busy ticks), and
  the temporaries from buffer assignment;
- **step time**: all six programs of one (S, M) timed interleaved (``_harness.interleaved``: rounds alternate,
  order rotated), median of rounds; the box has 2 shared cores, so read the ratios: skip / mask per schedule
  (median of per-round ratios), and each against GPipe skipped.

The compute bubble each schedule should show (skip): GPipe ``(S-1)/(M+S-1)``; 1F1B ``(S-1)/(M+S-1)``;
interleaved ``(S-1)/(VM+S-1)``; masked: GPipe the same (its idle ticks still ran), 1F1B ``(2S-2)/(M+2S-2)``,
interleaved ``(VS+S-2)/(VM+VS+S-2)``. On this box's 2 shared cores the step time follows the work executed (an idle
fake device frees the cores), not the critical path.

    python benchmarks/pipeline_idle.py --stage-only [--stages 4 2] [--micro-factors 1 4] [--rounds 3]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

import _harness as h  # noqa: E402
import jax  # noqa: E402
from compiled_programs import _SHAPE, _computations  # noqa: E402
from pipeline_schedules import compile_on, config, real_inputs  # noqa: E402

from nnx_zoo import Llama3Config  # noqa: E402
from nnx_zoo.layers import pipeline  # noqa: E402
from nnx_zoo.sharding import make_mesh  # noqa: E402

DEVICES = 8
MODES = ("mask", "skip")
_DEF = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+|\(.*?\)) ([\w\-]+)\((.*)$")


def bubble(schedule: str, mode: str, s: int, m: int, v: int) -> float:
    """The compute bubble per stage (the share of its time a stage computes nothing useful) the program implies."""
    if schedule == "gpipe":
        return (s - 1) / (m + s - 1)
    if mode == "mask":
        return (v * s + s - 2) / (v * m + v * s + s - 2)
    return (s - 1) / (v * m + s - 1)


def _callees(line: str) -> list[str]:
    """The computations one instruction calls (every branch of a conditional)."""
    names = re.findall(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)", line)
    m = re.search(r"branch_computations=\{([^}]*)\}", line)
    return names + ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m else [])


def program_facts(hlo: str) -> dict:
    """Conditionals, static dot FLOPs per device (loops' trip counts, every branch of a conditional counted as if
    it ran), and the share of them inside a conditional's branches."""
    comps, entry = _computations(hlo)
    runs, in_branch, order = {entry: 1}, {entry: False}, [entry]
    for name in order:  # callers before callees (HLO has no recursion)
        for line in comps.get(name, ()):
            trip = 1
            if " while(" in line:
                trip = int(re.search(r'"known_trip_count":\{"n":"(\d+)"', line).group(1))
            for callee in _callees(line):
                if callee in comps:
                    if callee not in runs:
                        order.append(callee)
                    runs[callee] = runs.get(callee, 0) + runs[name] * trip
                    in_branch[callee] = in_branch.get(callee, False) or in_branch[name] or " conditional(" in line
    flops = {"all": 0.0, "in_branches": 0.0}
    for name, lines in comps.items():
        shapes = {m.group(1): m.group(2) for m in map(_DEF.match, lines) if m}
        for line in lines:
            m = _DEF.match(line)
            if m is None or m.group(3) != "dot":
                continue
            lhs = re.findall(r"%([\w.\-]+)", m.group(4).split(")")[0])[0]
            lhs_dims = [int(n) for n in _SHAPE.search(shapes[lhs]).group(2).split(",") if n]
            res = _SHAPE.search(m.group(2))
            res_dims = [int(n) for n in res.group(2).split(",") if n] if res else []
            contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line).group(1)
            f = 2.0 * math.prod(res_dims) * math.prod(lhs_dims[int(d)] for d in contract.split(",") if d)
            flops["all"] += f * runs.get(name, 0)
            if in_branch.get(name):
                flops["in_branches"] += f * runs.get(name, 0)
    return {"conditionals": sum(" conditional(" in line for lines in comps.values() for line in lines),
            "dot_flops_static": flops["all"], "dot_flops_in_branches": flops["in_branches"]}


def compile_step(cfg: Llama3Config, mesh, batch: int, seq: int, kwargs: tuple, mode: str):
    """``pipeline_schedules.compile_on`` with ``IDLE_TICKS = mode`` while the step is traced; returns
    ``(compiled, input shardings, compile seconds)``."""
    before, pipeline.IDLE_TICKS = pipeline.IDLE_TICKS, mode
    try:
        return compile_on(cfg, mesh, batch, seq, kwargs)
    finally:
        pipeline.IDLE_TICKS = before


def run(a: argparse.Namespace) -> list[dict]:
    cfg = config(a)
    cases = []
    for s in a.stages:
        fsdp = 1 if a.stage_only else DEVICES // s
        mesh = make_mesh({"stage": s, "fsdp": fsdp}, devices=jax.devices()[:s * fsdp])
        for factor in a.micro_factors:
            m = factor * s
            timed, group, inputs, losses = {}, [], None, {}
            for name in a.schedules:
                v = 2 if name == "interleaved" else 1
                kwargs = (("pipeline_microbatches", m), ("pipeline_schedule", name))
                for mode in MODES:
                    compiled, (shardings, rows), secs = compile_step(cfg, mesh, a.batch, a.seq, kwargs, mode)
                    mem = compiled.memory_analysis()
                    case = {"schedule": name, "mode": mode, "stages": s, "fsdp": fsdp, "microbatches": m,
                            "virtual_stages": v, "compile_s": secs, **program_facts(compiled.as_text()),
                            "temp_bytes": int(mem.temp_size_in_bytes), "bubble": bubble(name, mode, s, m, v)}
                    cases.append(case)
                    group.append(case)
                    print(f"S={s} M={m} {name} {mode}: compiled {secs:.1f}s, {case['conditionals']} conditionals, "
                          f"dot GFLOP {case['dot_flops_static'] / 1e9:.3f} "
                          f"({case['dot_flops_in_branches'] / max(case['dot_flops_static'], 1):.0%} in branches), "
                          f"temp {case['temp_bytes'] / 2**20:.1f} MiB", flush=True)
                    if inputs is None:
                        inputs = real_inputs(cfg, shardings, rows, a.batch, a.seq)
                    losses[f"{name}/{mode}"] = float(compiled(*inputs)[1])
                    timed[f"{name}/{mode}"] = (lambda c=compiled, args=inputs: jax.block_until_ready(c(*args)[1]))
            times = h.interleaved(timed, rounds=a.rounds, target_s=a.target_s, warmup=0)
            for case in group:
                key = f"{case['schedule']}/{case['mode']}"
                case["loss"] = losses[key]
                case["seconds"] = times[key]
                case["median_s"] = h.median(times[key])
                case["vs_mask"] = h.ratio_stats(times[key], times[f"{case['schedule']}/mask"])["median_round_ratio"]
                if "gpipe/skip" in times:
                    case["vs_gpipe_skip"] = h.ratio_stats(times[key], times["gpipe/skip"])["median_round_ratio"]
                print(f"  {key}: {case['median_s'] * 1e3:.0f} ms/step, x{case['vs_mask']:.3f} of masked, "
                      f"x{case.get('vs_gpipe_skip', float('nan')):.3f} of gpipe/skip, loss {case['loss']:.6f}",
                      flush=True)
    return cases


def render(cases: list[dict]) -> str:
    return h.markdown_table(
        ["schedule", "S x fsdp", "M", "idle ticks", "bubble (formula)", "conditionals", "dot GFLOP/device (static)",
         "in branches", "temp MiB", "ms/step (median)", "vs masked", "vs gpipe skip"],
        [[c["schedule"], f"{c['stages']} x {c['fsdp']}", c["microbatches"], c["mode"], f"{c['bubble']:.3f}",
          c["conditionals"], f"{c['dot_flops_static'] / 1e9:.3f}",
          f"{c['dot_flops_in_branches'] / max(c['dot_flops_static'], 1):.0%}", f"{c['temp_bytes'] / 2**20:.1f}",
          f"{c['median_s'] * 1e3:.0f}", f"{c['vs_mask']:.3f}", f"{c.get('vs_gpipe_skip', float('nan')):.3f}"]
         for c in cases])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[4, 2])
    p.add_argument("--micro-factors", type=int, nargs="+", default=[1, 4], help="M = factor x S")
    p.add_argument("--schedules", nargs="+", default=list(pipeline.SCHEDULES))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target-s", type=float, default=0.5, help="seconds per contender per round")
    p.add_argument("--stage-only", action="store_true",
                   help="mesh {stage: S} on S devices: no collective inside a stage's branches (see the docstring)")
    p.add_argument("--out", default="pipeline_idle", help="results/<out>.json and .md")
    a = p.parse_args()
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]
    cases = run(a)
    load.append(os.getloadavg()[0])
    md = render(cases)
    print(md)
    h.write_results(a.out, {"environment": h.environment(), "args": vars(a), "load_average": load,
                            "wall_s": time.perf_counter() - t0, "cases": cases},
                    f"# pipeline_idle\n\n`{' '.join(['python benchmarks/pipeline_idle.py', *sys.argv[1:]])}`, "
                    f"{h.environment()['date_utc']}, load {load[0]:.1f} -> {load[1]:.1f}\n\n{md}")


if __name__ == "__main__":
    main()
