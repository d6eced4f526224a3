"""Pretrain any nnx_zoo family: a preset by name, or continued pretraining from a Hugging Face checkpoint.

With no arguments: the ``llama3-tiny`` preset, synthetic data, a short run on this machine's devices, a live
progress line, metrics in ``runs/llama3-tiny/metrics.jsonl`` and a checkpoint at the end. Run it again with the
same ``--run-dir`` and it resumes from the latest complete checkpoint.

Examples (the mesh ones need 8 devices: on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8 makes them):
    python recipes/pretrain.py --model qwen3-tiny --steps 50
    python recipes/pretrain.py --model llama3-small --mesh fsdp=4,tensor=2 --shard-mode explicit
    python recipes/pretrain.py --from-pretrained /path/to/Llama-3.2-1B --lr 1e-4 --data corpus.jsonl
    python recipes/pretrain.py --model llama3.1-405b --mesh fsdp=64,tensor=8 --plan

Every field of the chosen family's config class can be set with ``--model.<field> VALUE`` (``none`` for None);
``--model NAME --help`` lists that family's fields. Training extras a model has are used because it has them:
multi-token-prediction heads (the config's ``mtp_depth > 0``), aux-loss-free expert balancing (MoE layers and
``--routing-bias-rate > 0``), a sequence-wise balance loss (``seq_aux_loss_alpha > 0``), a sparse-attention
indexer's own loss (DeepSeek-V3.2: ``--indexer-stage dense_warmup`` trains the indexer alone on dense attention,
the rest frozen; ``--indexer-stage sparse`` trains it beside the model, on its own loss only). A warm-up goes on to
the sparse stage as a new run from its export:
    python recipes/pretrain.py --model deepseek3.2-tiny --indexer-stage dense_warmup --run-dir runs/warm
    python recipes/export_hf.py runs/warm exports/warm
    python recipes/pretrain.py --from-pretrained exports/warm --indexer-stage sparse --run-dir runs/sparse
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

# Make `python recipes/pretrain.py` work from a clone without installing. (NamedTuples, not dataclasses, below: a
# dataclass needs its module in sys.modules, which a module loaded by path need not be.)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXIT_CODES = """exit codes:
  0    finished (or nothing left to do)
  2    bad settings or files, the run directory is in use by another run, a damaged checkpoint, or a checkpoint
       could not be written; the message says what and how to fix it
  3    diverged: a step was not finite (loss, gradient norm or update), or the loss rose above
       --exploding-loss-factor times its first value; the newest checkpoint is the last healthy state (a bad
       one is moved to <run dir>/checkpoints-set-aside): lower --lr and rerun with --override-settings
  75   stopped early by SIGTERM/SIGINT, checkpoint saved: rerun the same command to resume
  128+N  a second signal N arrived: exited at once; the last complete checkpoint is kept
"""

SYNTHETIC_VOCAB = 256  # --synthetic-vocab's default; smaller model vocabularies use their own size

# Config fields that change how the model computes, not what: free to change when resuming a run.
HOW_FIELDS = frozenset({"moe_impl", "grouped_matmul_impl", "attention_impl", "batch_split_factor", "scan_layers",
                        "remat_policy"})

# The shortcut flags a family has only when its config has the field behind them (see _model_arguments).
FAMILY_FLAGS = {"--attention-impl": "attention_impl", "--moe-impl": "moe_impl", "--remat": "remat_policy",
                "--indexer-stage": "indexer_training"}


# The module docstring, for --help (inside a class body ``__doc__`` is the class's own docstring).
DESCRIPTION = __doc__


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and epilog as written (their examples keep their lines), and every option's default shown
    after its help unless the help already speaks of it (or there is none: None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default in ("", argparse.SUPPRESS) or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


class Entry(NamedTuple):
    """Who runs the recipe: its program name, default preset, help text and which families it trains.

    >>> Entry(prog="deepseek_pretrain.py", default_model="deepseek3-tiny", model_classes=("DeepSeekV3",))
    """

    prog: str = "pretrain.py"
    default_model: str = "llama3-tiny"
    description: str = DESCRIPTION
    model_classes: tuple[str, ...] | None = None  # model class names (e.g. "DeepSeekV3"); None: every family


GENERIC = Entry()


# ------------------------------------------------------------------------------------------- the command line
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


def _field_parser(annotation: Any) -> Callable[[str], Any]:
    """A string -> value parser for a config field's type annotation ('none' means None where allowed)."""
    # Only a union (``X | None``) is unwrapped: ``tuple[str, ...]``'s arguments are its items' type, not the field's.
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    as_tuple = typing.get_origin(base) is tuple

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
        value = json.loads(text)  # dicts such as rope_scaling, lists such as eos_token_id or layer_types
        return tuple(value) if as_tuple and isinstance(value, list) else value

    return parse


MTP_WEIGHT = 0.3  # --mtp-weight's default for models with MTP heads (DeepSeek-V3's 0.3, then 0.1 in its report)
ROUTING_BIAS_RATE = 1e-3  # --routing-bias-rate's default for routers that select on a bias (DeepSeek-V3's gamma)


def build_parser(model_config_cls: type, presets: Iterable[str] = (), *, entry: Entry = GENERIC,
                 model_defaults: Any = None, defaults_from: str = "preset") -> argparse.ArgumentParser:
    """The recipe's command line with ``--model.<field>`` for every field of ``model_config_cls``; ``--help``
    lists ``presets`` and the registered rule sets by name, and each field's value in ``model_defaults`` (the
    chosen preset's config, or the checkpoint's: ``defaults_from`` says which)."""
    # A one-line usage: argparse's own lists every --model.<field> and would bury the description under it.
    usage = "%(prog)s [--model PRESET | --from-pretrained DIR] [--model.<field> VALUE ...] [options]"
    p = argparse.ArgumentParser(prog=entry.prog, usage=usage, description=entry.description, epilog=EXIT_CODES,
                                formatter_class=HelpFormatter)
    _model_arguments(p.add_argument_group("model"), model_config_cls, presets, entry, model_defaults, defaults_from)
    _run_arguments(p.add_argument_group("run"))
    _parallelism_arguments(p.add_argument_group("parallelism"))
    _data_and_optimizer_arguments(p.add_argument_group("data and optimization"))
    return p


