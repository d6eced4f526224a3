"""One DeepSeek-V3.2 sparse-attention (DSA) layer against the same MLA layer with dense attention (issue 24).

Both contenders are ``nnx_zoo.models.deepseek.mla.MLA`` (the attention block: projections, rope, attention,
``o_proj``) built from one ``DeepSeekV3Config`` and holding the same weights; the DSA layer adds the lightning
indexer (``index_topk > 0``) and runs ``dsa.sparse_attention``; the dense layer (``index_topk = 0``) runs the
fastest attention backend of the platform through ``attention_impl="auto"`` (CPU: ``blockwise`` beyond 512 x 512
scores; GPU: cuDNN flash attention in bf16). What is timed: ``jax.jit(jax.grad(loss, argnums=(params, x)))`` with
``loss = mean(MLA(x))`` (float32), batch 1, causal, side by side in one process, interleaved rounds with the order
rotated (``_harness.interleaved``), median per contender and the median of per-round ratios DSA / dense.

Memory: XLA's ``temp_size_in_bytes`` of the AOT-compiled gradient program (``memory_analysis()``; nothing runs),
for both layers and for the dense layer with the einsum attention (``xla``, which builds the scores) as a
reference. The ``[seq, seq]`` check scans the compiled DSA program's HLO for any array shape with two dimensions
equal to the context (``[seq, seq]``-sized) and reports the largest arrays that have one dimension equal to it
(the indexer's per-block ``[block, seq]`` scores are expected there).

``--profile C``: where the DSA layer's time goes at context ``C`` (``_harness.profile_ops``: wall time per executed
HLO thunk, grouped by the source line in ``dsa.py`` / ``mla.py`` it comes from, forward and backward apart).

    python benchmarks/dsa_layer.py                            # CPU: contexts 1k-16k, writes results/dsa_layer.*
    python benchmarks/dsa_layer.py --quick                    # smoke run: contexts 256 and 512, tiny dims
    python benchmarks/dsa_layer.py --platform gpu             # GPU (bf16): contexts 4k-64k, top-k 2048
    python benchmarks/dsa_layer.py --contexts 8192 --profile 8192 --rounds 2

Dims (``--dims``): ``cpu`` is DeepSeek-V3.2's layer scaled down to run on 2 cores: hidden 2048, 16 heads,
q_lora 1536, kv_lora 512, nope 128 / rope 64 / v 128, indexer 16 heads x 128, top-k 256 (V3.2's 2048 of 128k as a
fraction of 16k); ``v32`` is the real layer (hidden 7168, 128 heads, indexer 64 x 128, top-k 2048; GPU). Writes
``dsa_layer.{json,md}`` (``dsa_layer_gpu`` on a GPU) to ``--out-dir`` after every context, so a run cut short keeps
its rows; a context that fails (out of memory) is recorded as an error. On a GPU (``bash benchmarks/gpu_run.sh
--cases dsa``): by an AOT compile on the CPU the V3.2 layer's DSA gradient needs ~95 GiB of temp at 64k, and
``nnx_zoo.sharding.plan.SPARSE_BLOCK_BYTES`` (64 MiB, the one block rule dsa runs) gives 8-row query blocks at
these dims; ``--block-bytes`` overrides it.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as h  # noqa: E402

GIB = 2**30
MIB = 2**20
# Layer dims (overrides of the deepseek3.2-671b preset; everything else, YaRN included, is V3.2's).
DIMS = {
    "cpu": dict(hidden_size=2048, num_attention_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, index_n_heads=16, index_head_dim=128),
    "v32": dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128),
    "quick": dict(hidden_size=256, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                  qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32),
}
DEFAULTS = {  # platform -> contexts, top-k, dims, dtype
    "cpu": ((1024, 2048, 4096, 8192, 16384), 256, "cpu", "float32"),
    "gpu": ((4096, 8192, 16384, 32768, 65536), 2048, "v32", "bfloat16"),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def configs(dims: dict, topk: int, dtype: str, dense_impl: str):
    from nnx_zoo.models.deepseek.config import DeepSeekV3Config

    base = dict(dims, num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=0,
                max_position_embeddings=max(163840, 2**17), dtype=dtype, param_dtype="float32")
    dense = DeepSeekV3Config.preset("deepseek3.2-671b", **base, index_topk=0, attention_impl=dense_impl)
    dsa = DeepSeekV3Config.preset("deepseek3.2-671b", **base, index_topk=topk, attention_impl=dense_impl)
    return dense, dsa


def build_layers(dense_cfg, dsa_cfg):
    """The two MLA layers, the DSA one holding the dense one's weights (plus its own indexer)."""
    import jax
    import numpy as np
    from flax import nnx

    from nnx_zoo.models.deepseek.mla import MLA

    dense = MLA(dense_cfg, rngs=nnx.Rngs(0))
    dsa = MLA(dsa_cfg, rngs=nnx.Rngs(1))
    nnx.update(dsa, nnx.state(dense, nnx.Param))
    shared = jax.tree.leaves(nnx.state(dense, nnx.Param))
    same = jax.tree.leaves(nnx.state(dsa, nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))))
    assert len(shared) == len(same) and all(np.array_equal(a, b) for a, b in zip(shared, same)), "weights differ"
    return dense, dsa


