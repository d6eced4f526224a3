"""Cost of one generated token: nnx_zoo's MLA-cache decode step vs. no cache, and vs. transformers' KV cache.

A random float32 DeepSeek-V3 derivative of the ``deepseek3-mini`` preset (MoE path ``dense``, the fast one on
CPU) is saved with ``save_pretrained`` and loaded by transformers' ``DeepseekV3ForCausalLM`` too, so both run the
same weights. For a batch of ``B`` rows whose context already holds ``S - 1`` tokens, three ways to get the
logits of token ``S`` are timed side by side (``_harness.interleaved``):

    nnx-cached     ``model.decode_step(tokens, cache)`` jitted, against an MLA cache of ``S`` slots (absorbed form)
    nnx-no-cache   the full forward over all ``S`` tokens, jitted (what generation without a cache pays per token)
    hf-cached      transformers' forward on one token with its ``DynamicCache`` of ``S - 1`` tokens, cropped back
                   after each call (torch limited to 1 thread: with 2 it spun ~35x slower on the loaded 2-core box)

Also measured from the arrays themselves: cache bytes per token per layer (ours: normed latent + rope key;
transformers 5 caches the same two, as ``keys [B, 1, S, kv_lora]`` and ``values [B, 1, S, rope]``, then expands
them per head at every step). Ratios within one run are what to read (the 2-core box is shared and noisy).

    python benchmarks/generate_decode.py            # contexts 128 1024, batch 4 (a few minutes on 2 cores)
    python benchmarks/generate_decode.py --quick    # context 64, batch 2 (smoke run)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as h  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo import DeepSeekV3, DeepSeekV3Config  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def make_models(tmp: Path) -> tuple[DeepSeekV3, object]:
    from transformers import DeepseekV3ForCausalLM

    config = DeepSeekV3Config.preset("deepseek3-mini", vocab_size=4096, num_hidden_layers=4, moe_impl="dense",
                                     num_nextn_predict_layers=0, max_position_embeddings=8192)
    DeepSeekV3.create(config).save_pretrained(tmp)
    ours = DeepSeekV3.from_pretrained(tmp, moe_impl="dense")
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, hf


@nnx.jit
def _decode(model, tokens, cache):
    return model.decode_step(tokens, cache)[0]


@nnx.jit
def _prefill(model, ids, cache):
    return model.prefill(ids, None, cache)[1]


@nnx.jit
def _full(model, ids):
    return model(ids)[:, -1]


def run_context(ours: DeepSeekV3, hf, batch: int, context: int, a, log) -> dict:
    c = ours.config
    ids = jnp.asarray(np.random.default_rng(context).integers(0, c.vocab_size, (batch, context)), jnp.int32)
    cache = _prefill(ours, ids[:, :-1], ours.init_cache(batch, context))  # S - 1 tokens in, one slot free
    last = ids[:, -1]
    torch_ids = torch.tensor(np.asarray(ids), dtype=torch.long)
    with torch.no_grad():
        past = hf(torch_ids[:, :-1], use_cache=True).past_key_values

    def hf_step():
        with torch.no_grad():
            out = hf(torch_ids[:, -1:], past_key_values=past, use_cache=True).logits
        past.crop(-1)  # drop the token just appended: every call sees S - 1 cached tokens
        return out

    # The three give the same logits (float32): a check that the timed calls compute the same thing.
    ref = np.asarray(_full(ours, ids))
    agree = {"nnx-cached": float(np.abs(np.asarray(_decode(ours, last, cache)) - ref).max()),
             "hf-cached": float(np.abs(hf_step()[:, -1].numpy() - ref).max())}
    contenders = {
        "nnx-cached": lambda: _decode(ours, last, cache).block_until_ready(),
        "nnx-no-cache": lambda: _full(ours, ids).block_until_ready(),
        "hf-cached": hf_step,
    }
    log(f"context {context}, batch {batch}")
    times = h.interleaved(contenders, rounds=a.rounds, target_s=a.target_s, log=log)
    ours_bytes = int(cache.bytes_per_token_per_layer())
    layer0 = past.layers[0]  # keys, values: [batch, cached heads, tokens, features]
    hf_bytes = sum(t.element_size() * t[0, :, 0].numel() for t in (layer0.keys, layer0.values))
    return {"batch": batch, "context": context, "times_s": times, "max_abs_logit_diff_vs_full": agree,
            "median_ms": {k: 1e3 * h.median(v) for k, v in times.items()},
            "no_cache_over_cached": h.ratio_stats(times["nnx-no-cache"], times["nnx-cached"]),
            "hf_over_nnx_cached": h.ratio_stats(times["hf-cached"], times["nnx-cached"]),
            "cache_bytes_per_token_per_layer": {"nnx": ours_bytes, "hf": hf_bytes}}


def render(results: list[dict], env: dict) -> str:
    rows = [(r["batch"], r["context"], r["median_ms"]["nnx-cached"], r["median_ms"]["nnx-no-cache"],
             r["median_ms"]["hf-cached"], r["no_cache_over_cached"]["median_round_ratio"],
             r["hf_over_nnx_cached"]["median_round_ratio"], r["cache_bytes_per_token_per_layer"]["nnx"],
             r["cache_bytes_per_token_per_layer"]["hf"]) for r in results]
    table = h.markdown_table(["batch", "context", "nnx cached ms/token", "nnx no-cache ms/token",
                              "hf cached ms/token", "no-cache / cached", "hf / nnx cached",
                              "cache B/token/layer nnx", "cache B/token/layer hf"], rows)
    agree = max(v for r in results for v in r["max_abs_logit_diff_vs_full"].values())
    return (f"# generate_decode\n\nAll three agree with the full forward's logits to {agree:.1e} (max abs).\n\n"
            f"{env['date_utc']}, jax {env['jax']}, {env['cpu_count']} CPUs, load "
            f"{env.get('loadavg')}\n\n{table}\n\nRatios are medians of per-round ratios.\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: context 64, batch 2, 3 rounds")
    p.add_argument("--contexts", nargs="+", type=int, default=None, help="default: 128 1024")
    p.add_argument("--batch", type=int, default=None, help="default 4")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    p.add_argument("--target-s", type=float, default=None, help="seconds per contender per round (default 0.3)")
    p.add_argument("--out-dir", default=None, help="where to write generate_decode.{json,md}")
    p.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)
    a.contexts = a.contexts or ([64] if a.quick else [128, 1024])
    a.batch = a.batch or (2 if a.quick else 4)
    a.rounds = a.rounds or (3 if a.quick else 5)
    a.target_s = a.target_s or (0.1 if a.quick else 0.3)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf = make_models(Path(tmp))
    results = [run_context(ours, hf, a.batch, s, a, log) for s in a.contexts]
    env = {**h.environment(), "loadavg": os.getloadavg()}
    md = render(results, env)
    print(md)
    if not a.no_write:
        h.write_results("generate_decode", {"env": env, "args": vars(a), "results": results}, md,
                        Path(a.out_dir) if a.out_dir else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
