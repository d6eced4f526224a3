"""The MoE section of ``kernel_memory.py``: XLA temp memory of an AOT-compiled DeepSeek grad step, ``moe_impl``
``dense`` against ``gmm`` with each portable grouped matmul (CPU, nothing runs).

The ``deepseek2-lite`` preset cut to 4 layers (1 dense + 3 MoE: hidden 2048, 64 routed experts top-6, 2 shared,
expert width 1408, MLA with kv_lora 512 and no query compression, 16 heads, vocab 102400), batch 1 x 2048, bf16
compute, f32 parameters, ``remat_policy="full"``: ``dense``, ``gmm`` + ``tiled``, ``gmm`` + ``xla``
(``jax.lax.ragged_dot``, whose CPU/GPU lowering expands to ``[groups, rows, hidden]``). What must hold (issue 21):
gmm-tiled temp <= dense temp.

    python benchmarks/kernel_memory.py --sections moe   # with the other sections' driver
    python benchmarks/kernel_memory_moe.py [--quick]    # this section alone, printed
"""

from __future__ import annotations

import sys
import time

import _harness as h
import jax
import jax.numpy as jnp
from flax import nnx

GIB = 2**30


def step_memory(model_factory, batch: int, seq: int, vocab: int) -> dict:
    """Compile a grad step of ``model_factory()`` (built abstractly) on ``[batch, seq]`` token ids; its memory
    analysis in bytes and the compile time."""
    abstract = nnx.eval_shape(model_factory)
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    ids = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

    def loss(params, rest, ids):
        # The plain cross-entropy (float32 log-softmax over the whole vocab), the same for every case of a section.
        logits = nnx.merge(graphdef, params, rest)(ids[:, :-1]).astype(jnp.float32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1)
        return -jnp.mean(picked)

    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, rest, ids).compile()
    mem = compiled.memory_analysis()
    return {
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "compile_s": time.perf_counter() - t0,
    }


MOE_CASES = {  # name -> (moe_impl, grouped_matmul_impl)
    "dense": ("dense", "auto"),
    "gmm tiled": ("gmm", "tiled"),
    "gmm xla (ragged_dot)": ("gmm", "xla"),
}


def moe_config(quick: bool, moe_impl: str, grouped_matmul_impl: str):
    from nnx_zoo import DeepSeekV3Config

    cut = dict(num_hidden_layers=4, dtype="bfloat16", remat_policy="full", moe_impl=moe_impl,
               grouped_matmul_impl=grouped_matmul_impl)
    if quick:  # a quarter of the widths and of the experts
        cut.update(hidden_size=512, intermediate_size=2736, moe_intermediate_size=352, n_routed_experts=16,
                   vocab_size=25600, kv_lora_rank=128, num_attention_heads=4)
    return DeepSeekV3Config.preset("deepseek2-lite", **cut)


def moe_section(quick: bool, log) -> dict:
    from nnx_zoo import DeepSeekV3

    batch, seq = (1, 512) if quick else (1, 2048)
    rows = []
    for name, (moe_impl, gmm_impl) in MOE_CASES.items():
        config = moe_config(quick, moe_impl, gmm_impl)
        log(f"[moe] {name}: compiling the {config.num_hidden_layers}-layer grad step at {batch} x {seq}")
        mem = step_memory(lambda c=config: DeepSeekV3(c, rngs=nnx.Rngs(0)), batch, seq, config.vocab_size)
        log(f"[moe] {name}: temp {mem['temp_bytes'] / GIB:.2f} GiB (compile {mem['compile_s']:.0f} s)")
        rows.append({"case": name, "moe_impl": moe_impl, "grouped_matmul_impl": gmm_impl, "batch": batch,
                     "seq": seq, **mem})
    dense = next(r for r in rows if r["case"] == "dense")["temp_bytes"]
    tiled = next(r for r in rows if r["case"] == "gmm tiled")["temp_bytes"]
    return {
        "model": "deepseek2-lite cut to 4 layers" + (" (quick: quarter widths, 16 experts)" if quick else ""),
        "dtype": "bfloat16 compute, float32 parameters", "remat_policy": "full", "rows": rows,
        "check": {"gmm_tiled_temp_le_dense": tiled <= dense, "gmm_tiled_over_dense": tiled / dense},
    }


def moe_markdown(section: dict) -> str:
    rows = [[r["case"], f"{r['batch']} x {r['seq']}", f"{r['temp_bytes'] / GIB:.2f}",
             f"{r['argument_bytes'] / GIB:.2f}", f"{r['compile_s']:.0f}"] for r in section["rows"]]
    check = section["check"]
    return "\n".join([
        f"## MoE: {section['model']}, {section['dtype']}, remat {section['remat_policy']}",
        "",
        h.markdown_table(["case", "batch", "XLA temp GiB", "arguments GiB", "compile s"], rows),
        "",
        f"gmm tiled temp / dense temp = {check['gmm_tiled_over_dense']:.2f} "
        f"({'holds' if check['gmm_tiled_temp_le_dense'] else 'FAILS'}: gmm tiled <= dense)",
    ])



if __name__ == "__main__":
    def _log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    print(moe_markdown(moe_section("--quick" in sys.argv, _log)))
