"""Pipeline schedules (``stage`` mesh axis) read from the compiled train step: bubble, activation memory, traffic.

For a small Llama (8 layers, hidden 256, seq 64, batch 32, vocab 1000) on 8 CPU devices, a mesh
``{"stage": S, "fsdp": 8 / S}`` with S in (2, 4) and M in (S, 2S, 4S) pipeline micro-batches (the global batch
stays 32: a micro-batch is 32 / M rows), every schedule of ``nnx_zoo.layers.pipeline.SCHEDULES`` (a new schedule
there is a new row here; its formula, if any, is one entry of ``FORMULAS``) compiles the trainer's
``train_step`` (forward, backward, AdamW) and reports, per device:

- **bubble**, from the matmul FLOPs of the compiled program (``dot`` instructions, each counted as many times as
  the while loops around it run: XLA's ``cost_analysis()`` counts a loop body once, so it cannot see the ticks).
  The layer stack's executed FLOPs (every dot without the vocab dim) against the useful ones: the un-pipelined
  step's (mesh ``{"fsdp": 8 / S}``, same per-device rows) divided by S. The SPMD pipeline runs every stage on
  every tick and masks the idle ones, so the excess *is* the bubble (plus any recompute). Written beside the
  schedule's textbook formula and what this program's tick structure predicts. The head's FLOPs (dots with the
  vocab dim) are reported as a multiple of the un-pipelined head's.
- **activation memory** from XLA's buffer assignment: ``temp_size_in_bytes`` of ``memory_analysis()``, less the
  arguments (parameters and AdamW moments, an upper bound on the gradient-sized temporaries), in units of one
  micro-batch's activations on one stage: the un-pipelined step's ``temp - arguments`` / (S x M).
- **collective bytes per step**: every collective-permute, all-reduce, all-gather, reduce-scatter and all-to-all in
  ``compiled.as_text()``, its operand bytes times the trip counts of the loops around it, split by the mesh axes
  its replica groups (or source-target pairs) span: ``stage`` (between stages), ``fsdp``, or both.
- **step time**: all schedules of one (S, M) timed interleaved, median of rounds, as a ratio to GPipe (the box is
  shared and noisy: read the ratios).

    python benchmarks/pipeline_schedules.py [--quick] [--stages 2 4] [--rounds 3] [--no-time]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as h  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from compiled_programs import _SHAPE, _computations, _multiplicities, _shape_bytes  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo import Llama3, Llama3Config  # noqa: E402
from nnx_zoo.layers import pipeline  # noqa: E402
from nnx_zoo.sharding import (  # noqa: E402
    get_rules,
    logical_to_mesh_axes,
    make_mesh,
    reserve_cpu_workers,
    state_shardings,
)
from nnx_zoo.train import OptimizerConfig, make_optimizer  # noqa: E402

# PJRT_NPROC=32 before JAX starts: with XLA:CPU's default of one collective worker per device 1F1B's in-flight
# collectives can starve the pool (a rendezvous-timeout abort, seen at S=4, M=8; reserve_cpu_workers says why).
reserve_cpu_workers()
from nnx_zoo.train.step import train_step  # noqa: E402

COLLECTIVES = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
DEVICES = 8


def _gpipe_program(s: int, m: int, v: int) -> float:
    """GPipe as ``pipeline_stack`` runs it: M + S - 1 forward ticks, then as many backward ticks, all stages busy."""
    return (s - 1) / (m + s - 1)


def _one_f_one_b_program(s: int, m: int, v: int) -> float:
    """``pipeline_1f1b_value_and_grad`` (1F1B, and interleaved with V > 1): T = MV + VS + S - 2 ticks, each a
    chunk's forward (F) and a chunk's backward that recomputes it (F + 2F), every stage, masked when idle; useful
    work is M V x 3F. (Idle ticks alone: (VS + S - 2) / T; the recompute adds a quarter of every tick.)"""
    return 1 - 3 * m * v / (4 * (m * v + v * s + s - 2))


# schedule name -> (textbook bubble, this program's predicted excess of executed over useful layer FLOPs), as
# functions of (stages S, micro-batches M, virtual stages V). A schedule without an entry is measured all the same.
FORMULAS: dict[str, tuple[Callable[[int, int, int], float], Callable[[int, int, int], float] | None]] = {
    "gpipe": (lambda s, m, v: (s - 1) / (m + s - 1), _gpipe_program),
    "1f1b": (lambda s, m, v: (s - 1) / (m + s - 1), _one_f_one_b_program),
    "interleaved": (lambda s, m, v: (s - 1) / (v * m + s - 1), _one_f_one_b_program),
}


def schedules() -> list[str]:
    """The pipeline module's schedule names (a tuple of names, or a name -> spec table)."""
    return list(pipeline.SCHEDULES)


