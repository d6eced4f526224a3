"""DeepSeek-V3 training-step throughput: nnx_zoo (JAX) against transformers' DeepseekV3ForCausalLM (PyTorch), CPU.

Part 1, the whole step: forward + backward of the mean next-token cross-entropy over all parameters, float32,
same config and same batch, tokens/s = batch * seq / seconds per step. Contenders:
  jax-dense   nnx_zoo, moe_impl='dense' (every expert on every token)
  jax-gmm     nnx_zoo, moe_impl='gmm' with grouped_matmul_impl='tiled' (sort, then row tiles of one expert
              each, batched einsums, custom-vjp backward: nnx_zoo.layers.grouped_matmul)
  jax-gmm-ragged  nnx_zoo, moe_impl='gmm' with grouped_matmul_impl='xla' (jax.lax.ragged_dot)
  jax-tiled   nnx_zoo with RoutedExperts' gmm path replaced, inside this script only, by a prototype dropless
              grouped matmul built from batched einsums over fixed-size row tiles (see moe_kernels.py)
  torch-Nt    transformers DeepseekV3ForCausalLM built from `config.to_hf_dict()`, torch.set_num_threads(N)
              (N = 2, the brief's setting, and 1: on a shared, oversubscribed 2-core box torch's 2-thread
              OpenMP regions can stall badly), default experts implementation (grouped_mm) and sdpa attention
JAX steps are `jax.jit(jax.value_and_grad(loss))` over the `nnx.Param` state (nnx.split / nnx.merge); torch
steps are `zero_grad(set_to_none=True); model(ids, labels=ids).loss.backward()`. Where `save_pretrained` works,
the torch model loads the JAX model's weights, so the two first losses must agree (printed as a check).
MTP heads are switched off (num_nextn_predict_layers=0): HF's forward has none.

Part 2, the MoE block alone (forward + backward w.r.t. its parameters and input, fixed cotangent) against a
dense SwiGLU MLP of equal active FLOPs per token: width moe_intermediate_size * (num_experts_per_tok +
n_shared_experts). Also the same two blocks in PyTorch for reference.

All contenders of one comparison are timed side by side in one process, interleaved, several rounds, medians.
Interleaved with the steps, two references: a 1024^3 float32 matmul (this box's practical peak FLOP/s) and the
step's three lm_head matmuls alone; the "roofline" table turns them into what the >= 2x-PyTorch target asks.

    python benchmarks/deepseek_train_step.py            # tiny and small, 1x128 and 4x128 (long: ~30+ min)
    python benchmarks/deepseek_train_step.py --quick    # smoke run: deepseek3-small, 1x128, 2 rounds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from moe_kernels import auto_tile, layer_tiled

from nnx_zoo import DeepSeekV3, DeepSeekV3Config

# ------------------------------------------------------------------------------------- prototype: tiled grouped mm


def tiled_swiglu(x, expert_idx, weights, wi_gate, wi_up, wo, *, tile: int | None = None):
    """Routed SwiGLU experts as a dropless tiled grouped matmul (``moe_kernels.layer_tiled``: tokens sorted by
    expert into row tiles, one expert per tile, batched einsums; no ragged_dot), in RoutedExperts' argument order."""
    tile = tile or auto_tile(expert_idx.size, wi_gate.shape[0])
    return layer_tiled(x, wi_gate, wi_up, wo, expert_idx, weights.astype(x.dtype), tile=tile)


@contextlib.contextmanager
def tiled_gmm_patch():
    """Temporarily routes nnx_zoo's RoutedExperts 'gmm' path through `tiled_swiglu` (tracing happens inside)."""
    from nnx_zoo.layers import moe as moe_mod

    original = moe_mod.RoutedExperts._gmm

    def _gmm(self, x, expert_idx, weights):
        if not jax.sharding.get_abstract_mesh().empty:
            raise NotImplementedError("the tiled prototype is single-device only")
        wi_gate, wi_up, wo = self._weights()
        return tiled_swiglu(x.astype(self.dtype), expert_idx, weights, wi_gate, wi_up, wo)

    moe_mod.RoutedExperts._gmm = _gmm
    try:
        yield
    finally:
        moe_mod.RoutedExperts._gmm = original


# ------------------------------------------------------------------------------------------------------ JAX steps
# name -> (config overrides, patch context)
JAX_IMPLS = {
    "jax-dense": ({"moe_impl": "dense"}, contextlib.nullcontext),
    "jax-gmm": ({"moe_impl": "gmm", "grouped_matmul_impl": "tiled"}, contextlib.nullcontext),
    "jax-gmm-ragged": ({"moe_impl": "gmm", "grouped_matmul_impl": "xla"}, contextlib.nullcontext),
    "jax-tiled": ({"moe_impl": "gmm"}, tiled_gmm_patch),
}


