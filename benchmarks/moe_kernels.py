"""Which MoE expert-compute path is fastest on this backend (decides the default `moe_impl` on CPU).

Two levels, each timed forward and forward+backward (jax.vjp with a fixed cotangent), jitted, float32:

kernel  one expert matmul over M = tokens * top_k routed rows, equal group sizes M / G:
        ragged   jax.lax.ragged_dot(x [M,H], w [G,H,F], group_sizes)          useful FLOPs 2*M*H*F
        einsum   einsum('gtd,gdf->gtf') on x reshaped to [G, M/G, H]          same FLOPs (the ideal grouped matmul)
        dense    einsum('td,gdf->gtf') on the T un-routed tokens             G/top_k times the FLOPs
layer   the whole routed-expert SwiGLU (gate, up, down; combine with the routing weights) on random top-k routing
        (unequal group sizes), gradients w.r.t. x, the three expert weights and the routing weights:
        dense    every expert on every token, combine with a [T, G] weight matrix (zeros off the top-k)
        gmm      argsort by expert, gather, three ragged_dots, weight, unsort (scatter-add)
        tiled    prototype: sort into fixed-size row tiles, each tile owned by one expert (groups padded to a
                 multiple of the tile), expert weights gathered per tile, batched einsum 'nbh,nhf->nbf';
                 dropless, no masking, FLOP overhead <= G * tile padded rows

Why: XLA:CPU has no ragged-dot instruction, so JAX lowers ragged_dot on CPU through `_ragged_dot_general_impl`,
which materialises a masked [G, M, H] copy of the rows and contracts over (group, hidden): G times the useful
FLOPs plus G times the memory traffic (the backward w.r.t. the weights expands both operands). The XLA flop count
of each compiled executable is reported next to the timings.

    python benchmarks/moe_kernels.py            # full run (several minutes on 2 cores)
    python benchmarks/moe_kernels.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from functools import partial

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int  # H
    expert_width: int  # F (moe_intermediate_size)
    tokens: int  # T (batch * sequence)
    top_k: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k


SHAPES = {
    # deepseek3-tiny-like: hidden 64, expert width 64, one 1x128 batch, top-8
    "tiny": Shape("tiny", hidden=64, expert_width=64, tokens=128, top_k=8),
    # a larger CPU shape: hidden 512, expert width 256, a 4x128 batch, top-8
    "large": Shape("large", hidden=512, expert_width=256, tokens=512, top_k=8),
}


# ----------------------------------------------------------------------------------------------------- kernel level
def kernel_ragged(x_rows, w, group_sizes):
    return jax.lax.ragged_dot(x_rows, w, group_sizes)


def kernel_einsum(x_rows, w, group_sizes):
    del group_sizes  # equal groups: [G * M/G, H] -> [G, M/G, H]
    g = w.shape[0]
    return jnp.einsum("gtd,gdf->gtf", x_rows.reshape(g, -1, x_rows.shape[-1]), w)


def kernel_dense(x_tokens, w, group_sizes):
    del group_sizes
    return jnp.einsum("td,gdf->gtf", x_tokens, w)


# ------------------------------------------------------------------------------------------------------ layer level
def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def layer_dense(x, wg, wu, wd, topk_idx, topk_w):
    """Every expert on every token. Weights [G,H,F], [G,H,F], [G,F,H]. The combine weight is applied to the
    intermediate so the down projection contracts over (expert, width) in one matmul (no [G,T,H] temporary)."""
    g = wg.shape[0]
    cw = jnp.sum(jax.nn.one_hot(topk_idx, g, dtype=x.dtype) * topk_w[..., None], axis=1)  # [T, G]
    act = _swiglu(jnp.einsum("th,ghf->tgf", x, wg), jnp.einsum("th,ghf->tgf", x, wu))
    return jnp.einsum("tgf,gfh->th", act * cw[:, :, None], wd)


def _sort_by_expert(topk_idx, g):
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted position -> assignment id (token * top_k + j)
    sizes = jnp.bincount(flat, length=g).astype(jnp.int32)
    return order, sizes


def layer_gmm(x, wg, wu, wd, topk_idx, topk_w):
    """Sort assignments by expert, gather rows, ragged_dot x3, weight, unsort by scatter-add."""
    t, k = topk_idx.shape
    order, sizes = _sort_by_expert(topk_idx, wg.shape[0])
    tok = order // k
    xs = x[tok]
    act = _swiglu(jax.lax.ragged_dot(xs, wg, sizes), jax.lax.ragged_dot(xs, wu, sizes))
    y = jax.lax.ragged_dot(act, wd, sizes) * topk_w.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[tok].add(y)


def auto_tile(rows: int, groups: int) -> int:
    """Largest power of two <= rows / (2 * groups), clamped to [8, 128]: padding waste <= half the useful rows."""
    tile = 8
    while tile * 2 <= min(128, rows // (2 * groups)):
        tile *= 2
    return tile


def layer_tiled(x, wg, wu, wd, topk_idx, topk_w, *, tile: int):
    """Dropless grouped matmul from XLA-friendly pieces: each group padded to a multiple of `tile` rows, the rows
    laid out as [n_tiles, tile, H] with one expert per tile, expert weights gathered per tile, batched einsums."""
    t, k = topk_idx.shape
    g = wg.shape[0]
    m = t * k
    n_tiles = -(-m // tile) + g  # static upper bound on sum_g ceil(size_g / tile)
    order, sizes = _sort_by_expert(topk_idx, g)
    padded = (sizes + tile - 1) // tile * tile
    pend = jnp.cumsum(padded)
    pstart = pend - padded
    start = jnp.cumsum(sizes) - sizes
    slot = jnp.arange(n_tiles * tile, dtype=jnp.int32)
    grp = jnp.minimum(jnp.searchsorted(pend, slot, side="right"), g - 1).astype(jnp.int32)
    off = slot - pstart[grp]
    valid = (off < sizes[grp]) & (slot < pend[-1])
    assign = order[jnp.where(valid, start[grp] + off, 0)]
    tok = assign // k
    w_slot = jnp.where(valid, topk_w.reshape(-1)[assign], 0.0)
    xs = jnp.where(valid[:, None], x[tok], 0.0).reshape(n_tiles, tile, -1)
    tile_e = grp[::tile]
    act = _swiglu(jnp.einsum("nbh,nhf->nbf", xs, wg[tile_e]), jnp.einsum("nbh,nhf->nbf", xs, wu[tile_e]))
    y = jnp.einsum("nbf,nfh->nbh", act, wd[tile_e]).reshape(n_tiles * tile, -1) * w_slot[:, None]
    return jnp.zeros_like(x).at[tok].add(y)


# -------------------------------------------------------------------------------------------------------- plumbing
def _fwd(f):
    return jax.jit(f)


def _fwd_bwd(f, n_diff: int):
    """jit of (out, grads w.r.t. the first n_diff args) with a fixed cotangent passed as the last argument."""

    def run(*args):
        ct = args[-1]
        diff, rest = args[:n_diff], args[n_diff:-1]
        out, vjp = jax.vjp(lambda *d: f(*d, *rest), *diff)
        return out, vjp(ct)

    return jax.jit(run)


def _blocker(jf, args):
    def call():
        return jax.block_until_ready(jf(*args))

    return call


def kernel_case(shape: Shape, groups: int, key) -> dict[str, tuple]:
    kx, kw = jax.random.split(key)
    m = shape.rows
    assert m % groups == 0
    x_rows = jax.random.normal(kx, (m, shape.hidden), jnp.float32)
    x_tok = x_rows[: shape.tokens]
    w = jax.random.normal(kw, (groups, shape.hidden, shape.expert_width), jnp.float32) * shape.hidden**-0.5
    gs = jnp.full((groups,), m // groups, jnp.int32)
    useful = 2.0 * m * shape.hidden * shape.expert_width
    return {
        "ragged": (kernel_ragged, (x_rows, w, gs), useful),
        "einsum": (kernel_einsum, (x_rows, w, gs), useful),
        "dense": (kernel_dense, (x_tok, w, gs), useful),
    }


def layer_case(shape: Shape, groups: int, key, tile: int) -> dict[str, tuple]:
    kx, kg, ku, kd, kr = jax.random.split(key, 5)
    hdim, f, t, k = shape.hidden, shape.expert_width, shape.tokens, shape.top_k
    x = jax.random.normal(kx, (t, hdim), jnp.float32)
    wg = jax.random.normal(kg, (groups, hdim, f), jnp.float32) * hdim**-0.5
    wu = jax.random.normal(ku, (groups, hdim, f), jnp.float32) * hdim**-0.5
    wd = jax.random.normal(kd, (groups, f, hdim), jnp.float32) * f**-0.5
    scores = jax.random.uniform(kr, (t, groups))
    topk_w, topk_idx = jax.lax.top_k(scores, k)
    topk_w = topk_w / topk_w.sum(-1, keepdims=True)
    args = (x, wg, wu, wd, topk_w, topk_idx.astype(jnp.int32))
    useful = 3 * 2.0 * t * k * hdim * f

    def reorder(fn):  # differentiable args first: (x, wg, wu, wd, topk_w, topk_idx)
        return lambda x, wg, wu, wd, tw, ti: fn(x, wg, wu, wd, ti, tw)

    return {
        "dense": (reorder(layer_dense), args, useful),
        "gmm": (reorder(layer_gmm), args, useful),
        "tiled": (reorder(partial(layer_tiled, tile=tile)), args, useful),
    }


def check_layer_agreement(case) -> float:
    outs = {n: np.asarray(jax.jit(f)(*a)) for n, (f, a, _) in case.items()}
    ref = outs["dense"]
    return max(float(np.max(np.abs(o - ref))) for o in outs.values())


def run_comparison(level, shape, groups, mode, case, args_ns, log):
    n_diff = 2 if level == "kernel" else 5  # kernel: (x, w); layer: (x, wg, wu, wd, topk_w)
    contenders, flops = {}, {}
    for name, (f, a, _) in case.items():
        if mode == "fwd":
            jf, call_args = _fwd(f), a
        else:
            out_shape = jax.eval_shape(f, *a)
            ct = jax.random.normal(jax.random.key(7), out_shape.shape, out_shape.dtype)
            jf, call_args = _fwd_bwd(f, n_diff), (*a, ct)
        compiled = jf.lower(*call_args).compile()
        flops[name] = h.compiled_flops(compiled)
        contenders[name] = _blocker(compiled, call_args)
    times = h.interleaved(contenders, rounds=args_ns.rounds, target_s=args_ns.target_s, log=log)
    useful = next(iter(case.values()))[2] * (1 if mode == "fwd" else 3)
    rows = []
    base = "einsum" if level == "kernel" else "dense"
    for name in case:
        med = h.median(times[name])
        rows.append({
            "level": level, "shape": shape.name, "groups": groups, "mode": mode, "path": name,
            "median_ms": 1e3 * med, "min_ms": 1e3 * min(times[name]), "rounds_ms": [1e3 * v for v in times[name]],
            "xla_flops": flops[name], "useful_flops": useful,
            "flop_overhead": (flops[name] / useful) if flops[name] else None,
            "useful_gflops_per_s": useful / med / 1e9,
            "vs_" + base: h.ratio_stats(times[name], times[base]),
        })
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny shape, 8 and 32 groups, 3 rounds")
    p.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES), help="default: tiny large")
    p.add_argument("--groups", nargs="+", type=int, default=None, help="numbers of experts (default: 8 16 32)")
    p.add_argument("--levels", nargs="+", default=["kernel", "layer"], choices=["kernel", "layer"])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"], choices=["fwd", "fwd_bwd"])
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per comparison (default 7)")
    p.add_argument("--target-s", type=float, default=None, help="seconds per contender per round (default 0.3)")
    p.add_argument("--tile", type=int, default=0, help="row tile of the 'tiled' path (0: auto)")
    p.add_argument("--out-dir", default=None, help="where to write moe_kernels.{json,md} (default benchmarks/results)")
    p.add_argument("--no-write", action="store_true", help="print only")
    a = p.parse_args(argv)
    a.shapes = a.shapes or (["tiny"] if a.quick else ["tiny", "large"])
    a.groups = a.groups or ([8, 32] if a.quick else [8, 16, 32])
    a.rounds = a.rounds or (3 if a.quick else 7)
    a.target_s = a.target_s or (0.1 if a.quick else 0.3)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    results, agreement = [], {}
    key = jax.random.key(0)
    for sname in a.shapes:
        shape = SHAPES[sname]
        for g in a.groups:
            tile = a.tile or auto_tile(shape.rows, g)
            for level in a.levels:
                case = kernel_case(shape, g, key) if level == "kernel" else layer_case(shape, g, key, tile)
                if level == "layer":
                    agreement[f"{sname}/G{g}"] = check_layer_agreement(case)
                for mode in a.modes:
                    log(f"[{level}] {sname} G={g} {mode}" + (f" tile={tile}" if level == "layer" else ""))
                    rows = run_comparison(level, shape, g, mode, case, a, log)
                    for r in rows:
                        if level == "layer":
                            r["tile"] = tile
                    results.extend(rows)

    md = render(results, a, agreement)
    print(md)
    if not a.no_write:
        payload = {"benchmark": "moe_kernels", "argv": sys.argv[1:] if argv is None else list(argv),
                   "environment": h.environment(), "shapes": {s: asdict(SHAPES[s]) for s in a.shapes},
                   "rounds": a.rounds, "target_s": a.target_s, "layer_max_abs_diff_vs_dense": agreement,
                   "results": results, "summary": summarize(results)}
        jp, mp = h.write_results("moe_kernels", payload, md, a.out_dir)
        log(f"wrote {jp} and {mp}")
    return 0


def summarize(results) -> list[dict]:
    """Per (level, shape, groups, mode): the winner and each path's slowdown relative to it."""
    out = []
    keys = sorted({(r["level"], r["shape"], r["groups"], r["mode"]) for r in results}, key=str)
    for k in keys:
        rows = [r for r in results if (r["level"], r["shape"], r["groups"], r["mode"]) == k]
        best = min(rows, key=lambda r: r["median_ms"])
        out.append({"level": k[0], "shape": k[1], "groups": k[2], "mode": k[3], "winner": best["path"],
                    "slowdown_vs_winner": {r["path"]: r["median_ms"] / best["median_ms"] for r in rows}})
    return out


