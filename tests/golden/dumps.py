"""Golden sharding dumps: for a small preset of each family under each named rule set on 8 devices, the parameter
table (path, logical names, PartitionSpec) and the shardings of the main activations. One file per (preset, rule
set): ``sharding_<preset>_<rules>.txt``.

Regenerate after an intended change (then review the diff like code), all of them or only some presets:

    python tests/golden/dumps.py
    python tests/golden/dumps.py llama3-small qwen3-tiny
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

# One mesh per rule set, chosen so that the set's special axes are present (8 devices each).
MESHES: dict[str, dict[str, int]] = {
    "default": {"fsdp": 2, "tensor": 2, "expert": 2},
    "pure-fsdp": {"fsdp": 8},
    "ep-as-cp": {"fsdp": 2, "context": 2, "expert": 2},
    "cp-as-ep": {"fsdp": 2, "context": 2, "expert": 2},
    "ep-as-dp": {"fsdp": 4, "expert": 2},
    "shard-exp-on-fsdp": {"fsdp": 4, "expert": 2},
    # tensor, not stage: the un-pipelined forward that records the activations does not run DeepSeek on a stage
    # axis (tests/sharding/test_pipeline_rules.py resolves the parameters on stage x fsdp x expert).
    "pipeline-large-moe": {"fsdp": 2, "tensor": 2, "expert": 2},
}
# Preset (any family's, by name) -> keyword arguments of the model call whose activations are recorded: the
# DeepSeek preset also runs its multi-token-prediction heads, so their activations are in its dump. One dense
# preset has its own output head (llama3-small: lm_head.kernel) and one ties it to the embedding (qwen3-tiny).
PRESETS: dict[str, dict[str, Any]] = {
    "deepseek3-mini": {"with_mtp": True},
    "llama3-small": {},
    "qwen3-tiny": {},
}
BATCH, SEQ = 8, 16


def _spec(spec) -> str:
    parts = ["(" + ",".join(a) + ")" if isinstance(a, tuple) else str(a) for a in spec]
    return "P(" + ", ".join(parts) + ")"


def dump(preset: str, rules: str) -> str:
    """The golden text for one preset under one rule set."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_zoo import AutoConfig, AutoModelForCausalLM
    from nnx_zoo.sharding import make_abstract_mesh, make_mesh, record_shardings, sharding_report, state_shardings

    sizes = MESHES[rules]
    config = AutoConfig.preset(preset)
    model_class = AutoModelForCausalLM.model_class(config)

    def make():
        return model_class(config, rngs=nnx.Rngs(0), rules=rules)

    report = sharding_report(make, make_abstract_mesh(sizes), rules)
    lines = [f"# {preset} under rule set {rules!r} on mesh {sizes} (explicit)", "", "## parameters"]
    for row in report.rows:
        names = ",".join(str(n) for n in row.names) if row.names is not None else "(none)"
        lines.append(f"{row.path}  [{names}]  {_spec(row.spec)}")

    mesh = make_mesh(sizes, shard_mode="explicit")
    graphdef, state = nnx.split(nnx.eval_shape(make))
    shardings = iter(state_shardings(state, mesh, rules))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=next(shardings)), state)
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=jax.NamedSharding(mesh, jax.P()))
    call_kwargs = PRESETS[preset]
    with jax.set_mesh(mesh), record_shardings() as seen:
        jax.eval_shape(lambda s, i: nnx.merge(graphdef, s).forward(i, **call_kwargs), state, ids)
    lines += ["", "## activations (logical names, shape -> spec; each distinct shard() call site once)"]
    done = set()
    for names, shape, spec in seen:
        line = f"[{','.join(str(n) for n in names)}] {'x'.join(map(str, shape))} -> {_spec(spec)}"
        if line not in done:
            done.add(line)
            lines.append(line)
    return "\n".join(lines) + "\n"


def path(preset: str, rules: str) -> Path:
    return HERE / f"sharding_{preset}_{rules}.txt"


def main(argv: list[str] | None = None) -> None:
    presets = sys.argv[1:] if argv is None else argv
    unknown = sorted(set(presets) - set(PRESETS))
    if unknown:
        raise SystemExit(f"no golden dumps for {unknown}; known presets: {sorted(PRESETS)} (add one to PRESETS)")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    for preset in presets or PRESETS:
        for rules in MESHES:
            path(preset, rules).write_text(dump(preset, rules))
            print(f"wrote {path(preset, rules)}")


if __name__ == "__main__":
    main()
