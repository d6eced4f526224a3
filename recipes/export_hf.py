"""Export a training run's checkpoint as a Hugging Face directory: config.json, safetensors shards and their index,
and the run's tokenizer file when it used one.

RUN_DIR is a run directory written by recipes/pretrain.py (or deepseek_pretrain.py, or nnx_zoo.train.train): it
holds checkpoints/<step>/. By default the latest complete checkpoint is exported; --step picks another. The output
loads with nnx_zoo.AutoModelForCausalLM.from_pretrained(OUT_DIR) and transformers' from_pretrained, and can be
fine-tuned in recipes/deepseek_finetune.ipynb (CHECKPOINT_DIR=OUT_DIR). Any family; DeepSeek-V3's MTP heads are
written as the extra layers of the hub format; LoRA runs are written with the adapters merged.

Examples:
    .venv/bin/python recipes/export_hf.py runs/deepseek3-tiny exports/deepseek3-tiny
    .venv/bin/python recipes/export_hf.py runs/llama3-tiny exports/llama3-tiny-step10 --step 10

OUT_DIR must not exist, be empty, or hold an earlier export (whose files are then replaced).

exit codes:
  0    exported
  2    bad input (no such run, no checkpoints, no such step, an OUT_DIR holding other files): nothing was written
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Make `python recipes/export_hf.py` work from a clone without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXIT_DONE, EXIT_BAD_INPUT = 0, 2


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``RUN_DIR OUT_DIR [--step N]``."""
    parser = argparse.ArgumentParser(prog="export_hf.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (the one holding checkpoints/)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the Hugging Face directory")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint step to export (default: the latest complete one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Export as the command line says; returns the exit code (0 exported, 2 bad input).

    >>> main(["runs/deepseek3-tiny", "exports/deepseek3-tiny"])
    0
    """
    args = build_parser().parse_args(argv)
    from nnx_zoo.hf import CheckpointError as HFCheckpointError
    from nnx_zoo.train import CheckpointError, ExportError, export_run

    try:
        export_run(args.run_dir, args.out_dir, step=args.step, log=print)
    except (ExportError, CheckpointError, HFCheckpointError, OSError) as err:
        print(f"export_hf.py: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main())
