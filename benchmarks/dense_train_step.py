"""Training-step throughput per family: nnx_zoo (JAX) against transformers' model class of the same family
(PyTorch), CPU, float32; by default Llama3 / Qwen3 (LlamaForCausalLM / Qwen3ForCausalLM), and any preset whose
``save_pretrained`` transformers loads (``--presets gpt-oss-tiny gemma3-tiny gemma4-tiny llama4-tiny
minimax-m2-tiny qwen3-next-tiny qwen3.5-tiny``: the MoE ones train without an aux loss on both sides, transformers
adding its own only under ``output_router_logits``, which the checkpoints leave off).

The step: forward + backward of the mean next-token cross-entropy over all parameters, same config, same batch,
same weights (the torch model loads the JAX model's `save_pretrained` output), tokens/s = batch * seq / seconds
per step. Before anything is timed the two losses and gradient norms are compared; a disagreement beyond 1e-4
(relative) stops the run, since timing two different computations would mean nothing.
  jax        nnx_zoo `AutoModelForCausalLM.create(AutoConfig.preset(name))`, as shipped (scanned layers), a
             `jax.jit(jax.value_and_grad(loss))` over the `nnx.Param` state with the trainer's own
             `token_cross_entropy`
  torch-Nt   transformers' model built by `AutoModelForCausalLM.from_pretrained` on that checkpoint (sdpa
             attention), `zero_grad(set_to_none=True); model(ids, labels=ids).loss.backward()`, with
             torch.set_num_threads(N) for N in 2 (the box's cores) and 1 (torch's 2-thread OpenMP regions can
             stall on this shared, oversubscribed box)
Interleaved with the steps, three references that are not steps: a 1024^3 float32 matmul in JAX and in torch
(the box's practical matmul FLOP/s; the fastest round of either is the peak, the most generous ceiling, and MFU is
model FLOP/s over it) and the three lm_head matmuls of the step alone at its shapes (`x @ W`, `g @ W^T`,
`x^T @ g`: work every implementation must do). Model FLOPs are the config's `train_flops_per_token`.

All contenders of one comparison are timed side by side in one process, interleaved, several rounds, the order
rotated each round, one untimed call of each before its timed calls in every round; medians, and ratios as the
median of per-round ratios (see `_harness.py`).

    python benchmarks/dense_train_step.py             # llama3-small, qwen3-small at 1x128 and 4x128 (~15 min)
    python benchmarks/dense_train_step.py --quick     # smoke run: llama3-tiny, 1x128, 2 rounds
    python benchmarks/dense_train_step.py --profile   # also: where the JAX step's time goes, per HLO op
    python benchmarks/dense_train_step.py --presets gpt-oss-tiny gemma3-tiny gemma4-tiny llama4-tiny \
        minimax-m2-tiny qwen3-next-tiny qwen3.5-tiny --batches 1x128 --out-name family_train_step   # per family
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM
from nnx_zoo.train.loss import token_cross_entropy

LOSS_RTOL = 1e-4  # the two frameworks must agree this well on loss and gradient norm before timing


# ------------------------------------------------------------------------------------------------------- JAX step
def mean_next_token_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting ``ids[:, 1:]`` from positions ``0..S-2`` (HF's ``labels=ids`` loss), via
    the trainer's `token_cross_entropy`, so the step is what a training run computes."""
    targets = jnp.roll(ids, -1, axis=1)
    mask = jnp.ones(ids.shape, jnp.float32).at[:, -1].set(0.0)
    total, count = token_cross_entropy(logits, targets, mask)
    return total / count


def jax_train_step(model, ids: jax.Array) -> tuple[callable, dict, object]:
    """A compiled `value_and_grad` step over the model's nnx.Param state: (blocking call, info, compiled)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, ids):
        return mean_next_token_loss(nnx.merge(graphdef, params, rest)(ids), ids)

    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss_fn)).lower(params, rest, ids).compile()
    info = {"compile_s": time.perf_counter() - t0, "xla_flops": h.compiled_flops(compiled)}
    loss, grads = compiled(params, rest, ids)
    info["loss"] = float(loss)
    info["grad_norm"] = float(jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads))))

    def call():
        return jax.block_until_ready(compiled(params, rest, ids))

    return call, info, compiled


# ----------------------------------------------------------------------------------------------------- torch step
def torch_model(jax_model):
    """transformers' model of the same family on the JAX model's weights (through a checkpoint on disk)."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as d:
        jax_model.save_pretrained(d)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.train()
    return model, {"torch_class": type(model).__name__, "attn_implementation": model.config._attn_implementation,
                   "torch": torch.__version__, "transformers": transformers.__version__}


