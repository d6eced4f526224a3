"""One DeepSeek-V4 attention layer (CSA and HCA) against DeepSeek-V3.2's DSA layer and dense MLA (issue 32).

Contenders, each one attention block (projections, attention, output projection), forward + backward:
- ``v4_csa`` / ``v4_hca``: ``nnx_zoo.models.deepseek4.attention.V4Attention`` of that layer type (sliding window of
  ``sliding_window`` raw keys, one shared K = V head, per-head sinks, the grouped low-rank output projection; CSA:
  entries pooled every ``compress_rate_csa`` tokens over overlapping windows, each query's ``index_topk`` chosen by
  the lightning indexer; HCA: entries every ``compress_rate_hca`` tokens, all visible), ``attention_impl="auto"``
  (``blockwise`` at these contexts: query blocks over their window and their entries). The indexer is frozen (the
  trainer's default, ``indexer_training="off"``): its weights get no gradient.
- ``dsa``: V3.2's MLA with its sparse attention (``index_topk``), and ``mla``: the same MLA with dense attention
  (``attention_impl="auto"``: ``blockwise`` on the CPU, cuDNN on a GPU), built as ``benchmarks/dsa_layer.py`` builds
  them (``dsa_layer.configs`` / ``build_layers``).

What is measured: XLA's ``temp_size_in_bytes`` of the AOT-compiled ``jax.jit(jax.grad(mean(layer(x))))`` (w.r.t.
the trained parameters and ``x``; nothing runs, so every context compiles on a laptop), with the arguments abstract
(``jax.ShapeDtypeStruct``) where nothing is timed; the ``[seq, seq]``-sized arrays of each compiled program
(``dsa_layer.seq_shapes``); and, up to ``--time-up-to``, the time of a call (``_harness.interleaved``: the
contenders side by side in one process, rounds in rotated order, medians). Batch 1, causal, one document.

    python benchmarks/v4_attention.py                       # CPU: memory at 8k, 32k, 128k, times at 8k
    python benchmarks/v4_attention.py --quick               # smoke run: contexts 512 and 1024, tiny dims
    python benchmarks/v4_attention.py --dims flash --dtype bfloat16 --memory-only --out-name v4_attention_flash
    python benchmarks/v4_attention.py --platform gpu        # GPU: V4-Flash / V3.2 dims, bf16, 8k-64k, all timed

Dims (``--dims``): ``flash`` is V4-Flash's layer (hidden 4096, 64 heads of 512 with a 64-wide rope part, q_lora
1024, 8 output groups of 1024, indexer 64 x 128 keeping 512, window 128, CSA every 4 and HCA every 128 tokens)
beside V3.2's (``dsa_layer`` ``v32``: hidden 7168, 128 heads, indexer 64 x 128, top-k 2048). ``cpu`` scales both
down as ``dsa_layer.py`` does for 2 cores (hidden 2048, 16 heads; V4 keeps its 512-wide head, its window, rates and
top-k 512, its indexer 16 x 128 and 4 output groups of 512; V3.2 ``dsa_layer`` ``cpu`` with its own top-k 2048).
Each model keeps its own top-k. Writes ``v4_attention.{json,md}`` (``--out-name``) after every context.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as h  # noqa: E402
import dsa_layer  # noqa: E402

MIB = 2**20
GIB = 2**30
V4_DIMS = {  # overrides of the deepseek4-flash preset (everything else, YaRN included, is V4-Flash's)
    "flash": {},
    "cpu": dict(hidden_size=2048, num_attention_heads=16, o_groups=4, o_lora_rank=512, index_n_heads=16),
    "quick": dict(hidden_size=256, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=128,
                  o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=32, sliding_window=32,
                  compress_rate_hca=32),
}
V32_DIMS = {"flash": "v32", "cpu": "cpu", "quick": "quick"}  # the V3.2 / MLA dims beside each
V32_TOPK = {"flash": 2048, "cpu": 2048, "quick": 64}
DEFAULTS = {  # platform -> contexts, dims, dtype, time up to
    "cpu": ((8192, 32768, 131072), "cpu", "float32", 8192),
    "gpu": ((8192, 32768, 65536), "flash", "bfloat16", 1 << 30),
}
CONTENDERS = ("v4_csa", "v4_hca", "dsa", "mla")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def v4_config(dims: str, dtype: str):
    from nnx_zoo.models.deepseek4.config import CSA, HCA, DeepSeekV4Config, hash_schedule

    return DeepSeekV4Config.preset("deepseek4-flash", **V4_DIMS[dims], num_hidden_layers=2, layer_types=(CSA, HCA),
                                   mlp_layer_types=hash_schedule(2, 0), num_nextn_predict_layers=0, dtype=dtype,
                                   param_dtype="float32", attention_impl="auto")


def v4_step(config, layer_type: str, seq: int, concrete: bool):
    """``(jitted grad of mean(V4Attention(x)) w.r.t. (trained parameters, x), args)``; ``concrete``: real arrays
    (to time), else abstract ones (to compile only)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_zoo.models.deepseek4.attention import V4Attention
    from nnx_zoo.models.deepseek4.model import DeepSeekV4

    make = lambda: V4Attention(config, layer_type, rngs=nnx.Rngs(0))  # noqa: E731
    layer = make() if concrete else nnx.eval_shape(make)
    # The model's own per-pass context (ropes, the compressed layers' windows), from an abstract model.
    model = nnx.eval_shape(lambda: DeepSeekV4(config, rngs=nnx.Rngs(0)))
    trained = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))  # the trainer freezes the indexer by default
    graphdef, params, rest = nnx.split(layer, trained, ...)

    def loss(params, x, rest):
        ctx = model._context(jnp.arange(seq)[None], jnp.ones((1, seq), bool), None)
        out = nnx.merge(graphdef, params, rest)(x, ctx).output
        return jnp.mean(out.astype(jnp.float32))

    shape = (1, seq, config.hidden_size)
    if concrete:
        x = jax.random.normal(jax.random.key(seq), shape, jnp.float32).astype(config.dtype)
    else:
        x = jax.ShapeDtypeStruct(shape, jnp.dtype(config.dtype))
    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x, rest)


