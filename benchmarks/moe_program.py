"""The MoE path's casts, routing and stacked-weight slices in the compiled train step, at a base commit and here.

A Qwen3-MoE-shaped step (the ``qwen3-moe-tiny`` widths with 16 experts, top-4, 3 layers; bf16 compute, float32
parameters, remat ``full``, ``moe_impl='gmm'``, AdamW) is compiled on the CPU from a worktree of ``--base`` and from
this checkout, each in its own process, and its HLO is read by ``compiled_programs.moe_weight_ops``: the program's
f32 -> bf16 casts of the expert weights (and how many run inside the layer loops), the scatters and gathers of
routed rows, and the dynamic-slices / copies of the stacked expert weights, each with its executions and bytes
per step. Cases: ``xla`` (``jax.lax.ragged_dot``: like tokamax, a kernel that takes a layer's weights whole in
bf16) with no mesh (how the GPU profile ran) and on a one-device mesh (how the recipe runs), and ``tiled`` with no
mesh (the CPU's grouped matmul, which reads the stored float32 weights a chunk at a time).

    python benchmarks/moe_program.py --base 373249b          # writes results/moe_program.{json,md}
    python benchmarks/moe_program.py --base 373249b --quick  # the first case only (~1.5 min)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import environment, markdown_table, write_results  # noqa: E402

SHAPE = dict(num_hidden_layers=3, num_experts=16, num_experts_per_tok=4, vocab_size=4096)
BATCH, SEQ = 2, 64
CASES = {  # name -> (grouped_matmul_impl, on a one-device mesh)
    "xla, no mesh": ("xla", False),
    "xla, 1-device mesh": ("xla", True),
    "tiled, no mesh": ("tiled", False),
}
ROWS = ("cast", "cast in loops", "scatter", "gather", "stack slice", "stack slice (fused)", "copy")


def worker(case: str) -> dict:
    """Compile the case's train step with the ``nnx_zoo`` on ``PYTHONPATH`` and read its program."""
    import compiled_programs as cp
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_zoo import AutoConfig, AutoModelForCausalLM
    from nnx_zoo.sharding import make_mesh
    from nnx_zoo.train import OptimizerConfig, make_optimizer
    from nnx_zoo.train.step import train_step

    kernel, on_mesh = CASES[case]
    config = AutoConfig.preset("qwen3-moe-tiny", dtype="bfloat16", remat_policy="full", moe_impl="gmm",
                               grouped_matmul_impl=kernel, **SHAPE)
    model = AutoModelForCausalLM.create(config, seed=0, mesh=make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
                                           if on_mesh else None)
    optimizer = make_optimizer(OptimizerConfig(), model, 10)
    ids = jnp.zeros((BATCH, SEQ), jnp.int32)
    batch = {"input_ids": ids, "targets": ids, "loss_mask": jnp.ones(ids.shape)}
    compiled = nnx.jit(lambda m, o, b: train_step(m, o, b)).lower(model, optimizer, batch).compile()
    ops = cp.moe_weight_ops(compiled.as_text(), config.num_experts, config.hidden_size,
                            config.moe_intermediate_size, BATCH * SEQ, config.num_experts_per_tok)
    expert_params = config.num_hidden_layers * 3 * config.num_experts * config.hidden_size * \
        config.moe_intermediate_size
    return {"ops": ops, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "expert_params": expert_params, "module": str(Path(sys.modules["nnx_zoo"].__file__).parent)}


def measure(checkout: Path, case: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNX_ZOO_") and k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(checkout))
    proc = subprocess.run([sys.executable, __file__, "--worker", case], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{checkout} {case}: compiling failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if Path(out["module"]).resolve() != (checkout / "nnx_zoo").resolve():
        raise RuntimeError(f"{case}: imported nnx_zoo from {out['module']}, not {checkout}")
    return out


def render(results: dict, base: str, head: str) -> str:
    lines = [f"# MoE casts, routing and stacked-weight slices: {head} (+ working tree) vs {base}", "",
             "Qwen3-MoE-shaped train step on the CPU (qwen3-moe-tiny widths: hidden 128, expert width 64; "
             f"16 experts, top-4, 3 layers; {BATCH} x {SEQ} tokens; bf16 compute, f32 parameters, remat full, "
             "moe_impl gmm, AdamW). Per step: executions (instructions in the program) and bytes written.", ""]
    for case, sides in results.items():
        rows = []
        for key in ROWS:
            b, h = sides["base"]["ops"][key], sides["head"]["ops"][key]
            rows.append([key, f"{b['runs']} ({b['ops']})", f"{b['bytes']:,}", f"{h['runs']} ({h['ops']})",
                         f"{h['bytes']:,}"])
        rows.append(["XLA temp bytes", "", f"{sides['base']['temp_bytes']:,}", "",
                     f"{sides['head']['temp_bytes']:,}"])
        lines += [f"## {case}", "", markdown_table(["", f"{base} runs (ops)", "bytes", f"{head} runs (ops)",
                                                    "bytes"], rows), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="git revision to compare this checkout against")
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--quick", action="store_true", help="the first case only, written as results/moe_program_quick")
    p.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    if not args.base:
        p.error("--base is required")

    def rev(name: str) -> str:
        return subprocess.run(["git", "rev-parse", "--short", name], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    base, head = rev(args.base), rev("HEAD")
    cases = list(CASES)[:1] if args.quick else args.cases
    with tempfile.TemporaryDirectory() as tmp:
        checkout = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(checkout), base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            results = {case: {"base": measure(checkout, case), "head": measure(ROOT, case)} for case in cases}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT, capture_output=True)
    md = render(results, base, head)
    payload = {"environment": environment(), "base": base, "head": head, "shape": SHAPE, "batch": BATCH, "seq": SEQ,
               "results": results}
    write_results("moe_program_quick" if args.quick else "moe_program", payload, md)
    print(md)


if __name__ == "__main__":
    main()
