"""What XLA compiles the train step into: involuntary rematerializations and collective bytes, per layout and mode.

For every layout of ``explicit_vs_auto.py`` (mesh + rule set + MoE path), on an all-Auto and an all-Explicit mesh
of 8 CPU devices, the trainer's ``train_step`` (forward, backward, clipping, AdamW, state donated, output state
pinned to the input shardings) is lowered and compiled from abstract inputs (nothing runs). Reported per case:

- ``remat``: how many times XLA's SPMD partitioner printed "Involuntary full rematerialization" (it had to
  replicate a whole tensor to reach a sharding). The message goes to the process's stderr from C++, so it is read
  by redirecting file descriptor 2 around the compile.
- ``bytes``: collective bytes per device per step, read from ``compiled.as_text()``: every all-gather,
  all-reduce, reduce-scatter, all-to-all and collective-permute, counted with the ring-traffic of its group of
  ``n`` devices (all-gather: result x (n-1)/n; reduce-scatter and all-to-all: operand x (n-1)/n; all-reduce:
  2 x operand x (n-1)/n; collective-permute: operand) and multiplied by the trip counts of the while loops
  (layer scans) that contain it (``known_trip_count`` in the loop's backend config).
- ``temp``: ``compiled.memory_analysis().temp_size_in_bytes`` (XLA's scratch per device; printed per case).
- ``paper``: the bytes the layout implies (the formula is in benchmarks/README.md, section 4.1, and in
  ``paper_bytes``).

Variants: ``plain`` (no MTP, no batch split) and ``split+mtp`` (batch_split_factor 2, one MTP head trained with
weight 0.3).

    python benchmarks/compiled_programs.py                    # deepseek3-mini, 2 layers, vocab 4096, 16 x 64
    python benchmarks/compiled_programs.py --rows "FSDP 8" --variants plain --dump /tmp/hlo
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as h  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo import DeepSeekV3, DeepSeekV3Config  # noqa: E402
from nnx_zoo.sharding import get_rules, logical_to_mesh_axes, make_mesh, state_shardings  # noqa: E402
from nnx_zoo.train import OptimizerConfig, make_optimizer  # noqa: E402
from nnx_zoo.train.step import train_step  # noqa: E402

LAYOUTS = h.SHARDING_LAYOUTS  # shared with the other sharding benchmark
MODES = ("auto", "explicit")
# name -> (batch_split_factor, MTP heads trained)
VARIANTS: dict[str, tuple[int, int]] = {"plain": (1, 0), "split+mtp": (2, 1), "split": (2, 0), "mtp": (1, 1)}
DEFAULT_VARIANTS = ("plain", "split+mtp")  # "split" and "mtp" alone take a gap apart
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
REMAT_MESSAGE = "Involuntary full rematerialization"
MTP_WEIGHT = 0.3


# ---- capturing what XLA prints -------------------------------------------------------------------------------


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Everything written to file descriptor 2 inside the block (C++ logging included), as one string appended
    to the yielded list on exit."""
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def remat_warnings(stderr_text: str) -> list[str]:
    """The "Involuntary full rematerialization" lines in ``stderr_text``."""
    return [line for line in stderr_text.splitlines() if REMAT_MESSAGE in line]


# ---- collective bytes from the compiled HLO ------------------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                 "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) [^\n]*\{$")