def _model_arguments(g: argparse._ArgumentGroup, config_cls: type, presets: Iterable[str], entry: Entry,
                     model_defaults: Any = None, defaults_from: str = "preset") -> None:
    g.add_argument("--model", default=entry.default_model,
                   help=f"preset name: {', '.join(presets)} (default: %(default)s)")
    g.add_argument("--from-pretrained", metavar="DIR",
                   help="continue pretraining from a Hugging Face checkpoint directory (config.json + safetensors) "
                   "of any supported family, instead of a randomly initialized preset")
    hints = typing.get_type_hints(config_cls)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    if "attention_impl" in fields:
        g.add_argument("--attention-impl", choices=("auto", "xla", "blockwise", "cudnn", "tokamax"),
                       help="attention kernel (shortcut for --model.attention_impl; the run prints what 'auto' chose)")
    if "moe_impl" in fields:
        g.add_argument("--moe-impl", choices=("auto", "dense", "gmm", "ep"),
                       help="MoE compute path (shortcut for --model.moe_impl)")
    if "remat_policy" in fields:
        from nnx_zoo.layers.scan import REMAT_POLICIES
        from nnx_zoo.train.remat_choice import MARGIN

        g.add_argument("--remat", choices=("auto", *REMAT_POLICIES),
                       help="what the backward pass recomputes (shortcut for --model.remat_policy). auto (the "
                       "default unless --model.remat_policy is given): the memory plan's least recomputation that "
                       "fits the device's memory (--device-memory) less --memory-margin, printed at start")
        g.add_argument("--device-memory", type=float, metavar="GIB",
                       help="--remat auto (and --plan): memory per device in GiB (default: what the runtime reports, "
                       "on the CPU the host's memory over its devices)")
        g.add_argument("--memory-margin", type=float, default=MARGIN,
                       help="--remat auto: the fraction of --device-memory left free (default: %(default)s)")
    if "indexer_training" in fields:
        g.add_argument("--indexer-stage", choices=getattr(config_cls, "INDEXER_STAGES", None),
                       help="how the sparse-attention indexer trains (shortcut for --model.indexer_training): "
                       "dense_warmup: dense attention, only the indexer trains (on its KL to the attention "
                       "distribution), the rest frozen; sparse: top-k attention, the indexer trains on its KL from "
                       "detached inputs, the rest on the language-model loss alone; off: no indexer loss. After a "
                       "warm-up, export it (recipes/export_hf.py RUN_DIR OUT) and start the sparse stage as a new "
                       "run with --from-pretrained OUT --indexer-stage sparse")
    for field in dataclasses.fields(config_cls):
        kind = getattr(hints[field.name], "__name__", None) or str(hints[field.name]).replace("typing.", "")
        # The value this run would use unless overridden: what a user compares an override against.
        value = "" if model_defaults is None else f"; {defaults_from}: {getattr(model_defaults, field.name)}"
        g.add_argument(f"--model.{field.name}", dest=f"model__{field.name}", type=_field_parser(hints[field.name]),
                       metavar="V", help=f"override {config_cls.__name__}.{field.name} ({kind}{value})".replace(
                           "%", "%%"))


def _run_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    g.add_argument("--run-dir", help="where metrics and checkpoints go (default: runs/<model>)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the model's initialization and of the synthetic data and its shuffling")
    g.add_argument("--extend", action="store_true",
                   help="resume a run past the --steps it was planned for, keeping its learning-rate schedule (the "
                   "added steps run at its final learning rate)")
    g.add_argument("--override-settings", action="store_true",
                   help="resume with changed settings (seed, data, optimizer hyper-parameters such as --lr, loss "
                   "weights, --steps with a re-planned schedule); without it a resume that would change them stops "
                   "and names each difference")
    g.add_argument("--log-every", type=int, default=1,
                   help="steps between metrics.jsonl records and progress-line updates")
    g.add_argument("--checkpoint-every", type=int, default=1000,
                   help="steps between checkpoints (0: none by step count); checkpoints are also written at the end "
                   "and on SIGTERM/SIGINT (default: %(default)s)")
    g.add_argument("--checkpoint-minutes", type=float, default=30.0,
                   help="minutes of wall time between checkpoints, whichever of this and --checkpoint-every comes "
                   "first (0: none by time); together they bound the work a hard kill loses (default: %(default)s)")
    g.add_argument("--exploding-loss-factor", type=float, default=10.0,
                   help="stop as diverged (exit 3) when a step's loss exceeds this many times the run's first loss "
                   "(and this many nats); the state it measured is never resumed from. 0: no check "
                   "(default: %(default)s)")
    g.add_argument("--keep-checkpoints", type=int, default=3, help="how many of the newest checkpoints to keep")
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
    g.add_argument("--plan-batch", type=int, metavar="ROWS",
                   help="--plan: rows per batch shard for the activation estimate (default: --batch split over the "
                   "mesh's batch shards, at least 1)")
    g.add_argument("--plan-seq-len", type=int, metavar="LEN",
                   help="--plan: sequence length for the activation estimate (default: --seq-len)")
    g.add_argument("--plan-platform", choices=("gpu", "tpu", "cpu"), default="gpu",
                   help="--plan: the backend whose kernels the estimate assumes, as 'auto' picks them there "
                   "(default: %(default)s)")


