"""Shared timing harness for the benchmark scripts (not a public module).

Method (the machine is small, shared and noisy): every contender of one comparison is compiled and warmed up
first, then timed side by side in the same process, interleaved over several rounds with the order rotated each
round. A round times `iters` back-to-back calls of one contender and records the mean seconds per call. We report
the median over rounds, and ratios both as the ratio of medians and as the median of the per-round ratios (the
latter cancels slow drifts of machine load that hit both contenders of a round alike).
"""

from __future__ import annotations

import collections
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# The sharding layouts the Auto-vs-Explicit and compiled-program benchmarks cover:
# name -> (mesh sizes, rule set, moe_impl). EP rows use the expert-parallel MoE path.
SHARDING_LAYOUTS: dict[str, tuple[dict[str, int], str, str]] = {
    "FSDP 8": ({"fsdp": 8}, "default", "dense"),
    "FSDP 4 + TP 2": ({"fsdp": 4, "tensor": 2}, "default", "dense"),
    "FSDP 4 + TP-transpose 2": ({"fsdp": 4, "tensor_transpose": 2}, "default", "dense"),
    "FSDP 4 + EP 2": ({"fsdp": 4, "expert": 2}, "default", "ep"),
    "FSDP 4 + EP-as-CP 2 (ep-as-cp)": ({"fsdp": 4, "expert": 2}, "ep-as-cp", "ep"),
    "FSDP 4 + EP 2 (shard-exp-on-fsdp)": ({"fsdp": 4, "expert": 2}, "shard-exp-on-fsdp", "ep"),
}


def calibrate_iters(fn: Callable[[], object], target_s: float, max_iters: int = 200) -> tuple[int, float]:
    """Calls `fn` once (already warm) and returns (iters so that one round takes about target_s, seconds/call)."""
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return max(1, min(max_iters, math.ceil(target_s / max(dt, 1e-9)))), dt