def mla_step(layer, seq: int, concrete: bool):
    """``dsa_layer.grad_step`` (the MLA block's gradient), with abstract arguments unless ``concrete`` (no input of
    gigabytes allocated to compile at 128k)."""
    if concrete:
        return dsa_layer.grad_step(layer, seq)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_zoo.layers.attention_mask import causal_mask
    from nnx_zoo.layers.rope import rope_cos_sin, rope_frequencies

    c = layer.config
    graphdef, params = nnx.split(layer, nnx.Param)
    inv_freq, factor = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    cos = jax.eval_shape(lambda: rope_cos_sin(jnp.arange(seq)[None], inv_freq, factor)[0])

    def loss(params, x, cos, sin):
        out, _ = nnx.merge(graphdef, params).attend(x, cos, sin, causal_mask(seq))
        return jnp.mean(out.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((1, seq, c.hidden_size), jnp.dtype(c.dtype))
    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x, cos, cos)


def v4_block_rows(config, layer_type: str, seq: int) -> int:
    """Query rows per block of V4's blockwise kernel at this context (``plan.compressed_block_rows``)."""
    from nnx_zoo.models.deepseek4 import kernel
    from nnx_zoo.models.deepseek4.config import CSA
    from nnx_zoo.sharding.plan import compressed_block_rows

    c, csa = config, layer_type == CSA
    entries = seq // c.compress_rate(layer_type)
    return compressed_block_rows(seq, c.sliding_window, entries, c.index_topk if csa else 0, c.num_attention_heads,
                                 c.index_n_heads if csa else 0, c.head_dim, max_rows=kernel.BLOCK)


