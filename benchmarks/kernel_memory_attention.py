"""The attention sections of ``kernel_memory.py``.

``attention``      Llama-3.2-1B shapes (16 layers, 32 query / 8 key-value heads of width 64, vocabulary 128,256),
                   one gradient step at batch 1, bfloat16 compute and parameters, ``remat_policy="full"``, for
                   ``attention_impl`` ``xla`` (einsum scores ``[b, heads, s, s]``), ``blockwise`` and ``auto`` at
                   sequence 4,096 and 8,192: XLA's temp bytes (``step_memory``: the plain float32 log-softmax
                   loss over the whole logits, so the output head's ``[s, vocab]`` float32 terms, linear in
                   ``s``, are in every number; the trainer's chunked head is not used). Target: temp(8192) <=
                   2.5 x temp(4096) under ``auto``.
``attention_cpu``  forward + backward seconds of one causal attention call on this CPU, ``xla`` against
                   ``blockwise`` (8 query / 2 key-value heads of width 32, batch 1, float32), at several lengths:
                   where ``auto`` switches on CPU (``nnx_zoo.layers.attention.CPU_XLA_MAX_SCORES``).

    python benchmarks/kernel_memory.py --sections attention attention_cpu
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from kernel_memory_moe import step_memory

GIB = 2**30


# --------------------------------------------------------------------------------------------------- attention
def attention_section(quick: bool, log: Callable[[str], None]) -> dict:
    from nnx_zoo import Llama3, Llama3Config
    from nnx_zoo.layers.attention import choose_attention_impl

    seqs = (1024, 2048) if quick else (4096, 8192)
    rows, ratios = [], {}
    for impl in ("xla", "blockwise", "auto"):
        temps = {}
        for seq in seqs:
            config = Llama3Config.preset("llama3.2-1b", dtype="bfloat16", param_dtype="bfloat16",
                                         remat_policy="full", attention_impl=impl)
            chosen = choose_attention_impl(impl, q_len=seq, k_len=seq, platform="cpu", qk_dim=64, v_dim=64)
            log(f"[attention] {impl} (runs {chosen}): compiling the Llama-3.2-1B grad step at 1 x {seq}")
            mem = step_memory(lambda c=config: Llama3(c, rngs=nnx.Rngs(0)), 1, seq, config.vocab_size)
            temps[seq] = mem["temp_bytes"]
            log(f"[attention] {impl}: temp {temps[seq] / GIB:.2f} GiB (compile {mem['compile_s']:.0f} s)")
            rows.append({"attention_impl": impl, "ran": chosen, "batch": 1, "seq": seq, **mem})
        ratios[impl] = temps[seqs[1]] / temps[seqs[0]]
    return {"model": "llama3.2-1b", "dtype": "bfloat16", "remat_policy": "full", "rows": rows,
            "ratio_of": f"{seqs[1]}/{seqs[0]}", "ratios": ratios,
            "check": {"auto_ratio": ratios["auto"], "auto_ratio_le_2_5": ratios["auto"] <= 2.5}}


def attention_markdown(section: dict) -> str:
    rows = [[r["attention_impl"], r["ran"], f"{r['batch']} x {r['seq']}", f"{r['temp_bytes'] / GIB:.2f}",
             f"{r['argument_bytes'] / GIB:.2f}", f"{r['compile_s']:.0f}"] for r in section["rows"]]
    ratios = ", ".join(f"{impl} {ratio:.2f}x" for impl, ratio in section["ratios"].items())
    check = section["check"]
    return "\n".join([
        f"## Attention: {section['model']}, {section['dtype']}, remat {section['remat_policy']}, batch 1",
        "",
        h.markdown_table(["attention_impl", "ran", "batch", "XLA temp GiB", "arguments GiB", "compile s"], rows),
        "",
        f"temp {section['ratio_of']}: {ratios} ({'holds' if check['auto_ratio_le_2_5'] else 'FAILS'}: auto <= 2.5x)",
    ])


# ----------------------------------------------------------------------------------------------- attention_cpu
def _median_seconds(fn: Callable[[], object], rounds: int) -> float:
    jax.block_until_ready(fn())  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def attention_cpu_section(quick: bool, log: Callable[[str], None]) -> dict:
    from nnx_zoo.layers.attention import attention, causal_mask

    heads, kv_heads, dim = 8, 2, 32
    seqs = (256, 1024) if quick else (256, 512, 1024, 2048, 4096)
    rows = []
    for seq in seqs:
        keys = jax.random.split(jax.random.key(seq), 3)
        q = jax.random.normal(keys[0], (1, seq, heads, dim))
        k, v = (jax.random.normal(key, (1, seq, kv_heads, dim)) for key in keys[1:])
        steps = {}
        for impl in ("xla", "blockwise"):
            def loss(q, k, v, impl=impl, seq=seq):
                return jnp.sum(attention(q, k, v, causal_mask(seq), dim**-0.5, impl) ** 2)

            steps[impl] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        rounds = 3 if quick or seq > 1024 else 7
        seconds: dict[str, list[float]] = {impl: [] for impl in steps}
        for _ in range(2):  # interleaved: two passes over the contenders
            for impl, step in steps.items():
                seconds[impl].append(_median_seconds(lambda step=step, args=(q, k, v): step(*args), rounds))
        row = {"seq": seq, **{f"{impl}_ms": 1e3 * float(np.median(s)) for impl, s in seconds.items()}}
        row["blockwise_over_xla"] = row["blockwise_ms"] / row["xla_ms"]
        log(f"[attention_cpu] {row}")
        rows.append(row)
    return {"shape": f"batch 1, {heads} query / {kv_heads} key-value heads of width {dim}, float32, causal",
            "rows": rows}


def attention_cpu_markdown(section: dict) -> str:
    rows = [[r["seq"], f"{r['xla_ms']:.1f}", f"{r['blockwise_ms']:.1f}", f"{r['blockwise_over_xla']:.2f}"]
            for r in section["rows"]]
    return "\n".join([
        f"## Attention on this CPU, forward + backward of one call ({section['shape']})",
        "",
        h.markdown_table(["seq", "xla ms", "blockwise ms", "blockwise / xla"], rows),
    ])


if __name__ == "__main__":
    def _log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    print(attention_cpu_markdown(attention_cpu_section("--quick" in sys.argv, _log)))