def interleaved(
    contenders: dict[str, Callable[[], object]],
    *,
    rounds: int,
    target_s: float = 0.3,
    warmup: int = 1,
    warm_each_round: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Times blocking zero-argument callables side by side; returns seconds per call, one entry per round.

    ``warm_each_round`` runs each contender once, untimed, right before its timed calls in every round, so that
    no contender pays for the state the previous one left behind (caches, freed pages, idle thread pools)."""
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    iters = {}
    for name in names:
        iters[name], _ = calibrate_iters(contenders[name], target_s)
    times: dict[str, list[float]] = {n: [] for n in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                fn, n = contenders[name], iters[name]
                if warm_each_round:
                    fn()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times[name].append((time.perf_counter() - t0) / n)
            if log:
                log(f"  round {r + 1}/{rounds}: " + ", ".join(f"{k}={1e3 * v[-1]:.2f}ms" for k, v in times.items()))
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """num/den as ratio of medians and as median of per-round ratios (rounds are paired)."""
    per_round = [a / b for a, b in zip(num, den, strict=True)]
    return {"ratio_of_medians": median(num) / median(den), "median_round_ratio": median(per_round),
            "min_round_ratio": min(per_round), "max_round_ratio": max(per_round)}


def environment() -> dict[str, object]:
    import jax

    env: dict[str, object] = {
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
    }
    try:
        import flax

        env["flax"] = flax.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        env["git_commit"] = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # pragma: no cover
        pass
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            if v == 0 or 0.01 <= abs(v) < 1e5:
                return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(stem: str, payload: dict, markdown: str, out_dir: Path | None = None) -> tuple[Path, Path]:
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    tmp = jpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    tmp.replace(jpath)
    tmp = mpath.with_suffix(".md.tmp")
    tmp.write_text(markdown.rstrip() + "\n")
    tmp.replace(mpath)
    return jpath, mpath


def grad_step_temp(model_cls: type, config: object, seq: int) -> dict:
    """AOT, nothing allocated: ``{"temp_bytes", "compile_s"}`` of one next-token-loss gradient step of
    ``model_cls(config)`` on 1 x ``seq`` tokens (XLA's temporaries, and the seconds the compile took)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    ids = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)

    def loss(params, rest, ids):
        logits = nnx.merge(graphdef, params, rest)(ids[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, rest, ids).compile()
    return {"temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes), "compile_s": time.perf_counter() - t0}


def compiled_flops(compiled) -> float | None:
    """XLA's flop count for a compiled executable (None when the backend does not report it)."""
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - cost analysis is best-effort
        return None
    if isinstance(ca, list | tuple):
        ca = ca[0] if ca else None
    if not ca:
        return None
    f = ca.get("flops")
    return float(f) if f is not None else None


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its source `op_name` metadata, from `compiled.as_text()`."""
    import re

    pattern = re.compile(r'\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"')
    out = {}
    for line in hlo_text.splitlines():
        m = pattern.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


_SECTION_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')
_INSTR = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ')
_META = re.compile(r'%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"(?:[^}]*?stack_frame_id=(\d+))?')
_CALLS = re.compile(r'calls=%([\w.\-]+)')
_COMPUTATION = re.compile(r'^%?([\w.\-]+) .*\{$')


def stack_frames(hlo: str) -> dict[int, tuple[str, str, int, int]]:
    """A compiled HLO text's stack-frame tables: frame id -> (file path, function, line, parent frame id; 0: none)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        m = _SECTION_ROW.match(line) if current is not None else None
        if m:
            current[int(m.group(1))] = m.group(2) if m.group(2) is not None else m.group(3)
        elif current is not None and line.strip():
            current = None

    def fields(text: str) -> dict[str, int]:
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}

    frames = {}
    for fid, text in tables.get("StackFrames", {}).items():
        f = fields(text)
        loc = fields(tables["FileLocations"][f["file_location_id"]])
        frames[fid] = (tables["FileNames"][loc["file_name_id"]], tables["FunctionNames"][loc["function_name_id"]],
                       loc["line"], f.get("parent_frame_id", 1) - 1)  # printed one above the id (0 = no parent)
    return frames


def innermost_frame(frames: dict, frame: int | None, wanted: Callable[[str], bool]) -> tuple[str, str, int] | None:
    """(file path, function, line) of the innermost frame of ``frame``'s stack whose file ``wanted`` accepts (where
    the code of interest asked for an op), else of its innermost frame; None for an op without a stack."""
    seen, first = set(), None
    while frame and frame in frames and frame not in seen:
        seen.add(frame)
        file, function, line, parent = frames[frame]
        first = first or (file, function, line)
        if wanted(file):
            return file, function, line
        frame = parent
    return first


def hlo_instructions(hlo: str) -> dict[str, dict]:
    """Every HLO instruction: its shape, op_name, stack frame and the computation it calls (a fusion's body).
    Instructions without metadata (some fusions) take their body's: its root's, else its first with metadata."""
    instrs, bodies, current = {}, collections.defaultdict(list), None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        meta = _META.search(line)
        calls = _CALLS.search(line)
        info = {"shape": m.group(2), "op_name": meta.group(2) if meta else None,
                "frame": int(meta.group(3)) if meta and meta.group(3) else None,
                "calls": calls.group(1) if calls else None, "root": line.lstrip().startswith("ROOT")}
        instrs[m.group(1)] = info
        if current:
            bodies[current].append(info)
    for info in instrs.values():
        if info["op_name"] is None and info["calls"] in bodies:
            body = sorted(bodies[info["calls"]], key=lambda i: not i["root"])
            donor = next((i for i in body if i["op_name"]), None)
            if donor:
                info["op_name"], info["frame"] = donor["op_name"], donor["frame"]
    return instrs


def hlo_op_sources(hlo_text: str, prefer: str = "nnx_zoo", plumbing: tuple[str, ...] = ("spec.py", "linear.py")
                   ) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (its source ``op_name``, ``file:line``) for every instruction with metadata (its own
    or its fusion body's, `hlo_instructions`). The line is the innermost frame whose file path contains ``prefer``
    and whose file is not ``plumbing`` (the einsum and linear helpers every layer calls): where the model's code
    asked for the op; else the innermost frame; "?" when there is none."""
    frames = stack_frames(hlo_text)

    def wanted(path: str) -> bool:
        return prefer in path and Path(path).name not in plumbing

    out = {}
    for name, info in hlo_instructions(hlo_text).items():
        if info["op_name"] is None:
            continue
        found = innermost_frame(frames, info["frame"], wanted)
        out[name] = (info["op_name"], f"{Path(found[0]).name}:{found[2]}" if found else "?")
    return out


CONTROL_FLOW = ("while", "call", "conditional")  # ops whose trace events span the ops they run


def trace_events(call: Callable[[], object], steps: int) -> tuple[list | None, float]:
    """``(perfetto trace events, wall seconds per step)`` of ``steps`` calls of ``call`` under ``jax.profiler``
    (after one untraced warm-up call); events None when no trace was written."""
    import glob
    import gzip
    import json
    import tempfile

    import jax

    call()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(steps):
                call()
            wall = (time.perf_counter() - t0) / steps
        files = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        if not files:
            return None, wall
        events = json.load(gzip.open(files[0]))
    return (events["traceEvents"] if isinstance(events, dict) else events), wall


def profile_ops(compiled, call: Callable[[], object], steps: int = 3) -> dict:
    """Per-HLO-instruction wall time of `call` (which runs `compiled`) from a jax.profiler trace.

    XLA:CPU records one trace event per executed thunk, named after its HLO instruction; instructions inside a
    scanned layer body are summed over iterations. Control-flow thunks (while/call) are skipped so nothing is
    counted twice. Returns ms per step for every instruction with its source op_name, largest first.
    """
    meta = hlo_op_names(compiled.as_text())
    events, wall = trace_events(call, steps)
    if events is None:
        return {"error": "no perfetto trace written"}
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in events:
        name = e.get("name")
        if e.get("ph") != "X" or name not in meta or name.split(".")[0] in CONTROL_FLOW:
            continue
        total[name] = total.get(name, 0.0) + e.get("dur", 0.0)
        count[name] = count.get(name, 0) + 1
    ops = [{"hlo": k, "op_name": meta[k], "ms": v / steps / 1e3, "calls_per_step": count[k] / steps}
           for k, v in sorted(total.items(), key=lambda kv: -kv[1])]
    return {"wall_ms_per_step": 1e3 * wall, "op_ms_per_step": sum(o["ms"] for o in ops), "ops": ops}


# ------------------------------------------------------------------- train-step comparisons against PyTorch
PEAK_MATMUL = 1024  # side of the square float32 matmul timed as the box's practical FLOP/s ceiling


def torch_train_step(model, ids_np, threads: int) -> tuple[Callable[[], object], dict]:
    """A blocking torch train step (``zero_grad``, ``model(ids, labels=ids).loss.backward()``) at ``threads``
    intra-op threads, run once: (call, info with the first step's seconds, loss and gradient norm)."""
    import numpy as np
    import torch

    ids = torch.from_numpy(np.asarray(ids_np, dtype=np.int64))

    def call():
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    t0 = time.perf_counter()
    loss = call()
    grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
    return call, {"first_step_s": time.perf_counter() - t0, "loss": float(loss.detach()), "grad_norm": grad_norm}


def matmul_references(hidden: int, vocab: int, tokens: int, torch_peak: bool = False) -> dict[str, Callable]:
    """Timed references that are not train steps (names start with '~'): ``~peak-matmul-jax`` (and
    ``~peak-matmul-torch`` at 2 threads), a 1024^3 float32 matmul, the box's practical matmul FLOP/s; and
    ``~lm_head-matmuls``, the three lm_head matmuls of a train step at its shapes (logits ``x @ W``,
    ``dx = g @ W^T``, ``dW = x^T @ g``) in JAX (and ``~lm_head-matmuls-torch``, the same in torch at 1 thread):
    work every implementation must do."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    a = jax.random.normal(k1, (PEAK_MATMUL, PEAK_MATMUL), jnp.float32)
    x = jax.random.normal(k1, (tokens, hidden), jnp.float32)
    w = jax.random.normal(k2, (hidden, vocab), jnp.float32)
    g = jax.random.normal(k3, (tokens, vocab), jnp.float32)
    peak = jax.jit(lambda a: a @ a)
    head = jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g))
    out = {"~peak-matmul-jax": lambda: jax.block_until_ready(peak(a)),
           "~lm_head-matmuls": lambda: jax.block_until_ready(head(x, w, g))}
    if torch_peak:
        import torch

        ta = torch.from_numpy(np.array(a))

        def torch_peak_call():
            torch.set_num_threads(2)
            return ta @ ta

        out["~peak-matmul-torch"] = torch_peak_call
        tx, tw, tg = (torch.from_numpy(np.array(v)) for v in (x, w, g))

        def torch_head_call():
            torch.set_num_threads(1)  # the faster torch setting on the shared box (section 5)
            return tx @ tw, tg @ tw.T, tx.T @ tg

        out["~lm_head-matmuls-torch"] = torch_head_call
    return out


def peak_flops(times: dict[str, list[float]]) -> dict[str, float]:
    """FLOP/s of each ``~peak-matmul-*`` reference in ``times``, from its fastest round (the most generous
    ceiling)."""
    return {n: 2 * PEAK_MATMUL**3 / min(ts) for n, ts in times.items() if n.startswith("~peak-matmul")}


def time_step_contenders(contenders: dict[str, Callable], infos: dict[str, dict], tokens: int, a, log) -> dict:
    """Times ``contenders`` interleaved (``a.rounds``, ``a.target_s``, ``a.warm_each_round``) and builds the
    common part of a comparison's record: load averages, the faster torch setting, every step contender's median,
    tokens/s and rounds (with ``infos[name]``), and each JAX contender's speedups over every torch one.
    ``reference_rounds_s`` holds the rounds of the '~' references; ``times`` all rounds (dropped before
    writing)."""
    load0 = os.getloadavg()
    times = interleaved(contenders, rounds=a.rounds, target_s=a.target_s, warm_each_round=a.warm_each_round, log=log)
    torch_names = [n for n in times if n.startswith("torch")]
    best_torch = min(torch_names, key=lambda n: median(times[n])) if torch_names else None
    out = {"tokens_per_step": tokens, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
           "best_torch": best_torch, "times": times,
           "reference_rounds_s": {n: ts for n, ts in times.items() if n.startswith("~")}, "contenders": {}}
    for name, ts in times.items():
        if name.startswith("~"):
            continue
        med = median(ts)
        entry = {**infos[name], "median_s": med, "tokens_per_s": tokens / med, "rounds_s": ts}
        if name.startswith("jax"):
            for tn in torch_names:
                entry[f"speedup_vs_{tn}"] = ratio_stats(times[tn], ts)
            if best_torch:
                entry["speedup_vs_best_torch"] = entry[f"speedup_vs_{best_torch}"]
            if infos[name].get("xla_flops"):
                entry["xla_gflops_per_s"] = infos[name]["xla_flops"] / med / 1e9
        out["contenders"][name] = entry
    return out


def summarize_profile(prof: dict, category: Callable[[str], str], top: int = 12) -> dict:
    """`profile_ops`' result with its ops' ms summed per ``category(op_name)`` bucket, and the ``top`` ops."""
    if "ops" not in prof:
        return prof
    cats: dict[str, float] = {}
    for o in prof["ops"]:
        cats[category(o["op_name"])] = cats.get(category(o["op_name"]), 0.0) + o["ms"]
    return {"wall_ms_per_step": prof["wall_ms_per_step"], "op_ms_per_step": prof["op_ms_per_step"],
            "executed_ops_per_step": sum(o["calls_per_step"] for o in prof["ops"]),
            "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])), "top_ops": prof["ops"][:top]}


def add_step_args(parser, presets: list[str], quick_presets: list[str], rounds: int) -> None:
    """The options every train-step comparison takes; `fill_step_defaults` fills what a run leaves unset (a
    ``--quick`` smoke run is ``quick_presets`` at 1x128, 2 rounds of 0.2 s; a full run ``presets`` at 1x128 and
    4x128, ``rounds`` rounds of 1 s)."""
    quick = " ".join(quick_presets)
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}, 1x128, 2 rounds")
    parser.add_argument("--presets", nargs="+", default=None, help=f"default: {' '.join(presets)}")
    parser.add_argument("--batches", nargs="+", default=None, help="BxS entries (default: 1x128 4x128)")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {rounds})")
    parser.add_argument("--target-s", type=float, default=None, help="seconds per contender per round (default 1.0)")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[2, 1],
                        help="torch.set_num_threads values, one torch contender each (default: 2 1)")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--out-dir", default=None, help="where to write results (default: benchmarks/results)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.set_defaults(default_presets=presets, quick_presets=quick_presets, default_rounds=rounds)


def batch_shapes(entries: Sequence[str]) -> list[tuple[int, int]]:
    """``["1x128", "4x128"]`` -> ``[(1, 128), (4, 128)]``."""
    return [tuple(int(v) for v in e.lower().split("x")) for e in entries]


def log(msg: str) -> None:
    """Progress to stderr (stdout carries the markdown)."""
    import sys

    print(msg, file=sys.stderr, flush=True)


def fill_step_defaults(a) -> None:
    """Sets what ``a`` (parsed with `add_step_args`' options) left unset."""
    a.presets = a.presets or (a.quick_presets if a.quick else a.default_presets)
    a.batches = a.batches or (["1x128"] if a.quick else ["1x128", "4x128"])
    a.rounds = a.rounds or (2 if a.quick else a.default_rounds)
    a.target_s = a.target_s or (0.2 if a.quick else 1.0)
