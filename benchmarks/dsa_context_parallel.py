"""What DeepSeek-V3.2's sparse attention gathers when the sequence is split over devices (``ep-as-cp``).

Under context parallelism each device holds a slice of the queries, and a query's top-k may pick keys from any
slice. ``dsa.sparse_attention`` gathers, over the sequence, the per-token entries the selection and the attention
read (MLA's normed latent, the shared rope key, the indexer's key: ``kv_lora + rope + index_head_dim`` numbers per
token), then each device selects and attends locally: no top-k merge across devices. Dense MLA instead gathers
its per-head keys and values (``heads * (qk_head_dim + v_head_dim)`` per token).

This script compiles one MLA layer's forward + backward on 8 CPU devices (FSDP 4 x EP 2, rules ``ep-as-cp``,
Explicit axes) for both and counts the all-gathers in the compiled program and the bytes they produce per device;
then it scales the per-token widths to the real V3.2 layer. Nothing runs, so it is not timing: the cost is the
collective volume.

    python benchmarks/dsa_context_parallel.py     # writes results/dsa_context_parallel.{json,md}
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from nnx_zoo import DeepSeekV3Config  # noqa: E402
from nnx_zoo.layers.attention import causal_mask  # noqa: E402
from nnx_zoo.models.deepseek.mla import MLA  # noqa: E402
from nnx_zoo.sharding import get_rules, logical_to_mesh_axes, make_mesh, use_rules  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SEQ, BATCH = 256, 8
LAYER = dict(hidden_size=256, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, attention_impl="xla")
INDEXER = dict(index_topk=64, index_n_heads=4, index_head_dim=32)
_GATHER = re.compile(r"= (f32|bf16|s32|pred)\[([\d,]*)\][^ ]* all-gather\(")
_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "pred": 1}


def gathers(config: DeepSeekV3Config) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of every all-gather in one MLA layer's compiled forward + backward under ep-as-cp."""
    mesh = make_mesh({"fsdp": 4, "expert": 2}, shard_mode="explicit")
    graphdef, state = nnx.split(MLA(config, rngs=nnx.Rngs(0)))
    cos = sin = jnp.ones((1, SEQ, config.qk_rope_head_dim // 2))

    def loss(state, x):
        with use_rules("ep-as-cp"):
            return jnp.sum(nnx.merge(graphdef, state)(x, cos, sin, causal_mask(SEQ)) ** 2)

    spec = logical_to_mesh_axes(("activation_batch", "activation_length", "activation_embed"), get_rules("ep-as-cp"),
                                mesh)
    assert spec[1] == "expert", spec  # the sequence is split
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((BATCH, SEQ, config.hidden_size)), NamedSharding(mesh, spec))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile().as_text()
    out = []
    for kind, dims in _GATHER.findall(hlo):
        shape = tuple(int(d) for d in dims.split(",") if d)
        size = _BYTES[kind]
        for d in shape:
            size *= d
        out.append((shape, size))
    return out


def main() -> int:
    base = DeepSeekV3Config.preset("deepseek3-mini", **LAYER)
    rows = {}
    for name, config in (("dense MLA", base), ("DSA", base.with_overrides(**INDEXER))):
        found = gathers(config)
        rows[name] = dict(count=len(found), bytes=sum(b for _, b in found), shapes=sorted({s for s, _ in found}))
    v32 = DeepSeekV3Config.preset("deepseek3.2-671b")
    per_token = {"dense MLA": v32.num_attention_heads * (v32.qk_head_dim + v32.v_head_dim),
                 "DSA": v32.kv_lora_rank + v32.qk_rope_head_dim + v32.index_head_dim}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dsa_context_parallel.json").write_text(json.dumps(
        dict(seq=SEQ, batch=BATCH, layer=LAYER, indexer=INDEXER, rows={k: {**v, "shapes": [list(s) for s in
             v["shapes"]]} for k, v in rows.items()}, v32_values_per_token=per_token), indent=2))
    lines = ["| layer | all-gathers | gathered bytes per device | shapes | V3.2 values per token gathered |",
             "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['count']} | {row['bytes'] / 2**20:.2f} MiB | "
                     f"{', '.join(str(list(s)) for s in row['shapes'])} | {per_token[name]} |")
    text = (f"One MLA layer, forward + backward, batch {BATCH} x {SEQ} tokens on FSDP 4 x EP 2 (`ep-as-cp`, "
            f"Explicit), dims {LAYER}; DSA adds {INDEXER}.\n\n" + "\n".join(lines) + "\n")
    (RESULTS / "dsa_context_parallel.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