def grad_step(layer, seq: int):
    """``(jitted grad of mean(layer(x)) w.r.t. (params, x), args)`` for a causal batch-1 sequence."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_zoo.layers.attention_mask import causal_mask
    from nnx_zoo.layers.rope import rope_cos_sin, rope_frequencies

    c = layer.config
    graphdef, params = nnx.split(layer, nnx.Param)
    inv_freq, factor = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    cos, sin = rope_cos_sin(jnp.arange(seq)[None], inv_freq, factor)
    x = jax.random.normal(jax.random.key(seq), (1, seq, c.hidden_size), jnp.float32).astype(c.dtype)

    def loss(params, x, cos, sin):
        out, _ = nnx.merge(graphdef, params).attend(x, cos, sin, causal_mask(seq))
        return jnp.mean(out.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x, cos, sin)


_SHAPE = re.compile(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8|f64|s64)\[([0-9,]+)\]")


def seq_shapes(hlo: str, seq: int) -> dict:
    """Array shapes in a compiled program's HLO with two dims equal to ``seq`` (``[seq, seq]``-sized), and the
    largest ones with one such dim (their element counts)."""
    squares, ones = collections.Counter(), collections.Counter()
    for m in _SHAPE.finditer(hlo):
        dims = [int(d) for d in m.group(1).split(",") if d]
        n = dims.count(seq)
        if n >= 2:
            squares[m.group(0)] += 1
        elif n == 1:
            ones[m.group(0)] += 1

    def size(shape: str) -> int:
        out = 1
        for d in shape[shape.index("[") + 1:-1].split(","):
            out *= int(d)
        return out

    largest = sorted(ones, key=lambda s: -size(s))[:6]
    return {"seq_by_seq": dict(squares), "largest_with_one_seq_dim": {s: size(s) for s in largest}}


def compile_step(step, args) -> tuple[object, dict]:
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    info = {"compile_s": time.perf_counter() - t0, "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
            "flops": h.compiled_flops(compiled)}
    return compiled, info


def block_rows(seq: int, dsa_cfg) -> int:
    """The query rows per block that ``dsa.sparse_attention`` uses at this context."""
    from nnx_zoo.models.deepseek import dsa

    c = dsa_cfg
    return dsa._block_size(seq, seq, min(c.index_topk, seq), c.num_attention_heads, c.index_n_heads,
                           c.kv_lora_rank + c.qk_rope_head_dim)


# ------------------------------------------------------------------------------------------------ the profile
def _where(frames: dict, frame: int | None) -> str:
    """The innermost frame in dsa.py or mla.py of a stack (else the innermost frame), as ``file:line function``."""
    found = h.innermost_frame(frames, frame, lambda path: Path(path).name in ("dsa.py", "mla.py"))
    return f"{Path(found[0]).name}:{found[2]} {found[1]}" if found else "?"


def profile_by_line(compiled, call, steps: int = 1) -> dict:
    """Wall ms per step of a compiled program (a jax.profiler trace; XLA:CPU records one event per executed thunk,
    summed over loop iterations; thunks on both cores add up, so the op total can exceed the wall time) grouped by
    the source line in dsa.py / mla.py of each HLO op and by pass (``bwd``: under ``transpose``), largest first.
    Ops without any metadata are grouped by their result shape."""
    text = compiled.as_text()
    frames = h.stack_frames(text)
    instrs = h.hlo_instructions(text)
    events, wall = h.trace_events(call, steps)
    if events is None:
        return {"error": "no perfetto trace written"}
    groups: dict[tuple[str, str], float] = collections.defaultdict(float)
    examples: dict[tuple[str, str], str] = {}
    for e in events:
        name = e.get("name")
        if e.get("ph") != "X" or name not in instrs or name.split(".")[0] in h.CONTROL_FLOW:
            continue
        info = instrs[name]
        op_name = info["op_name"] or ""
        where = _where(frames, info["frame"]) if info["frame"] else f"(no metadata) {info['shape']}"
        key = (where, "bwd" if "transpose(" in op_name else "fwd")
        groups[key] += e.get("dur", 0.0) / 1e3 / steps
        examples.setdefault(key, op_name.split("/")[-1] or name)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"wall_ms": 1e3 * wall, "op_ms": sum(groups.values()),
            "groups": [{"where": k[0], "pass": k[1], "ms": v, "op": examples[k]} for k, v in ranked[:60]]}


def source_lines(path: Path) -> dict[str, str]:
    return {str(i + 1): text.strip() for i, text in enumerate(path.read_text().splitlines())}


# ------------------------------------------------------------------------------------------------ the run
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                   help="defaults (contexts, top-k, dims, dtype) for this platform; auto: JAX's backend")
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--topk", type=int, default=None, help="index_topk (default: CPU 256, GPU 2048)")
    p.add_argument("--dims", choices=sorted(DIMS), default=None, help="layer dims (default: CPU cpu, GPU v32)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: CPU float32, GPU bfloat16)")
    p.add_argument("--dense-impl", default="auto", help="the dense layer's attention_impl (default auto)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per context")
    p.add_argument("--long-rounds", type=int, default=2, help="rounds at contexts >= --long-from")
    p.add_argument("--long-from", type=int, default=16384)
    p.add_argument("--xla-up-to", type=int, default=2048,
                   help="also time the dense layer with the einsum attention (xla) up to this context (CPU), to "
                        "check auto's choice; its memory is compiled at every context")
    p.add_argument("--xla-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the dense layer with the einsum attention too (memory reference; default: CPU "
                        "yes, GPU no)")
    p.add_argument("--render", default=None, help="only rewrite the markdown of this results JSON")
    p.add_argument("--memory-only", action="store_true", help="compile and report memory; time nothing")
    p.add_argument("--profile", type=int, nargs="*", default=[], help="contexts to profile the DSA program at")
    p.add_argument("--block-bytes", type=int, default=None, help="override plan.SPARSE_BLOCK_BYTES (tuning)")
    p.add_argument("--max-block", type=int, default=None, help="override dsa._MAX_BLOCK (tuning)")
    p.add_argument("--quick", action="store_true", help="smoke run: contexts 256 512, tiny dims, top-k 64")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--out-name", default=None, help="results stem (default dsa_layer, dsa_layer_gpu on GPU)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    if a.render:
        import json

        payload = json.loads(Path(a.render).read_text())
        md = markdown(payload)
        Path(a.render).with_suffix(".md").write_text(md.rstrip() + "\n")
        print(md)
        return 0

    import jax

    from nnx_zoo.layers.attention import choose_attention_impl
    from nnx_zoo.models.deepseek import dsa as dsa_module
    from nnx_zoo.sharding import plan as plan_module

    platform = jax.default_backend() if a.platform == "auto" else a.platform
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else "cpu"
    if platform == "gpu" and jax.default_backend() == "cpu":
        log("warning: --platform gpu on a CPU backend (argument check only: the GPU defaults run on the CPU)")
    contexts, topk, dims, dtype = DEFAULTS[platform]
    if a.quick:
        contexts, topk, dims = (256, 512), 64, "quick"
    contexts = a.contexts or contexts
    topk = a.topk or topk
    dims = a.dims or dims
    dtype = a.dtype or dtype
    xla_memory = platform == "cpu" if a.xla_memory is None else a.xla_memory
    if a.block_bytes:
        plan_module.SPARSE_BLOCK_BYTES = a.block_bytes
    if a.max_block:
        dsa_module._MAX_BLOCK = a.max_block
    log(f"platform {platform} ({jax.devices()[0].device_kind}), dims {dims} {DIMS[dims]}, top-k {topk}, {dtype}, "
        f"contexts {contexts}, SPARSE_BLOCK_BYTES {plan_module.SPARSE_BLOCK_BYTES}, _MAX_BLOCK {dsa_module._MAX_BLOCK}")

    dense_cfg, dsa_cfg = configs(DIMS[dims], topk, dtype, a.dense_impl)
    xla_cfg = configs(DIMS[dims], topk, dtype, "xla")[0]
    dense, dsa = build_layers(dense_cfg, dsa_cfg)
    from flax import nnx

    from nnx_zoo.models.deepseek.mla import MLA

    xla_layer = MLA(xla_cfg, rngs=nnx.Rngs(0)) if xla_memory else None
    c = dense_cfg
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    rows, profiles = [], {}
    stem = a.out_name or ("dsa_layer_gpu" if platform == "gpu" else "dsa_layer") + ("_quick" if a.quick else "")

    def finish(final: bool) -> None:
        """Writes what has been measured so far (after every context: a run cut short keeps its rows)."""
        env = h.environment()
        env["loadavg_end"] = list(os.getloadavg())
        payload = {"benchmark": "dsa_layer", "argv": sys.argv[1:] if argv is None else list(argv),
                   "environment": env, "platform": platform, "device": jax.devices()[0].device_kind,
                   "dims": DIMS[dims], "dims_name": dims, "topk": topk, "dtype": dtype,
                   "block_bytes": plan_module.SPARSE_BLOCK_BYTES, "max_block": dsa_module._MAX_BLOCK, "complete": final,
                   "rows": rows, "profiles": {str(k): v for k, v in profiles.items()}}
        if profiles:
            here = Path(dsa_module.__file__)
            payload["source_lines"] = {"dsa.py": source_lines(here), "mla.py": source_lines(here.parent / "mla.py")}
        md = markdown(payload)
        if final:
            print(md)
        if not a.no_write:
            jp, mp = h.write_results(stem, payload, md, a.out_dir)
            log(f"wrote {jp} and {mp}")

    for seq in contexts:
        ran = choose_attention_impl(a.dense_impl, q_len=seq, k_len=seq, qk_dim=qk, v_dim=c.v_head_dim)
        row: dict = {"seq": seq, "dense_ran": ran, "topk": topk, "dsa_sparse": topk < seq,
                     "dsa_block_rows": block_rows(seq, dsa_cfg) if topk < seq else None}
        rows.append(row)
        steps = {}
        contenders = {"dense": dense, "dsa": dsa, **({"dense_xla": xla_layer} if xla_memory else {})}
        for name, layer in contenders.items():
            log(f"{seq}: compiling {name}")
            try:
                step, args = grad_step(layer, seq)
                compiled, info = compile_step(step, args)
            except Exception as err:  # noqa: BLE001 - e.g. out of memory at the longest context: a result
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                log(f"{seq}: {name} failed to compile: {row[name]['error']}")
                continue
            row[name] = info
            scan = seq_shapes(compiled.as_text(), seq)
            row[name]["seq_by_seq_shapes"] = scan["seq_by_seq"]
            row[name]["largest_with_one_seq_dim"] = scan["largest_with_one_seq_dim"]
            log(f"{seq}: {name} temp {info['temp_bytes'] / MIB:.0f} MiB, compile {info['compile_s']:.1f} s, "
                f"[seq, seq] shapes {scan['seq_by_seq'] or 'none'}")
            steps[name] = (compiled, args)
        timed = [n for n in ("dense", "dsa") if n in steps]
        if "dense_xla" in steps and platform == "cpu" and seq <= a.xla_up_to:
            timed.append("dense_xla")
        if not a.memory_only and timed:
            calls = {n: (lambda cs=steps[n]: jax.block_until_ready(cs[0](*cs[1]))) for n in timed}
            rounds = a.long_rounds if seq >= a.long_from else a.rounds
            log(f"{seq}: timing {timed}, {rounds} rounds")
            try:
                times = h.interleaved(calls, rounds=rounds, target_s=1.0, warmup=0, log=log)
            except Exception as err:  # noqa: BLE001 - e.g. out of memory when running: a result
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                log(f"{seq}: timing failed: {row['error']}")
                times = {}
            for n in times:
                row[n]["seconds"] = times[n]
                row[n]["median_s"] = h.median(times[n])
            if "dsa" in times and "dense" in times:
                row["dsa_over_dense"] = h.ratio_stats(times["dsa"], times["dense"])
                log(f"{seq}: dense {row['dense']['median_s']:.3f} s, dsa {row['dsa']['median_s']:.3f} s, "
                    f"dsa/dense {row['dsa_over_dense']['median_round_ratio']:.2f}")
            if "dense_xla" in times:
                row["dense_over_xla"] = h.ratio_stats(times["dense"], times["dense_xla"])
        if seq in a.profile and topk < seq and "dsa" in steps:
            log(f"{seq}: profiling the DSA program")
            cs = steps["dsa"]
            profiles[seq] = profile_by_line(cs[0], lambda cs=cs: jax.block_until_ready(cs[0](*cs[1])))
        del steps
        finish(final=seq == contexts[-1])
    return 0


def markdown(r: dict) -> str:
    d = r["dims"]
    env = r["environment"]
    out = [f"# One DSA layer vs the same MLA layer with dense attention ({r['platform']}: {r['device']}, "
           f"jax {env['jax']}, {env['date_utc']})", "",
           f"MLA: hidden {d['hidden_size']}, {d['num_attention_heads']} heads, q_lora {d['q_lora_rank']}, kv_lora "
           f"{d['kv_lora_rank']}, nope/rope/v {d['qk_nope_head_dim']}/{d['qk_rope_head_dim']}/{d['v_head_dim']}; "
           f"indexer {d['index_n_heads']} heads x {d['index_head_dim']}, top-k {r['topk']}; {r['dtype']} compute, "
           f"float32 parameters; batch 1, causal; forward + backward (grad w.r.t. parameters and input of the "
           f"mean output). dsa.py blocks: SPARSE_BLOCK_BYTES {r['block_bytes'] // MIB} MiB, "
           f"_MAX_BLOCK {r['max_block']}. "
           f"Load average at the end {', '.join(f'{x:.1f}' for x in env['loadavg_end'])}. Times: median over "
           f"rounds; DSA / dense: median of per-round ratios (min-max).", ""]
    if r.get("merged_from"):
        out += ["Rows from separate runs (each context's contenders side by side in one process): "
                      + "; ".join(f"`{m['argv']}` ({m['date_utc']}, load at the end {m['loadavg_end']})"
                                  for m in r["merged_from"]) + ".", ""]
    has_xla = any("dense_xla" in row for row in r["rows"])
    rows = []
    for row in r["rows"]:
        ratio = row.get("dsa_over_dense")
        xla = row.get("dense_xla", {})
        rows.append([row["seq"], row["dense_ran"], _ms(row["dense"]), _ms(row["dsa"]),
                     "" if ratio is None else f"{ratio['median_round_ratio']:.2f} "
                     f"({ratio['min_round_ratio']:.2f}-{ratio['max_round_ratio']:.2f})",
                     _mib(row["dense"]), _mib(row["dsa"]), *([_ms(xla), _mib(xla) if xla else ""] if has_xla else []),
                     row["dsa_block_rows"] or "dense (top-k >= seq)",
                     len(row["dense"].get("seconds", [])) or ""])
    out += [h.markdown_table(["context", "dense ran", "dense ms", "DSA ms", "DSA / dense", "dense temp MiB",
                              "DSA temp MiB", *(["einsum (xla) dense ms", "einsum dense temp MiB"] if has_xla else []),
                              "DSA block rows", "rounds"], rows), ""]
    h_ = d["num_attention_heads"]
    model_dims = {*d.values(), h_ * (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]), h_ * d["kv_lora_rank"],
                  h_ * (d["qk_nope_head_dim"] + d["v_head_dim"]), h_ * d["v_head_dim"],
                  d["index_n_heads"] * d["index_head_dim"], d["kv_lora_rank"] + d["qk_rope_head_dim"],
                  h_ * d["qk_rope_head_dim"], h_ * d["qk_nope_head_dim"]}
    out += ["`[seq, seq]`-sized arrays in the compiled programs (HLO array shapes with two dims equal to the context; "
            "where the context equals a model dim, e.g. hidden or heads x width, such shapes may be activations like "
            "`[seq, hidden]`):", ""]
    for row in r["rows"]:
        parts = []
        for name in ("dsa", "dense", "dense_xla"):
            if name not in row:
                continue
            found = row[name].get("seq_by_seq_shapes", {})
            parts.append(f"{name}: " + (", ".join(f"`{k}` x{v}" for k, v in found.items()) if found else "none"))
        largest = list(row["dsa"].get("largest_with_one_seq_dim", {}))[:3]
        note = " (context == a model dim or heads x width: ambiguous)" if row["seq"] in model_dims else ""
        if row.get("dsa_block_rows") and row["dsa_block_rows"] * d["index_n_heads"] == row["seq"]:
            note += " (DSA block rows x indexer heads == context: the indexer scores `[block x heads, seq]`)"
        out.append(f"- {row['seq']}{note}: " + "; ".join(parts) + ". DSA's largest arrays with one context-sized dim: "
                   + ", ".join(f"`{s}`" for s in largest))
    for seq, prof in r["profiles"].items():
        if "error" in prof:
            out += ["", f"Profile at {seq}: {prof['error']}"]
            continue
        lines = r.get("source_lines", {})
        out += ["", f"## Where the DSA layer's time goes at {seq} (one profiled call: wall {prof['wall_ms']:,.0f} ms, "
                f"attributed ops {prof['op_ms']:,.0f} ms; per source line, forward / backward)", ""]
        table = []
        for g in prof["groups"][:20]:
            file_line = g["where"].split(" ")[0]
            file, _, line = file_line.partition(":")
            text = lines.get(file, {}).get(line, "")
            table.append([g["where"], g["pass"], f"{g['ms']:,.0f}", f"{g['ms'] / prof['op_ms']:.0%}", g["op"],
                          "`" + text[:90].replace("|", "\\|") + "`" if text else ""])
        out.append(h.markdown_table(["where", "pass", "ms", "share", "op", "source"], table))
    return "\n".join(out)


def _ms(info: dict) -> str:
    return f"{1e3 * info['median_s']:,.0f}" if "median_s" in info else info.get("error", "")[:40]


def _mib(info: dict) -> str:
    return f"{info['temp_bytes'] / MIB:,.0f}" if "temp_bytes" in info else "error"


if __name__ == "__main__":
    raise SystemExit(main())
