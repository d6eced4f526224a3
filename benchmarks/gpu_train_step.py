"""Training speed on one GPU, side by side in one run: nnx_zoo's recipe step against transformers (eager and
``torch.compile``), the MoE ``gmm`` path against ``dense``, and the attention and grouped-matmul kernels.

One command on a bare GPU machine (the image lacks grain and tokamax; their wheels travel with the tree):

    bash benchmarks/gpu_wheels.sh        # on a machine that reaches PyPI: the wheels into .whl/
    bash benchmarks/gpu_run.sh           # on the GPU machine: install them into /tmp/site, run this file

Cases (each in its own subprocess, so one case's memory or an out-of-memory error does not touch the next):

- ``llama``: Llama-3.2-1B shapes, batch 4 x 2048, bf16 compute, f32 parameters, AdamW, clip 1.0:
  ``recipes/pretrain.py --model llama3.2-1b --model.dtype bfloat16 --remat full`` as a user runs it (its own
  ``metrics.jsonl``; the process is killed after the timed steps, which skips the end-of-run checkpoint), against
  transformers' ``LlamaForCausalLM`` from the same config (sdpa attention, bf16 autocast, f32 parameters, fused
  AdamW, clip 1.0), eager and under ``torch.compile``. Then the recipe's train step is profiled (below).
- ``moe``: the ``deepseek2-lite`` preset cut to 4 layers, batch 4 x 2048, the recipe with ``moe_impl`` ``gmm``
  (each grouped-matmul kernel: ``auto``, ``tokamax``, ``pallas_triton``, ``tiled``) and ``dense``.
- The family cases, one table (``FAMILIES``: preset, cut, batch x seq): the recipe as a user runs it (``moe_impl``
  ``auto``: ``gmm`` with the best grouped-matmul kernel) against transformers' model class on the same cut config,
  eager and under ``torch.compile``; then the profile. ``qwen3moe``: ``qwen3-moe-30b-a3b`` (128 experts, top-8,
  GQA 32/4, q/k norm) cut to 2 layers; ``gpt_oss``: ``gpt-oss-20b`` (32 biased experts, top-4, sinks, sliding /
  full) cut to 2 layers; ``gemma3``: the whole ``gemma3-1b`` (5:1 sliding / global); ``qwen3_5``:
  ``qwen3.5-35b-a3b``'s first 4 layers (3 gated DeltaNet, 1 gated attention) with 128 of its 256 experts; all at
  batch 4 x 2048; ``kimi_linear``: ``kimi-linear-48b-a3b``'s first 4 layers (3 KDA, the first dense; 1 MLA
  without rope) with 64 of its 256 experts, batch 4 x 2048. The profile (``llama`` and the family cases): the
  recipe's ``train_step`` traced under ``jax.profiler``, device time per step by part of the model, by the source
  line each kernel's HLO op came from, and by kernel. ``--smoke`` runs ``torch.compile`` with the ``eager``
  backend (dynamo's capture without inductor's CPU code generation, which took minutes).
- ``attention``: forward + backward of one attention call (GQA 32/8 heads, head dim 64, causal; and MLA 16 heads,
  192/128) for each ``attention_impl`` against ``cudnn`` at b4 s2048 and b1 s8192; the packed-document case
  (``segment_ids``, which cuDNN's public API cannot take) with the path ``auto`` falls back to.
- ``gmm``: forward + backward of one grouped matmul at the MoE layer's shape (4 x 2048 tokens x top-6 rows,
  64 experts, 2048 -> 1408) for each grouped-matmul kernel.
- ``v4`` (a family case without transformers): DeepSeek-V4's training step: the ``deepseek4-flash`` preset (its
  attention, 4 hyper-connection streams, MTP layer) cut to its first 4 layers (two sliding-window layers, one CSA,
  one HCA; three hash-routed) and 8 of its 256 experts, batch 1 x 4096 (the memory plan: ~60 GiB per device under
  remat full), the recipe as a user runs it (``attention_impl`` ``auto``), then the profile.

Every tokens/s figure uses one FLOP formula: the nnx_zoo config's ``train_flops_per_token(seq_len)`` (6 x active
matmul parameters + causal attention), and MFU divides by the data-sheet dense bf16 peak (989 TFLOP/s on H100).
Medians are taken over the steps after ``--skip`` warm-up steps. Peak memory: the recipe's ``peak_memory_gib``
(XLA's ``peak_bytes_in_use``), torch's ``max_memory_allocated``.

    python benchmarks/gpu_train_step.py                       # everything (GPU)
    python benchmarks/gpu_train_step.py --cases attention gmm # some cases
    python benchmarks/gpu_train_step.py --smoke               # tiny shapes on CPU: checks the script itself

Writes ``gpu_train_step.{json,md}`` to ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GMM_KERNELS = ("auto", "tokamax", "pallas_triton", "tiled")
ATTENTION_IMPLS = ("cudnn", "tokamax", "blockwise", "xla")


class FamilyRun(NamedTuple):
    """One family case's run: a preset, the config fields that cut it to fit one device, batch x seq."""

    preset: str
    cut: dict[str, int]
    batch: int
    seq: int