def _parallelism_arguments(g: argparse._ArgumentGroup) -> None:
    from nnx_zoo.layers.pipeline import SCHEDULES as PIPELINE_SCHEDULES
    from nnx_zoo.sharding import RULE_SETS

    g.add_argument("--mesh", type=parse_mesh, default={"fsdp": -1},
                   help="mesh axis sizes, e.g. fsdp=4,expert=2; one may be -1 (default: all devices on fsdp)")
    g.add_argument("--shard-mode", choices=("auto", "explicit"), default="auto",
                   help="JAX sharding mode of the mesh: auto (XLA propagates layouts) or explicit (typed shardings)")
    g.add_argument("--rules", default="default",
                   help=f"rule set name: {', '.join(RULE_SETS)} (default: %(default)s)")
    g.add_argument("--allow-partial", action="store_true",
                   help="a parameter dimension that does not divide over its rule's mesh axes goes on the longest "
                   "prefix of them that divides it (more replication, each one printed at start) instead of "
                   "failing; --plan lists them with the bytes they replicate")
    g.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="pipeline micro-batches per accumulation step, with a 'stage' axis in --mesh (default: the "
                   "stage count; a multiple of it for interleaved); more shrink the bubble, (S-1)/(M+S-1) of each "
                   "stage's time for gpipe, (VS+S-2)/(MV+VS+S-2) for 1f1b (V=1) and interleaved")
    g.add_argument("--pipeline-schedule", choices=tuple(PIPELINE_SCHEDULES), default="gpipe",
                   help="order of the pipeline's forward and backward passes (default: %(default)s): gpipe, all "
                   "forwards then all backwards, every micro-batch's activations alive; 1f1b, each micro-batch's "
                   "backward right after its forward on the last stage, at most 2S-1 micro-batches' stage inputs "
                   "kept (the backward recomputes the stage); interleaved, 1f1b over --virtual-stages chunks per "
                   "stage (stage s runs layer chunks s, S+s, ...), at most (V+1)S-1 chunk inputs kept")
    g.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="--pipeline-schedule interleaved: layer chunks per stage (default 2; the layers must split "
                   "into V*S chunks of the same layer kinds); 1 with the other schedules")
    g.add_argument("--num-processes", type=int, default=int(os.environ.get("NNX_ZOO_NUM_PROCESSES", 1)),
                   help="processes in a multi-host run (env NNX_ZOO_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=int(os.environ.get("NNX_ZOO_PROCESS_ID", 0)),
                   help="this process's index, 0 .. --num-processes - 1 (env NNX_ZOO_PROCESS_ID)")
    g.add_argument("--coordinator", default=os.environ.get("NNX_ZOO_COORDINATOR", ""),
                   help="host:port of process 0 in a multi-host run (env NNX_ZOO_COORDINATOR)")


def _data_and_optimizer_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--batch", type=int, default=8, help="global batch (rows per step, default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=64,
                   help="tokens per row (at most the model's max_position_embeddings)")
    g.add_argument("--accum-steps", type=int, default=1, help="gradient-accumulation micro-batches per step")
    g.add_argument("--data", default="synthetic",
                   help="'synthetic' (default), or a .txt/.jsonl/.parquet file or a directory of them")
    g.add_argument("--tokenizer", default="bytes",
                   help="for files: 'bytes' (built-in byte-level) or a tokenizers JSON file")
    g.add_argument("--eos-token", metavar="TOKEN",
                   help="the token of a tokenizers JSON file that ends each document (default: the first of </s>, "
                   "<|endoftext|>, <eos>, <｜end▁of▁sentence｜> that it has)")
    g.add_argument("--synthetic-vocab", type=int, default=None, metavar="N",
                   help=f"token ids the synthetic data uses, 0 .. N-1; at most the model's vocab_size (default: "
                   f"{SYNTHETIC_VOCAB}, or the model's vocab_size if smaller)")
    g.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: Muon on the hidden weight matrices (per layer and expert), AdamW on embeddings, "
                   "output head, norms (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="final learning rate as a fraction of --lr (cosine and wsd schedules)")
    g.add_argument("--warmup-steps", type=int, default=5, help="steps of linear warmup from 0 to --lr")
    g.add_argument("--schedule", choices=("cosine", "wsd", "constant"), default="cosine",
                   help="learning-rate schedule after warmup: cosine decay, warmup-stable-decay, or constant")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled (AdamW) weight decay")
    g.add_argument("--clip-norm", type=float, default=1.0, help="global gradient-norm clipping threshold")
    g.add_argument("--mtp-weight", type=float, default=None,
                   help=f"weight of the multi-token-prediction loss (models with MTP heads; default {MTP_WEIGHT}; "
                   "a model without them refuses a weight above 0)")
    g.add_argument("--routing-bias-rate", type=float, default=None,
                   help="aux-loss-free balancing of MoE models whose router selects on a bias: router bias step "
                   f"after each update (0: off; default {ROUTING_BIAS_RATE}; a model without such a router refuses "
                   "a rate above 0)")
    g.add_argument("--loss-chunk-tokens", type=int, default=None,
                   help="tokens per device whose logits the output head + cross-entropy computes at a time (default: "
                   "chunks of at most 512 MiB of float32 logits, one chunk on an Auto mesh splitting the tokens; "
                   "0: the whole micro-batch at once, no recompute)")


# ------------------------------------------------------------------------------------- which model, which family
class ModelSource(NamedTuple):
    """Where the model comes from: a preset name or a checkpoint directory, and its config class."""

    config_cls: type
    preset: str | None = None
    pretrained: Path | None = None

    @property
    def name(self) -> str:
        """The run's name: the preset, or the checkpoint directory's name."""
        return self.preset if self.pretrained is None else self.pretrained.resolve().name

    def config(self, overrides: Mapping[str, Any]) -> Any:
        """The model config with ``overrides`` (field -> value) applied."""
        if self.pretrained is not None:
            from nnx_zoo import AutoConfig

            return AutoConfig.from_hf(self.pretrained, **overrides)
        return self.config_cls.preset(self.preset, **overrides)


