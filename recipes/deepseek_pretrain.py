"""Pretrain DeepSeek-V3 with nnx_zoo.

With no arguments: the ``deepseek3-tiny`` preset, synthetic data, a short run on this machine's devices, a live
progress line, metrics in ``runs/deepseek3-tiny/metrics.jsonl`` and a checkpoint at the end. Run it again with the
same ``--run-dir`` and it resumes from the latest complete checkpoint.

Examples (the second needs 8 devices: on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8 makes them):
    python recipes/deepseek_pretrain.py
    python recipes/deepseek_pretrain.py --model deepseek3-small --steps 200 --mesh fsdp=4,expert=2 --rules ep-as-dp
    python recipes/deepseek_pretrain.py --model.num_hidden_layers 4 --shard-mode explicit --run-dir runs/tiny-4-layers
    python recipes/deepseek_pretrain.py --model deepseek3-671b --mesh fsdp=64,expert=8 --plan

Every ``DeepSeekV3Config`` field can be set with ``--model.<field> VALUE`` (``none`` for None).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Make `python recipes/deepseek_pretrain.py` work from a clone without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_mesh(text: str) -> dict[str, int]:
    """'fsdp=4,expert=2' -> {'fsdp': 4, 'expert': 2}; malformed entries and repeated axes are refused."""
    from nnx_zoo.sharding.mesh import parse_mesh as parse

    try:
        return parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_step_range(text: str) -> tuple[int, int]:
    """'5:7' -> (5, 7); '5' -> (5, 5)."""
    first, _, last = text.partition(":")
    try:
        steps = (int(first), int(last or first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:LAST step numbers such as 5:7, got {text!r}") from None
    if not 1 <= steps[0] <= steps[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= FIRST <= LAST, got {text!r}")
    return steps


def _field_parser(annotation: Any):
    """A string -> value parser for a config field's type annotation ('none' means None where allowed)."""
    hint = annotation
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        if base is bool:
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
        if base in (int, float, str):
            try:
                return base(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {base.__name__}, got {text!r}") from None
        return json.loads(text)  # dicts such as rope_scaling

    return parse


def build_parser(model_config_cls: type, presets: Iterable[str] = ()) -> argparse.ArgumentParser:
    """The recipe's command line; ``--help`` lists ``presets`` and the registered rule sets by name."""
    from nnx_zoo.sharding import RULE_SETS

    p = argparse.ArgumentParser(
        prog="deepseek_pretrain.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXIT_CODES,
    )
    g = p.add_argument_group("model")
    g.add_argument("--model", default="deepseek3-tiny",
                   help=f"preset name: {', '.join(presets)} (default: %(default)s)")
    g.add_argument("--moe-impl", choices=("auto", "dense", "gmm", "ep"),
                   help="MoE compute path (shortcut for --model.moe_impl)")
    g.add_argument("--remat", help="remat policy (shortcut for --model.remat_policy)")
    hints = typing.get_type_hints(model_config_cls)
    for field in dataclasses.fields(model_config_cls):
        kind = getattr(hints[field.name], "__name__", None) or str(hints[field.name]).replace("typing.", "")
        g.add_argument(f"--model.{field.name}", dest=f"model__{field.name}", type=_field_parser(hints[field.name]),
                       metavar="V", help=f"override the preset's {field.name} ({kind})")

    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    g.add_argument("--run-dir", help="where metrics and checkpoints go (default: runs/<model>)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--extend", action="store_true",
                   help="resume a run past the --steps it was planned for, keeping its learning-rate schedule (the "
                   "added steps run at its final learning rate)")
    g.add_argument("--override-settings", action="store_true",
                   help="resume with changed settings (seed, data, optimizer hyper-parameters such as --lr, loss "
                   "weights, --steps with a re-planned schedule); without it a resume that would change them stops "
                   "and names each difference")
    g.add_argument("--log-every", type=int, default=1)
    g.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints; 0: end and signals")
    g.add_argument("--keep-checkpoints", type=int, default=3)
    g.add_argument("--sync-checkpoints", action="store_true", help="save synchronously (default: async)")
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events (needs tensorboardX)")
    g.add_argument("--profile-steps", type=parse_step_range, metavar="FIRST:LAST",
                   help="write a JAX profiler trace of these steps (1-based, inclusive) to <run dir>/profile, "
                   "e.g. 5:7 (view with TensorBoard's profile plugin or Perfetto)")
    g.add_argument("--no-progress", action="store_true", help="no live progress line")
    g.add_argument("--peak-flops", type=float, metavar="FLOP/S",
                   help="peak FLOP/s per device that MFU divides by, e.g. 989e12 (default: the data sheet on "
                   "GPU/TPU; on CPU a float32 matmul peak measured once per machine and cached under "
                   "$XDG_CACHE_HOME/nnx_zoo, by default ~/.cache/nnx_zoo)")
    g.add_argument("--plan", action="store_true",
                   help="print the sharding report and per-device memory for the mesh, allocate nothing, exit")

    g = p.add_argument_group("parallelism")
    g.add_argument("--mesh", type=parse_mesh, default={"fsdp": -1},
                   help="mesh axis sizes, e.g. fsdp=4,expert=2; one may be -1 (default: all devices on fsdp)")
    g.add_argument("--shard-mode", choices=("auto", "explicit"), default="auto")
    g.add_argument("--rules", default="default",
                   help=f"rule set name: {', '.join(RULE_SETS)} (default: %(default)s)")
    g.add_argument("--num-processes", type=int, default=int(os.environ.get("NNX_ZOO_NUM_PROCESSES", 1)),
                   help="processes in a multi-host run (env NNX_ZOO_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=int(os.environ.get("NNX_ZOO_PROCESS_ID", 0)))
    g.add_argument("--coordinator", default=os.environ.get("NNX_ZOO_COORDINATOR", ""),
                   help="host:port of process 0 in a multi-host run (env NNX_ZOO_COORDINATOR)")

    g = p.add_argument_group("data and optimization")
    g.add_argument("--batch", type=int, default=8, help="global batch (rows per step, default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--accum-steps", type=int, default=1, help="gradient-accumulation micro-batches per step")
    g.add_argument("--data", default="synthetic",
                   help="'synthetic' (default), or a .txt/.jsonl/.parquet file or a directory of them")
    g.add_argument("--tokenizer", default="bytes",
                   help="for files: 'bytes' (built-in byte-level) or a tokenizers JSON file")
    g.add_argument("--synthetic-vocab", type=int, default=256, help="token ids used by the synthetic data")
    g.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: Muon on the hidden weight matrices (per layer and expert), AdamW on embeddings, "
                   "output head, norms (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup-steps", type=int, default=5)
    g.add_argument("--schedule", choices=("cosine", "wsd", "constant"), default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-norm", type=float, default=1.0)
    g.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the multi-token-prediction loss")
    g.add_argument("--routing-bias-rate", type=float, default=1e-3,
                   help="aux-loss-free balancing: router bias step after each update (0: off; default %(default)s)")
    return p


EXIT_CODES = """exit codes:
  0    finished (or nothing left to do)
  2    bad settings or files, or a checkpoint could not be written; the message says what and how to fix it
  3    a step was not finite (loss, gradient norm or update): it was not applied; the last finite state is the
       newest checkpoint
  75   stopped early by SIGTERM/SIGINT, checkpoint saved: rerun the same command to resume
  128+N  a second signal N arrived: exited at once; the last complete checkpoint is kept
"""

# DeepSeekV3Config fields that change how the model computes, not what: free to change when resuming a run.
HOW_FIELDS = frozenset({"moe_impl", "batch_split_factor", "scan_layers", "remat_policy"})


def main(argv: list[str] | None = None) -> int:
    from nnx_zoo import DeepSeekV3Config
    from nnx_zoo.models.deepseek import PRESETS
    from nnx_zoo.train import NonFiniteLossError
    from nnx_zoo.train.run_spec import EXIT_BAD_INPUT, EXIT_DIVERGED

    args = build_parser(DeepSeekV3Config, presets=PRESETS).parse_args(argv)
    try:
        return run(args)
    except NonFiniteLossError as err:
        print(f"\ndeepseek_pretrain.py: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    except (ValueError, RuntimeError, OSError) as err:
        print(f"\ndeepseek_pretrain.py: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def model_definition(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(architecture, settings that change the numbers) of a model config, for the run's stored definition."""
    structure = {k: v for k, v in config.to_hf_dict().items() if k != "initializer_range"}
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if f.name not in structure and f.name not in HOW_FIELDS and f.name != "initializer_range"}
    return structure, settings


def run(args: argparse.Namespace) -> int:
    if args.num_processes > 1:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    from flax import nnx

    from nnx_zoo import DeepSeekV3, DeepSeekV3Config
    from nnx_zoo.sharding import make_abstract_mesh, sharding_report
    from nnx_zoo.train import DataConfig, OptimizerConfig, TrainConfig, train
    from nnx_zoo.train.run_spec import EXIT_DONE, EXIT_STOPPED

    overrides = {
        k.removeprefix("model__"): v for k, v in vars(args).items() if k.startswith("model__") and v is not None
    }
    if args.moe_impl:
        overrides["moe_impl"] = args.moe_impl
    if args.remat:
        overrides["remat_policy"] = args.remat
    config = DeepSeekV3Config.preset(args.model, **overrides)
    if args.seq_len > config.max_position_embeddings:  # RoPE past it was never trained (or YaRN-scaled) for
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings ({config.max_position_embeddings}"
            f" for {args.model}); use --seq-len {config.max_position_embeddings} or less, or raise "
            "--model.max_position_embeddings"
        )

    if args.plan:
        sizes = {k: v for k, v in args.mesh.items()}
        if any(v == -1 for v in sizes.values()):
            raise ValueError("--plan needs every mesh size given explicitly (no -1), e.g. --mesh fsdp=64,expert=8")
        report = sharding_report(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0)), make_abstract_mesh(sizes),
                                 args.rules)
        print(report.table())
        return 0

    with_mtp = config.num_nextn_predict_layers > 0 and args.mtp_weight > 0
    train_config = TrainConfig(
        steps=args.steps,
        run_dir=args.run_dir or f"runs/{args.model}",
        mesh=args.mesh,
        shard_mode=args.shard_mode,
        rules=args.rules,
        accum_steps=args.accum_steps,
        mtp_weight=args.mtp_weight,
        # The MTP heads only run (and cost) when their loss counts; expert loads only when balancing uses them.
        model_kwargs=tuple(
            (name, True) for name, wanted in (
                ("with_mtp", with_mtp),
                ("with_expert_load", config.num_moe_layers > 0 and args.routing_bias_rate > 0),
            ) if wanted
        ),
        routing_bias_rate=args.routing_bias_rate,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        async_checkpoints=not args.sync_checkpoints,
        seed=args.seed,
        tensorboard=args.tensorboard,
        profile_steps=args.profile_steps,
        progress=not args.no_progress,
        peak_flops_per_device=args.peak_flops,
        extend=args.extend,
        override_settings=args.override_settings,
        optimizer=OptimizerConfig(
            name=args.optimizer, lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
            schedule=args.schedule,
            weight_decay=args.weight_decay, clip_norm=args.clip_norm,
        ),
        data=DataConfig(source=args.data, tokenizer=args.tokenizer, seq_len=args.seq_len, global_batch=args.batch,
                        seed=args.seed,
                        synthetic_vocab=min(args.synthetic_vocab, config.vocab_size)),
    )
    params = config.num_parameters()
    print(f"nnx_zoo: {args.model}: {params.total / 1e6:.1f}M parameters ({params.active / 1e6:.1f}M active), "
          f"run dir {train_config.run_dir}", file=sys.stderr)
    structure, settings = model_definition(config)
    summary = train(
        lambda: DeepSeekV3(config, rngs=nnx.Rngs(args.seed)),
        train_config,
        vocab_size=config.vocab_size,
        flops_per_token=config.train_flops_per_token(args.seq_len, include_mtp=with_mtp),  # MTP heads count when run
        model_structure=structure,
        model_settings=settings,
    )
    if summary.get("already_finished"):
        print(f"this run already finished: its checkpoint is at step {summary['start_step']} of --steps "
              f"{args.steps} in {Path(train_config.run_dir) / 'checkpoints'}. To train further on the same "
              f"learning-rate schedule, rerun with a larger --steps and --extend (e.g. --steps {2 * args.steps} "
              "--extend); to re-plan the schedule, add --override-settings instead; for a new run, use another "
              "--run-dir.")
        return EXIT_DONE
    print_summary(summary, train_config)
    return EXIT_STOPPED if summary.get("stopped_by_signal") else EXIT_DONE


def print_summary(summary: dict[str, Any], config: Any) -> None:
    losses = summary["losses"]
    last = summary["last"] or {}
    lines = [
        f"steps {summary['start_step']} -> {summary['end_step']}"
        + (" (resumed)" if summary["start_step"] else "")
        + (" (stopped by signal; checkpoint saved; rerun to resume)" if summary.get("stopped_by_signal") else ""),
    ]
    if losses:
        lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if last:
        mfu = last.get("mfu")
        lines.append(f"last step: {last['tokens_per_s']:.0f} tokens/s, {last['tflops_per_device'] * 1e3:.3f} "
                     f"GFLOP/s per device" + (f", MFU {100 * mfu:.2f}%" if mfu is not None else ""))
    lines.append(f"peak per device: {summary['peak_flops_per_device'] / 1e9:.1f} GFLOP/s ({summary['peak_source']})")
    run_dir = Path(config.run_dir)
    lines.append(f"metrics: {run_dir / 'metrics.jsonl'}; checkpoints: {run_dir / 'checkpoints'}")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