class Family(NamedTuple):
    """A family case: the recipe as a user runs it at ``full`` (``smoke`` on the CPU), against transformers eager
    and ``torch.compile`` on the same cut config when ``torch``, then the profile. ``moe``: a failed recipe run is
    retried with the ``pallas_triton`` grouped-matmul kernel (the run a user falls back to when tokamax fails).
    ``slice_fusion``: the recipe runs again with ``SLICE_FUSION_FLAG`` (a GPU only flag, so not under ``--smoke``),
    to measure whether the grouped-matmul custom call then reads each layer's slice of the stacked expert weights in
    place instead of from a copy (issue 37; benchmarks README section 15)."""

    full: FamilyRun
    smoke: FamilyRun
    moe: bool
    torch: bool = True
    slice_fusion: bool = False


# XLA:GPU runs GEMMs and custom calls on a dynamic slice in place with it (off by default in jax 0.11).
SLICE_FUSION_FLAG = "--xla_gpu_enable_dynamic_slice_fusion=true"


# Every cut plans under remat full below an H100's 78 GiB (tests/test_device_scripts.py checks it).
FAMILIES = {
    # 128 experts, top-8, GQA 32/4, q/k norm; 2 of 48 layers: ~1.8B parameters
    "qwen3moe": Family(FamilyRun("qwen3-moe-30b-a3b", {"num_hidden_layers": 2}, 4, 2048),
                       FamilyRun("qwen3-moe-tiny", {"num_hidden_layers": 2}, 2, 64), moe=True, slice_fusion=True),
    # 32 experts (biased, clamped SwiGLU), top-4, sinks, a 128-token sliding layer then a full one; 2 of 24 layers
    "gpt_oss": Family(FamilyRun("gpt-oss-20b", {"num_hidden_layers": 2}, 4, 2048),
                      FamilyRun("gpt-oss-tiny", {}, 2, 64), moe=True),
    # the whole 1B model: 26 layers, 5 sliding (512 tokens) : 1 global, 262k vocabulary (~18 GiB planned)
    "gemma3": Family(FamilyRun("gemma3-1b", {}, 4, 2048), FamilyRun("gemma3-tiny", {}, 2, 64), moe=False),
    # Qwen3.5-35B-A3B's first 4 layers (3 gated-DeltaNet, 1 gated full attention) with 128 of its 256 experts
    # (all 256 plan at ~71 GiB before transformers' own activations), top-8 and a shared expert; its MTP layer off
    # (transformers has none: the same work on both sides)
    "qwen3_5": Family(FamilyRun("qwen3.5-35b-a3b", {"num_hidden_layers": 4, "num_experts": 128,
                                                    "mtp_num_hidden_layers": 0}, 4, 2048),
                      FamilyRun("qwen3.5-moe-tiny", {}, 2, 64), moe=True),
    # Kimi-Linear-48B-A3B's first 4 layers (3 KDA, the first dense; 1 MLA without rope) with 64 of its 256 experts
    # (2.3B parameters, ~41 GiB planned), top-8 by sigmoid + selection bias and a shared expert
    "kimi_linear": Family(FamilyRun("kimi-linear-48b-a3b", {"num_hidden_layers": 4, "num_experts": 64}, 4, 2048),
                          FamilyRun("kimi-linear-tiny", {}, 2, 64), moe=True),
    # DeepSeek-V4 (no transformers model): its first 4 layers (two sliding-window, one CSA, one HCA; three
    # hash-routed) and 8 of its 256 experts, 1 x 4096 (~60 GiB planned); deepseek4-tiny is already 4 layers of
    # every type, a hash layer and MTP, of 8 experts
    "v4": Family(FamilyRun("deepseek4-flash", {"num_hidden_layers": 4, "n_routed_experts": 8}, 1, 4096),
                 FamilyRun("deepseek4-tiny", {}, 2, 64), moe=True, torch=False),
}
CASES = ("llama", "moe", *FAMILIES, "attention", "gmm")


