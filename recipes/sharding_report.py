"""Plan a run: where every parameter of a model lives on a mesh, and what each device pays for it.

Nothing is allocated (abstract model, abstract mesh), so this describes DeepSeek-V3 671B on 512 devices from a
laptop. Any family's preset works (``recipes/pretrain.py --help`` lists them):

    python recipes/sharding_report.py --model deepseek3-671b --mesh fsdp=64,expert=8 --rules default
    python recipes/sharding_report.py --model llama3.1-405b --mesh fsdp=64,tensor=8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Make `python recipes/sharding_report.py` work from a clone without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM
from nnx_zoo.sharding import RULE_SETS, ShardingError, make_abstract_mesh, sharding_report
from nnx_zoo.sharding import parse_mesh as parse_mesh_sizes


def parse_mesh(text: str) -> dict[str, int]:
    """'fsdp=64,expert=8' -> {'fsdp': 64, 'expert': 8}; malformed entries and repeated axes are refused."""
    try:
        return parse_mesh_sizes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek3-671b", help="a preset name of any family (default: %(default)s)")
    parser.add_argument("--mesh", type=parse_mesh, default=parse_mesh("fsdp=32,expert=8"),
                        help="mesh axis sizes, e.g. fsdp=64,expert=8 (default: %(default)s)")
    parser.add_argument("--rules", default="default", choices=sorted(RULE_SETS), help="rule set name")
    parser.add_argument("--json", help="also write the report as JSON to this path")
    parser.add_argument("--summary", action="store_true", help="print only the totals, not every Variable")
    args = parser.parse_args(argv)
    try:
        config = AutoConfig.preset(args.model)
        model_cls = AutoModelForCausalLM.model_class(config)
        mesh = make_abstract_mesh(args.mesh)
        report = sharding_report(lambda: model_cls(config, rngs=nnx.Rngs(0)), mesh, args.rules)
    except (ShardingError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = report.table()
    print(text.split("\n\n", 1)[-1] if args.summary else text)
    if args.json:
        report.save_json(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