def check_same_computation(jax_info: dict, torch_info: dict, log) -> dict:
    """Relative differences of loss and gradient norm; raises when they exceed LOSS_RTOL."""
    out = {k: abs(jax_info[k] - torch_info[k]) / abs(torch_info[k]) for k in ("loss", "grad_norm")}
    log(f"  check: loss jax {jax_info['loss']:.7f} torch {torch_info['loss']:.7f} (rel {out['loss']:.1e}); grad "
        f"norm jax {jax_info['grad_norm']:.7f} torch {torch_info['grad_norm']:.7f} (rel {out['grad_norm']:.1e})")
    if max(out.values()) > LOSS_RTOL:
        raise SystemExit(f"nnx_zoo and transformers disagree on the same weights and batch ({out}); fix that "
                         "before timing anything")
    return out


# ------------------------------------------------------------------------------------ roofline reference points
def roofline(times: dict[str, list[float]], cfg, tokens: int, seq: int) -> dict:
    """Peak, MFU of every contender, and the floor the lm_head matmuls put under any step."""
    peaks = h.peak_flops(times)
    peak = max(peaks.values())
    flops_per_step = cfg.train_flops_per_token(seq) * tokens
    head_flops = 3 * 2 * tokens * cfg.hidden_size * cfg.vocab_size
    head_s = h.median(times["~lm_head-matmuls"])
    out = {"peak_gflops_per_s": peak / 1e9, "peaks_gflops_per_s": {k: v / 1e9 for k, v in peaks.items()},
           "model_gflop_per_step": flops_per_step / 1e9, "lm_head_share_of_flops": head_flops / flops_per_step,
           "lm_head_matmuls_ms": 1e3 * head_s, "lm_head_matmuls_fraction_of_peak": head_flops / head_s / peak,
           "mfu": {}}
    if "~lm_head-matmuls-torch" in times:
        out["lm_head_matmuls_torch_ms"] = 1e3 * h.median(times["~lm_head-matmuls-torch"])
        out["lm_head_matmuls_jax_over_torch"] = h.ratio_stats(times["~lm_head-matmuls"],
                                                              times["~lm_head-matmuls-torch"])["median_round_ratio"]
    for name, ts in times.items():
        if not name.startswith("~"):
            out["mfu"][name] = flops_per_step / h.median(ts) / peak
    return out


# ------------------------------------------------------------------------------------------------ op profile
def op_category(op_name: str) -> str:
    """A coarse, name-based bucket for one HLO instruction of the dense train step (see `h.profile_ops`)."""
    in_layers = "/while/body/" in op_name
    if not in_layers:
        if "while" in op_name:
            return "scan loop control"
        return "outside layers: embedding, final norm, lm_head matmuls, loss"
    if "dynamic_update_slice" in op_name or "dynamic_slice" in op_name:
        return "layers: scan slice in / stack out (params, grads, residuals)"
    if any(s in op_name for s in ("bqhd,bkhd", "bhqk,bkhd", "bqkd", "softmax", "dot_product_attention")):
        return "layers: attention scores/softmax/mix"
    if "dot_general" in op_name or "einsum" in op_name:
        return "layers: projection and MLP matmuls"
    return "layers: norms, rope, SwiGLU, masks, layout (elementwise)"