class Shapes:
    """The shapes of a run: full size on a GPU, tiny for ``--smoke`` on a CPU."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.llama = ("llama3-tiny", 2, 64) if smoke else ("llama3.2-1b", 4, 2048)  # preset, batch, seq
        self.moe = ("deepseek3-tiny", 2, 64) if smoke else ("deepseek2-lite", 4, 2048)
        self.moe_layers = 2 if smoke else 4
        # (batch, seq, heads, kv_heads, qk_dim, v_dim)
        self.attention = ([(1, 128, 4, 2, 32, 32), (1, 256, 4, 2, 48, 32)] if smoke else
                          [(4, 2048, 32, 8, 64, 64), (1, 8192, 32, 8, 64, 64), (4, 2048, 16, 16, 192, 128),
                           (1, 8192, 16, 16, 192, 128)])
        self.gmm = (512, 8, 64, 32) if smoke else (4 * 2048 * 6, 64, 2048, 1408)  # rows, groups, k, n
        self.families = {name: f.smoke if smoke else f.full for name, f in FAMILIES.items()}
        self.steps, self.skip = (4, 1) if smoke else (12, 4)
        # torch.compile's backend. The smoke traces the model with dynamo (what breaks when transformers or torch
        # change) but skips inductor's C++ code generation, which on the CPU took over 5 minutes for the tiny
        # Qwen3.5-MoE (the first step, fwd + bwd) and checks nothing about this script.
        self.compile_backend = "eager" if smoke else "inductor"
        self.profile_steps = 2 if smoke else 3


# ------------------------------------------------------------------------------------- the recipe, as a user runs it
def run_recipe(name: str, argv: list[str], steps: int, skip: int, timeout_s: float, xla_flags: str = "") -> dict:
    """``recipes/pretrain.py argv`` in a subprocess until ``steps`` steps are logged, then killed (no end-of-run
    checkpoint of a multi-GB optimizer state), with ``xla_flags`` added to ``XLA_FLAGS``. Returns the medians of
    its own per-step metrics."""
    env = _env()
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, str(ROOT / "recipes" / "pretrain.py"), *argv, "--steps", "100000", "--run-dir",
               run_dir, "--no-progress", "--checkpoint-every", "0", "--checkpoint-minutes", "0"]
        log_path = Path(run_dir) / "log.txt"
        start = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            records: list[dict] = []
            metrics = Path(run_dir) / "metrics.jsonl"
            while proc.poll() is None and time.perf_counter() - start < timeout_s:
                time.sleep(1.0)
                if metrics.exists():
                    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                if len(records) >= steps:
                    break
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text = log_path.read_text()
    kernels = next((line.split("kernels:", 1)[1].strip() for line in text.splitlines() if "kernels:" in line), "")
    compile_s = next((line.split(" in ")[-1] for line in text.splitlines() if "compiled and ran step" in line), "")
    if len(records) <= skip:
        return {"name": name, "error": _tail(text), "kernels": kernels}
    timed = records[skip:]
    return {"name": name, "tokens_per_s": _median(r["tokens_per_s"] for r in timed),
            "mfu": _median(r["mfu"] for r in timed) if timed[0].get("mfu") is not None else None,
            "peak_memory_gib": max((r.get("peak_memory_gib") or 0.0) for r in records) or None,
            "kernels": kernels, "compile": compile_s, "steps_timed": len(timed), "loss_last": timed[-1]["loss"]}


def recipe_args(preset: str, batch: int, seq: int, *more: str) -> list[str]:
    return ["--model", preset, "--batch", str(batch), "--seq-len", str(seq), "--model.dtype", "bfloat16",
            "--remat", "full", *more]


# --------------------------------------------------------------------------------------------- transformers
def torch_worker(preset: str, batch: int, seq: int, steps: int, skip: int, compile_model: bool,
                 overrides: str = "{}", compile_backend: str = "inductor") -> dict:
    """transformers' model from the nnx_zoo preset's own HF config (with ``overrides``, a JSON object of config
    fields), one training step per iteration; sdpa attention, or eager attention where transformers has no sdpa
    path for the model; ``compile_model``: under ``torch.compile(backend=compile_backend)``."""
    import torch
    import transformers

    from nnx_zoo import AutoConfig

    config = AutoConfig.preset(preset, **json.loads(overrides))
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    attn = "sdpa"
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=torch.float32)
    except ValueError:  # a model transformers has no sdpa path for (GPT-OSS's sinks): its eager attention
        attn = "eager"
        model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=torch.float32)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda)
    forward = torch.compile(model, backend=compile_backend) if compile_model else model
    ids = torch.randint(0, 256, (batch, seq), device=device)

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()  # float(loss) waits for the step
        times.append(time.perf_counter() - start)
    tokens_per_s = batch * seq / statistics.median(times[skip:])
    peak = _peak_flops(torch.cuda.get_device_name() if cuda else "")
    flops = config.train_flops_per_token(seq)
    return {"tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops / peak if peak else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "kernels": f"{attn} attention" + (", eager" if not compile_model else ", torch.compile" + (
                "" if compile_backend == "inductor" else f" (backend {compile_backend})"))}


# --------------------------------------------------------------------------------------------- kernels alone
def attention_worker(shape: tuple[int, ...], variants: list[tuple[str, bool]], rounds: int) -> list[dict]:
    """Seconds per forward + backward of one causal attention call for each ``(attention_impl, segments)`` variant,
    in one process (each variant compiles its own program; one that fails records its error)."""
    import jax
    import jax.numpy as jnp

    from nnx_zoo.layers.attention import attention, causal_mask, choose_attention_impl

    batch, seq, heads, kv_heads, qk_dim, v_dim = shape
    keys = jax.random.split(jax.random.key(0), 4)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    q = jax.random.normal(keys[0], (batch, seq, heads, qk_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, qk_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, v_dim), dtype)
    results = []
    for impl, segments in variants:
        segment_ids = (jnp.arange(seq)[None] * 4 // seq).repeat(batch, 0) if segments else None  # 4 documents a row
        mask = causal_mask(seq, None, segment_ids)
        row = {"shape": list(shape), "impl": impl, "segments": segments}
        try:
            row["ran"] = choose_attention_impl(impl, q_len=seq, k_len=seq, segments=segments, qk_dim=qk_dim,
                                               v_dim=v_dim)

            def loss(q, k, v, mask=mask, impl=impl):
                return jnp.sum(attention(q, k, v, mask, qk_dim**-0.5, impl).astype(jnp.float32))

            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            row["seconds"] = _time_jax(lambda step=step: step(q, k, v), rounds)
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run here is a result, not a crash
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        results.append(row)
    return results


def gmm_worker(shape: tuple[int, ...], impls: list[str], rounds: int) -> list[dict]:
    """Seconds per forward + backward of one grouped matmul (near-balanced random groups) for each
    ``grouped_matmul_impl``, in one process, in the given order (``pallas_triton`` sets a process-wide flag that
    changes how ``ragged_dot`` lowers: keep it last)."""
    import jax
    import jax.numpy as jnp

    from nnx_zoo.layers.grouped_matmul import choose_grouped_matmul_impl, grouped_matmul

    rows, groups, k, n = shape
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (rows, k), dtype)
    rhs = jax.random.normal(keys[1], (groups, k, n), dtype) * k**-0.5
    choice = jax.random.randint(keys[2], (rows,), 0, groups)
    group_sizes = jnp.bincount(choice, length=groups).astype(jnp.int32)
    flops = 3 * 2 * rows * k * n  # forward + the two backward GEMMs
    results = []
    for impl in impls:
        row = {"shape": list(shape), "impl": impl}
        try:
            row["ran"] = choose_grouped_matmul_impl(impl)

            def loss(lhs, rhs, impl=impl):
                return jnp.sum(grouped_matmul(lhs, rhs, group_sizes, impl=impl).astype(jnp.float32))

            step = jax.jit(jax.grad(loss, argnums=(0, 1)))
            row["seconds"] = _time_jax(lambda step=step: step(lhs, rhs), rounds)
            row["tflops"] = flops / row["seconds"] / 1e12
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run here is a result, not a crash
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        results.append(row)
    return results


# --------------------------------------------------------------------------------------------- where the time goes
def profile_worker(preset: str, batch: int, seq: int, overrides: str, steps: int) -> dict:
    """The recipe's train step (``train_step``: AdamW, clip 1.0, bf16 compute, remat full) traced under
    ``jax.profiler``: device time per step summed by the source line each executed kernel's HLO op came from, and
    by a coarse part of the model. XLA's command buffers (CUDA graphs) are off for this process so that every
    kernel is traced on its own."""
    import jax
    from _harness import CONTROL_FLOW, hlo_op_sources, trace_events
    from flax import nnx

    from nnx_zoo import AutoConfig, AutoModelForCausalLM
    from nnx_zoo.train.optim import OptimizerConfig, make_optimizer
    from nnx_zoo.train.step import train_step

    config = AutoConfig.preset(preset, **{"dtype": "bfloat16", "remat_policy": "full", **json.loads(overrides)})
    model = AutoModelForCausalLM.create(config, seed=0)
    optimizer = make_optimizer(OptimizerConfig(), model, total_steps=1000)
    ids = jax.random.randint(jax.random.key(0), (batch, seq), 0, config.vocab_size)
    data = {"input_ids": ids, "targets": jax.numpy.roll(ids, -1, axis=1),
            "loss_mask": jax.numpy.ones(ids.shape, jax.numpy.float32).at[:, -1].set(0.0)}
    graphdef, state = nnx.split((model, optimizer))
    del model, optimizer

    def step(state, data):
        m, o = nnx.merge(graphdef, state)
        metrics = train_step(m, o, data)
        return nnx.state((m, o)), metrics["loss"]

    compiled = jax.jit(step, donate_argnums=0).lower(state, data).compile()
    where = hlo_op_sources(compiled.as_text())  # HLO instruction -> (op_name, file:line)
    live = [state]

    def call():
        live[0], loss = compiled(live[0], data)
        return jax.block_until_ready(loss)

    events, wall = trace_events(call, steps)
    if events is None:
        return {"error": "no perfetto trace written"}
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", ""))}
    by_line: dict[str, float] = {}
    by_part: dict[str, float] = {}
    kernels: dict[str, float] = {}
    total = 0.0
    for e in events:
        if e.get("ph") != "X" or (gpu_pids and e.get("pid") not in gpu_pids):
            continue
        op = str(e.get("args", {}).get("hlo_op", e.get("name", "")))
        if op not in where and not gpu_pids:
            continue  # (CPU smoke run: only events named after an HLO instruction are ops)
        if op.split(".")[0] in CONTROL_FLOW:
            continue
        ms = e.get("dur", 0.0) / 1e3 / steps
        total += ms
        op_name, line = where.get(op, ("", "?"))
        part, kernel = _part(line, op_name), str(e.get("name", ""))[:80]
        by_line[line] = by_line.get(line, 0.0) + ms
        by_part[part] = by_part.get(part, 0.0) + ms
        kernels[kernel] = kernels.get(kernel, 0.0) + ms

    def top(d: dict, n: int) -> dict:
        return {k: round(v, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]}

    return {"wall_ms_per_step": 1e3 * wall, "kernel_ms_per_step": total, "traced_gpu": bool(gpu_pids),
            "parts_ms": top(by_part, 20), "lines_ms": top(by_line, 30), "kernels_ms": top(kernels, 20)}


def _part(line: str, op_name: str) -> str:
    """A coarse part of the train step for one kernel, from its source file."""
    file = line.split(":")[0]
    parts = {"grouped_matmul.py": "experts: grouped matmuls", "moe.py": "experts: sort, gather, matmuls, combine",
             "sparse_moe.py": "experts: router", "routers.py": "experts: router", "attention.py": "attention",
             "embed.py": "embedding + lm_head matmuls", "loss.py": "lm_head chunks + cross-entropy",
             "norm.py": "norms", "scan.py": "layer scan (slices, stacking)", "rope.py": "rope",
             "step.py": "step: gradient sums, clip, AdamW", "optim.py": "step: gradient sums, clip, AdamW",
             "causal_lm.py": "lm_head matmuls (in the loss's chunks)", "mlp.py": "dense MLP",
             "blockwise_attention.py": "attention", "hyper_connection.py": "hyper-connections",
             "compressor.py": "V4 attention: compressed entries, indexer", "kernel.py": "V4 attention: kernel",
             "dsa.py": "sparse attention: indexer top-k, gather"}
    if file in parts:
        return parts[file]
    if "optax" in op_name or file.startswith(("transform", "clipping", "alias", "update", "numerics")):
        return "step: gradient sums, clip, AdamW"
    return f"other ({file})"


# --------------------------------------------------------------------------------------------- the cases
def llama_case(s: Shapes, timeout_s: float) -> list[dict]:
    preset, batch, seq = s.llama
    rows = [run_recipe("nnx_zoo recipe", recipe_args(preset, batch, seq), s.steps, s.skip, timeout_s)]
    for compiled in (False, True):
        name = "transformers + torch.compile" if compiled else "transformers eager"
        rows.append({"name": name, **_worker(["torch", preset, batch, seq, s.steps, s.skip, int(compiled)],
                                             timeout_s)})
    rows.append({"name": "nnx_zoo step, profiled", **_worker(["profile", preset, batch, seq, "{}", s.profile_steps],
                                                               timeout_s)})
    return rows


def moe_case(s: Shapes, timeout_s: float) -> list[dict]:
    preset, batch, seq = s.moe
    cut = ["--model.num_hidden_layers", str(s.moe_layers), "--model.first_k_dense_replace", "1",
           "--model.num_nextn_predict_layers", "0"]
    rows = [run_recipe("dense", recipe_args(preset, batch, seq, *cut, "--moe-impl", "dense"), s.steps, s.skip,
                       timeout_s)]
    for kernel in GMM_KERNELS:
        argv = recipe_args(preset, batch, seq, *cut, "--moe-impl", "gmm", "--model.grouped_matmul_impl", kernel)
        rows.append(run_recipe(f"gmm ({kernel})", argv, s.steps, s.skip, timeout_s))
    return rows


def family_recipe_args(run: FamilyRun) -> list[str]:
    """The recipe's command line of a family case (``recipe_args`` with its cut of the preset)."""
    return recipe_args(run.preset, run.batch, run.seq,
                       *(w for k, v in run.cut.items() for w in (f"--model.{k}", str(v))))


