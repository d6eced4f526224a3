"""Auto vs Explicit sharding: train-step time and per-device peak memory, side by side, on 8 CPU devices.

Our version of the table in seed 001 (MaxText's explicit-sharding PR for DeepSeek). For each parallelism layout
(mesh + rule set) the same DeepSeek-V3 train step (the trainer's ``train_step``: forward, backward, global-norm
clipping, AdamW update, state donated) is compiled twice, once on a mesh whose axes are all ``Auto`` and once
on one whose axes are all ``Explicit``, from the same parameter values and batch. Reported per row:

- peak memory per device from XLA's buffer assignment (``compiled.memory_analysis()``: arguments + outputs -
  donated aliases + temporaries; its ``peak_memory_in_bytes`` is only the argument size on XLA:CPU),
- step time: both modes timed interleaved in one process, several rounds, medians and the median of per-round
  explicit/auto ratios (``_harness.interleaved``),
- what XLA emitted, counted in ``compiled.as_text()``: collectives (all-gather, all-reduce, reduce-scatter,
  all-to-all, collective-permute), copies and transposes, to explain a row where the modes differ.

Targets (issue 4): explicit step time within 5% of auto or better, explicit peak memory no higher than auto.

    python benchmarks/explicit_vs_auto.py            # deepseek3-mini (vocab 4096), batch 8 x 128, 5 rounds
    python benchmarks/explicit_vs_auto.py --quick    # smaller: 2 layers, batch 8 x 32, 2 rounds
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import _harness as h  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo import DeepSeekV3, DeepSeekV3Config  # noqa: E402
from nnx_zoo.sharding import get_rules, logical_to_mesh_axes, make_mesh, state_shardings  # noqa: E402
from nnx_zoo.train import OptimizerConfig, make_optimizer  # noqa: E402
from nnx_zoo.train.step import train_step  # noqa: E402

ROWS = h.SHARDING_LAYOUTS  # shared with the other sharding benchmark
MODES = ("auto", "explicit")
HLO_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "copy", "transpose")


def bench_config(quick: bool, moe_impl: str) -> DeepSeekV3Config:
    layers = dict(num_hidden_layers=2) if quick else {}
    return DeepSeekV3Config.preset("deepseek3-mini", vocab_size=4096, num_nextn_predict_layers=0, moe_impl=moe_impl,
                                   **layers)


def hlo_counts(hlo_text: str) -> dict[str, int]:
    """How many instructions of each kind in ``HLO_OPS`` (async ``-start`` halves counted once, fused
    computations included)."""
    code = re.sub(r"metadata=\{[^}]*\}", "", hlo_text)  # op_name metadata reads like "transpose(jvp(...))"
    ops = collections.Counter(re.findall(r" (" + "|".join(HLO_OPS) + r")(?:-start)?\(", code))
    return {op: ops.get(op, 0) for op in HLO_OPS}


def initial_state(config: DeepSeekV3Config, rules: str) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) of the model and its optimizer, as numpy arrays (placed per mode later; the steps
    donate their state, so no placed array may share a buffer with these)."""
    def make():
        model = DeepSeekV3(config, rngs=nnx.Rngs(0), rules=rules)
        return model, make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), model, total_steps=100)

    graphdef, state = nnx.split(nnx.jit(make)())
    return graphdef, jax.device_get(state)


def compile_step(graphdef, state, batch, mesh, rules: str):
    """The donated train step, compiled for ``mesh``; returns (compiled, placed state, placed batch, info)."""
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = train_step(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics["loss"]

    shardings = state_shardings(state, mesh, get_rules(rules))
    state = jax.tree.unflatten(jax.tree.structure(state),
                               [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(state), shardings)])
    batch_spec = logical_to_mesh_axes(("activation_batch", None), rules, mesh)
    batch = jax.device_put(batch, jax.NamedSharding(mesh, batch_spec))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        # The new state keeps the resolved shardings (under Auto, XLA would otherwise pick its own for some of it,
        # and the next call would need another compile): what a training loop must do.
        state_out = jax.tree.map(lambda a: a.sharding, state)
        compiled = jax.jit(step, donate_argnums=0, out_shardings=(state_out, None)).lower(state, batch).compile()
    mem = compiled.memory_analysis()
    # XLA:CPU's peak_memory_in_bytes is the argument size only (2.98 MiB in every row of the first runs, whatever
    # the program held): the peak is bounded by arguments + outputs - donated aliases + temporaries instead.
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes)
    info = {"compile_s": time.perf_counter() - t0, "peak_bytes": int(total),
            "xla_peak_bytes": int(mem.peak_memory_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes),
            "hlo": hlo_counts(compiled.as_text())}
    return compiled, state, batch, info


