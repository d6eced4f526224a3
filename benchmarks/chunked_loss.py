"""The trainer's loss with and without the whole batch's logits: CPU step time side by side, and XLA temp memory.

Part 1, time (CPU, float32): ``jax.value_and_grad`` over the ``nnx.Param`` state of the trainer's loss
(``nnx_zoo.train.step.loss_terms``) on the small presets, three contenders compiled and timed interleaved in one
process (``_harness.interleaved``: rounds, order rotated, medians and the median of per-round ratios):
  logits    the path before chunking: ``model.forward`` computes the logits, ``token_cross_entropy`` their loss
            (what ``loss_terms`` did; it still does this for a model without ``output_head``)
  default   ``loss_terms`` as shipped: ``forward(with_logits=False)`` + ``chunked_head_cross_entropy`` with the
            default chunk (at most 512 MiB of float32 logits: these batches are one chunk)
  chunked   the same with ``loss_chunk_tokens=64``: 2 chunks at 1 x 128, 8 at 4 x 128 (recomputes the head)

Part 2, memory (AOT compile on CPU, nothing runs): ``memory_analysis().temp_size_in_bytes`` of
  - the gradient of the head + loss alone at Llama-3.2-1B's head (embed 2048, vocab 128,256, bf16 compute,
    float32 weight) for 1 x 8192 tokens: the whole logits vs the default chunks vs chunks of 1,024 tokens;
  - the llama3-small grad step (the trainer's loss) at 4 x 2048 (1 GB of float32 logits): logits vs default vs
    1,024-token chunks.

    python benchmarks/chunked_loss.py            # both parts (~10 min on 2 cores)
    python benchmarks/chunked_loss.py --quick    # 2 rounds, small shapes
"""

from __future__ import annotations

import argparse
import sys

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM
from nnx_zoo.train.loss import chunked_head_cross_entropy, token_cross_entropy
from nnx_zoo.train.step import loss_terms

CONTENDERS = {"logits": "old", "default": None, "chunked": 64}  # name -> loss_chunk_tokens ("old": no head fn)


def _batch(vocab: int, batch: int, seq: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (batch, seq + 1))
    return {"input_ids": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32),
            "loss_mask": jnp.ones((batch, seq), jnp.float32)}


def _loss(graphdef, rest, chunk_tokens):
    def old(params, batch):  # the trainer's loss before chunking, for a model without MTP
        logits = nnx.merge(graphdef, params, rest).forward(batch["input_ids"]).logits
        total, count = token_cross_entropy(logits, batch["targets"], batch["loss_mask"])
        return total / count

    def new(params, batch):
        total, metrics = loss_terms(nnx.merge(graphdef, params, rest), batch, 0.0, loss_chunk_tokens=chunk_tokens)
        return total / metrics["tokens"]

    return old if chunk_tokens == "old" else new


def time_section(presets: list[str], shapes: list[tuple[int, int]], rounds: int, target_s: float) -> list[dict]:
    rows = []
    for preset in presets:
        config = AutoConfig.preset(preset)
        model = AutoModelForCausalLM.create(config, seed=0)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        for batch_size, seq in shapes:
            batch = _batch(config.vocab_size, batch_size, seq)
            calls, losses = {}, {}
            for name, chunk_tokens in CONTENDERS.items():
                compiled = jax.jit(jax.value_and_grad(_loss(graphdef, rest, chunk_tokens))).lower(
                    params, batch).compile()
                losses[name] = float(compiled(params, batch)[0])
                calls[name] = lambda c=compiled, p=params, b=batch: jax.block_until_ready(c(p, b))
            h.log(f"{preset} {batch_size}x{seq}: losses {losses}")
            assert max(losses.values()) - min(losses.values()) <= 1e-5 * abs(losses["logits"]), losses
            times = h.interleaved(calls, rounds=rounds, target_s=target_s, warm_each_round=True, log=h.log)
            row = {"preset": preset, "batch": f"{batch_size}x{seq}",
                   "ms": {k: 1e3 * h.median(v) for k, v in times.items()}}
            row["ratio_vs_logits"] = {k: h.ratio_stats(v, times["logits"]) for k, v in times.items() if k != "logits"}
            rows.append(row)
    return rows