def family_case(name: str, s: Shapes, timeout_s: float) -> list[dict]:
    run, family = s.families[name], FAMILIES[name]
    argv, cut = family_recipe_args(run), json.dumps(run.cut)
    rows = [run_recipe("nnx_zoo recipe", argv, s.steps, s.skip, timeout_s)]
    if family.moe and "error" in rows[0]:  # auto's kernel (tokamax when it imports) failed: the run a user falls
        rows.append(run_recipe("nnx_zoo recipe (gmm pallas_triton)",  # back to
                               [*argv, "--model.grouped_matmul_impl", "pallas_triton"], s.steps, s.skip, timeout_s))
    if family.slice_fusion and not _SMOKE[0]:
        rows.append(run_recipe("nnx_zoo recipe, dynamic-slice fusion", argv, s.steps, s.skip, timeout_s,
                               xla_flags=SLICE_FUSION_FLAG))
    for compiled in (False, True) if family.torch else ():
        label = "transformers + torch.compile" if compiled else "transformers eager"
        rows.append({"name": label, **_worker(["torch", run.preset, run.batch, run.seq, s.steps, s.skip,
                                               int(compiled), cut], timeout_s)})
    rows.append({"name": "nnx_zoo step, profiled", **_worker(["profile", run.preset, run.batch, run.seq, cut,
                                                               s.profile_steps], timeout_s)})
    return rows