def plan_estimate(config, layer_type: str, seq: int) -> dict:
    """What the memory plan counts for one such layer (``nnx_zoo.sharding.plan``: kept for the backward, and the
    attention's one-layer scratch), for comparison with the compiled temp."""
    from nnx_zoo.sharding import plan

    shapes = plan.DecoderShapes.from_config(config, {"moe": "gmm"})
    local = plan.Local(batch=1, seq=seq, keys=seq, heads=config.num_attention_heads, kv_heads=1, mlp=0, moe_mlp=0,
                       vocab=0, experts=0, shared_mlp=0)
    return {"kept_bytes": plan.v4_attention_bytes(shapes, local, layer_type, looped=False),
            "scratch_bytes": plan.v4_attention_scratch_bytes(shapes, local, layer_type),
            "impl": shapes.v4.impl(layer_type, seq)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--dims", choices=sorted(V4_DIMS), default=None, help="layer dims (default: CPU cpu, GPU flash)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: CPU float32, GPU bfloat16)")
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    p.add_argument("--time-up-to", type=int, default=None, help="time the contexts up to this (CPU default 8192)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per context")
    p.add_argument("--memory-only", action="store_true", help="compile and report memory; time nothing")
    p.add_argument("--quick", action="store_true", help="smoke run: contexts 512 1024, tiny dims, one round")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--out-name", default=None, help="results stem (default v4_attention, v4_attention_gpu on GPU)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)

    import jax

    platform = jax.default_backend() if a.platform == "auto" else a.platform
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else "cpu"
    contexts, dims, dtype, time_up_to = DEFAULTS[platform]
    if a.quick:
        contexts, dims, a.rounds = (512, 1024), "quick", 1
    contexts = a.contexts or contexts
    dims = a.dims or dims
    dtype = a.dtype or dtype
    time_up_to = 0 if a.memory_only else (a.time_up_to if a.time_up_to is not None else time_up_to)
    log(f"platform {platform} ({jax.devices()[0].device_kind}), dims {dims}, {dtype}, contexts {contexts}, timed up "
        f"to {time_up_to}")

    from nnx_zoo.models.deepseek4.config import CSA, HCA

    v4 = v4_config(dims, dtype)
    mla_cfg, dsa_cfg = dsa_layer.configs(dsa_layer.DIMS[V32_DIMS[dims]], V32_TOPK[dims], dtype, "auto")
    mla, dsa = dsa_layer.build_layers(mla_cfg, dsa_cfg)
    layer_types = {"v4_csa": CSA, "v4_hca": HCA}
    rows: list[dict] = []
    stem = a.out_name or ("v4_attention_gpu" if platform == "gpu" else "v4_attention") + ("_quick" if a.quick else "")

    def finish(final: bool) -> None:
        env = h.environment()
        env["loadavg_end"] = list(os.getloadavg())
        payload = {"benchmark": "v4_attention", "argv": sys.argv[1:] if argv is None else list(argv),
                   "environment": env, "platform": platform, "device": jax.devices()[0].device_kind, "dims": dims,
                   "v4_dims": {k: getattr(v4, k) for k in ("hidden_size", "num_attention_heads", "head_dim",
                                                           "qk_rope_head_dim", "q_lora_rank", "o_groups",
                                                           "o_lora_rank", "index_n_heads", "index_head_dim",
                                                           "index_topk", "sliding_window", "compress_rate_csa",
                                                           "compress_rate_hca")},
                   "v32_dims": dsa_layer.DIMS[V32_DIMS[dims]], "v32_topk": V32_TOPK[dims], "dtype": dtype,
                   "complete": final, "rows": rows}
        md = markdown(payload)
        if final:
            print(md)
        if not a.no_write:
            jp, mp = h.write_results(stem, payload, md, a.out_dir)
            log(f"wrote {jp} and {mp}")

    for seq in contexts:
        timed = seq <= time_up_to
        row: dict = {"seq": seq, "timed": timed}
        rows.append(row)
        steps = {}
        for name in a.contenders:
            log(f"{seq}: compiling {name}")
            try:
                if name in layer_types:
                    step, args = v4_step(v4, layer_types[name], seq, concrete=timed)
                else:
                    step, args = mla_step(dsa if name == "dsa" else mla, seq, concrete=timed)
                compiled, info = dsa_layer.compile_step(step, args)
            except Exception as err:  # noqa: BLE001 - a contender that fails to compile is a result
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                log(f"{seq}: {name} failed: {row[name]['error']}")
                continue
            scan = dsa_layer.seq_shapes(compiled.as_text(), seq)
            info.update(seq_by_seq_shapes=scan["seq_by_seq"], largest_with_one_seq_dim=scan["largest_with_one_seq_dim"])
            if name in layer_types:
                info["block_rows"] = v4_block_rows(v4, layer_types[name], seq)
                info["plan"] = plan_estimate(v4, layer_types[name], seq)
            elif name == "dsa":
                info["block_rows"] = dsa_layer.block_rows(seq, dsa_cfg)
            row[name] = info
            log(f"{seq}: {name} temp {info['temp_bytes'] / MIB:,.0f} MiB, compile {info['compile_s']:.1f} s, "
                f"[seq, seq] shapes {scan['seq_by_seq'] or 'none'}")
            if timed:
                steps[name] = (compiled, args)
            else:
                del compiled
        if steps:
            calls = {n: (lambda cs=steps[n]: jax.block_until_ready(cs[0](*cs[1]))) for n in steps}
            log(f"{seq}: timing {list(steps)}, {a.rounds} rounds")
            try:
                times = h.interleaved(calls, rounds=a.rounds, target_s=1.0, warmup=0, log=log)
            except Exception as err:  # noqa: BLE001 - e.g. out of memory when running
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                log(f"{seq}: timing failed: {row['error']}")
                times = {}
            for n, ts in times.items():
                row[n]["seconds"] = ts
                row[n]["median_s"] = h.median(ts)
            for n in ("v4_csa", "v4_hca", "dsa"):
                if n in times and "mla" in times:
                    row[f"{n}_over_mla"] = h.ratio_stats(times[n], times["mla"])
        del steps
        finish(final=seq == contexts[-1])
    return 0