def families(entry: Entry = GENERIC) -> dict[str, tuple[type, list[str]]]:
    """Model class name -> (config class, preset names) of every family ``entry`` trains."""
    from nnx_zoo.models.registry import MODEL_TYPES, preset_names

    config_classes = {model_cls.__name__: config_cls for config_cls, model_cls in MODEL_TYPES.values()}
    return {name: (config_classes[name], presets) for name, presets in preset_names().items()
            if entry.model_classes is None or name in entry.model_classes}


def model_source(argv: list[str] | None, entry: Entry = GENERIC) -> ModelSource:
    """Which family the command line asks for (``--model`` or ``--from-pretrained``), read before the full
    parse because the ``--model.<field>`` options depend on it. A ``ValueError`` says what is wrong."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--model")
    pre.add_argument("--from-pretrained")
    known, _ = pre.parse_known_args(argv)
    if known.from_pretrained is not None:
        if known.model is not None:
            raise ValueError("give --model (a preset) or --from-pretrained (a checkpoint directory), not both")
        return _pretrained_source(Path(known.from_pretrained), entry)
    name = known.model or entry.default_model
    table = families(entry)
    for config_cls, presets in table.values():
        if name in presets:
            return ModelSource(config_cls, preset=name)
    listing = "; ".join(f"{family}: {', '.join(presets)}" for family, (_, presets) in table.items())
    hint = "" if entry.model_classes is None else " (recipes/pretrain.py trains every family)"
    raise ValueError(f"unknown preset {name!r}; presets are {listing}{hint}")


def _pretrained_source(directory: Path, entry: Entry) -> ModelSource:
    from nnx_zoo import AutoConfig

    if not directory.is_dir():
        raise ValueError(f"--from-pretrained {directory}: not a directory; pass a Hugging Face checkpoint "
                         "directory (the one holding config.json and *.safetensors)")
    config_cls = type(AutoConfig.from_hf(directory))
    allowed = {cls for cls, _ in families(entry).values()}
    if config_cls not in allowed:
        raise ValueError(f"--from-pretrained {directory}: a {config_cls.__name__} checkpoint, which {entry.prog} "
                         "does not train; use recipes/pretrain.py")
    return ModelSource(config_cls, pretrained=directory)


# ------------------------------------------------------------------------------------------------ the run
def main(argv: list[str] | None = None, *, entry: Entry = GENERIC) -> int:
    """Run the recipe; returns the exit code (``EXIT_CODES``)."""
    from nnx_zoo.sharding import reserve_cpu_workers
    from nnx_zoo.train.loop import DivergenceError
    from nnx_zoo.train.run_spec import EXIT_BAD_INPUT, EXIT_DIVERGED

    reserve_cpu_workers()  # fake CPU devices: room for collectives in flight, before JAX starts its CPU client

    try:
        source = model_source(argv, entry)
    except ValueError as err:
        print(f"{entry.prog}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser = build_parser(source.config_cls, presets=_preset_listing(entry), entry=entry,
                          model_defaults=_model_defaults(source, argv),
                          defaults_from="preset" if source.pretrained is None else "checkpoint")
    args, unknown = parser.parse_known_args(argv)
    fields = [w.split("=", 1)[0] for w in unknown if w.startswith("--model.")]
    if fields:
        names = [f.name for f in dataclasses.fields(source.config_cls)]
        hints = []
        for flag in fields:
            close = difflib.get_close_matches(flag.removeprefix("--model."), names, n=3)
            hints.append(flag + (f" (did you mean {' or '.join('--model.' + c for c in close)}?)" if close else ""))
        print(f"{entry.prog}: {', '.join(hints)}: not a field of {source.config_cls.__name__} (the config of "
              f"{source.name}); its fields are {', '.join(names)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    problem = _family_flag_problem(unknown, source, entry) or _process_problem(args)
    if problem:
        print(f"{entry.prog}: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return run(args, source, entry)
    except DivergenceError as err:
        if err.summary is not None and err.summary.get("end_step", 0) > err.summary.get("start_step", 0):
            print_summary(err.summary, args.run_dir or f"runs/{source.name}")
        print(f"\n{entry.prog}: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    except (ValueError, RuntimeError, OSError) as err:
        print(f"\n{entry.prog}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _family_flag_problem(unknown: list[str], source: ModelSource, entry: Entry) -> str | None:
    """A shortcut flag that another family takes but this one's config has no field for (``--indexer-stage`` on a
    Llama): what the flag is for and which presets take it, not argparse's bare 'unrecognized arguments'."""
    for i, word in enumerate(unknown):
        flag, _, value = word.partition("=")
        if flag not in FAMILY_FLAGS:
            continue
        field = FAMILY_FLAGS[flag]
        value = value or (unknown[i + 1] if i + 1 < len(unknown) else "")
        takers = [name for cls, presets in families(entry).values()
                  if field in {f.name for f in dataclasses.fields(cls)}
                  for name in sorted(presets, key=lambda n: "tiny" not in n) if _takes(cls, name, field, value)]
        return (f"{flag} sets {field}, which {source.config_cls.__name__} (the config of {source.name}) does not "
                f"have; leave {flag} out, or train a model that has it (e.g. --model {takers[0]})" if takers else
                f"{flag} is not an option of {entry.prog}")
    return None


def _takes(config_cls: type, preset: str, field: str, value: str) -> bool:
    """Whether ``preset`` builds with ``field`` set to ``value`` (a model the flag would work on)."""
    try:
        config_cls.preset(preset, **{field: value})
    except (ValueError, TypeError):
        return False
    return True


