"""Did a change slow the CPU train step? The recipe at a base git revision against this checkout, side by side.

Each round runs the pretraining recipe (synthetic data, AdamW, float32, 1 CPU device) once from a worktree of
``--base`` and once from this checkout, in fresh subprocesses, in alternating order, and takes the median
tokens/s of each run's steps after ``--skip``. We report each side's median over rounds and the median of the
per-round ratios (head / base), which cancels load drifts that hit both runs of a round alike.

    python benchmarks/cpu_ab.py --base 86017e1                 # deepseek3-tiny 4x128 and llama3-small 4x128
    python benchmarks/cpu_ab.py --base HEAD~3 --rounds 3 --presets llama3-small
    python benchmarks/cpu_ab.py --base 86017e1 --programs      # compare the compiled steps instead (no timing)

``--programs`` compiles the trainer's step (AdamW, the recipe's MoE extras) at each side and compares XLA's
flops, temp bytes and HLO op counts: equal programs run at equal speed, whatever the machine's load.

Writes benchmarks/results/cpu_ab.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import environment, markdown_table, write_results  # noqa: E402

CASES = {  # preset -> recipe arguments
    "deepseek3-tiny": ["--batch", "4", "--seq-len", "128"],
    "llama3-small": ["--batch", "4", "--seq-len", "128"],
}


def run_recipe(checkout: Path, preset: str, steps: int, skip: int) -> float:
    """Median tokens/s of the recipe from ``checkout`` over its steps after ``skip``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNX_ZOO_") and k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(checkout))
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, str(checkout / "recipes" / "pretrain.py"), "--model", preset, *CASES[preset],
               "--steps", str(steps), "--run-dir", run_dir, "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(f"{checkout} {preset}: the recipe failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in records[skip:])


PROGRAM_SUMMARY = """
import collections, json, re, sys
import jax.numpy as jnp
from flax import nnx
from nnx_zoo import AutoConfig, AutoModelForCausalLM
from nnx_zoo.train import OptimizerConfig, make_optimizer, train_step
preset, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = AutoConfig.preset(preset)
model = AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0))
optimizer = make_optimizer(OptimizerConfig(), model, 10)
ids = jnp.zeros((batch, seq), jnp.int32)
batch = {"input_ids": ids, "targets": ids, "loss_mask": jnp.ones(ids.shape)}
extras = dict(model_kwargs=(("with_expert_load", True),), routing_bias_rate=1e-3) if getattr(
    config, "num_moe_layers", 0) else {}
compiled = nnx.jit(lambda m, o, b: train_step(m, o, b, **extras)).lower(model, optimizer, batch).compile()
ops = collections.Counter(m.group(1) for m in re.finditer(r"= \\S+ (\\w[\\w-]*)\\(", compiled.as_text()))
cost = compiled.cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
print(json.dumps({"flops": cost.get("flops"), "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                  "hlo_ops": sum(ops.values()), "dots": ops["dot"], "fusions": ops["fusion"]}))
"""


def program_summary(checkout: Path, preset: str) -> dict:
    """XLA's flops, temp bytes and HLO op counts of the trainer's compiled step from ``checkout``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNX_ZOO_") and k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(checkout))
    batch, seq = CASES[preset][1], CASES[preset][3]
    proc = subprocess.run([sys.executable, "-c", PROGRAM_SUMMARY, preset, batch, seq], capture_output=True,
                          text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{checkout} {preset}: compiling the step failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision to compare this checkout against")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--presets", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--programs", action="store_true", help="compare the compiled steps instead of timing them")
    args = p.parse_args()

    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            if args.programs:
                programs = {preset: {"base": program_summary(base, preset), "head": program_summary(ROOT, preset)}
                            for preset in args.presets}
                rows = [[preset, side, *programs[preset][side].values()] for preset in programs
                        for side in ("base", "head")]
                md = "\n".join([f"# CPU train step programs: {head} (+ working tree) vs {rev}", "",
                                 markdown_table(["preset", "side", "XLA flops", "temp bytes", "HLO ops", "dots",
                                                 "fusions"], rows)])
                write_results("cpu_ab_programs", {"base": rev, "head": head, "programs": programs}, md)
                print(md)
                return
            results = {}
            for preset in args.presets:
                runs: dict[str, list[float]] = {"base": [], "head": []}
                for r in range(args.rounds):
                    order = [("base", base), ("head", ROOT)]
                    for side, checkout in order if r % 2 == 0 else order[::-1]:
                        runs[side].append(run_recipe(checkout, preset, args.steps, args.skip))
                    print(f"{preset} round {r + 1}: base {runs['base'][-1]:.0f}, head {runs['head'][-1]:.0f} "
                          f"tokens/s (load {os.getloadavg()[0]:.1f})", flush=True)
                ratios = [h / b for h, b in zip(runs["head"], runs["base"], strict=True)]
                results[preset] = {**runs, "ratios": ratios}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)

    rows = [[preset, " ".join(CASES[preset][1::2]), f"{statistics.median(r['base']):.0f}",
             f"{statistics.median(r['head']):.0f}", f"{statistics.median(r['ratios']):.3f}",
             f"{min(r['ratios']):.3f}-{max(r['ratios']):.3f}"] for preset, r in results.items()]
    md = "\n".join([
        f"# CPU train step: {head} (+ working tree) vs {rev}",
        "",
        f"The recipe (synthetic data, AdamW, float32, 1 CPU device), {args.rounds} rounds alternating base/head, "
        f"median tokens/s of steps {args.skip + 1}-{args.steps} per run.",
        "",
        markdown_table(["preset", "batch x seq", f"base {rev} tokens/s", "head tokens/s", "median head/base",
                        "range"], rows),
    ])
    write_results("cpu_ab", {"environment": environment(), "base": rev, "head": head, "results": results}, md)
    print(md)


if __name__ == "__main__":
    main()