def attention_case(s: Shapes, timeout_s: float) -> list[dict]:
    rows = []
    variants = [(impl, False) for impl in ATTENTION_IMPLS + ("auto",)] + [("auto", True)]
    for shape in s.attention:
        result = _worker(["attention", json.dumps(shape), json.dumps(variants)], timeout_s)
        rows += result if isinstance(result, list) else [{"shape": list(shape), "impl": "all", "segments": False,
                                                           **result}]
    return rows


def gmm_case(s: Shapes, timeout_s: float) -> list[dict]:
    impls = ["xla", "tiled", "tokamax", "auto", "pallas_triton"]
    result = _worker(["gmm", json.dumps(s.gmm), json.dumps(impls)], timeout_s)
    return result if isinstance(result, list) else [{"shape": list(s.gmm), "impl": "all", **result}]


# --------------------------------------------------------------------------------------------- plumbing
def _worker(args: list[object], timeout_s: float) -> dict | list[dict]:
    """This file's ``--worker`` mode in a fresh process; its last stdout line is a JSON result."""
    cmd = [sys.executable, __file__, "--worker", *map(str, args)]
    if _SMOKE[0]:
        cmd.append("--smoke")
    env = _env()
    if args[0] == "profile":  # every kernel traced on its own, not inside a CUDA graph
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_enable_command_buffer=".strip()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": _tail(done.stderr or done.stdout)}
    return json.loads(lines[-1])


