"""Peak host memory of loading an HF DeepSeek-V3 checkpoint, relative to the checkpoint's size.

A float32 DeepSeek-V3 (MoE layers with per-expert keys, an MTP layer) of about 1 GB is written with our
``save_pretrained`` (several shards) to a temporary directory. Then each loader runs in a FRESH subprocess (so the
writer's allocations do not count):

    nnx            ``DeepSeekV3.from_pretrained(dir)``, no mesh (one CPU device)
    nnx-fsdp8      ``DeepSeekV3.from_pretrained(dir, mesh={fsdp: 8})`` on 8 fake CPU devices
                   (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before jax is imported)
    transformers   ``DeepseekV3ForCausalLM.from_pretrained(dir, dtype=torch.float32)`` (side by side)

Each subprocess imports its framework and initializes it (jax: ``jax.devices()`` and one small computation;
torch: one small op), records the baseline RSS (``VmRSS``), loads, and reports the peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``, which counts file-backed pages such as mmapped safetensors as well as
anonymous memory). A sampling thread also records the peaks of ``RssAnon`` and ``RssFile`` (every 2 ms,
approximate: it needs the GIL). Reported: checkpoint bytes on disk (all ``*.safetensors``; this includes the MTP
layer's copies of the embedding and head, which the loaders skip), the bytes of the parameters the model holds,
peak and baseline RSS, and the ratios (peak - baseline) / checkpoint and peak / checkpoint. Target:
(peak - baseline) / checkpoint <= 1.3.

    python benchmarks/hf_load_memory.py            # ~1 GB checkpoint (a few minutes on 2 cores)
    python benchmarks/hf_load_memory.py --quick    # ~0.1 GB checkpoint (smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGET = 1.3
LOADERS = ("nnx", "nnx-fsdp8", "transformers")
# Derivatives of the deepseek3-small preset: (num_hidden_layers, n_routed_experts, hidden_size, moe_intermediate).
SIZES = {"full": (14, 32, 512, 256), "quick": (4, 16, 256, 128)}


def make_config(size: str):
    from nnx_zoo.models.deepseek.config import DeepSeekV3Config

    layers, experts, hidden, moe_inner = SIZES[size]
    return DeepSeekV3Config.preset(
        "deepseek3-small", num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=experts,
        hidden_size=hidden, intermediate_size=3 * hidden, moe_intermediate_size=moe_inner, num_attention_heads=8,
        q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, n_group=4, topk_group=2, num_nextn_predict_layers=1,
        dtype="float32", param_dtype="float32")


# ---------------------------------------------------------------- memory probes (used in the subprocesses)
def _status() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


class _Sampler:
    """Peaks of RssAnon and RssFile, sampled on a thread."""

    def __init__(self, period_s: float = 0.002):
        self.period_s, self.peak, self._stop = period_s, {"RssAnon": 0, "RssFile": 0}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = _status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])
            time.sleep(self.period_s)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _measure(directory: str, loader: str) -> dict:
    """Runs in a fresh subprocess: initialize the framework, record the baseline, load, record the peak."""
    if loader == "transformers":
        import torch
        import transformers

        torch.set_num_threads(2)
        torch.ones(4).sum().item()
        load = lambda: transformers.DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32)  # noqa: E731
        count = lambda m: sum(p.numel() * p.element_size() for p in m.state_dict().values())  # noqa: E731
    else:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import nnx_zoo  # noqa: F401
        from nnx_zoo.models.deepseek import DeepSeekV3
        from nnx_zoo.sharding import make_mesh

        assert len(jax.devices()) == (8 if loader == "nnx-fsdp8" else 1), jax.devices()
        jnp.ones(4).sum().block_until_ready()
        mesh = make_mesh({"fsdp": 8}) if loader == "nnx-fsdp8" else None
        load = lambda: DeepSeekV3.from_pretrained(directory, mesh=mesh)  # noqa: E731

        def count(m: object) -> int:
            return sum(x.nbytes for x in jax.tree.leaves(nnx.state(m, nnx.Param)))

    base = _status()
    base_maxrss = _maxrss()
    t0 = time.perf_counter()
    with _Sampler() as sampler:
        model = load()
    seconds = time.perf_counter() - t0
    peak = _maxrss()
    after = _status()
    return {"loader": loader, "baseline_rss": base["VmRSS"], "baseline_maxrss": base_maxrss,
            "baseline_anon": base["RssAnon"], "baseline_file": base["RssFile"], "peak_rss": peak,
            "after_rss": after["VmRSS"], "after_anon": after["RssAnon"], "after_file": after["RssFile"],
            "peak_anon_sampled": sampler.peak["RssAnon"], "peak_file_sampled": sampler.peak["RssFile"],
            "param_bytes": int(count(model)), "load_seconds": seconds}


def _write(directory: str, size: str, shard_bytes: int) -> dict:
    """Runs in a subprocess: build a random model and write it with save_pretrained."""
    from nnx_zoo.models.deepseek import DeepSeekV3

    config = make_config(size)
    model = DeepSeekV3.create(config)
    model.save_pretrained(directory, max_shard_bytes=shard_bytes)
    return {"params_total_incl_mtp": config.num_parameters(include_mtp=True).total}


def _child(args: list[str], env_extra: dict[str, str] | None = None) -> dict:
    env = {**os.environ, **(env_extra or {})}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"subprocess {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~0.1 GB checkpoint instead of ~1 GB")
    parser.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=LOADERS)
    parser.add_argument("--shards", type=int, default=4, help="about how many safetensors shards to write")
    parser.add_argument("--keep", metavar="DIR", help="write the checkpoint to DIR and keep it (default: a tempdir)")
    parser.add_argument("--no-save", action="store_true", help="print the table only, write no results files "
                        "(--quick never writes them)")
    parser.add_argument("--_child", nargs=2, metavar=("MODE", "ARG"), help=argparse.SUPPRESS)
    parser.add_argument("--_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = "quick" if args.quick else "full"

    if args._child:  # subprocess entry points
        mode, arg = args._child
        if mode == "measure":
            result = _measure(args._dir, arg)
        else:
            result = _write(args._dir, size, int(arg))
        print(json.dumps(result))
        return

    from _harness import environment, markdown_table, write_results

    layers, experts, hidden, moe_inner = SIZES[size]
    with tempfile.TemporaryDirectory(prefix="hf_load_memory_") as tmp:
        directory = Path(args.keep) if args.keep else Path(tmp) / "ckpt"
        cfg = make_config(size)
        approx = cfg.num_parameters(include_mtp=True).total * 4 + 2 * cfg.vocab_size * cfg.hidden_size * 4
        shard_bytes = max(1, approx // args.shards)
        t0 = time.perf_counter()
        written = _child(["--_child", "write", str(shard_bytes), "--_dir", str(directory)]
                         + (["--quick"] if args.quick else []))
        print(f"wrote {directory} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        files = sorted(directory.glob("*.safetensors"))
        ckpt_bytes = sum(f.stat().st_size for f in files)
        results = []
        for loader in args.loaders:
            extra = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"} if loader == "nnx-fsdp8" else {}
            extra["JAX_PLATFORMS"] = "cpu"
            r = _child(["--_child", "measure", loader, "--_dir", str(directory)], extra)
            r["delta_over_ckpt"] = (r["peak_rss"] - r["baseline_rss"]) / ckpt_bytes
            r["peak_over_ckpt"] = r["peak_rss"] / ckpt_bytes
            r["delta_over_params"] = (r["peak_rss"] - r["baseline_rss"]) / r["param_bytes"]
            results.append(r)
            print(f"{loader}: peak {r['peak_rss'] / 2**20:.0f} MiB, baseline {r['baseline_rss'] / 2**20:.0f} MiB, "
                  f"(peak-baseline)/ckpt {r['delta_over_ckpt']:.3f}, {r['load_seconds']:.1f}s", file=sys.stderr)

    mib = 2**20
    header = ["loader", "ckpt MiB (disk)", "params MiB (loaded)", "baseline RSS MiB", "peak RSS MiB",
              "(peak-base)/ckpt", "peak/ckpt", "(peak-base)/params", "peak anon MiB*", "peak file MiB*",
              "RSS after MiB", "load s"]
    rows = [[r["loader"], ckpt_bytes / mib, r["param_bytes"] / mib, r["baseline_rss"] / mib, r["peak_rss"] / mib,
             r["delta_over_ckpt"], r["peak_over_ckpt"], r["delta_over_params"], r["peak_anon_sampled"] / mib,
             r["peak_file_sampled"] / mib, r["after_rss"] / mib, r["load_seconds"]] for r in results]
    table = markdown_table(header, rows)
    ok = all(r["delta_over_ckpt"] <= TARGET for r in results if r["loader"] != "transformers")
    md = (f"# HF checkpoint load: peak host memory ({'quick' if args.quick else 'full'})\n\n"
          f"`python benchmarks/hf_load_memory.py{' --quick' if args.quick else ''}`: float32 DeepSeek-V3, "
          f"{layers} layers (1 dense + {layers - 1} MoE, {experts} routed experts, hidden {hidden}, expert "
          f"inner {moe_inner}) + 1 MTP layer, {len(files)} shards, per-expert keys. Each loader in a fresh "
          f"subprocess; baseline = VmRSS after importing and initializing the framework; peak = ru_maxrss.\n\n"
          f"{table}\n\n"
          f"\\* sampled every 2 ms on a thread (approximate). Checkpoint bytes include the MTP layer's copies of the "
          f"embedding and head (skipped by the loaders). Target (nnx): (peak-base)/ckpt <= {TARGET}: "
          f"{'met' if ok else 'NOT met'}.\n")
    print(md)
    if not (args.no_save or args.quick):
        payload = {"size": size, "config": {"layers": layers, "experts": experts, "hidden": hidden,
                                             "moe_intermediate": moe_inner}, "shards": len(files),
                   "checkpoint_bytes": ckpt_bytes, "written": written, "target": TARGET, "target_met": ok,
                   "results": results, "environment": environment()}
        jpath, mpath = write_results("hf_load_memory", payload, md)
        print(f"wrote {jpath} and {mpath}", file=sys.stderr)


if __name__ == "__main__":
    main()