def _shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (a tuple shape sums its members)."""
    return sum(_DTYPE_BYTES[d] * math.prod(int(n) for n in dims.split(",") if n) for d, dims in _SHAPE.findall(text))


def _group_size(line: str, devices: int) -> int:
    """Devices per replica group of a collective instruction (the three ways XLA writes groups)."""
    named = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\S+)? \{([^}]*)\}", line)
    if named:  # mesh['axis_0'=4,'axis_1'=2] {'axis_1'} (a device order may sit between): the listed axes group
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", named.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", named.group(2)))
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if iota:
        return int(iota.group(1).split(",")[-1])
    listed = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    if "source_target_pairs=" in line:
        return 2  # collective-permute: point to point
    return devices  # empty groups: all devices


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """HLO module text -> ({computation name: instruction lines}, entry computation name)."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and "=" not in line.split("{")[0].split("(")[0]:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None and line.strip() and line.strip() != "}":
            comps[current].append(line)
    return comps, entry


def _multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of ``entry``: a while loop's body and condition run
    ``known_trip_count`` times per execution of the computation holding the loop; every branch of a conditional
    counts as if it ran each time (a static bound, as XLA's ``cost_analysis()`` counts them)."""
    mult: dict[str, int] = {entry: 1}
    order = [entry]
    for name in order:
        for line in comps.get(name, ()):
            trip = 1
            if " while(" in line:
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                if m is None:
                    raise ValueError(f"while loop without a known trip count: {line[:200]}")
                trip = int(m.group(1))
            callees = re.findall(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)", line)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)  # every branch, as if it ran
            callees += [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
            for callee in callees:
                if callee in comps:
                    if callee not in mult:
                        order.append(callee)
                    mult[callee] = mult.get(callee, 0) + mult[name] * trip
    return mult


SLICED_ALL_REDUCE = "all-reduce+slice"  # an all-reduce whose every consumer keeps only this device's shard


def _defining_lines(lines: list[str]) -> dict[str, str]:
    """Instruction name -> its line (metadata dropped), for one computation."""
    defs = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if m:
            defs[m.group(1)] = re.sub(r", metadata=\{.*", "", line)
    return defs


def _consumers(defs: dict[str, str], name: str) -> list[str]:
    """The lines of ``defs`` that read the value ``name``."""
    ref = re.compile(r"%" + re.escape(name) + r"(?![\w.\-])")
    return [line for other, line in defs.items() if other != name and ref.search(line.split(" = ", 1)[1])]


def _sliced_members(defs: dict[str, str], name: str, members: int) -> list[bool]:
    """For each member of the all-reduce ``name`` (a tuple when ``members`` > 1): whether every consumer reads it
    together with ``partition-id``, i.e. keeps only this device's slice of the sum. XLA:GPU's
    ReduceScatterCreator turns such all-reduce + dynamic-slice pairs into reduce-scatters; XLA:CPU has no such
    pass, so on CPU the gradient of an FSDP-sharded weight is all-reduced whole and then sliced."""
    readers = _consumers(defs, name)
    if members == 1:
        by_member = [readers]
    else:
        by_member = [[] for _ in range(members)]
        for line in readers:
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .* get-tuple-element\(.*index=(\d+)", line)
            if m is None:
                return [False] * members  # the tuple itself is read whole
            by_member[int(m.group(2))] += _consumers(defs, m.group(1))
    return [bool(rs) and all("partition-id" in r.split(" = ", 1)[1] for r in rs) for rs in by_member]


def collective_bytes(hlo: str, devices: int) -> dict[str, float]:
    """Per-device collective traffic of one execution of the compiled module ``hlo`` (ring algorithms), by kind.

    Read from each instruction's result shape (the compiled text names operands without shapes): all-gather
    ``R (n-1)/n``, reduce-scatter ``R (n-1)`` (its operand is ``n R``), all-reduce ``2 R (n-1)/n``, all-to-all
    ``R (n-1)/n``, collective-permute ``R``, for a result of ``R`` bytes per device and groups of ``n``.
    All-reduced values that every consumer slices by ``partition-id`` are counted under ``SLICED_ALL_REDUCE``
    (same ring formula) rather than ``all-reduce``: ``as_reduce_scatter`` halves them.
    """
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, entry)
    total = dict.fromkeys((*COLLECTIVES, SLICED_ALL_REDUCE), 0.0)
    pattern = re.compile(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
    factor = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1.0,
              "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
              "collective-permute": lambda n: 1.0}
    for name, lines in comps.items():
        defs = _defining_lines(lines)
        for inst, line in defs.items():
            m = pattern.search(line)
            if m is None:
                continue
            result_shape, kind, is_async = m.groups()
            n = _group_size(line, devices)
            if n <= 1:
                continue
            shapes = [_shape_bytes(s.group(0)) for s in _SHAPE.finditer(result_shape)]
            if kind == "all-reduce" and not is_async:
                for size, sliced in zip(shapes, _sliced_members(defs, inst, len(shapes)), strict=True):
                    total[SLICED_ALL_REDUCE if sliced else kind] += factor[kind](n) * size * mult.get(name, 0)
                continue
            # an async start's result holds (operands, results, ...): count the results half
            result = max(shapes) if is_async else sum(shapes)
            total[kind] += factor[kind](n) * result * mult.get(name, 0)
    return total


_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w-]+)\((.*)")


def moe_weight_ops(hlo: str, experts: int, hidden: int, moe_mlp: int, tokens: int, k: int) -> dict[str, dict]:
    """What the compiled module ``hlo`` does to the routed experts' stacked weights (``[.., experts, hidden,
    moe_mlp]`` / ``[.., experts, moe_mlp, hidden]``) and to the routed rows, per execution (ops inside a while
    loop run its trip count times). Each entry: ``ops`` (instructions in the text), ``runs`` (executions per
    step), ``bytes`` (their results' bytes per step):

    - ``cast``: the program's float32 -> bfloat16 casts of expert weights (a ``convert`` whose ``op_name`` is
      JAX's ``convert_element_type``); ``cast in loops``: those of them inside a while loop (a layer scan).
      ``xla convert``: weight-shaped converts XLA added itself (XLA:CPU computes bfloat16 dots in float32).
    - ``scatter`` / ``gather`` of routed rows: results ``[tokens or tokens * k, hidden]`` (size-1 dims dropped),
      and of their routing weights ``[tokens * k]``.
    - ``stack slice``: a ``dynamic-slice`` of a stacked expert weight ``[layers, ...]`` that is its own
      instruction (a copy in memory), and ``stack slice (fused)``: one fused into its consumer; ``copy``: a
      weight-shaped ``copy`` inside a loop (a layout change or a copy of a layer's weights) that is its own
      instruction.
    """
    comps, entry = _computations(hlo)
    mult = _multiplicities(comps, entry)
    fused = {c for lines in comps.values() for line in lines if " fusion(" in line
             for c in re.findall(r"calls=%?([\w.\-]+)", line)}
    loops = {c for lines in comps.values() for line in lines if " while(" in line
             for c in re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)}
    changed = True
    while changed:  # computations called from inside a loop are inside it too
        before = len(loops)
        for name in list(loops):
            for line in comps.get(name, ()):
                loops.update(re.findall(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)", line))
        changed = len(loops) != before
    weights = {(experts, hidden, moe_mlp), (experts, moe_mlp, hidden)}
    rows = {(tokens, hidden), (tokens * k, hidden), (tokens * k,)}  # routed rows, and their routing weights
    out: dict[str, dict] = {key: {"ops": 0, "runs": 0, "bytes": 0} for key in (
        "cast", "cast in loops", "xla convert", "scatter", "gather", "stack slice", "stack slice (fused)", "copy")}

    def add(key: str, runs: int, size: int) -> None:
        out[key]["ops"] += 1
        out[key]["runs"] += runs
        out[key]["bytes"] += runs * size

    for name, lines in comps.items():
        runs = mult.get(name, 0)
        types = {}
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            result, kind, operands = m.group(2), m.group(3), m.group(4)
            types[m.group(1)] = result
            shape = _SHAPE.search(result)
            if shape is None or not runs:
                continue
            dims = tuple(int(d) for d in shape.group(2).split(",") if d)
            size = _shape_bytes(result)
            first = re.match(r"%([\w.\-]+)", operands)
            source = _SHAPE.search(types.get(first.group(1), "")) if first else None
            if kind == "convert" and dims[-3:] in weights and source is not None:
                if "convert_element_type" in line and shape.group(1) == "bf16" and source.group(1) == "f32":
                    add("cast", runs, size)
                    if name in loops:
                        add("cast in loops", runs, size)
                elif "convert_element_type" not in line:
                    add("xla convert", runs, size)
            elif kind in ("scatter", "gather") and tuple(d for d in dims if d != 1) in rows:
                add(kind, runs, size)
            elif kind == "dynamic-slice" and dims[-3:] in weights and source is not None:
                stacked = tuple(int(d) for d in source.group(2).split(",") if d)
                if len(stacked) == 4 and stacked[-3:] == dims[-3:]:
                    add("stack slice (fused)" if name in fused else "stack slice", runs, size)
            elif kind == "copy" and dims[-3:] in weights and name in loops and name not in fused:
                add("copy", runs, size)
    return out


def as_reduce_scatter(measured: dict[str, float]) -> float:
    """Total bytes with each all-reduce + slice-by-partition counted as the reduce-scatter it is on GPU/TPU
    (XLA's ReduceScatterCreator): half the all-reduce's ring traffic."""
    return sum(measured.values()) - measured.get(SLICED_ALL_REDUCE, 0.0) / 2


# ---- the train step of one case ------------------------------------------------------------------------------


def case_config(layout: str, variant: str, *, layers: int = 2, vocab: int = 4096, **overrides) -> DeepSeekV3Config:
    """deepseek3-mini with ``layers`` layers (the first dense) for ``layout`` and ``variant``."""
    factor, mtp = VARIANTS[variant]
    return DeepSeekV3Config.preset("deepseek3-mini", vocab_size=vocab, num_hidden_layers=layers,
                                   num_nextn_predict_layers=mtp, batch_split_factor=factor,
                                   moe_impl=LAYOUTS[layout][2], **overrides)


def abstract_state(config: DeepSeekV3Config, rules: str) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of the model and its AdamW optimizer; nothing is allocated."""
    def make():
        model = DeepSeekV3(config, rngs=nnx.Rngs(0), rules=rules)
        return model, make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0), model, total_steps=100)

    return nnx.split(nnx.eval_shape(make))


def compile_case(config: DeepSeekV3Config, layout: str, mode: str, batch: int, seq: int):
    """The donated train step of ``config`` on ``layout``'s mesh in ``mode``, lowered from abstract inputs and
    compiled; returns ``(compiled, stderr text of the compile, mesh)``."""
    sizes, rules, _ = LAYOUTS[layout]
    mesh = make_mesh(sizes, shard_mode=mode)
    graphdef, state = abstract_state(config, rules)
    shardings = state_shardings(state, mesh, get_rules(rules))
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
              for x, s in zip(jax.tree.leaves(state), shardings)]
    state = jax.tree.unflatten(jax.tree.structure(state), leaves)
    batch_sharding = jax.NamedSharding(mesh, logical_to_mesh_axes(("activation_batch", None), rules, mesh))
    batch_arrays = {name: jax.ShapeDtypeStruct((batch, seq), dtype, sharding=batch_sharding)
                    for name, dtype in (("input_ids", jnp.int32), ("targets", jnp.int32),
                                        ("loss_mask", jnp.float32))}
    mtp = config.num_nextn_predict_layers > 0
    kwargs = dict(mtp_weight=MTP_WEIGHT if mtp else 0.0, model_kwargs=(("with_mtp", True),) if mtp else ())

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = train_step(model, optimizer, batch, **kwargs)
        return nnx.state((model, optimizer)), metrics["loss"]

    with jax.set_mesh(mesh), captured_stderr() as err:
        out_state = jax.tree.map(lambda a: a.sharding, state)
        compiled = jax.jit(step, donate_argnums=0, out_shardings=(out_state, None)).lower(
            state, batch_arrays).compile()
    return compiled, err[0], mesh


# ---- bytes on paper -----------------------------------------------------------------------------------------

# The activation dim each weight dim meets: a mesh axis that splits both stays put (kept); any other mesh axis of
# the weight is an FSDP axis, gathered before use.
_WEIGHT_TO_ACTIVATION = {"embed": "activation_embed", "embed_no_exp": "activation_embed",
                         "mtp_embed": "activation_embed", "heads": "activation_heads",
                         "kv_heads": "activation_kv_heads", "mlp": "activation_mlp",
                         "moe_mlp": "activation_moe_mlp", "vocab": "activation_vocab", "exp": "activation_exp",
                         "kv": "activation_kv", "q_lora": "activation_q_lora", "kv_lora": "activation_kv_lora"}


def _spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _resolved(names, rules, mesh) -> tuple[str, ...]:
    spec = logical_to_mesh_axes(tuple(names), rules, mesh)
    return tuple(a for e in spec for a in _spec_axes(e))


def paper_bytes(config: DeepSeekV3Config, layout: str, batch: int, seq: int) -> dict[str, float]:
    """Per-device collective bytes of one train step that ``layout`` implies (benchmarks/README.md, 4.1).

    ``fsdp``: each weight gathered over its FSDP axes in the forward and again in the backward pass, its gradient
    reduce-scattered over them and all-reduced over the data axes it is replicated on. ``tp``/``tp_transpose``/
    ``ep``/``cp``: the activations those axes move (see the README for the per-layer counts).
    """
    sizes, rules_name, impl = LAYOUTS[layout]
    rules = get_rules(rules_name)
    mesh = make_mesh(sizes, shard_mode="auto")
    size = dict(zip(mesh.axis_names, mesh.axis_sizes))
    prod = lambda axes: math.prod(size[a] for a in axes)  # noqa: E731
    word = jnp.dtype(config.dtype).itemsize
    token_axes = _resolved(("activation_batch", "activation_length"), rules, mesh)
    ep_axes = _resolved(("exp",), rules, mesh) if impl == "ep" else ()
    ep_gather = tuple(a for a in _resolved(("activation_tokens",), rules, mesh) if a in ep_axes)

    graphdef, state = abstract_state(config, rules_name)
    model_state = nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)
    fsdp = 0.0
    for _, var in nnx.to_flat_state(model_state):
        names = tuple(var.get_metadata().get("out_sharding") or ())
        spec = logical_to_mesh_axes(names, rules, mesh, shape=var.shape)
        kept, gathered = [], []
        for name, entry in zip(names, tuple(spec) + (None,) * (len(names) - len(spec))):
            act = _WEIGHT_TO_ACTIVATION.get(name)
            act_axes = ep_axes if name == "exp" and impl == "ep" else (
                _resolved((act,), rules, mesh) if act else ())
            for a in _spec_axes(entry):
                (kept if a in act_axes else gathered).append(a)
        full = math.prod(var.shape) * word / prod(kept)  # the weight as each device uses it
        g = prod(gathered)
        data = [a for a in token_axes if a not in gathered and a not in kept
                and not ("exp" in names and a in ep_gather)]
        r = prod(data)
        fsdp += 3 * full * (g - 1) / g + 2 * (r - 1) / r * full / g
    tokens = batch * seq / prod(token_axes)  # per device
    hidden = tokens * config.hidden_size * word
    moe_layers = config.num_moe_layers + config.num_nextn_predict_layers
    layers = config.num_hidden_layers + config.num_nextn_predict_layers
    heads = 1 + config.num_nextn_predict_layers  # output-head passes
    out = {"fsdp": fsdp, "tp": 0.0, "tp_transpose": 0.0, "ep": 0.0, "cp": 0.0}
    t = size.get("tensor", 1)
    if t > 1:  # 2 all-reduces per layer and pass; embedding output (forward), output-head input grad (backward)
        out["tp"] = 2 * (t - 1) / t * hidden * (4 * layers + 2 * heads)
    tt = size.get("tensor_transpose", 1)
    if tt > 1:  # gather the input of attention and MLP, reduce-scatter their outputs: 4 per layer and pass
        out["tp_transpose"] = (tt - 1) / tt * hidden * (8 * layers + 3 * heads)
    n = prod(ep_gather)
    if n > 1:  # all-gather the tokens, reduce-scatter the outputs, forward and backward
        out["ep"] = 4 * (n - 1) * hidden * moe_layers
    c = prod(_resolved(("activation_length",), rules, mesh))
    if c > 1:  # keys and values gathered over the sequence (forward), their gradients reduce-scattered (backward)
        kv = tokens * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim) * word
        out["cp"] = 2 * (c - 1) * kv * layers
    return out


# ---- the benchmark ------------------------------------------------------------------------------------------


def warning_site(line: str) -> str:
    """A short description of one warning: the op, its shape, the sharding transition and the traced op name."""
    op = re.search(r"HLO operation %([\w.\-]+) = (\S+)", line)
    move = re.search(r"from sharding (\{[^}]*\}) to (\{[^}]*\})", line)
    name = re.search(r'op_name="([^"]*)"', line)
    src = re.search(r'source_file="?([^ "]*)"? source_line=(\d+)', line)
    parts = [f"{op.group(1)} {op.group(2)}" if op else "?", f"{move.group(1)} -> {move.group(2)}" if move else "",
             name.group(1) if name else "", f"{src.group(1)}:{src.group(2)}" if src else ""]
    return " | ".join(p for p in parts if p)


def run_case(layout: str, mode: str, variant: str, a) -> dict:
    config = case_config(layout, variant, layers=a.layers, vocab=a.vocab)
    t0 = time.perf_counter()
    compiled, err, mesh = compile_case(config, layout, mode, a.batch, a.seq)
    hlo = compiled.as_text()
    if a.dump:
        Path(a.dump).mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"\W+", "_", f"{layout}_{mode}_{variant}").strip("_")
        (Path(a.dump) / f"{slug}.hlo.txt").write_text(hlo)
    warnings = remat_warnings(err)
    measured = collective_bytes(hlo, mesh.size)
    temp = compiled.memory_analysis().temp_size_in_bytes  # XLA's scratch per device: what the schedule holds
    paper = paper_bytes(config, layout, a.batch, a.seq)
    return {"layout": layout, "mode": mode, "variant": variant, "compile_s": time.perf_counter() - t0,
            "remat_warnings": len(warnings), "warning_sites": [warning_site(w) for w in warnings],
            "measured_bytes": measured, "paper_bytes": paper,
            "measured_total": sum(measured.values()), "as_reduce_scatter_total": as_reduce_scatter(measured),
            "paper_total": sum(paper.values()), "temp_bytes": temp}


def render(rows: list[dict], a) -> str:
    kinds = (*COLLECTIVES, SLICED_ALL_REDUCE)
    header = ["layout", "variant", "remat auto / explicit", "measured MiB auto / explicit",
              "as RS MiB auto / explicit", "paper MiB", "as RS / paper (auto, explicit)",
              "explicit by kind: " + " / ".join(_KIND_LABELS[k] for k in kinds) + " MiB"]
    table = []
    key = lambda r: (r["layout"], r["variant"])  # noqa: E731
    cases = {}
    for r in rows:
        cases.setdefault(key(r), {})[r["mode"]] = r
    for (layout, variant), by_mode in cases.items():
        auto, expl = by_mode.get("auto"), by_mode.get("explicit")
        either = auto or expl
        mib = lambda r, k: "-" if r is None else f"{r[k] / 2**20:.2f}"  # noqa: E731
        ratio = lambda r: "-" if r is None else f"{r['as_reduce_scatter_total'] / max(r['paper_total'], 1):.2f}"  # noqa: E731
        by_kind = "-" if expl is None else " / ".join(f"{expl['measured_bytes'][k] / 2**20:.2f}" for k in kinds)
        table.append([layout, variant,
                      f"{'-' if auto is None else auto['remat_warnings']} / "
                      f"{'-' if expl is None else expl['remat_warnings']}",
                      f"{mib(auto, 'measured_total')} / {mib(expl, 'measured_total')}",
                      f"{mib(auto, 'as_reduce_scatter_total')} / {mib(expl, 'as_reduce_scatter_total')}",
                      f"{either['paper_total'] / 2**20:.2f}", f"{ratio(auto)}, {ratio(expl)}", by_kind])
    note = (f"deepseek3-mini ({a.layers} layers, vocab {a.vocab}), batch {a.batch} x {a.seq}, float32, 8 CPU devices; "
            "plain = no MTP, no batch split; split+mtp = batch_split_factor 2 and one MTP head (weight 0.3); "
            "split, mtp = either alone. "
            "remat = 'Involuntary full rematerialization' warnings printed while compiling; MiB = collective "
            "bytes per device per step (loop trip counts included); as RS = the same with every all-reduce whose "
            "consumers all slice it by partition-id (AR+slice) counted as the reduce-scatter XLA:GPU/TPU make "
            "of it (half the bytes; XLA:CPU has no ReduceScatterCreator pass).")
    return note + "\n\n" + _markdown_table(header, table)


_KIND_LABELS = {"all-gather": "AG", "all-reduce": "AR", SLICED_ALL_REDUCE: "AR+slice", "reduce-scatter": "RS",
                "all-to-all": "A2A", "collective-permute": "CP"}


def _markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), metavar="ROW")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dump", default=None, help="write each compiled HLO module into this folder")
    p.add_argument("--out-dir", default=None, help="where to write compiled_programs.{json,md}")
    p.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = []
    for layout in a.rows:
        for variant in a.variants:
            for mode in a.modes:
                r = run_case(layout, mode, variant, a)
                rows.append(r)
                log(f"[{layout} | {variant} | {mode}] {r['remat_warnings']} remat warnings, "
                    f"{r['measured_total'] / 2**20:.2f} MiB measured "
                    f"({r['as_reduce_scatter_total'] / 2**20:.2f} as RS) vs "
                    f"{r['paper_total'] / 2**20:.2f} on paper, "
                    f"temp {r['temp_bytes'] / 2**20:.2f} MiB ({r['compile_s']:.1f}s)")
                for site in dict.fromkeys(r["warning_sites"]):
                    log(f"    {r['warning_sites'].count(site)}x {site}")
    md = render(rows, a)
    print(md)
    if not a.no_write:
        payload = {"benchmark": "compiled_programs", "argv": sys.argv[1:] if argv is None else list(argv),
                   "environment": h.environment(), "layers": a.layers, "vocab": a.vocab, "batch": a.batch,
                   "seq": a.seq, "rows": rows}
        jp, mp = h.write_results("compiled_programs", payload, md, a.out_dir)
        log(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