def run_worker(argv: list[str], smoke: bool) -> None:
    s = Shapes(smoke)
    kind, rest = argv[0], argv[1:]
    if kind == "torch":
        result = torch_worker(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]), bool(int(rest[5])),
                              *rest[6:], compile_backend=s.compile_backend)
    elif kind == "profile":
        result = profile_worker(rest[0], int(rest[1]), int(rest[2]), rest[3], int(rest[4]))
    elif kind == "attention":
        variants = [(impl, bool(segments)) for impl, segments in json.loads(rest[1])]
        result = attention_worker(tuple(json.loads(rest[0])), variants, 3 if smoke else 10)
    elif kind == "gmm":
        result = gmm_worker(tuple(json.loads(rest[0])), json.loads(rest[1]), 3 if smoke else 10)
    else:
        raise SystemExit(f"unknown worker {kind!r}")
    del s
    print(json.dumps(result))


def _time_jax(fn, rounds: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _peak_flops(device_name: str) -> float | None:
    from nnx_zoo.train.metrics import PEAK_FLOPS_PER_DEVICE

    return next((f for name, f in PEAK_FLOPS_PER_DEVICE.items() if device_name.startswith(name)), None)


def _median(values) -> float:
    return float(statistics.median(list(values)))


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


_SMOKE = [False]
RECIPE_CASES = ("llama", "moe", *FAMILIES)  # the cases that run the recipe (a tokens/s table)


def markdown(results: dict) -> str:
    from _harness import markdown_table

    out = [f"# GPU train step ({results['device']})", ""]
    if any(case in results for case in RECIPE_CASES):
        rows = []
        for case in RECIPE_CASES:
            for r in results.get(case, []):
                rows.append([case, r["name"], _fmt(r.get("tokens_per_s"), "{:,.0f}"), _fmt(r.get("mfu"), "{:.1%}"),
                             _fmt(r.get("peak_memory_gib"), "{:.1f}"), r.get("kernels", ""), r.get("error", "")])
        out += [markdown_table(["case", "run", "tokens/s", "MFU", "peak GiB", "kernels", "error"], rows), ""]
        for case in RECIPE_CASES:
            for r in results.get(case, []):
                if "parts_ms" in r:
                    out += [f"## {case}: where the step's time goes (device ms per step; wall "
                            f"{r['wall_ms_per_step']:.1f} ms, traced kernels {r['kernel_ms_per_step']:.1f} ms)", ""]
                    for key, title in (("parts_ms", "part"), ("lines_ms", "source line"), ("kernels_ms", "kernel")):
                        out += [markdown_table([title, "ms"], [[k, f"{v:.2f}"] for k, v in r[key].items()]), ""]
    if "attention" in results:
        rows = [[r["shape"], r["impl"] + (" + segments" if r["segments"] else ""), r.get("ran", ""),
                 _fmt(r.get("seconds"), "{:.3f}", 1e3), r.get("error", "")] for r in results["attention"]]
        out += [markdown_table(["b, s, heads, kv heads, d_qk, d_v", "attention_impl", "ran", "fwd+bwd ms", "error"],
                               rows), ""]
    if "gmm" in results:
        rows = [[r["shape"], r["impl"], r.get("ran", ""), _fmt(r.get("seconds"), "{:.3f}", 1e3),
                 _fmt(r.get("tflops"), "{:.0f}"), r.get("error", "")] for r in results["gmm"]]
        out += [markdown_table(["rows, groups, k, n", "grouped_matmul_impl", "ran", "fwd+bwd ms", "TFLOP/s",
                                "error"], rows), ""]
    return "\n".join(out)


def _fmt(value, pattern: str, scale: float = 1.0) -> str:
    return "" if value is None else pattern.format(value * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per subprocess")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        smoke = "--smoke" in args.worker
        run_worker([a for a in args.worker if a != "--smoke"], smoke or args.smoke)
        return
    _SMOKE[0] = args.smoke
    import jax
    from _harness import environment, write_results

    shapes = Shapes(args.smoke)
    results: dict = {"device": str(jax.devices()[0].device_kind), "environment": environment(),
                     "steps": shapes.steps, "skip": shapes.skip}
    runners = {"llama": llama_case, "moe": moe_case, "attention": attention_case, "gmm": gmm_case,
               **{name: functools.partial(family_case, name) for name in FAMILIES}}
    for case in args.cases:
        print(f"== {case}", flush=True)
        results[case] = runners[case](shapes, args.timeout)
        for row in results[case]:
            print("  " + json.dumps(row), flush=True)
        # after every case: a device call cut off at its time limit still brings back the cases that finished
        text = markdown(results)
        write_results("gpu_train_step" + ("_smoke" if args.smoke else ""), results, text, out_dir=args.out)
    print(text)


if __name__ == "__main__":
    main()