def virtual_stages(name: str) -> int:
    spec = pipeline.SCHEDULES[name] if isinstance(pipeline.SCHEDULES, dict) else None
    return int(getattr(spec, "virtual_stages", 1) or 1)


def model_kwargs(name: str, virtual: int | None) -> tuple[tuple[str, object], ...]:
    kwargs: list[tuple[str, object]] = [("pipeline_schedule", name)]
    if virtual is not None and "pipeline_virtual_stages" in inspect.signature(Llama3.forward).parameters:
        kwargs.append(("pipeline_virtual_stages", virtual))
    return tuple(kwargs)


# ---- reading the compiled program ----------------------------------------------------------------------------

_DEF = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+|\(.*?\)) ([\w\-]+)\((.*)$")


def _dims(shape: str) -> list[int]:
    m = _SHAPE.search(shape)
    return [int(n) for n in m.group(2).split(",") if n] if m else []


def dot_flops(hlo: str, vocab: int) -> dict[str, float]:
    """Matmul FLOPs per execution of the module, loop trip counts included: ``{"layers", "head"}`` (a dot with
    the vocab dim in an operand or its result is the head's)."""
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, entry)
    out = {"layers": 0.0, "head": 0.0}
    for name, lines in comps.items():
        shapes = {}
        for line in lines:
            m = _DEF.match(line)
            if m:
                shapes[m.group(1)] = m.group(2)
        for line in lines:
            m = _DEF.match(line)
            if m is None or m.group(3) != "dot":
                continue
            lhs, rhs = re.findall(r"%([\w.\-]+)", m.group(4).split(")")[0])[:2]
            lhs_dims, rhs_dims, res_dims = _dims(shapes[lhs]), _dims(shapes[rhs]), _dims(m.group(2))
            contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line).group(1)
            k = math.prod(lhs_dims[int(d)] for d in contract.split(",") if d)
            kind = "head" if vocab in (*lhs_dims, *rhs_dims, *res_dims) else "layers"
            out[kind] += 2.0 * math.prod(res_dims) * k * mult.get(name, 0)
    return out


