"""What the kernels hold: XLA temp memory of AOT-compiled training steps on CPU (no GPU needed, nothing runs).

Each section compiles ``jax.value_and_grad`` of a model's loss for one batch and reads
``compiled.memory_analysis()`` (``temp``: XLA's scratch for the step; ``arguments``: parameters and batch).
Sections live in their own modules and are listed in ``SECTIONS``:

- ``attention``, ``attention_cpu`` (``kernel_memory_attention.py``): the Llama-3.2-1B grad step at 1 x 4096 and
  1 x 8192 per ``attention_impl``; and where ``auto`` switches from ``xla`` to ``blockwise`` on this CPU.
- ``moe`` (``kernel_memory_moe.py``): the 4-layer DeepSeek-V2-Lite-shaped grad step at 1 x 2048, bf16, remat
  full: ``dense`` vs ``gmm`` with the tiled grouped matmul vs ``gmm`` with ``jax.lax.ragged_dot``.
- ``local`` (``kernel_memory_local.py``): a Gemma-3-1B-shaped grad step, 5:1 sliding / global against all global.
- ``hybrid``, ``hybrid_cp`` (``kernel_memory_hybrid.py``): a Qwen3.5-9B-shaped grad step at 8k / 32k / 128k, the
  3:1 linear / full schedule against all linear and all full attention; the sequence split's state hand-off in
  collective bytes of the compiled sharded step.

    python benchmarks/kernel_memory.py                 # every section, writes results/kernel_memory.{json,md}
    python benchmarks/kernel_memory.py --sections moe  # one section
    python benchmarks/kernel_memory.py --quick         # smaller shapes (smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _harness as h
from kernel_memory_attention import (
    attention_cpu_markdown,
    attention_cpu_section,
    attention_markdown,
    attention_section,
)
from kernel_memory_hybrid import hybrid_cp_markdown, hybrid_cp_section, hybrid_markdown, hybrid_section
from kernel_memory_local import local_markdown, local_section
from kernel_memory_moe import moe_markdown, moe_section

SECTIONS = {  # name -> (run(quick, log) -> dict, markdown(dict) -> str)
    "attention": (attention_section, attention_markdown),
    "attention_cpu": (attention_cpu_section, attention_cpu_markdown),
    "moe": (moe_section, moe_markdown),
    "local": (local_section, local_markdown),
    "hybrid": (hybrid_section, hybrid_markdown),
    "hybrid_cp": (hybrid_cp_section, hybrid_cp_markdown),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", choices=sorted(SECTIONS), default=None, help="default: all")
    p.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    p.add_argument("--out-dir", default=None, help="where to write kernel_memory.{json,md} (default results/)")
    p.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = {name: SECTIONS[name][0](a.quick, log) for name in (a.sections or SECTIONS)}
    previous = h.RESULTS_DIR / "kernel_memory.json" if a.out_dir is None else Path(a.out_dir) / "kernel_memory.json"
    if a.sections and not a.quick and previous.exists():  # sections not run this time keep their last results
        kept = json.loads(previous.read_text()).get("sections", {})
        results = {name: results.get(name, kept.get(name)) for name in SECTIONS if name in results or name in kept}
    env = h.environment()
    md = "\n\n".join([f"# Kernel memory: XLA temp of AOT-compiled train steps on {env['backend']} (jax {env['jax']})",
                      *(SECTIONS[name][1](section) for name, section in results.items())])
    print(md)
    if not a.no_write:
        payload = {"benchmark": "kernel_memory", "argv": sys.argv[1:] if argv is None else list(argv),
                   "environment": env, "quick": a.quick, "sections": results}
        jp, mp = h.write_results("kernel_memory", payload, md, a.out_dir)
        log(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
