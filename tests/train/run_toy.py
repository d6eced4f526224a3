"""Run the toy trainer in its own process (for multi-process and kill tests).

python tests/train/run_toy.py RUN_DIR --steps N [--width W] [--checkpoint-every K] [--devices D]
    [--num-processes P --process-id I --coordinator HOST:PORT]
Prints one JSON line {"losses": [...], "start_step": S} at the end; "step N" after each step.
"""

import argparse
import json
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("run_dir")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--width", type=int, default=32)
p.add_argument("--checkpoint-every", type=int, default=0)
p.add_argument("--devices", type=int, default=8)
p.add_argument("--mesh", default="fsdp=-1")
p.add_argument("--num-processes", type=int, default=1)
p.add_argument("--process-id", type=int, default=0)
p.add_argument("--coordinator", default="")
args = p.parse_args()

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
if args.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

from flax import nnx  # noqa: E402

from nnx_zoo.train import DataConfig, OptimizerConfig, TrainConfig, train  # noqa: E402
from tests.train.toy_lm import ToyLM  # noqa: E402

mesh = {k: int(v) for k, v in (part.split("=") for part in args.mesh.split(","))}
config = TrainConfig(
    steps=args.steps, run_dir=args.run_dir, mesh=mesh, progress=False, checkpoint_every=args.checkpoint_every,
    data=DataConfig(seq_len=16, global_batch=8, synthetic_vocab=32), optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2),
)


def report(state, metrics):
    print(f"step {int(metrics['step_index']) + 1}", flush=True)


summary = train(lambda: ToyLM(64, args.width, nnx.Rngs(0)), config, vocab_size=64, flops_per_token=1.0,
                after_step=report)
print(json.dumps({"losses": summary["losses"], "start_step": summary["start_step"]}), flush=True)