def _iota_groups(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm is not None:
        ids = ids.transpose(perm)
    return ids.reshape(dims)


def replica_groups(line: str, devices: int) -> list[list[int]]:
    """The device groups of one collective instruction, in the four ways XLA writes them."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")]
    named = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))? "
                      r"\{([^}]*)\}", line)
    if named:  # mesh['axis_0'=4,'axis_1'=2] device_ids=([2,4]T(1,0)) {'axis_1'}: groups along the listed axes
        axes = re.findall(r"'(\w+)'=(\d+)", named.group(1))
        sizes = [int(n) for _, n in axes]
        reshape = [int(n) for n in named.group(2).split(",")] if named.group(2) else sizes
        perm = [int(n) for n in named.group(3).split(",")] if named.group(3) else None
        ids = _iota_groups(sizes, reshape, perm)
        grouped = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in named.group(4)]
        kept = [i for i in range(len(axes)) if i not in grouped]
        return ids.transpose(kept + grouped).reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if iota:
        dims = [int(n) for n in iota.group(1).split(",")]
        reshape = [int(n) for n in iota.group(2).split(",")]
        perm = [int(n) for n in iota.group(3).split(",")] if iota.group(3) else None
        return _iota_groups(dims, reshape, perm).tolist()
    listed = re.search(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}", line)
    if listed:
        return [[int(n) for n in g.split(",") if n] for g in re.findall(r"\{([0-9,]*)\}", listed.group(1))]
    return [list(range(devices))]


def spanned_axes(groups: list[list[int]], mesh: jax.sharding.Mesh) -> str:
    """The mesh axes (of size > 1) along which the members of some group differ: partition ``p`` is the mesh's
    ``p``-th device in row-major order (jit's device assignment)."""
    shape = mesh.devices.shape
    axes = set()
    for group in groups:
        coords = np.array([np.unravel_index(p, shape) for p in group])
        axes |= {mesh.axis_names[i] for i in range(len(shape)) if len(set(coords[:, i])) > 1}
    return "+".join(a for a in mesh.axis_names if a in axes) or "none"


def collectives(hlo: str, mesh: jax.sharding.Mesh) -> dict[str, dict]:
    """Per spanned-axes label: ``{"bytes", "runs", "by_kind": {kind: bytes}, "ticks": [runs of each permute]}``: operand
    bytes per device per step (all-gather's operand is its result / n, reduce-scatter's result x n)."""
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, entry)
    pattern = re.compile(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
    out: dict[str, dict] = {}
    for name, lines in comps.items():
        for line in lines:
            m = pattern.search(line.split(", metadata=")[0])
            if m is None:
                continue
            result, kind, is_async = m.groups()
            groups = replica_groups(line, DEVICES)
            n = max(len(g) for g in groups)
            if n <= 1:
                continue
            sizes = [_shape_bytes(s.group(0)) for s in _SHAPE.finditer(result)]
            size = max(sizes) if is_async else sum(sizes)
            operand = size / n if kind == "all-gather" else size * n if kind == "reduce-scatter" else size
            label = spanned_axes(groups, mesh)
            entry_ = out.setdefault(label, {"bytes": 0.0, "runs": 0, "by_kind": {}, "ticks": []})
            runs = mult.get(name, 0)
            entry_["bytes"] += operand * runs
            entry_["runs"] += runs
            entry_["by_kind"][kind] = entry_["by_kind"].get(kind, 0.0) + operand * runs
            if kind == "collective-permute":
                entry_["ticks"].append(runs)
    return out


# ---- building the steps ----------------------------------------------------------------------------------------


def config(a: argparse.Namespace) -> Llama3Config:
    return Llama3Config.preset("llama3-tiny", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                               num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=a.hidden // 4, max_position_embeddings=a.seq, remat_policy="none")


def _make(cfg: Llama3Config):
    model = Llama3(cfg, rngs=nnx.Rngs(0))
    return model, make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), model, total_steps=100)


def compile_step(cfg: Llama3Config, sizes: dict[str, int], batch: int, seq: int, kwargs: tuple):
    """The trainer's step (not donated, so it can be called again on the same state) on ``sizes``' Auto mesh,
    compiled from abstract inputs; returns ``(compiled, mesh, input shardings, compile seconds)``."""
    mesh = make_mesh(sizes, devices=jax.devices()[:math.prod(sizes.values())])
    return (lambda compiled, shardings, seconds: (compiled, mesh, shardings, seconds))(
        *compile_on(cfg, mesh, batch, seq, kwargs))


def compile_on(cfg: Llama3Config, mesh, batch: int, seq: int, kwargs: tuple):
    """``compile_step`` on a given mesh; returns ``(compiled, input shardings, compile seconds)``."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: _make(cfg)))
    shardings = state_shardings(state, mesh, get_rules("default"))
    state = jax.tree.unflatten(jax.tree.structure(state), [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(jax.tree.leaves(state), shardings)])
    rows = jax.NamedSharding(mesh, logical_to_mesh_axes(("activation_batch", None), "default", mesh))
    batch_arrays = {k: jax.ShapeDtypeStruct((batch, seq), d, sharding=rows)
                    for k, d in (("input_ids", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32))}

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = train_step(model, optimizer, batch, model_kwargs=kwargs)
        return nnx.state((model, optimizer)), metrics["loss"]

    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, out_shardings=(jax.tree.map(lambda x: x.sharding, state), None)).lower(
            state, batch_arrays).compile()
    return compiled, (shardings, rows), time.perf_counter() - t0


def real_inputs(cfg: Llama3Config, shardings, rows, batch: int, seq: int):
    """A random model + optimizer state and token batch placed on the compiled step's input shardings."""
    graphdef, state = nnx.split(_make(cfg))
    state = jax.tree.unflatten(jax.tree.structure(state),
                               [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(state), shardings)])
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1))
    data = {"input_ids": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
            "loss_mask": np.ones((batch, seq), np.float32)}
    return state, {k: jax.device_put(v, rows) for k, v in data.items()}