def render(results, a, agreement) -> str:
    env = h.environment()
    parts = [
        "# MoE expert-compute paths on " + f"{env['backend']} ({env['processor']}, {env['cpu_count']} cores)",
        "",
        f"jax {env['jax']}, float32, jitted; {a.rounds} interleaved rounds of ~{a.target_s}s per contender; "
        "median ms per call. `xFLOP` = XLA cost-analysis flops / useful flops. `vs base` = median of per-round "
        "time ratios against the base path (einsum for kernel, dense for layer); >1 is slower.",
        "",
    ]
    for level in a.levels:
        base = "einsum" if level == "kernel" else "dense"
        lv = [r for r in results if r["level"] == level]
        if not lv:
            continue
        parts.append(f"## {level} level" + (" (one matmul, equal groups)" if level == "kernel" else
                                             " (routed SwiGLU experts incl. dispatch/combine, random top-k)"))
        parts.append("")
        header = ["shape", "G", "mode", "path", "ms", "useful GFLOP/s", "xFLOP", f"vs {base}"]
        if level == "layer":
            header.insert(2, "tile")
        rows = []
        for r in lv:
            row = [r["shape"], r["groups"], r["mode"], r["path"], r["median_ms"], r["useful_gflops_per_s"],
                   r["flop_overhead"] if r["flop_overhead"] is not None else "n/a",
                   r["vs_" + base]["median_round_ratio"]]
            if level == "layer":
                row.insert(2, r["tile"])
            rows.append(row)
        parts.append(h.markdown_table(header, rows))
        parts.append("")
    summ = summarize(results)
    parts.append("## winners")
    parts.append("")
    parts.append(h.markdown_table(
        ["level", "shape", "G", "mode", "winner", "slowdown of the others"],
        [[s["level"], s["shape"], s["groups"], s["mode"], s["winner"],
          ", ".join(f"{k} {v:.2f}x" for k, v in s["slowdown_vs_winner"].items() if k != s["winner"])]
         for s in summ]))
    if agreement:
        parts += ["", "Layer outputs agree with dense (max abs diff): "
                  + ", ".join(f"{k} {v:.1e}" for k, v in agreement.items())]
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
