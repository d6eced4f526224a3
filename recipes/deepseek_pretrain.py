"""Pretrain DeepSeek-V3 with nnx_zoo.

With no arguments: the ``deepseek3-tiny`` preset, synthetic data, a short run on this machine's devices, a live
progress line, metrics in ``runs/deepseek3-tiny/metrics.jsonl`` and a checkpoint at the end. Run it again with the
same ``--run-dir`` and it resumes from the latest complete checkpoint.

Examples (the second needs 8 devices: on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8 makes them):
    python recipes/deepseek_pretrain.py
    python recipes/deepseek_pretrain.py --model deepseek3-small --steps 200 --mesh fsdp=4,expert=2 --rules ep-as-dp
    python recipes/deepseek_pretrain.py --model.num_hidden_layers 4 --shard-mode explicit --run-dir runs/tiny-4-layers
    python recipes/deepseek_pretrain.py --model deepseek3-671b --mesh fsdp=64,expert=8 --plan

Every ``DeepSeekV3Config`` field can be set with ``--model.<field> VALUE`` (``none`` for None). This is the
DeepSeek entry point of ``recipes/pretrain.py`` (one code path; that recipe trains every family).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path


def _load_generic_recipe():
    """recipes/pretrain.py as a module, whether this file runs as a script or is loaded by path."""
    spec = importlib.util.spec_from_file_location("pretrain", Path(__file__).resolve().with_name("pretrain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain = _load_generic_recipe()
ENTRY = pretrain.Entry(prog="deepseek_pretrain.py", default_model="deepseek3-tiny", description=__doc__,
                       model_classes=("DeepSeekV3",))
EXIT_CODES = pretrain.EXIT_CODES
HOW_FIELDS = pretrain.HOW_FIELDS
parse_mesh = pretrain.parse_mesh
parse_step_range = pretrain.parse_step_range
model_definition = pretrain.model_definition
print_summary = pretrain.print_summary


def build_parser(model_config_cls: type, presets: Iterable[str] = ()) -> argparse.ArgumentParser:
    """The recipe's command line; ``--help`` lists ``presets`` and the registered rule sets by name."""
    return pretrain.build_parser(model_config_cls, presets, entry=ENTRY)


def main(argv: list[str] | None = None) -> int:
    """Run the DeepSeek recipe; returns the exit code (``EXIT_CODES``)."""
    return pretrain.main(argv, entry=ENTRY)


if __name__ == "__main__":
    sys.exit(main())