def _process_problem(args: argparse.Namespace) -> str | None:
    """A multi-process run's flags that cannot start one, said before JAX tries."""
    if args.num_processes < 1:
        return f"--num-processes must be at least 1, got {args.num_processes}"
    if args.num_processes > 1 and not args.coordinator:
        return (f"--num-processes {args.num_processes} needs --coordinator HOST:PORT, the address of process 0 that "
                "every process reaches (e.g. --coordinator 10.0.0.1:12355, or env NNX_ZOO_COORDINATOR), and each "
                f"process its --process-id 0 .. {args.num_processes - 1}")
    if not 0 <= args.process_id < args.num_processes:
        return f"--process-id {args.process_id} must be in 0 .. {args.num_processes - 1} (--num-processes " \
               f"{args.num_processes})"
    return None


def _model_defaults(source: ModelSource, argv: list[str] | None) -> Any:
    """For ``--help`` only: the config the chosen preset or checkpoint gives, whose values the help shows."""
    if not {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        return None
    try:
        return source.config({})
    except (ValueError, TypeError, OSError):  # the run itself reports a broken checkpoint config
        return None


def _preset_listing(entry: Entry) -> list[str]:
    return [name for _, presets in families(entry).values() for name in presets]


def model_definition(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(architecture, settings that change the numbers) of a model config, for the run's stored definition."""
    structure = {k: v for k, v in config.to_hf_dict().items() if k != "initializer_range"}
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if f.name not in structure and f.name not in HOW_FIELDS and f.name != "initializer_range"}
    return structure, settings


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config field -> value from ``--model.<field>`` and the shortcut flags."""
    overrides = {
        k.removeprefix("model__"): v for k, v in vars(args).items() if k.startswith("model__") and v is not None
    }
    if getattr(args, "attention_impl", None):
        overrides["attention_impl"] = args.attention_impl
    if getattr(args, "moe_impl", None):
        overrides["moe_impl"] = args.moe_impl
    if getattr(args, "remat", None) and args.remat != "auto":
        overrides["remat_policy"] = args.remat
    if getattr(args, "indexer_stage", None):
        overrides["indexer_training"] = args.indexer_stage
    return overrides


def model_config(args: argparse.Namespace, source: ModelSource) -> Any:
    """The config the command line describes, after checking ``--seq-len`` against its positions."""
    config = source.config(model_overrides(args))
    if args.seq_len > config.max_position_embeddings:  # RoPE past it was never trained (or YaRN-scaled) for
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings ({config.max_position_embeddings}"
            f" for {source.name}); use --seq-len {config.max_position_embeddings} or less, or raise "
            "--model.max_position_embeddings"
        )
    return config


class Extras(NamedTuple):
    """The training extras a model has and the run uses: MTP heads, expert-load balancing."""

    mtp_weight: float  # 0 when the model has no MTP heads (or --mtp-weight 0): the heads do not run
    routing_bias_rate: float  # 0 when the model has no MoE layers (or --routing-bias-rate 0)
    pipeline: tuple[tuple[str, Any], ...] = ()  # the forward's pipeline keywords (a 'stage' axis in --mesh)

    @property
    def model_kwargs(self) -> tuple[tuple[str, Any], ...]:
        # The MTP heads only run (and cost) when their loss counts; expert loads only when balancing uses them.
        return tuple((name, True) for name, wanted in (("with_mtp", self.mtp_weight > 0),
                                                       ("with_expert_load", self.routing_bias_rate > 0)) if wanted
                     ) + self.pipeline


def pipeline_settings(model_cls: type, args: argparse.Namespace, config: Any = None) -> tuple[tuple[str, Any], ...]:
    """The forward's pipeline keywords for ``--mesh stage=S,...``, ``--microbatches`` and ``--pipeline-schedule``
    (none without a stage axis); a model whose forward cannot pipeline (or, given ``config``, whose
    ``pipeline_problem`` says why not), a count that does not divide the accumulation step's rows, micro-batches
    without stages, or (given ``config``) layers that do not split into the stages' chunks (naming the
    ``--model.pipeline_layers`` that fit) are errors saying what to change."""
    import inspect

    from nnx_zoo.layers.pipeline import resolve_schedule

    virtual = args.virtual_stages
    try:
        schedule = resolve_schedule(args.pipeline_schedule, virtual)
    except ValueError as e:
        raise ValueError(f"--pipeline-schedule {args.pipeline_schedule} --virtual-stages {virtual}: {e}") from None
    stages = args.mesh.get("stage", 1)
    if stages == -1:
        raise ValueError("--mesh stage=-1: give the pipeline's stage count explicitly, e.g. --mesh stage=2,fsdp=-1")
    if stages == 1:
        if args.microbatches is not None or virtual not in (None, 1):
            flag = "--microbatches" if args.microbatches is not None else "--virtual-stages"
            raise ValueError(f"{flag} {args.microbatches or virtual} needs a pipeline: add a 'stage' axis to --mesh "
                             "(e.g. --mesh stage=2,fsdp=-1), or leave the flag out")
        return ()
    if "pipeline_microbatches" not in inspect.signature(model_cls.forward).parameters:
        raise ValueError(f"--mesh stage={stages}: {model_cls.__name__} does not run pipelined yet (its forward "
                         "takes no pipeline_microbatches); train it on a mesh without 'stage'")
    problem = None if config is None else getattr(model_cls, "pipeline_problem", lambda _: None)(config)
    if problem is not None:
        raise ValueError(f"--mesh stage={stages}: {problem}")
    micro = stages if args.microbatches is None else args.microbatches
    rows = args.batch // max(args.accum_steps, 1)
    if micro < 1 or rows % micro:
        raise ValueError(f"--microbatches {micro} must be >= 1 and divide the {rows} rows of each accumulation step "
                         f"(--batch {args.batch} / --accum-steps {args.accum_steps})")
    settings = (("pipeline_microbatches", micro), ("pipeline_schedule", schedule.name))
    if hasattr(config, "check_pipeline"):  # before anything is built: which layers split, which pipeline_layers fit
        try:
            config.check_pipeline(stages, schedule.virtual_stages)
        except ValueError as e:
            raise ValueError(f"--mesh stage={stages}: {e}") from None
    if not schedule.interleaved:
        return settings
    if micro % stages:
        raise ValueError(f"--pipeline-schedule interleaved runs micro-batches in groups of the {stages} stages: "
                         f"--microbatches {micro} must be a multiple of {stages}")
    if "pipeline_virtual_stages" not in inspect.signature(model_cls.forward).parameters:
        raise ValueError(f"--pipeline-schedule interleaved: {model_cls.__name__}'s forward takes no "
                         "pipeline_virtual_stages yet; use --pipeline-schedule 1f1b or gpipe")
    return (*settings, ("pipeline_virtual_stages", schedule.virtual_stages))


def training_extras(config: Any, model_cls: type, args: argparse.Namespace) -> Extras:
    """What the model says it has (config fields, model methods), switched on as far as the flags allow: by
    default (a flag not given) where the model has it; a weight or rate above 0 given for a model without it is an
    error, not a setting silently dropped. The sequence-wise balance loss needs nothing here: a model whose config
    asks for it returns it."""
    has_mtp = getattr(config, "mtp_depth", 0) > 0  # FamilyConfig.mtp_depth: any family's MTP depths
    moe = getattr(config, "num_moe_layers", 0) > 0
    can_balance = (moe and hasattr(model_cls, "update_routing_bias")
                   and getattr(config, "has_routing_bias", True))  # a softmax top-k router has no bias to move
    name = type(config).__name__
    if not has_mtp and (args.mtp_weight or 0) > 0:
        raise ValueError(f"--mtp-weight {args.mtp_weight:g}: this {name} has no multi-token-prediction heads "
                         "(mtp_depth 0); leave the flag out, or build it with them (--model.num_nextn_predict_layers, "
                         "--model.mtp_num_hidden_layers: whichever its config has)")
    if not can_balance and (args.routing_bias_rate or 0) > 0:
        why = ("has no MoE layers" if not moe else "routes without a selection bias (aux-loss-free balancing "
               "moves one); balance it with its own loss if its config has one (--model.output_router_logits, "
               "--model.seq_aux_loss_alpha)")
        raise ValueError(f"--routing-bias-rate {args.routing_bias_rate:g}: this {name} {why}; leave the flag out")
    mtp = MTP_WEIGHT if args.mtp_weight is None else args.mtp_weight
    rate = ROUTING_BIAS_RATE if args.routing_bias_rate is None else args.routing_bias_rate
    return Extras(mtp_weight=mtp if has_mtp else 0.0, routing_bias_rate=rate if can_balance else 0.0)


def trained_parameters(config: Any, model_cls: type) -> tuple[int, int]:
    """(parameters the trainer updates, all parameters) of ``config``'s model, counted on an abstract one: what
    ``model.trainable()`` selects (``nnx_zoo.train.optim.trainable_filter``; all of them unless the model freezes
    part of itself, e.g. for an indexer warm-up)."""
    import jax
    from flax import nnx

    from nnx_zoo.train.optim import trainable_filter

    model = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))

    def count(wrt: Any) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.All(nnx.Param, wrt))))

    return count(trainable_filter(model)), count(nnx.Param)


def what_trains(config: Any, model_cls: type, extras: Extras, pretrained: bool) -> tuple[Extras, list[str]]:
    """The lines that say what this run trains when the model trains part of itself (the config's
    ``training_notes``), and the extras adjusted to it: no routing-bias balancing when the stage freezes the
    routers (the config's ``routers_train``)."""
    notes = getattr(config, "training_notes", None)
    lines = notes(*trained_parameters(config, model_cls), pretrained=pretrained) if notes is not None else []
    if extras.routing_bias_rate > 0 and not getattr(config, "routers_train", True):
        lines.append(f"routing-bias balancing off (--routing-bias-rate {extras.routing_bias_rate:g} not used): this "
                     "training stage freezes the routers")
        extras = extras._replace(routing_bias_rate=0.0)
    return extras, lines


def plan(args: argparse.Namespace, config: Any) -> int:
    """``--plan``: the sharding report of ``config``'s model on the given mesh, from abstract arrays."""
    from nnx_zoo.layers.kernel_choices import describe as describe_kernels
    from nnx_zoo.layers.kernel_choices import kernel_choices
    from nnx_zoo.sharding import STACK_AXES, make_abstract_mesh
    from nnx_zoo.train.remat_choice import choose_remat

    if any(v == -1 for v in args.mesh.values()):
        raise ValueError("--plan needs every mesh size given explicitly (no -1), e.g. --mesh fsdp=64,expert=8")
    seq_len = args.plan_seq_len or args.seq_len
    kernels = kernel_choices(config, seq_len=seq_len, segments=args.data != "synthetic", platform=args.plan_platform)
    mesh = make_abstract_mesh(dict(args.mesh))
    result = memory_plan_of(args, config, mesh, seq_len, kernels, args.plan_batch)
    print(f"kernels on {args.plan_platform}: {describe_kernels(config, kernels)}")
    fallbacks = result.report.fallbacks
    if args.mesh.get("stage", 1) > 1:  # per stage, by schedule (nnx_zoo/sharding/plan_pipeline.py)
        staged = memory_plan_of(args, config, mesh, seq_len, kernels, args.plan_batch, pipeline=True)
        print(result.report.table() + "\n\n" + staged.table())
        fallbacks = tuple(f for f in fallbacks if f.name not in STACK_AXES)  # the stage table says what to do
        result = staged  # the fullest stage's step decides the remat policy
    else:
        print(result.report.table() + "\n\n" + result.table())
    if args.device_memory:
        print("\n" + choose_remat(result, int(args.device_memory * 2**30), "--device-memory",
                                  args.memory_margin).describe())
    if fallbacks:
        print(f"\nTraining on this mesh with these rules needs --allow-partial: {len(fallbacks)} "
              "dimension(s) above do not divide over their rule's mesh axes (strict placement refuses them).")
    return 0


def memory_plan_of(args: argparse.Namespace, config: Any, mesh: Any, seq_len: int, kernels: dict[str, str],
                   batch_per_device: int | None = None, pipeline: bool = False) -> Any:
    """The memory plan of training ``config`` as the command line describes it on ``mesh`` (abstract or real);
    ``pipeline``: per stage of the mesh's ``stage`` axis, for ``--microbatches`` and ``--pipeline-schedule``."""
    import functools

    from flax import nnx

    from nnx_zoo import AutoModelForCausalLM
    from nnx_zoo.sharding.plan import memory_plan
    from nnx_zoo.sharding.plan_pipeline import pipeline_memory_plan
    from nnx_zoo.train.loss import default_chunk_tokens

    model_cls = AutoModelForCausalLM.model_class(config)
    # The trainer's chunked loss: the default chunk, except on an Auto mesh that splits the tokens (one chunk).
    chunk = args.loss_chunk_tokens
    if chunk is None:
        chunk = None if args.shard_mode == "auto" and math.prod(mesh.axis_sizes) > 1 else default_chunk_tokens(
            config.vocab_size)
    planner = memory_plan
    if pipeline:
        planner = functools.partial(pipeline_memory_plan, microbatches=args.microbatches,
                                    schedule=args.pipeline_schedule, virtual_stages=args.virtual_stages or 2)
    return planner(lambda: model_cls(config, rngs=nnx.Rngs(0)), config, mesh, args.rules, seq_len=seq_len,
                   batch_per_device=batch_per_device, global_batch=args.batch, kernels=kernels,
                   loss_chunk_tokens=chunk or None)


def remat_is_auto(args: argparse.Namespace) -> bool:
    """``--remat auto``, given or by default (a family with a remat policy, none forced by --model.remat_policy)."""
    if not hasattr(args, "model__remat_policy"):
        return False
    return args.remat == "auto" or (args.remat is None and args.model__remat_policy is None)


def auto_remat(args: argparse.Namespace, source: ModelSource, config: Any) -> tuple[Any, str]:
    """``(config with the policy auto chose, the line saying why)`` for this run's mesh, batch and devices."""
    from nnx_zoo.layers.kernel_choices import kernel_choices
    from nnx_zoo.sharding import make_mesh
    from nnx_zoo.train.remat_choice import choose_remat, device_memory

    mesh = make_mesh(dict(args.mesh), shard_mode=args.shard_mode)
    kernels = kernel_choices(config, seq_len=args.seq_len, segments=args.data != "synthetic")
    budget, where = (int(args.device_memory * 2**30), "--device-memory") if args.device_memory else device_memory()
    choice = choose_remat(memory_plan_of(args, config, mesh, args.seq_len, kernels), budget, where,
                          args.memory_margin)
    return source.config({**model_overrides(args), "remat_policy": choice.policy}), choice.describe()


def train_config(args: argparse.Namespace, source: ModelSource, config: Any, extras: Extras) -> Any:
    """The trainer's settings from the command line."""
    from nnx_zoo.train import DataConfig, OptimizerConfig, TrainConfig

    return TrainConfig(
        steps=args.steps,
        run_dir=args.run_dir or f"runs/{source.name}",
        mesh=args.mesh,
        shard_mode=args.shard_mode,
        rules=args.rules,
        allow_partial=args.allow_partial,
        accum_steps=args.accum_steps,
        mtp_weight=extras.mtp_weight,
        model_kwargs=extras.model_kwargs,
        routing_bias_rate=extras.routing_bias_rate,
        loss_chunk_tokens=args.loss_chunk_tokens,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        checkpoint_minutes=args.checkpoint_minutes,
        exploding_loss_factor=args.exploding_loss_factor,
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
            schedule=args.schedule, weight_decay=args.weight_decay, clip_norm=args.clip_norm,
        ),
        data=DataConfig(source=args.data, tokenizer=args.tokenizer, eos_token=args.eos_token, seq_len=args.seq_len,
                        global_batch=args.batch, seed=args.seed, synthetic_vocab=synthetic_vocab(args, config)),
    )