def _head_temp(tokens: int, embed: int, vocab: int, chunk_tokens: int | None) -> int:
    """XLA temp bytes of the gradient (weight and hidden) of a bf16 head on a float32 weight + the loss."""
    hidden = jax.ShapeDtypeStruct((1, tokens, embed), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((embed, vocab), jnp.float32)
    ints = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, tokens), jnp.float32)

    def loss(w, x, t, m):
        total, count = chunked_head_cross_entropy(x, lambda y: y @ w.astype(jnp.bfloat16), t, m,
                                                  chunk_tokens=chunk_tokens)
        return total / count

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(weight, hidden, ints, mask).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _step_temp(preset: str, batch_size: int, seq: int, chunk_tokens) -> int:
    config = AutoConfig.preset(preset)
    model = nnx.eval_shape(lambda: AutoModelForCausalLM.create(config, seed=0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = jax.eval_shape(lambda: _batch(config.vocab_size, batch_size, seq))
    compiled = jax.jit(jax.value_and_grad(_loss(graphdef, rest, chunk_tokens))).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def memory_section(quick: bool) -> list[dict]:
    tokens, embed, vocab = (2048, 512, 32000) if quick else (8192, 2048, 128256)
    rows = [{"what": f"head + loss, {tokens} tokens, embed {embed}, vocab {vocab} (bf16 on f32 weight)",
             "f32_logits_MiB": tokens * vocab * 4 / 2**20,
             "temp_MiB": {str(c): _head_temp(tokens, embed, vocab, c) / 2**20 for c in (0, None, 1024)}}]
    batch_size, seq = (2, 512) if quick else (4, 2048)
    vocab = AutoConfig.preset("llama3-small").vocab_size
    rows.append({"what": f"llama3-small grad step, {batch_size}x{seq}",
                 "f32_logits_MiB": batch_size * seq * vocab * 4 / 2**20,
                 "temp_MiB": {str(c): _step_temp("llama3-small", batch_size, seq, c) / 2**20
                              for c in ("old", None, 1024)}})
    return rows


def markdown(time_rows: list[dict], memory_rows: list[dict]) -> str:
    names = [n for n in CONTENDERS if n != "logits"]
    out = ["## CPU step time (ms, median) and ratio to the logits path (median of per-round ratios)", "",
           h.markdown_table(["preset", "batch", *[f"{n} ms" for n in CONTENDERS], *[f"{n} / logits" for n in names]],
                            [[r["preset"], r["batch"], *[r["ms"][n] for n in CONTENDERS],
                              *[r["ratio_vs_logits"][n]["median_round_ratio"] for n in names]] for r in time_rows]),
           "", "## XLA temp memory (MiB; chunk tokens: 0/old = whole logits, None = default)", ""]
    for r in memory_rows:
        out.append(f"- {r['what']}: one float32 [tokens, vocab] = {r['f32_logits_MiB']:.0f} MiB; temp "
                   + ", ".join(f"{k}: {v:.0f}" for k, v in r["temp_MiB"].items()))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out-dir", default=None)
    a = parser.parse_args(argv)
    shapes = [(1, 128)] if a.quick else [(1, 128), (4, 128)]
    time_rows = time_section(["llama3-small", "deepseek3-tiny"], shapes, a.rounds or (2 if a.quick else 7),
                             0.2 if a.quick else 1.0)
    memory_rows = memory_section(a.quick)
    md = markdown(time_rows, memory_rows)
    print(md)
    payload = {"benchmark": "chunked_loss", "argv": sys.argv[1:] if argv is None else list(argv),
               "environment": h.environment(), "time": time_rows, "memory": memory_rows}
    h.write_results("chunked_loss" + ("_quick" if a.quick else ""), payload, md, a.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