def _mib(info: dict | None) -> str:
    if not info:
        return ""
    return f"{info['temp_bytes'] / MIB:,.0f}" if "temp_bytes" in info else info.get("error", "")[:30]


def _k(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def scaling(rows: list[dict], name: str) -> list[str]:
    """Temp ratios between consecutive contexts, with the context ratio (linear growth: equal)."""
    out = []
    have = [r for r in rows if "temp_bytes" in r.get(name, {})]
    for lo, hi in zip(have, have[1:], strict=False):
        out.append(f"{hi[name]['temp_bytes'] / lo[name]['temp_bytes']:.2f} ({_k(hi['seq'])} / {_k(lo['seq'])} = "
                   f"{hi['seq'] / lo['seq']:.0f})")
    return out


def markdown(r: dict) -> str:
    env, d, m = r["environment"], r["v4_dims"], r["v32_dims"]
    names = [n for n in CONTENDERS if any(n in row for row in r["rows"])]
    out = [f"# One DeepSeek-V4 attention layer (CSA, HCA) vs V3.2's DSA and dense MLA ({r['platform']}: "
           f"{r['device']}, jax {env['jax']}, {env['date_utc']})", "",
           f"V4 ({r['dims']}): hidden {d['hidden_size']}, {d['num_attention_heads']} heads x {d['head_dim']} (rope "
           f"{d['qk_rope_head_dim']}), q_lora {d['q_lora_rank']}, output {d['o_groups']} groups x {d['o_lora_rank']}, "
           f"window {d['sliding_window']}, CSA every {d['compress_rate_csa']} tokens (indexer {d['index_n_heads']} x "
           f"{d['index_head_dim']}, top-k {d['index_topk']}), HCA every {d['compress_rate_hca']}; attention_impl auto. "
           f"V3.2 / MLA: hidden {m['hidden_size']}, {m['num_attention_heads']} heads, q_lora {m['q_lora_rank']}, "
           f"kv_lora {m['kv_lora_rank']}, indexer {m['index_n_heads']} x {m['index_head_dim']}, top-k {r['v32_topk']}; "
           f"MLA dense with attention_impl auto. {r['dtype']} compute, float32 parameters, batch 1, forward + "
           f"backward. Memory: XLA temp of the AOT-compiled gradient (nothing runs). Load average at the end "
           f"{', '.join(f'{x:.1f}' for x in env['loadavg_end'])}.", ""]
    table = []
    for row in r["rows"]:
        cells = [f"{row['seq']:,}"] + [_mib(row.get(n)) for n in names]
        cells.append(", ".join(f"{n} {row[n]['block_rows']}" for n in names if row.get(n, {}).get("block_rows")))
        table.append(cells)
    out += ["**XLA temp, MiB**", "", h.markdown_table(["context", *names, "query rows per block"], table), ""]
    out += ["**Growth of the temp per context step** (linear in the context: the ratio equals the context ratio)", ""]
    out += [h.markdown_table(["contender", "temp ratios"], [[n, "; ".join(scaling(r["rows"], n))] for n in names]),
            ""]
    timed = [row for row in r["rows"] if any("median_s" in row.get(n, {}) for n in names)]
    if timed:
        trows = []
        for row in timed:
            cells = [f"{row['seq']:,}"] + [f"{1e3 * row[n]['median_s']:,.0f}" if "median_s" in row.get(n, {}) else ""
                                           for n in names]
            cells += [f"{row[k]['median_round_ratio']:.2f} ({row[k]['min_round_ratio']:.2f}-"
                      f"{row[k]['max_round_ratio']:.2f})" if k in row else ""
                      for k in ("v4_csa_over_mla", "v4_hca_over_mla", "dsa_over_mla")]
            cells.append(len(row[names[0]].get("seconds", [])))
            trows.append(cells)
        out += ["**Forward + backward, ms** (medians; ratios: median of per-round ratios, min-max)", "",
                h.markdown_table(["context", *[f"{n} ms" for n in names], "CSA / MLA", "HCA / MLA", "DSA / MLA",
                                  "rounds"], trows), ""]
    plan_rows = []
    for row in r["rows"]:
        for n in ("v4_csa", "v4_hca"):
            info = row.get(n, {})
            if "plan" in info and "temp_bytes" in info:
                est = info["plan"]["kept_bytes"] + info["plan"]["scratch_bytes"]
                plan_rows.append([f"{row['seq']:,}", n, f"{est / MIB:,.0f}", f"{info['temp_bytes'] / MIB:,.0f}",
                                  f"{est / info['temp_bytes']:.2f}"])
    if plan_rows:
        out += ["**The memory plan's count of the V4 layer** (kept for the backward + one block's scratch, "
                "`nnx_zoo.sharding.plan`; the compiled temp adds the backward's cotangents and the weights' gradients)",
                "", h.markdown_table(["context", "layer", "plan MiB", "XLA temp MiB", "plan / XLA"], plan_rows), ""]
    def squares(info: dict) -> str:
        return str(info.get("seq_by_seq_shapes") or "none")

    out.append("`[seq, seq]`-sized arrays in the compiled programs: " + "; ".join(
        f"{row['seq']:,}: " + ", ".join(f"{n} {squares(row[n])}" for n in names if "temp_bytes" in row.get(n, {}))
        for row in r["rows"]))
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