def bench_config(preset: str, **overrides) -> DeepSeekV3Config:
    return DeepSeekV3Config.preset(preset, num_nextn_predict_layers=0, **overrides)


def make_model(cfg: DeepSeekV3Config) -> DeepSeekV3:
    return nnx.jit(lambda: DeepSeekV3(cfg, rngs=nnx.Rngs(0)))()


def cross_entropy(logits, ids):
    """Mean next-token cross-entropy over positions 0..S-2 (HF's `labels=ids` loss), via the trainer's own
    `token_cross_entropy` (so the step is what a training run does)."""
    from nnx_zoo.train.loss import token_cross_entropy

    targets = jnp.roll(ids, -1, axis=1)
    mask = jnp.ones(ids.shape, jnp.float32).at[:, -1].set(0.0)
    total, count = token_cross_entropy(logits, targets, mask)
    return total / count


def jax_train_step(model: DeepSeekV3, ids: jax.Array, patch) -> tuple[callable, dict, object]:
    """A compiled `value_and_grad` step over the model's nnx.Param state; returns (blocking call, info)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, ids):
        return cross_entropy(nnx.merge(graphdef, params, rest)(ids), ids)

    step = jax.jit(jax.value_and_grad(loss_fn))
    t0 = time.perf_counter()
    with patch():
        compiled = step.lower(params, rest, ids).compile()
    info = {"compile_s": time.perf_counter() - t0, "xla_flops": h.compiled_flops(compiled)}
    try:
        mem = compiled.memory_analysis()
        info["temp_bytes"] = int(mem.temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - best effort
        pass
    loss, _ = compiled(params, rest, ids)
    info["loss"] = float(loss)

    def call():
        return jax.block_until_ready(compiled(params, rest, ids))

    return call, info, compiled


# ------------------------------------------------------------------------------------ roofline reference points
def roofline(times: dict[str, list[float]], cfg: DeepSeekV3Config, tokens: int, seq: int,
             best_torch: str | None) -> dict:
    """What the >= 2x-PyTorch target asks of this box, from the reference timings of `h.matmul_references`.

    The peak is the fastest round of the 1024^3 matmul (the most generous ceiling); the model's FLOPs are the
    config's own `train_flops_per_token` (6 x active matmul parameters + attention; `dense`'s extra expert work
    is not counted, so this is what any implementation must do)."""
    peak = h.peak_flops(times)["~peak-matmul-jax"]
    flops_per_step = cfg.train_flops_per_token(seq) * tokens
    head_s = h.median(times["~lm_head-matmuls"])
    out = {"peak_gflops_per_s": peak / 1e9, "model_gflop_per_step": flops_per_step / 1e9,
           "lm_head_matmuls_ms": 1e3 * head_s,
           "lm_head_share_of_flops": 3 * 2 * tokens * cfg.hidden_size * cfg.vocab_size / flops_per_step,
           "achieved": {}}
    for name, ts in times.items():
        if not name.startswith("~"):
            out["achieved"][name] = {"gflops_per_s": flops_per_step / h.median(ts) / 1e9,
                                     "fraction_of_peak": flops_per_step / h.median(ts) / peak}
    if best_torch:
        budget = h.median(times[best_torch]) / 2  # the step time that would be 2x the best torch setting
        out["target_2x"] = {"tokens_per_s": tokens / budget, "step_ms": 1e3 * budget,
                            "gflops_per_s_needed": flops_per_step / budget / 1e9,
                            "fraction_of_peak_needed": flops_per_step / budget / peak,
                            "lm_head_matmuls_fraction_of_step": head_s / budget}
    return out


_EXPERT_SPECS = ("th,ehi->tei", "tei,eih->th", "nbh,nhf->nbf", "nbf,nfh->nbh")
_ATTN_SPECS = ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd", "softmax")


def op_category(op_name: str) -> str:
    """A coarse, name-based bucket for one HLO instruction of the train step (see `profile_ops`)."""
    if "/while/body/" not in op_name:
        if "while" in op_name:
            return "scan loop control"
        return "outside layers: embedding, lm_head matmuls, loss"
    if "dynamic_update_slice" in op_name or "dynamic_slice" in op_name:
        return "scan: per-layer slice in / stack out (params, grads, residuals)"
    if any(spec in op_name for spec in _EXPERT_SPECS) or op_name.endswith("closed_call/dot_general"):
        # a bare dot_general in the layer body is ragged_dot's masked-dense lowering
        return "layers: routed-expert matmuls"
    if any(spec in op_name for spec in _ATTN_SPECS):
        return "layers: attention scores/softmax/mix"
    if "dot_general" in op_name:
        return "layers: other matmuls (projections, shared expert, router)"
    return "layers: elementwise/layout/sort/gather (incl. ragged_dot masks)"


# ---------------------------------------------------------------------------------------------------- torch steps
def torch_model(config: DeepSeekV3Config, jax_model: DeepSeekV3 | None, log):
    import torch
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    hf = HFConfig(**config.to_hf_dict())
    weights = "independent random init"
    model = None
    if jax_model is not None:
        try:
            with tempfile.TemporaryDirectory() as d:
                jax_model.save_pretrained(d)
                model = DeepseekV3ForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
            weights = "loaded from the JAX model (save_pretrained)"
        except Exception as e:  # noqa: BLE001 - fall back to a random init, say so
            log(f"  torch: could not load the JAX weights ({type(e).__name__}: {e}); random init")
    if model is None:
        model = DeepseekV3ForCausalLM(hf)
    model.train()
    info = {"weights": weights, "experts_implementation": model.config._experts_implementation,
            "attn_implementation": model.config._attn_implementation, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    return model, info


# ------------------------------------------------------------------------------------------------ part 1: the step
def run_step_comparison(preset: str, batch: int, seq: int, a, log) -> dict:
    cfg = bench_config(preset)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, dtype=jnp.int32)
    contenders, infos, profiled = {}, {}, {}
    model = None
    for name in a.impls:
        impl, patch = JAX_IMPLS[name]
        t0 = time.perf_counter()
        model = make_model(cfg.with_overrides(**impl))
        init_s = time.perf_counter() - t0
        contenders[name], infos[name], profiled[name] = jax_train_step(model, ids, patch)
        infos[name]["init_s"] = init_s
        log(f"  {name}: init {init_s:.1f}s, compile {infos[name]['compile_s']:.1f}s, loss {infos[name]['loss']:.5f}")
    if not a.no_torch:
        tmodel, tinfo = torch_model(cfg, model, log)
        for threads in a.torch_threads:
            name = f"torch-{threads}t"
            contenders[name], sinfo = h.torch_train_step(tmodel, np.asarray(ids), threads)
            infos[name] = {**tinfo, **sinfo, "torch_threads": threads}
            log(f"  {name}: {tinfo['weights']}, first step {sinfo['first_step_s']:.1f}s, loss {sinfo['loss']:.5f}")
    tokens = batch * seq
    contenders.update(h.matmul_references(cfg.hidden_size, cfg.vocab_size, tokens))
    timed = h.time_step_contenders(contenders, infos, tokens, a, log)
    times = timed.pop("times")
    out = {"preset": preset, "batch": batch, "seq": seq, **timed}
    out["roofline_rounds_s"] = out.pop("reference_rounds_s")
    out["roofline"] = roofline(times, cfg, tokens, seq, out["best_torch"])
    out["model_train_flops_per_token"] = cfg.train_flops_per_token(seq)
    if a.profile:
        for name in times:
            if name.startswith("jax"):
                log(f"  profiling {name}")
                out["contenders"][name]["profile"] = h.summarize_profile(
                    h.profile_ops(profiled[name], contenders[name], steps=a.profile_steps), op_category)
    return out


# ---------------------------------------------------------------------------------------------- part 2: MoE block
def run_moe_block_comparison(preset: str, batch: int, seq: int, a, log) -> dict:
    from nnx_zoo.layers.mlp import SwiGLU
    from nnx_zoo.models.deepseek import DeepSeekMoE

    cfg = bench_config(preset)
    width = cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    x = jax.random.normal(jax.random.key(2), (batch, seq, cfg.hidden_size), jnp.float32)
    ct = jax.random.normal(jax.random.key(3), x.shape, jnp.float32)

    def compile_block(module, call, patch=contextlib.nullcontext):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)

        def fwd_bwd(params, rest, x, ct):
            def f(params, x):
                return call(nnx.merge(graphdef, params, rest), x)

            out, vjp = jax.vjp(f, params, x)
            return out, vjp(ct)

        with patch():
            compiled = jax.jit(fwd_bwd).lower(params, rest, x, ct).compile()
        return (lambda: jax.block_until_ready(compiled(params, rest, x, ct))), h.compiled_flops(compiled)

    contenders, flops = {}, {}
    for name in a.impls:
        impl, patch = JAX_IMPLS[name]
        moe = DeepSeekMoE(cfg.with_overrides(**impl), rngs=nnx.Rngs(0))
        contenders[f"{name} moe"], flops[f"{name} moe"] = compile_block(moe, lambda m, x: m(x)[0], patch)
    mlp = SwiGLU(cfg.hidden_size, width, rngs=nnx.Rngs(0))
    contenders["jax dense-mlp"], flops["jax dense-mlp"] = compile_block(mlp, lambda m, x: m(x))
    if not a.no_torch:
        contenders.update(torch_blocks(cfg, width, np.asarray(x), np.asarray(ct), a.torch_threads))
    times = h.interleaved(contenders, rounds=a.rounds, target_s=a.target_s, log=log)
    useful = 3 * 2.0 * batch * seq * 3 * cfg.hidden_size * width  # fwd+bwd of the equal-active-FLOP MLP
    out = {"preset": preset, "batch": batch, "seq": seq, "dense_mlp_width": width, "useful_flops": useful,
           "loadavg_after": os.getloadavg(), "contenders": {}}
    for name, ts in times.items():
        base = "jax dense-mlp" if name.startswith("jax") else name.split()[0] + " dense-mlp"
        out["contenders"][name] = {"median_ms": 1e3 * h.median(ts), "rounds_ms": [1e3 * t for t in ts],
                                   "xla_flops": flops.get(name), "vs_dense_mlp": h.ratio_stats(ts, times[base])}
    return out


def torch_blocks(cfg: DeepSeekV3Config, width: int, x_np, ct_np, threads_list) -> dict:
    import torch
    from transformers import DeepseekV3Config as HFConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3MoE

    torch.manual_seed(0)
    hf = HFConfig(**cfg.to_hf_dict())
    blocks = {"moe": DeepseekV3MoE(hf), "dense-mlp": DeepseekV3MLP(hf, intermediate_size=width)}
    x = torch.from_numpy(x_np).requires_grad_(True)
    ct = torch.from_numpy(ct_np)
    out = {}
    for name, block in blocks.items():
        with torch.no_grad():  # standalone modules are not initialized by a PreTrainedModel: do it here
            for p in block.parameters():
                p.normal_(0.0, cfg.initializer_range)

        for threads in threads_list:
            def call(block=block, threads=threads):
                torch.set_num_threads(threads)
                block.zero_grad(set_to_none=True)
                x.grad = None
                y = block(x)
                y.backward(ct)
                return y

            out[f"torch-{threads}t {name}"] = call
    return out


# --------------------------------------------------------------------------------------------------------- report
def render(steps: list[dict], blocks: list[dict], a) -> str:
    env = h.environment()
    parts = [f"# DeepSeek-V3 train step on {env['backend']} ({env['processor']}, {env['cpu_count']} cores)", "",
             f"jax {env['jax']} / flax {env.get('flax')}, float32, forward+backward of mean cross-entropy; "
             f"{a.rounds} interleaved rounds, medians.", ""]
    if steps:
        rows = []
        for s in steps:
            for name, c in s["contenders"].items():
                vs2 = c.get("speedup_vs_torch-2t", {}).get("median_round_ratio", "")
                vsb = c.get("speedup_vs_best_torch", {}).get("median_round_ratio", "")
                rows.append([s["preset"], f"{s['batch']}x{s['seq']}", name, c["median_s"], c["tokens_per_s"], vs2,
                             vsb, c.get("compile_s", ""), c["loss"],
                             f"{s['loadavg_before'][0]:.1f}/{s['loadavg_after'][0]:.1f}"])
        parts += ["## whole step", "",
                  "`vs torch-2t` / `vs best torch`: median over rounds of (torch time / this time) against PyTorch "
                  "with 2 threads (the brief's setting) and against the faster of the torch thread settings; "
                  "> 1 means nnx_zoo is faster. `load 1m`: the machine's 1-minute load average before/after.", "",
                  h.markdown_table(["preset", "batch", "contender", "s/step", "tokens/s", "vs torch-2t",
                                    "vs best torch", "compile s", "loss", "load 1m"], rows), ""]
    if steps:
        rows = []
        for s in steps:
            r = s["roofline"]
            best = max(r["achieved"].values(), key=lambda c: c["fraction_of_peak"]) if r["achieved"] else {}
            jax_best = max((c["fraction_of_peak"] for n, c in r["achieved"].items() if n.startswith("jax")),
                           default=float("nan"))
            t = r.get("target_2x", {})
            rows.append([s["preset"], f"{s['batch']}x{s['seq']}", r["model_gflop_per_step"], r["peak_gflops_per_s"],
                         100 * best.get("fraction_of_peak", float("nan")), 100 * jax_best,
                         t.get("tokens_per_s", ""), t.get("step_ms", ""), t.get("gflops_per_s_needed", ""),
                         100 * t["fraction_of_peak_needed"] if t else "", r["lm_head_matmuls_ms"],
                         100 * t["lm_head_matmuls_fraction_of_step"] if t else ""])
        parts += ["## roofline: what 2x PyTorch asks of this box", "",
                  "`peak`: fastest round of a 1024^3 float32 matmul timed interleaved with the steps. `GFLOP/step`: "
                  "the config's `train_flops_per_token` x tokens (what any implementation must compute). `best % "
                  "peak` / `jax % peak`: model FLOP/s of the fastest contender / the fastest nnx_zoo contender over "
                  "that peak. `2x target`: twice the faster torch setting's tokens/s, the step time and FLOP/s it "
                  "implies. `lm_head mm`: median time of only the three lm_head matmuls at the step's shapes, and "
                  "their share of the 2x step-time budget.", "",
                  h.markdown_table(["preset", "batch", "GFLOP/step", "peak GFLOP/s", "best % peak", "jax % peak",
                                    "2x target tokens/s", "2x step ms", "2x GFLOP/s", "2x % peak",
                                    "lm_head mm ms", "lm_head mm % of 2x step"], rows), ""]
    prof_rows, top_rows = [], []
    for s in steps:
        for name, c in s["contenders"].items():
            prof = c.get("profile")
            if not prof or "categories_ms" not in prof:
                continue
            tag = f"{s['preset']} {s['batch']}x{s['seq']} {name}"
            for cat, ms in prof["categories_ms"].items():
                prof_rows.append([tag, cat, ms, 100.0 * ms / prof["op_ms_per_step"]])
            for o in prof["top_ops"][:8]:
                top_rows.append([tag, o["hlo"], o["ms"], o["calls_per_step"], o["op_name"][-90:]])
    if prof_rows:
        parts += ["## where the JAX step's time goes (jax.profiler trace, per executed HLO thunk)", "",
                  h.markdown_table(["contender", "bucket", "ms/step", "%"], prof_rows), "",
                  h.markdown_table(["contender", "HLO op", "ms/step", "runs/step", "source op_name (tail)"],
                                   top_rows), ""]
    if blocks:
        rows = []
        for b in blocks:
            for name, c in b["contenders"].items():
                rows.append([b["preset"], f"{b['batch']}x{b['seq']}", name, c["median_ms"],
                             c["vs_dense_mlp"]["median_round_ratio"]])
        parts += ["## MoE block vs dense SwiGLU of equal active FLOPs (forward+backward)", "",
                  "dense width = moe_intermediate_size * (num_experts_per_tok + n_shared_experts); ratio = MoE "
                  "time / dense-MLP time of the same framework (target <= 1.5).", "",
                  h.markdown_table(["preset", "batch", "block", "ms", "vs dense MLP"], rows), ""]
    return "\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_step_args(p, ["deepseek3-tiny", "deepseek3-small"], ["deepseek3-small"], rounds=5)
    p.add_argument("--impls", nargs="+", default=list(JAX_IMPLS), choices=list(JAX_IMPLS))
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch contenders")
    p.add_argument("--warm-each-round", action="store_true",
                   help="one untimed step of each contender before its timed steps in every round (the JAX step "
                   "ran up to 1.6x slower right after torch's)")
    p.add_argument("--parts", nargs="+", default=["step", "moe"], choices=["step", "moe"])
    p.add_argument("--profile", action="store_true", help="also trace each JAX step and report where its time goes")
    a = p.parse_args(argv)
    h.fill_step_defaults(a)
    log = h.log

    steps, blocks = [], []
    for preset in a.presets:
        for batch, seq in h.batch_shapes(a.batches):
            if "step" in a.parts:
                log(f"[step] {preset} {batch}x{seq}")
                steps.append(run_step_comparison(preset, batch, seq, a, log))
            if "moe" in a.parts:
                log(f"[moe block] {preset} {batch}x{seq}")
                blocks.append(run_moe_block_comparison(preset, batch, seq, a, log))
    md = render(steps, blocks, a)
    print(md)
    if not a.no_write:
        payload = {"benchmark": "deepseek_train_step", "argv": sys.argv[1:] if argv is None else list(argv),
                   "environment": h.environment(), "rounds": a.rounds, "target_s": a.target_s,
                   "torch_threads": a.torch_threads, "steps": steps, "moe_blocks": blocks}
        jp, mp = h.write_results("deepseek_train_step", payload, md, a.out_dir)
        log(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