def synthetic_vocab(args: argparse.Namespace, config: Any) -> int:
    """How many token ids the synthetic data uses: ``--synthetic-vocab`` (refused past the model's vocabulary:
    the run would not be what was asked for), by default ``SYNTHETIC_VOCAB`` or the vocabulary if smaller."""
    if args.synthetic_vocab is None:
        return min(SYNTHETIC_VOCAB, config.vocab_size)
    if args.synthetic_vocab > config.vocab_size:
        raise ValueError(f"--synthetic-vocab {args.synthetic_vocab} exceeds the model's vocab_size "
                         f"({config.vocab_size}); use --synthetic-vocab {config.vocab_size} or less, or raise "
                         f"--model.vocab_size to {args.synthetic_vocab}")
    return args.synthetic_vocab


def pretrained_loader(source: ModelSource, args: argparse.Namespace) -> Callable[..., None] | None:
    """For ``--from-pretrained``: a function that sets a freshly created, sharded model's weights from the
    checkpoint, read onto the same mesh and rules (the trainer calls it on a new run, not on a resume)."""
    if source.pretrained is None:
        return None

    def load(model: Any, mesh: Any) -> None:
        import jax
        from flax import nnx

        from nnx_zoo import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(source.pretrained, mesh=mesh, rules=args.rules,
                                                      allow_partial=args.allow_partial, **model_overrides(args))
        # Same rules, mesh and allow_partial give the same layouts; placing onto the model's own keeps the step's
        # pinned ones.
        nnx.update(model, jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), nnx.state(loaded),
                                       nnx.state(model)))

    return load


