"""The linear-attention sections of ``kernel_memory.py`` (Qwen3.5's gated delta rule; issue 34).

``hybrid``     Qwen3.5-9B-shaped layers (width 4,096; full layers 16 query heads / 4 key-value heads of 256; linear
               layers 16 query/key heads and 32 value heads of 128, a 4-tap convolution; SwiGLU 12,288), four of
               them in Qwen3.5's schedule (three linear, one full), the vocabulary cut to 8,192 so that the output
               head does not hide the layers, one gradient step at batch 1, bfloat16, ``remat_policy="full"``, at
               8,192, 32,768 and 131,072 tokens: XLA's temp bytes of the hybrid, of the same layers all linear
               (the delta rule alone: its state ``[h, d_k, d_v]`` at chunk boundaries and the chunk bodies'
               scratch, linear in the context) and all full attention (a same-size model without the delta rule).
               Full layers run ``blockwise`` (flash-style, no score matrix: the fair comparison) and ``xla`` (the
               dense reference, scores materialized) where it compiles.
``hybrid_cp``  The cost of the sequence split's state hand-off: the collective bytes per device of one sharded
               gradient step (same layers, four of them, batch 8 x 4,096 on 8 CPU devices, FSDP 4 x EP 2) read from
               the compiled program (``compiled_programs.collective_bytes``: ring traffic, while loops counted by
               their trip counts), under ``ep-as-cp`` (the expert axis splits the sequence in two: each linear
               layer hands its affine state map ``[h, d_k, d_k + d_v]`` across, all-gathered, and sums the final
               state) against ``default`` (the same mesh splitting the batch 8 ways: no hand-off). The hand-off's
               own collectives are picked out by their shapes (the maps' trailing ``[d_k, d_k + d_v]``). Runs in a
               child process with 8 fake CPU devices.

    python benchmarks/kernel_memory.py --sections hybrid hybrid_cp
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

GIB, MIB = 2**30, 2**20
VOCAB = 8192
SCHEDULES = {"qwen3.5 (3 linear : 1 full)": None, "all linear": "linear_attention", "all full": "full_attention"}


def _config(layers: int, seq: int, schedule: str, impl: str, **extra):
    from nnx_zoo import Qwen35Config

    fields = dict(vocab_size=VOCAB, num_hidden_layers=layers, dtype="bfloat16", param_dtype="bfloat16",
                  remat_policy="full", attention_impl=impl, max_position_embeddings=max(seq, 4096), **extra)
    if SCHEDULES[schedule] is not None:
        fields["layer_types"] = (SCHEDULES[schedule],) * layers
    return Qwen35Config.preset("qwen3.5-9b", **fields)


def hybrid_section(quick: bool, log: Callable[[str], None]) -> dict:
    import _harness as h

    from nnx_zoo import Qwen35

    seqs = (2048, 8192) if quick else (8192, 32768, 131072)
    layers = 4
    rows = []
    for impl in ("blockwise", "xla"):
        for schedule in SCHEDULES:
            if impl == "xla" and schedule == "all linear":
                continue  # no softmax attention: the same program as under blockwise
            for seq in seqs:
                config = _config(layers, seq, schedule, impl)
                log(f"[hybrid] {impl} {schedule}: compiling the grad step at 1 x {seq}")
                try:
                    costs = h.grad_step_temp(Qwen35, config, seq)
                except Exception as err:  # noqa: BLE001 - a compile that fails is reported, not fatal
                    log(f"[hybrid]   failed: {type(err).__name__}: {str(err)[:200]}")
                    costs = {"temp_bytes": None, "compile_s": None, "error": f"{type(err).__name__}"}
                else:
                    log(f"[hybrid]   temp {costs['temp_bytes'] / GIB:.2f} GiB (compile {costs['compile_s']:.0f} s)")
                rows.append({"attention_impl": impl, "schedule": schedule, "seq": seq, **costs})
    by = {(r["attention_impl"], r["schedule"], r["seq"]): r["temp_bytes"] for r in rows}
    growth = {}
    for (impl, schedule, seq), temp in by.items():
        before = [s for s in seqs if s < seq]
        if before and temp and by.get((impl, schedule, before[-1])):
            growth[f"{impl} {schedule} {seq // 1024}k/{before[-1] // 1024}k"] = temp / by[impl, schedule, before[-1]]
    linear = [g for name, g in growth.items() if "all linear" in name]
    return {"model": "qwen3.5-9b layers, vocabulary 8,192", "layers": layers, "rows": rows, "growth": growth,
            "check": {"all_linear_growth": linear,
                      "all_linear_temp_linear": all(g <= 1.125 * 4 for g in linear)}}


def hybrid_markdown(section: dict) -> str:
    rows = [[r["attention_impl"], r["schedule"], f"1 x {r['seq']}",
             "fails to compile" if r["temp_bytes"] is None else f"{r['temp_bytes'] / GIB:.2f}",
             "" if r["compile_s"] is None else f"{r['compile_s']:.0f}"] for r in section["rows"]]
    growth = [[name, f"{g:.2f}x"] for name, g in section["growth"].items()]
    return "\n\n".join([
        f"## hybrid: {section['model']}, {section['layers']} layers, bf16, remat full, one grad step",
        h_table(["full layers' attention_impl", "schedule", "batch x seq", "temp GiB", "compile s"], rows),
        "Temp growth for 4x the context (linear: 4x):",
        h_table(["case", "temp"], growth),
        f"Check: the all-linear temp grows {', '.join(f'{g:.2f}x' for g in section['check']['all_linear_growth'])} "
        f"per 4x context (linear: {section['check']['all_linear_temp_linear']})."])


def h_table(header, rows) -> str:
    import _harness as h

    return h.markdown_table(header, rows)


# ---- the sequence split's state hand-off: collective bytes of the compiled step -------------------------------

CP_CASES = {"batch split (default)": "default", "sequence split (ep-as-cp)": "ep-as-cp"}


def _cp_child(quick: bool) -> dict:
    """In a process with 8 CPU devices: the collective bytes of each ``CP_CASES`` step."""
    import compiled_programs as cp
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_zoo import Qwen35
    from nnx_zoo.sharding import get_rules, logical_to_mesh_axes, make_mesh, state_shardings

    batch, seq = (8, 1024) if quick else (8, 4096)
    config = _config(4, seq, "qwen3.5 (3 linear : 1 full)", "blockwise")
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode="explicit")
    out = {"batch": batch, "seq": seq, "mesh": "fsdp 4 x expert 2", "d_k": dk, "d_v": dv, "cases": {}}
    for name, rules in CP_CASES.items():
        abstract = nnx.eval_shape(lambda r=rules: Qwen35(config, rngs=nnx.Rngs(0), rules=r))
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        shard = lambda tree, r=rules: jax.tree.unflatten(jax.tree.structure(tree), [  # noqa: E731
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(jax.tree.leaves(tree), state_shardings(tree, mesh, get_rules(r)), strict=True)])
        params, rest = shard(params), shard(rest)
        ids = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=jax.NamedSharding(
            mesh, logical_to_mesh_axes(("activation_batch", None), rules, mesh)))

        def loss(params, rest, ids, graphdef=graphdef):
            model = nnx.merge(graphdef, params, rest)
            logits = model(ids[:, :-1]).astype(jnp.float32)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss)).lower(params, rest, ids).compile()
        hlo = compiled.as_text()
        comps, entry = cp._computations(hlo)
        mult, unknown = _multiplicities(comps, entry)
        strict, cp._multiplicities = cp._multiplicities, lambda comps, entry: _multiplicities(comps, entry)[0]
        try:
            totals = cp.collective_bytes(hlo, 8)
        finally:
            cp._multiplicities = strict
        # The hand-off's own collectives: results whose trailing dims are the maps' [d_k, d_k + d_v] (all-gathered
        # over the sequence shards, forward and backward) or the final state's [h, d_k, d_v] in float32 (summed).
        pattern = re.compile(r"= (\w+)\[([0-9,]*)\][^ ]* (" + "|".join(cp.COLLECTIVES) + r")(-start)?\(")
        in_unknown = 0
        handoff, count = 0.0, 0
        factor = {"all-gather": lambda n: (n - 1) / n, "all-reduce": lambda n: 2 * (n - 1) / n,
                  "reduce-scatter": lambda n: n - 1.0, "all-to-all": lambda n: (n - 1) / n,
                  "collective-permute": lambda n: 1.0}
        for comp, lines in comps.items():
            for line in lines:
                m = pattern.search(line)
                if m is None:
                    continue
                dtype, dims, kind, _ = m.groups()
                shape = tuple(int(d) for d in dims.split(",") if d)
                in_unknown += comp in unknown
                state = dtype == "f32" and shape[-2:] == (dk, dv) and len(shape) >= 3
                if len(shape) >= 3 and (shape[-2:] == (dk, dk + dv) or state):
                    n = cp._group_size(line, 8)
                    handoff += factor[kind](n) * cp._DTYPE_BYTES[dtype] * math.prod(shape) * mult.get(comp, 0)
                    count += mult.get(comp, 0)
        out["cases"][name] = {"rules": rules, "collective_bytes": totals, "total_bytes": sum(totals.values()),
                              "handoff_bytes": handoff, "handoff_collectives": count,
                              "collectives_in_loops_of_unknown_trips": in_unknown,
                              "compile_s": time.perf_counter() - t0}
    return out


def _multiplicities(comps: dict[str, list[str]], entry: str) -> tuple[dict[str, int], set[str]]:
    """``compiled_programs._multiplicities``, but a while loop without a known trip count (the blockwise attention's
    key-block loop) counts once; returns the computations under such loops too (reported: none of them should
    hold a collective)."""
    mult: dict[str, int] = {entry: 1}
    unknown: set[str] = set()
    order = [entry]
    for name in order:
        for line in comps.get(name, ()):
            trip = 1
            m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line) if " while(" in line else None
            if m is not None:
                trip = int(m.group(1))
            for callee in re.findall(r"(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-]+)", line):
                if callee in comps:
                    if " while(" in line and m is None or name in unknown:
                        unknown.add(callee)
                    if callee not in mult:
                        order.append(callee)
                    mult[callee] = mult.get(callee, 0) + mult[name] * trip
    return mult, unknown


def hybrid_cp_section(quick: bool, log: Callable[[str], None]) -> dict:
    here = Path(__file__).resolve().parent
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                       " --xla_force_host_platform_device_count=8").strip(), "JAX_PLATFORMS": "cpu"}
    log("[hybrid_cp] compiling the sharded grad steps in a child process with 8 CPU devices")
    done = subprocess.run([sys.executable, str(here / "kernel_memory_hybrid.py"), "--cp-child",
                           *(["--quick"] if quick else [])], env=env, cwd=here, capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"the hand-off child failed:\n{done.stderr[-3000:]}")
    section = json.loads(done.stdout.strip().splitlines()[-1])
    for name, case in section["cases"].items():
        log(f"[hybrid_cp]   {name}: {case['total_bytes'] / MIB:.1f} MiB of collectives, hand-off "
            f"{case['handoff_bytes'] / MIB:.2f} MiB")
    return section


def hybrid_cp_markdown(section: dict) -> str:
    cases = section["cases"]
    kinds = [k for k in next(iter(cases.values()))["collective_bytes"]
             if any(c["collective_bytes"][k] for c in cases.values())]
    rows = [[name, *(f"{c['collective_bytes'][k] / MIB:.1f}" for k in kinds), f"{c['total_bytes'] / MIB:.1f}",
             f"{c['handoff_bytes'] / MIB:.2f} ({c['handoff_collectives']})",
             f"{100 * c['handoff_bytes'] / max(c['total_bytes'], 1):.1f}%"] for name, c in cases.items()]
    return "\n\n".join([
        f"## hybrid_cp: the sequence split's state hand-off, qwen3.5-9b layers x 4, batch {section['batch']} x "
        f"{section['seq']}, {section['mesh']}, bf16, one grad step (MiB per device)",
        h_table(["case", *kinds, "total", "hand-off (collectives)", "hand-off share"], rows)])


if __name__ == "__main__" and "--cp-child" in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(_cp_child("--quick" in sys.argv)))