def run_row(name: str, a, log) -> dict:
    sizes, rules, impl = ROWS[name]
    config = bench_config(a.quick, impl)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (a.batch, a.seq + 1))
    batch = {"input_ids": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32),
             "loss_mask": jnp.ones((a.batch, a.seq), jnp.float32)}
    graphdef, host_state = initial_state(config, rules)
    calls, infos = {}, {}
    for mode in MODES:
        mesh = make_mesh(sizes, shard_mode=mode)
        compiled, state, placed, info = compile_step(graphdef, host_state, batch, mesh, rules)
        holder = {"state": state}

        def call(compiled=compiled, holder=holder, placed=placed):
            holder["state"], loss = compiled(holder["state"], placed)
            return jax.block_until_ready(loss)

        info["first_loss"] = float(call())
        calls[mode], infos[mode] = call, info
        log(f"  {mode}: compiled in {info['compile_s']:.1f}s, peak {info['peak_bytes'] / 2**20:.2f} MiB, "
            f"loss {info['first_loss']:.5f}, hlo {info['hlo']}")
    times = h.interleaved(calls, rounds=a.rounds, target_s=a.target_s, log=log)
    return {"row": name, "mesh": sizes, "rules": rules, "moe_impl": impl, "modes": infos,
            "seconds": times, "median_s": {m: h.median(t) for m, t in times.items()},
            "explicit_over_auto": h.ratio_stats(times["explicit"], times["auto"])}


def render(rows: list[dict], a) -> str:
    header = ["layout", "auto peak MiB", "explicit peak MiB", "peak change", "auto step ms", "explicit step ms",
              "explicit/auto time (median of rounds)", "collectives auto/explicit", "copy+transpose auto/explicit"]
    table = []
    for r in rows:
        auto, expl = r["modes"]["auto"], r["modes"]["explicit"]
        coll = [sum(m["hlo"][op] for op in HLO_OPS[:5]) for m in (auto, expl)]
        moves = [m["hlo"]["copy"] + m["hlo"]["transpose"] for m in (auto, expl)]
        table.append([r["row"], auto["peak_bytes"] / 2**20, expl["peak_bytes"] / 2**20,
                      f"{100 * (expl['peak_bytes'] / auto['peak_bytes'] - 1):+.1f}%",
                      1e3 * r["median_s"]["auto"], 1e3 * r["median_s"]["explicit"],
                      f"{r['explicit_over_auto']['median_round_ratio']:.3f}", f"{coll[0]} / {coll[1]}",
                      f"{moves[0]} / {moves[1]}"])
    note = (f"deepseek3-mini (vocab 4096{', 2 layers' if a.quick else ''}, no MTP), batch {a.batch} x {a.seq}, "
            f"float32, 8 CPU devices, {a.rounds} interleaved rounds; peak = per-device arguments + outputs - donated "
            "+ temporaries (XLA's buffer assignment).")
    return note + "\n\n" + h.markdown_table(header, table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 layers, batch 8 x 32, 2 rounds")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW",
                   help=f"layouts to run (default: all of {list(ROWS)})")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 128; --quick 32)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 2)")
    p.add_argument("--target-s", type=float, default=None, help="seconds per mode per round (default 1.0)")
    p.add_argument("--out-dir", default=None, help="where to write explicit_vs_auto.{json,md}")
    p.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)
    a.seq = a.seq or (32 if a.quick else 128)
    a.rounds = a.rounds or (2 if a.quick else 5)
    a.target_s = a.target_s or (0.2 if a.quick else 1.0)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = []
    for name in a.rows:
        log(f"[{name}]")
        rows.append(run_row(name, a, log))
    md = render(rows, a)
    print(md)
    if not a.no_write:
        payload = {"benchmark": "explicit_vs_auto", "argv": sys.argv[1:] if argv is None else list(argv),
                   "environment": h.environment(), "load_average": os.getloadavg(), "rounds": a.rounds,
                   "target_s": a.target_s, "batch": a.batch, "seq": a.seq, "quick": a.quick, "rows": rows}
        jp, mp = h.write_results("explicit_vs_auto", payload, md, a.out_dir)
        log(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