def run(args: argparse.Namespace, source: ModelSource, entry: Entry = GENERIC) -> int:
    """Train (or plan) what ``args`` describe; returns the exit code."""
    if args.num_processes > 1:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    from nnx_zoo.train.run_lock import lock_run_dir

    config = model_config(args, source)
    if args.plan:
        return plan(args, config)

    # Before anything slow: a second run on a busy run directory is refused in seconds (train() holds it again).
    hold = lock_run_dir(args.run_dir or f"runs/{source.name}")
    try:
        return _train(args, source, entry, config)
    finally:
        if hold is not None:
            hold.release()


def _train(args: argparse.Namespace, source: ModelSource, entry: Entry, config: Any) -> int:
    from flax import nnx

    from nnx_zoo import AutoModelForCausalLM
    from nnx_zoo.layers.kernel_choices import describe as describe_kernels
    from nnx_zoo.layers.kernel_choices import kernel_choices
    from nnx_zoo.train import train
    from nnx_zoo.train.run_spec import EXIT_DONE, EXIT_STOPPED

    pipeline = pipeline_settings(AutoModelForCausalLM.model_class(config), args, config)  # before the memory plan
    remat_line = None
    if remat_is_auto(args):  # the memory plan: after the lock, as it takes a while
        config, remat_line = auto_remat(args, source, config)
    model_cls = AutoModelForCausalLM.model_class(config)
    extras, stage_lines = what_trains(config, model_cls, training_extras(config, model_cls, args),
                                      pretrained=source.pretrained is not None)
    extras = extras._replace(pipeline=pipeline)
    settings = train_config(args, source, config, extras)
    params = config.num_parameters()
    print(f"nnx_zoo: {source.name} ({model_cls.__name__}): {params.total / 1e6:.1f}M parameters "
          f"({params.active / 1e6:.1f}M active), run dir {settings.run_dir}", file=sys.stderr)
    for line in [*stage_lines, *([remat_line] if remat_line else [])]:
        print(f"nnx_zoo: {line}", file=sys.stderr)
    kernels = describe_kernels(config, kernel_choices(config, seq_len=args.seq_len, segments=args.data != "synthetic"))
    print(f"nnx_zoo: kernels: {kernels}", file=sys.stderr)
    structure, model_settings = model_definition(config)
    if source.pretrained is not None:  # where the starting weights came from is part of what the run is
        model_settings["from_pretrained"] = str(source.pretrained.resolve())
    summary = train(
        # The model resolves its activations by the rules its weights are placed by.
        lambda: model_cls(config, rngs=nnx.Rngs(args.seed), rules=args.rules),
        settings,
        vocab_size=config.vocab_size,
        # MTP heads count when they run.
        flops_per_token=config.train_flops_per_token(args.seq_len, include_mtp=extras.mtp_weight > 0),
        model_structure=structure,
        model_settings=model_settings,
        init_model=pretrained_loader(source, args),
    )
    if summary.get("already_finished"):
        print(f"this run already finished: its checkpoint is at step {summary['start_step']} of --steps "
              f"{args.steps} in {Path(settings.run_dir) / 'checkpoints'}. To train further on the same "
              f"learning-rate schedule, rerun with a larger --steps and --extend (e.g. --steps "
              f"{2 * summary['start_step']} --extend); to re-plan the schedule, add --override-settings instead; for "
              "a new run, use another --run-dir.")
        return EXIT_DONE
    print_summary({**summary, "kernels": kernels}, settings.run_dir)
    return EXIT_STOPPED if summary.get("stopped_by_signal") else EXIT_DONE