def torch_profile(call, steps: int = 3, top: int = 12) -> dict:
    """Self CPU time per torch op (torch.profiler), ms per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    call()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            call()
    wall = (time.perf_counter() - t0) / steps
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"wall_ms_per_step (profiled)": 1e3 * wall,
            "top_ops": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
                        for e in rows[:top]]}


# ------------------------------------------------------------------------------------------------ one comparison
def run_comparison(preset: str, batch: int, seq: int, a, log) -> dict:
    cfg = AutoConfig.preset(preset)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, dtype=jnp.int32)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.create(cfg, seed=0)
    contenders, infos = {}, {}
    contenders["jax"], infos["jax"], compiled = jax_train_step(model, ids)
    infos["jax"]["init_s"] = time.perf_counter() - t0 - infos["jax"]["compile_s"]
    log(f"  jax: compile {infos['jax']['compile_s']:.1f}s, loss {infos['jax']['loss']:.6f}")
    if a.unrolled:  # the same model with its layer stack unrolled: what the scan's slicing and stacking cost
        unrolled = AutoModelForCausalLM.create(cfg.with_overrides(scan_layers=False), seed=0)
        contenders["jax-unrolled"], infos["jax-unrolled"], _ = jax_train_step(unrolled, ids)
        log(f"  jax-unrolled: compile {infos['jax-unrolled']['compile_s']:.1f}s, loss "
            f"{infos['jax-unrolled']['loss']:.6f}")
    tmodel, tinfo = torch_model(model)
    check = None
    for threads in a.torch_threads:
        name = f"torch-{threads}t"
        contenders[name], sinfo = h.torch_train_step(tmodel, np.asarray(ids), threads)
        infos[name] = {**tinfo, **sinfo, "torch_threads": threads}
        check = check or check_same_computation(infos["jax"], sinfo, log)
    tokens = batch * seq
    contenders.update(h.matmul_references(cfg.hidden_size, cfg.vocab_size, tokens, torch_peak=True))
    timed = h.time_step_contenders(contenders, infos, tokens, a, log)
    times = timed.pop("times")
    out = {"preset": preset, "model": type(model).__name__, "batch": batch, "seq": seq, **timed,
           "same_computation_rel_diff": check, "model_train_flops_per_token": cfg.train_flops_per_token(seq),
           "num_parameters": cfg.num_parameters().total}
    best_torch = out["best_torch"]
    out["roofline"] = roofline(times, cfg, tokens, seq)
    for name, entry in out["contenders"].items():
        entry["mfu"] = out["roofline"]["mfu"][name]
    if a.profile:
        log("  profiling jax")
        out["contenders"]["jax"]["profile"] = h.summarize_profile(
            h.profile_ops(compiled, contenders["jax"], steps=a.profile_steps), op_category)
        log(f"  profiling {best_torch}")
        out["contenders"][best_torch]["profile"] = torch_profile(contenders[best_torch], steps=a.profile_steps)
    return out


# --------------------------------------------------------------------------------------------------------- report
def render(results: list[dict], a) -> str:
    env = h.environment()
    rows, roof_rows = [], []
    for s in results:
        c = s["contenders"]
        jx = c["jax"]
        load = f"{s['loadavg_before'][0]:.1f}/{s['loadavg_after'][0]:.1f}"
        rows.append([s["preset"], f"{s['batch']}x{s['seq']}", jx["tokens_per_s"],
                     *(c[f"torch-{t}t"]["tokens_per_s"] for t in a.torch_threads),
                     *(jx[f"speedup_vs_torch-{t}t"]["median_round_ratio"] for t in a.torch_threads),
                     jx["speedup_vs_best_torch"]["ratio_of_medians"], 100 * jx["mfu"],
                     100 * c[s["best_torch"]]["mfu"], f"{jx['loss']:.5f} / {c[s['best_torch']]['loss']:.5f}", load])
        r = s["roofline"]
        roof_rows.append([s["preset"], f"{s['batch']}x{s['seq']}", r["model_gflop_per_step"],
                          r["peaks_gflops_per_s"]["~peak-matmul-jax"], r["peaks_gflops_per_s"]["~peak-matmul-torch"],
                          100 * r["lm_head_share_of_flops"], r["lm_head_matmuls_ms"],
                          100 * r["lm_head_matmuls_fraction_of_peak"], r.get("lm_head_matmuls_torch_ms", "-"),
                          r.get("lm_head_matmuls_jax_over_torch", "-"), 1e3 * jx["median_s"],
                          1e3 * c[s["best_torch"]]["median_s"]])
    threads = [f"torch {t}t" for t in a.torch_threads]
    presets = ", ".join(dict.fromkeys(s["preset"] for s in results))
    parts = [f"# Train step against transformers ({presets}) on {env['backend']} ({env['processor']}, "
             f"{env['cpu_count']} cores)", "",
             f"jax {env['jax']} / flax {env.get('flax')}, float32, forward+backward of the mean next-token "
             f"cross-entropy, same weights in both; {a.rounds} interleaved rounds, medians.", "",
             "`jax / torch Nt`: median over rounds of (torch time / nnx_zoo time), > 1 = nnx_zoo faster; `jax / best "
             "torch`: ratio of median tokens/s against the faster torch setting. MFU: model FLOP/s "
             "(`train_flops_per_token` x tokens / step time) over the peak below. `loss`: first-step loss nnx_zoo / "
             "torch. `load 1m`: the 1-minute load average before/after the timed rounds.", "",
             h.markdown_table(["preset", "batch", "jax tokens/s", *(f"{t} tokens/s" for t in threads),
                               *(f"jax / {t}" for t in threads), "jax / best torch", "jax MFU %",
                               "best torch MFU %", "loss", "load 1m"], rows), "",
             "## roofline", "",
             "`peak`: fastest round of a 1024^3 float32 matmul, JAX and torch (2 threads), timed interleaved with the "
             "steps; MFU uses the larger. `lm_head`: share of the step's model FLOPs in the three lm_head matmuls, "
             "their time alone at the step's shapes (JAX) and their FLOP rate as % of peak; the same three in torch (1 "
             "thread) and JAX's time over torch's (median of per-round ratios).", "",
             h.markdown_table(["preset", "batch", "GFLOP/step", "peak jax GFLOP/s", "peak torch GFLOP/s",
                               "lm_head % of FLOPs", "lm_head mm ms", "lm_head mm % peak", "torch 1t lm_head mm ms",
                               "lm_head mm jax / torch time", "jax step ms",
                               "best torch step ms"], roof_rows), ""]
    variant_rows = [[s["preset"], f"{s['batch']}x{s['seq']}", name, c["tokens_per_s"],
                     c["speedup_vs_best_torch"]["ratio_of_medians"], s["contenders"]["jax"]["median_s"] / c["median_s"]]
                    for s in results for name, c in s["contenders"].items() if name.startswith("jax-")]
    if variant_rows:
        parts += ["## nnx_zoo variants (`jax-unrolled`: `scan_layers=False`)", "",
                  h.markdown_table(["preset", "batch", "variant", "tokens/s", "vs best torch", "vs jax (scanned)"],
                                   variant_rows), ""]
    prof_rows, top_rows, torch_rows = [], [], []
    for s in results:
        tag = f"{s['preset']} {s['batch']}x{s['seq']}"
        prof = s["contenders"]["jax"].get("profile")
        if prof and "categories_ms" in prof:
            for cat, ms in prof["categories_ms"].items():
                prof_rows.append([tag, cat, ms, 100.0 * ms / prof["op_ms_per_step"]])
            prof_rows.append([tag, f"all executed ops ({prof['executed_ops_per_step']:.0f} per step) / wall",
                              prof["op_ms_per_step"], f"wall {prof['wall_ms_per_step']:.1f} ms"])
            for o in prof["top_ops"][:8]:
                top_rows.append([tag, o["hlo"], o["ms"], o["calls_per_step"], o["op_name"][-80:]])
        tprof = s["contenders"][s["best_torch"]].get("profile")
        if tprof:
            for o in tprof["top_ops"][:8]:
                torch_rows.append([f"{tag} {s['best_torch']}", o["op"], o["self_ms"], o["calls_per_step"]])
    if prof_rows:
        parts += ["## where the JAX step's time goes (jax.profiler trace, per executed HLO thunk)", "",
                  h.markdown_table(["case", "bucket", "ms/step", "%"], prof_rows), "",
                  h.markdown_table(["case", "HLO op", "ms/step", "runs/step", "source op_name (tail)"], top_rows),
                  "", "## torch's top ops (torch.profiler, self CPU time)", "",
                  h.markdown_table(["case", "op", "self ms/step", "calls/step"], torch_rows), ""]
    return "\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_step_args(p, ["llama3-small", "qwen3-small"], ["llama3-tiny"], rounds=7)
    p.add_argument("--no-warm-each-round", dest="warm_each_round", action="store_false",
                   help="skip the untimed call of each contender before its timed calls in every round")
    p.add_argument("--profile", action="store_true", help="also profile the JAX step and the faster torch step")
    p.add_argument("--unrolled", action="store_true",
                   help="also time the model with scan_layers=False (jax-unrolled), to measure the scan's cost")
    p.add_argument("--out-name", default="dense_train_step", help="results/<name>.{json,md}")
    a = p.parse_args(argv)
    h.fill_step_defaults(a)

    log = h.log

    results = []
    for preset in a.presets:
        for batch, seq in h.batch_shapes(a.batches):
            log(f"[step] {preset} {batch}x{seq}")
            results.append(run_comparison(preset, batch, seq, a, log))
    md = render(results, a)
    print(md)
    if not a.no_write:
        payload = {"benchmark": "dense_train_step", "argv": sys.argv[1:] if argv is None else list(argv),
                   "environment": h.environment(), "rounds": a.rounds, "target_s": a.target_s,
                   "warm_each_round": a.warm_each_round, "torch_threads": a.torch_threads, "results": results}
        jp, mp = h.write_results(a.out_name, payload, md, a.out_dir)
        log(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