def analyse(compiled, mesh, cfg: Llama3Config) -> dict:
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    return {"flops": dot_flops(hlo, cfg.vocab_size), "collectives": collectives(hlo, mesh),
            "temp_bytes": int(mem.temp_size_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes)}


# ---- the run ---------------------------------------------------------------------------------------------------


def run(a: argparse.Namespace) -> dict:
    cfg = config(a)
    names = schedules()
    if a.schedules:
        names = [n for n in names if n in a.schedules]
    for dim in (a.hidden, 2 * a.hidden, a.seq, a.batch, a.hidden // 4):  # the head's dots are told by the vocab dim
        if dim == a.vocab:
            raise SystemExit(f"--vocab {a.vocab} equals another dim of the model; pick a vocab size of its own")
    log = print
    cases, refs = [], {}
    for s in a.stages:
        f = DEVICES // s
        ref, ref_mesh, _, ref_s = compile_step(cfg, {"fsdp": f}, a.batch, a.seq, ())
        ref = refs[f"fsdp{f}"] = {**analyse(ref, ref_mesh, cfg), "compile_s": ref_s}
        log(f"un-pipelined fsdp={f}: compiled in {ref_s:.1f}s, temp {ref['temp_bytes'] / 2**20:.1f} MiB, "
            f"layer GFLOP {ref['flops']['layers'] / 1e9:.2f}")
        state = None
        for m in (s, 2 * s, 4 * s)[: a.micro_counts]:
            timed = {}
            for name in names:
                v = virtual_stages(name)
                if cfg.num_hidden_layers % (s * v):
                    log(f"skip {name} S={s}: {cfg.num_hidden_layers} layers do not split into {s} x {v} stages")
                    continue
                kwargs = (("pipeline_microbatches", m), *model_kwargs(name, v if v > 1 else None))
                compiled, mesh, (shardings, rows), secs = compile_step(cfg, {"stage": s, "fsdp": f}, a.batch, a.seq,
                                                                       kwargs)
                got = analyse(compiled, mesh, cfg)
                useful = ref["flops"]["layers"] / s
                unit = (ref["temp_bytes"] - ref["argument_bytes"]) / (s * m)
                activation = got["temp_bytes"] - got["argument_bytes"]
                textbook, program = FORMULAS.get(name, (None, None))
                case = {"schedule": name, "stages": s, "fsdp": f, "microbatches": m, "virtual_stages": v,
                        "compile_s": secs, **got,
                        "useful_layer_flops": useful,
                        "bubble_measured": 1 - useful / got["flops"]["layers"],
                        "bubble_textbook": textbook(s, m, v) if textbook else None,
                        "bubble_program": program(s, m, v) if program else None,
                        "head_flops_ratio": got["flops"]["head"] / ref["flops"]["head"],
                        "activation_bytes": activation, "microbatch_activation_bytes": unit,
                        "microbatches_held": activation / unit}
                cases.append(case)
                stage_traffic = got["collectives"].get("stage", {})
                log(f"S={s} M={m} {name}: compiled in {secs:.1f}s; bubble {case['bubble_measured']:.3f} "
                    f"(textbook {case['bubble_textbook']}, program {case['bubble_program']}); temp "
                    f"{got['temp_bytes'] / 2**20:.1f} MiB = {case['microbatches_held']:.2f} micro-batches; stage "
                    f"bytes {stage_traffic.get('bytes', 0) / 2**20:.2f} MiB, ticks {stage_traffic.get('ticks')}")
                if not a.no_time:
                    if state is None:
                        state = real_inputs(cfg, shardings, rows, a.batch, a.seq)
                    timed[name] = (lambda c=compiled, args=state: jax.block_until_ready(c(*args)[1]))
                    case["_timed"] = True
            if len(timed) > 1 or (timed and a.rounds):
                times = h.interleaved(timed, rounds=a.rounds, target_s=0.0, warmup=0, log=log)  # calibration warms
                for case in cases:
                    if case.get("_timed") and case["stages"] == s and case["microbatches"] == m:
                        case.pop("_timed")
                        case["seconds"] = times[case["schedule"]]
                        case["median_s"] = h.median(times[case["schedule"]])
                        if "gpipe" in times:
                            case["vs_gpipe"] = h.ratio_stats(times[case["schedule"]], times["gpipe"])
    return {"config": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                     "num_attention_heads", "num_key_value_heads", "head_dim",
                                                     "vocab_size", "remat_policy", "dtype")},
            "batch": a.batch, "seq": a.seq, "schedules": names, "unpipelined": refs, "cases": cases}


