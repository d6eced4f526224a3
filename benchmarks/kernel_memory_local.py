"""The local-attention section of ``kernel_memory.py``.

``local``  Gemma-3-1B-shaped layers (26 of width 1,152, 4 query heads / 1 key-value head of width 256, five
           sliding layers with a 512-token window per global one), the vocabulary cut to 8,192 so that the output
           head's ``[s, vocab]`` terms do not hide the layers, one gradient step at batch 1, bfloat16,
           ``remat_policy="full"``, at 8,192 and 32,768 tokens, against the same model with every layer global
           (``layer_types`` all ``full_attention``): XLA's temp bytes under ``attention_impl`` ``auto``
           (``blockwise`` at these lengths on CPU: it skips the key blocks outside a window) and ``xla`` (the dense
           reference, which computes every score and masks them). Then one attention call's forward + backward
           time, windowed against global, at 2,048 and 8,192 tokens. (XLA's ``cost_analysis`` counts a loop body
           once, so its FLOPs say nothing about scanned layers or blockwise's key-block loop: not reported.)
           Target: under ``auto`` the 5:1 model's temp grows linearly (32k / 8k <= 4.5x) and the windowed call's
           time grows about linearly (4x) while the global call's grows about 16x.

    python benchmarks/kernel_memory.py --sections local
"""

from __future__ import annotations

from collections.abc import Callable

import _harness as h
import jax

GIB = 2**30
VOCAB = 8192


def _attention_times(seq: int, window: int, rounds: int, log: Callable[[str], None]) -> dict:
    """Forward + backward seconds of one Gemma-3-1B attention call (4 query heads, 1 key-value head of 256,
    float32, batch 1) through the dispatcher's ``blockwise`` path, windowed against global, side by side."""
    from nnx_zoo.layers.attention import attention, causal_mask

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, seq, 4, 256))
    k, v = (jax.random.normal(key, (1, seq, 1, 256)) for key in keys[1:])
    mask = causal_mask(seq)

    def step(w):
        grad = jax.jit(jax.grad(lambda q, k, v: attention(q, k, v, mask, 256**-0.5, "blockwise", window=w).sum(),
                                argnums=(0, 1, 2)))
        return lambda: jax.block_until_ready(grad(q, k, v))

    times = h.interleaved({f"window {window}": step(window), "global": step(None)}, rounds=rounds, log=log)
    return {name: float(sorted(t)[len(t) // 2]) for name, t in times.items()}


def local_section(quick: bool, log: Callable[[str], None]) -> dict:
    from nnx_zoo import Gemma3, Gemma3Config

    seqs = (2048, 8192) if quick else (8192, 32768)
    layers = 6 if quick else 26
    rows = []
    for impl in ("auto", "xla"):
        for schedule in ("5:1 local", "all global"):
            for seq in seqs:
                fields = dict(vocab_size=VOCAB, num_hidden_layers=layers, dtype="bfloat16", param_dtype="bfloat16",
                              remat_policy="full", attention_impl=impl, max_position_embeddings=seq)
                if schedule == "all global":
                    fields["layer_types"] = ("full_attention",) * layers
                config = Gemma3Config.preset("gemma3-1b", **fields)
                log(f"[local] {impl} {schedule}: compiling the grad step at 1 x {seq}")
                costs = h.grad_step_temp(Gemma3, config, seq)
                log(f"[local]   temp {costs['temp_bytes'] / GIB:.2f} GiB (compile {costs['compile_s']:.0f} s)")
                rows.append({"attention_impl": impl, "schedule": schedule, "seq": seq, **costs})
    by = {(r["attention_impl"], r["schedule"], r["seq"]): r for r in rows}
    lo, hi = seqs
    growth = {f"{impl} {schedule}": by[impl, schedule, hi]["temp_bytes"] / by[impl, schedule, lo]["temp_bytes"]
              for impl in ("auto", "xla") for schedule in ("5:1 local", "all global")}
    # Timed at 2k and 8k whatever the compiled lengths: a global call at 32k takes minutes on a laptop CPU.
    times = {seq: _attention_times(seq, 512, 2 if quick else 3, log) for seq in (2048, 8192)}
    return {"model": "gemma3-1b layers, vocabulary 8,192", "layers": layers, "window": 512, "rows": rows,
            "growth_of": f"{hi}/{lo}", "growth": growth, "attention_s": times,
            "check": {"auto_local_temp_growth": growth["auto 5:1 local"],
                      "auto_local_temp_linear": growth["auto 5:1 local"] <= 1.125 * hi / lo,
                      "window_time_growth": times[8192]["window 512"] / times[2048]["window 512"]}}


def local_markdown(section: dict) -> str:
    rows = [[r["attention_impl"], r["schedule"], f"1 x {r['seq']}", f"{r['temp_bytes'] / GIB:.2f}",
             f"{r['compile_s']:.0f}"] for r in section["rows"]]
    growth = [[name, f"{g:.2f}x"] for name, g in section["growth"].items()]
    times = [[seq, f"{t['window 512']:.3f}", f"{t['global']:.3f}", f"{t['window 512'] / t['global']:.2f}"]
             for seq, t in section["attention_s"].items()]
    return "\n\n".join([
        f"## local: {section['model']}, {section['layers']} layers (5 sliding, window {section['window']}, per "
        "global), bf16, remat full, one grad step",
        h.markdown_table(["attention_impl", "schedule", "batch x seq", "temp GiB", "compile s"], rows),
        f"Temp growth {section['growth_of']}:",
        h.markdown_table(["case", "temp"], growth),
        "One attention call, forward + backward, blockwise, float32 (medians, side by side):",
        h.markdown_table(["seq", "window 512 s", "global s", "ratio"], times),
        f"Check: `auto` 5:1 temp grows {section['check']['auto_local_temp_growth']:.2f}x "
        f"(linear: {section['check']['auto_local_temp_linear']}); the windowed call's time grows "
        f"{section['check']['window_time_growth']:.2f}x."])
