"""Throughput of the pretraining recipe's train step: tokens/s, TFLOP/s per device and MFU.

Each case runs ``recipes/deepseek_pretrain.py`` itself in a fresh subprocess (synthetic data, AdamW, the
recipe's defaults otherwise; its own jitted train step, data loading, metrics and end-of-run checkpoint) and reads
``metrics.jsonl``, one record per step. The first ``--skip`` steps (compilation, warm-up) are dropped; we report
the median over the remaining steps of the recipe's own per-step figures:

    tokens/s            tokens of the step / wall seconds of the step (host loop included)
    TFLOP/s per device  tokens/s * the model's training FLOPs per token / devices, where FLOPs per token =
                        ``DeepSeekV3Config.train_flops_per_token(seq_len, include_mtp=...)``: 6 x active matmul
                        parameters (embedding lookup excluded, MTP heads included when trained) + causal attention
    MFU                 TFLOP/s per device / peak per device. On CPU the peak is MEASURED once per machine
                        (``nnx_zoo.train.metrics.resolve_peak``): float32 1024^3 matmuls, the best of 5 rounds
                        spaced 0.2 s apart, divided by the number of local devices, cached in
                        ~/.cache/nnx_zoo/peak_flops.json and raised when a step runs faster (MFU <= 100%); on
                        GPU/TPU it is the data-sheet dense bf16 peak. The peak printed here is the one the recipe
                        divided by.

    python benchmarks/recipe_throughput.py                # deepseek3-tiny and deepseek3-mini, 1 CPU device
    python benchmarks/recipe_throughput.py --quick        # fewer steps (smoke run)

Writes benchmarks/results/recipe_throughput.{json,md}.
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

# (preset, extra recipe arguments): batch x seq_len tokens per step.
CASES = {
    "deepseek3-tiny": ["--batch", "4", "--seq-len", "128"],
    "deepseek3-mini": ["--batch", "8", "--seq-len", "128"],
}


def load_average() -> float:
    return os.getloadavg()[0]


def run_case(preset: str, extra: list[str], steps: int, devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNX_ZOO_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    else:
        env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, str(ROOT / "recipes" / "deepseek_pretrain.py"), "--model", preset, "--steps",
               str(steps), "--run-dir", run_dir, "--no-progress", *extra]
        load_before = load_average()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(f"{preset}: recipe failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    peak_line = next(line for line in proc.stdout.splitlines() if line.startswith("peak per device"))
    return {"preset": preset, "args": extra, "steps": steps, "devices": devices, "records": records,
            "peak_line": peak_line, "load_1m_before_after": [load_before, load_average()]}


def summarize(case: dict, skip: int) -> dict:
    steady = case["records"][skip:]
    med = {k: statistics.median(r[k] for r in steady) for k in ("tokens_per_s", "tflops_per_device", "mfu")}
    peaks = [r["tflops_per_device"] / r["mfu"] for r in steady if r.get("mfu")]
    batch, seq = int(case["args"][1]), int(case["args"][3])
    return {"preset": case["preset"], "tokens_per_step": batch * seq, "batch": f"{batch}x{seq}",
            "devices": case["devices"], "steps_timed": len(steady), **med,
            "peak_tflops_per_device": statistics.median(peaks), "peak_source": case["peak_line"],
            "load_1m": case["load_1m_before_after"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="leading steps dropped (compilation, warm-up)")
    p.add_argument("--devices", type=int, default=1, help="CPU devices (fake ones share the host's cores)")
    p.add_argument("--presets", nargs="*", default=list(CASES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args()
    steps = 5 if args.quick else args.steps

    cases, rows = [], []
    for preset in args.presets:
        print(f"{preset}: {steps} steps ...", flush=True)
        case = run_case(preset, CASES[preset], steps, args.devices)
        summary = summarize(case, args.skip)
        cases.append({**case, "summary": summary})
        rows.append([preset, summary["batch"], summary["devices"], summary["steps_timed"], summary["tokens_per_s"],
                     1e3 * summary["tflops_per_device"], 1e3 * summary["peak_tflops_per_device"],
                     f"{100 * summary['mfu']:.2f}%", "/".join(f"{x:.1f}" for x in summary["load_1m"])])
        print(f"  {rows[-1]}", flush=True)

    env = environment()
    header = ["preset", "batch", "devices", "steps timed", "tokens/s", "GFLOP/s per device",
              "peak GFLOP/s per device", "MFU", "load 1m"]
    md = "\n".join([
        f"# Pretraining recipe throughput ({env['backend']}, {env['processor']}, {env['cpu_count']} cores)",
        "",
        f"jax {env['jax']} / flax {env.get('flax')}, float32, AdamW, synthetic data; `python "
        "recipes/deepseek_pretrain.py --model PRESET --batch B --seq-len S`; median over steps after the first "
        f"{args.skip}. FLOPs per token: `train_flops_per_token` (6 x active matmul parameters + causal attention). "
        "Peak: measured by the recipe at start-up, best of 5 float32 1024^3 matmuls on this host / local devices "
        "(the CPU has no data-sheet peak). `load 1m`: the machine's 1-minute load average before/after (a loaded "
        "machine lowers both the step rate and the measured peak).",
        "",
        markdown_table(header, rows),
    ])
    payload = {"environment": env, "skip": args.skip, "cases": cases}
    jpath, mpath = write_results("recipe_throughput", payload, md, args.out_dir)
    print(md)
    print(f"wrote {jpath} and {mpath}")


if __name__ == "__main__":
    main()
