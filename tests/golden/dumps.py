"""Golden sharding dumps: for a small DeepSeek preset under each named rule set on 8 devices, the parameter table
(path, logical names, PartitionSpec) and the shardings of the main activations.

Regenerate after an intended change (then review the diff like code):

    python tests/golden/dumps.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
}
PRESET = "deepseek3-mini"
BATCH, SEQ = 8, 16


def _spec(spec) -> str:
    parts = ["(" + ",".join(a) + ")" if isinstance(a, tuple) else str(a) for a in spec]
    return "P(" + ", ".join(parts) + ")"


def dump(rules: str) -> str:
    """The golden text for one rule set."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnx_zoo import DeepSeekV3, DeepSeekV3Config
    from nnx_zoo.sharding import make_abstract_mesh, make_mesh, record_shardings, sharding_report

    sizes = MESHES[rules]
    config = DeepSeekV3Config.preset(PRESET)
    report = sharding_report(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0), rules=rules),
                             make_abstract_mesh(sizes), rules)
    lines = [f"# {PRESET} under rule set {rules!r} on mesh {sizes} (explicit)", "", "## parameters"]
    for row in report.rows:
        names = ",".join(str(n) for n in row.names) if row.names is not None else "(none)"
        lines.append(f"{row.path}  [{names}]  {_spec(row.spec)}")

    mesh = make_mesh(sizes, shard_mode="explicit")
    model = nnx.eval_shape(lambda: DeepSeekV3(config, rngs=nnx.Rngs(0), rules=rules))
    graphdef, state = nnx.split(model)
    from nnx_zoo.sharding import state_shardings

    shardings = iter(state_shardings(state, mesh, rules))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=next(shardings)), state)
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=jax.NamedSharding(mesh, jax.P()))
    with jax.set_mesh(mesh), record_shardings() as seen:
        jax.eval_shape(lambda s, i: nnx.merge(graphdef, s)(i, with_mtp=True), state, ids)
    lines += ["", "## activations (logical names, shape -> spec; each distinct shard() call site once)"]
    done = set()
    for names, shape, spec in seen:
        line = f"[{','.join(str(n) for n in names)}] {'x'.join(map(str, shape))} -> {_spec(spec)}"
        if line not in done:
            done.add(line)
            lines.append(line)
    return "\n".join(lines) + "\n"


def path(rules: str) -> Path:
    return HERE / f"sharding_{rules}.txt"


def main() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    for rules in MESHES:
        path(rules).write_text(dump(rules))
        print(f"wrote {path(rules)}")


if __name__ == "__main__":
    main()