def print_summary(summary: dict[str, Any], run_dir: str | Path) -> None:
    """The end-of-run lines: steps, first and last loss, last throughput, peak, where the files are, and a
    diverged run's flag (its message follows on stderr)."""
    losses = summary["losses"]
    last = summary["last"] or {}
    lines = [
        f"steps {summary['start_step']} -> {summary['end_step']}"
        + (" (resumed)" if summary["start_step"] else "")
        + (" (stopped by signal; checkpoint saved; rerun to resume)" if summary.get("stopped_by_signal") else "")
        + (" (DIVERGED: see the message below; exit code 3)" if summary.get("diverged") else ""),
    ]
    if losses:
        lines.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    first = summary.get("first") or {}
    for name in ("aux_loss", "indexer_loss"):  # the model's own loss terms, first and last logged
        if name in last and name in first:
            lines.append(f"{name} {first[name]:.4f} -> {last[name]:.4f}")
    if last:
        mfu = last.get("mfu")
        lines.append(f"last step: {last['tokens_per_s']:.0f} tokens/s, {last['tflops_per_device'] * 1e3:.3f} "
                     f"GFLOP/s per device" + (f", MFU {100 * mfu:.2f}%" if mfu is not None else ""))
    if "peak_flops_per_device" in summary:
        lines.append(f"peak per device: {summary['peak_flops_per_device'] / 1e9:.1f} GFLOP/s "
                     f"({summary['peak_source']})")
    if summary.get("kernels"):
        lines.append(f"kernels: {summary['kernels']}")
    run_dir = Path(run_dir)
    lines.append(f"metrics: {run_dir / 'metrics.jsonl'}; checkpoints: {run_dir / 'checkpoints'}")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