def _mib(x: float) -> float:
    return x / 2**20


def render(result: dict) -> str:
    cases = result["cases"]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    bubble = h.markdown_table(
        ["schedule", "S", "M", "ticks (trips of the loops with a stage permute)", "layer GFLOP/device: executed",
         "useful", "excess measured", "formula: this program", "formula: textbook", "head FLOPs / un-pipelined"],
        [[c["schedule"], c["stages"], c["microbatches"],
          " / ".join(str(t) for t in sorted({t for t in c["collectives"].get("stage", {}).get("ticks", []) if t > 1}))
          or "-",
          c["flops"]["layers"] / 1e9, c["useful_layer_flops"] / 1e9, fmt(c["bubble_measured"]),
          fmt(c["bubble_program"]), fmt(c["bubble_textbook"]), c["head_flops_ratio"]] for c in cases])
    memory = h.markdown_table(
        ["schedule", "V", "S", "M", "temp MiB", "arguments MiB", "activations MiB (temp - arguments)",
         "one micro-batch on one stage MiB", "micro-batches held"],
        [[c["schedule"], c["virtual_stages"], c["stages"], c["microbatches"], _mib(c["temp_bytes"]),
          _mib(c["argument_bytes"]), _mib(c["activation_bytes"]), _mib(c["microbatch_activation_bytes"]),
          c["microbatches_held"]]
         for c in cases])
    labels = sorted({k for c in cases for k in c["collectives"]})
    traffic = h.markdown_table(
        ["schedule", "S", "M", *[f"{k} MiB (runs)" for k in labels], "stage-axis kinds"],
        [[c["schedule"], c["stages"], c["microbatches"],
          *[f"{_mib(c['collectives'][k]['bytes']):.2f} ({c['collectives'][k]['runs']})" if k in c["collectives"]
            else "-" for k in labels],
          ", ".join(f"{kind} {_mib(b):.2f}"
                    for kind, b in c["collectives"].get("stage", {}).get("by_kind", {}).items())]
         for c in cases])
    parts = ["## Bubble: layer-stack matmul FLOPs per device, executed vs useful", bubble,
             "## Activation memory per device (XLA buffer assignment)", memory,
             "## Collective operand bytes per device per step, by the mesh axes the groups span", traffic]
    timed = [c for c in cases if "median_s" in c]
    if timed:
        parts += ["## Step time, interleaved (ratios to GPipe are what to read)", h.markdown_table(
            ["schedule", "S", "M", "median s/step", "vs GPipe (median of per-round ratios)", "min", "max"],
            [[c["schedule"], c["stages"], c["microbatches"], c["median_s"],
              c.get("vs_gpipe", {}).get("median_round_ratio", 1.0), c.get("vs_gpipe", {}).get("min_round_ratio", 1.0),
              c.get("vs_gpipe", {}).get("max_round_ratio", 1.0)] for c in timed])]
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="S=2 only, M=S, 2 layers, batch 8, seq 32, 1 round")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro-counts", type=int, default=3, help="how many of M = S, 2S, 4S to run")
    p.add_argument("--schedules", nargs="+", help="a subset of the pipeline module's schedules (default: all)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-time", action="store_true", help="compile and read the programs only")
    p.add_argument("--out", default="pipeline_schedules", help="results/<out>.json and .md")
    a = p.parse_args()
    if a.quick:
        a.stages, a.micro_counts, a.layers, a.batch, a.seq, a.rounds = [2], 1, 4, 16, 32, 1
        a.out = a.out + "_quick"
    t0 = time.perf_counter()
    load = [os.getloadavg()[0]]
    result = run(a)
    load.append(os.getloadavg()[0])
    md = render(result)
    print(md)
    h.write_results(a.out, {"environment": h.environment(), "args": vars(a), "load_average": load,
                            "wall_s": time.perf_counter() - t0, **result},
                    f"# pipeline_schedules\n\n`{' '.join(['python benchmarks/pipeline_schedules.py', *sys.argv[1:]])}`"
                    f", {h.environment()['date_utc']}, load {load[0]:.1f} -> {load[1]:.1f}\n\n{md}")


if __name__ == "__main__":
    main()
