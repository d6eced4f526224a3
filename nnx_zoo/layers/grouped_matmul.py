"""One grouped matmul for the MoE ``gmm`` path, with a kernel per backend.

``grouped_matmul(lhs [m, k], rhs [g, k, n], group_sizes [g]) -> out [m, n]``: the rows of ``lhs`` are sorted by
group; the first ``group_sizes[0]`` rows are multiplied by ``rhs[0]``, the next ``group_sizes[1]`` by ``rhs[1]``,
and so on (the semantics of ``jax.lax.ragged_dot``; rows past ``sum(group_sizes)`` give zeros).

Implementations (``impl``):

- ``tiled``: portable, plain XLA ops, any backend. Each group's rows are padded to a multiple of a row tile
  (``tile`` rows), so every tile belongs to one group; each tile is multiplied by its group's weight in a batched
  einsum. A ``jax.custom_vjp`` computes the activation gradient the same way and the weight gradient as a
  per-group sum of the tiles' ``[k, n]`` products. The tiles are processed in chunks inside a ``lax.scan``, so
  the per-tile weight copies and products held at once stay within about the size of the rows themselves.
  Nothing of size ``[g, m, ...]`` is ever built.
- ``xla``: ``jax.lax.ragged_dot``. XLA:TPU has a native ragged dot; XLA:CPU and XLA:GPU lower it to a dense
  ``[g, m, k]`` masked expansion (and its weight gradient expands both operands), so it is a reference there.
- ``tokamax``: ``tokamax.ragged_dot`` (optional package, the Mosaic/Triton kernels MaxText uses; it picks its
  best kernel for the backend). Missing -> one warning line and the portable path.
- ``pallas_triton``: ``jax.lax.ragged_dot`` lowered by JAX's Pallas-Triton kernel on NVIDIA GPUs
  (``jax_ragged_dot_use_gpu_pallas_triton_lowering``). Missing (or not a GPU) -> one warning line, portable path.
- ``auto``: ``choose_grouped_matmul_impl`` below.

>>> out = grouped_matmul(jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.array([2, 0, 4]), impl="tiled")
>>> out.shape
(6, 5)
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from nnx_zoo.layers import kernels

GROUPED_MATMUL_IMPLS = ("auto", "tiled", "xla", "tokamax", "pallas_triton")

# Chunks of tiles hold at most this many weight elements at once, or the size of the rows operand if larger:
# small problems (every CPU preset) then run in one chunk, with no loop.
_MIN_CHUNK_ELEMENTS = 1 << 22
_PALLAS_TRITON_MODULE = "jax._src.lax.pallas_lowerings.gpu.ragged_dot"
_PALLAS_TRITON_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    impl: str = "auto",
    preferred_element_type: jnp.dtype | None = None,
    tile: int | None = None,
    chunk: int | None = None,
) -> jax.Array:
    """``out [m, n]`` with ``out[rows of group i] = lhs[rows of group i] @ rhs[i]``; rows sorted by group.

    ``lhs [m, k]``, ``rhs [g, k, n]``, ``group_sizes [g]`` (integers, ``sum <= m``; empty groups are fine).
    The products run in ``lhs``'s dtype: ``rhs`` may be stored wider (float32 master weights with bfloat16
    activations) and is cast to it (the ``tiled`` path casts one chunk of tiles at a time, so no narrowed copy of
    the whole ``rhs`` is made, and its gradient is accumulated in float32 and returned in ``rhs``'s dtype).
    Products are accumulated in float32; ``preferred_element_type`` is the output dtype (default ``lhs``'s).
    ``tile`` sets the ``tiled`` path's row tile (default: ``default_tile(m, g)``) and ``chunk`` its tiles per scan
    step (default: as many as keep the step's weight copies within the rows' size, and all of them for small
    problems). ``group_sizes`` gets no gradient.

    >>> x, w = jnp.ones((5, 8)), jnp.ones((2, 8, 3))
    >>> grouped_matmul(x, w, jnp.array([3, 2]), impl="tiled")[:, 0]
    Array([8., 8., 8., 8., 8.], dtype=float32)
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],) or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul wants lhs [m, k], rhs [g, k, n], group_sizes [g]; got {lhs.shape}, "
                         f"{rhs.shape}, {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integers, got {group_sizes.dtype}")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    group_sizes = jax.lax.stop_gradient(group_sizes).astype(jnp.int32)
    impl = choose_grouped_matmul_impl(impl)
    if impl == "tiled":
        tile = tile or default_tile(lhs.shape[0], rhs.shape[0])
        return _tiled(lhs, rhs, group_sizes, tile, chunk, out_dtype)
    rhs = rhs.astype(lhs.dtype)
    if impl == "tokamax":
        return kernels.tokamax().ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    if impl == "pallas_triton":
        # The flag is read when the enclosing jit is lowered, which happens after this function has returned
        # (a context manager here would have exited by then), so it is set for the process. It only changes how
        # ragged_dot lowers on GPUs; a jit traced before it was set retraces once (the flag is in the jit key).
        if not getattr(jax.config, _PALLAS_TRITON_FLAG):
            jax.config.update(_PALLAS_TRITON_FLAG, True)
    # "xla" and "pallas_triton"
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def choose_grouped_matmul_impl(requested: str, platform: str | None = None) -> str:
    """The implementation ``grouped_matmul(impl=requested)`` runs on ``platform`` (default: JAX's backend).

    ``auto``: CPU -> ``tiled``; GPU -> ``tokamax`` if it imports, else ``pallas_triton``; TPU -> ``tokamax`` if it
    imports, else ``xla`` (XLA:TPU has a native ragged dot). A kernel that cannot run (its package is missing, or
    the platform is not its own) becomes the portable path (``xla`` on TPU, ``tiled`` elsewhere) with one
    warning line.

    >>> choose_grouped_matmul_impl("auto", "cpu")
    'tiled'
    """
    if requested not in GROUPED_MATMUL_IMPLS:
        raise ValueError(f"unknown grouped matmul implementation {requested!r}; choose one of {GROUPED_MATMUL_IMPLS}")
    platform = kernels.platform_name(platform)
    portable = "xla" if platform == "tpu" else "tiled"
    if requested == "auto":
        if platform == "cpu":
            return "tiled"
        if kernels.tokamax() is not None:
            return "tokamax"
        if platform == "gpu" and _pallas_triton_available():
            return "pallas_triton"
        if platform == "gpu":  # (XLA:TPU's own ragged dot is a kernel; XLA:GPU's is the dense expansion)
            kernels.warn_once(f"grouped_matmul: no GPU grouped-matmul kernel ({kernels.tokamax_unavailable()}, and "
                              "this jax lacks the Pallas-Triton ragged_dot); using the 'tiled' path")
        return portable
    if requested == "tokamax" and (why := kernels.tokamax_unavailable()):
        kernels.warn_once(f"grouped_matmul: {why}; using the {portable!r} path")
        return portable
    if requested == "pallas_triton" and not (platform == "gpu" and _pallas_triton_available()):
        why = "needs an NVIDIA GPU" if platform != "gpu" else f"this jax lacks {_PALLAS_TRITON_MODULE}"
        kernels.warn_once(f"grouped_matmul: the Pallas-Triton ragged_dot {why}; using the {portable!r} path")
        return portable
    return requested


def default_tile(rows: int, groups: int) -> int:
    """The ``tiled`` path's row tile: the largest power of two <= ``rows / (2 * groups)``, within [8, 128].

    Why: every group wastes up to ``tile - 1`` padded rows, so with ``tile <= rows / (2 * groups)`` the padding
    is at most half the real rows (about a quarter on average); 128 rows already make a matmul efficient, and
    below 8 the per-tile weight copies cost more than the saved rows.
    """
    tile = 8
    while tile * 2 <= min(128, rows // (2 * max(groups, 1))):
        tile *= 2
    return tile


# --------------------------------------------------------------------------------------------- the tiled path
def _tiled(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int, chunk: int | None,
           out_dtype: jnp.dtype) -> jax.Array:
    m, k = lhs.shape
    groups, _, n = rhs.shape
    # Static bound on the tiles: sum_i ceil(size_i / tile) <= ceil(m / tile) + g. Tiles go in chunks of
    # `chunk` (one scan step each), at most about the rows' size of weight copies per step.
    bound = -(-m // tile) + groups
    chunk = chunk or max(_MIN_CHUNK_ELEMENTS, m * max(k, n)) // (k * n)
    chunk = max(1, min(bound, chunk))
    num_tiles = -(-bound // chunk) * chunk
    # Inside jax.shard_map, both operands enter the custom_vjp varying over the same mesh axes: the weight
    # gradient of this shard's rows then is a valid cotangent, and JAX's own transpose of this widening sums it
    # over the shards (a weight replicated over the token shards gets the total).
    lhs, rhs = _varying_like(lhs, rhs), _varying_like(rhs, lhs)
    return _tiled_vjp(lhs, rhs, group_sizes, tile, chunk, num_tiles, out_dtype)


class _Layout:
    """Where each row sits in the padded, tiled layout (``num_tiles * tile`` slots, each group's rows starting
    on a tile boundary), as two gather maps, and each tile's group.

    ``source [slots]``: the ``lhs`` row in each slot (``m`` for a padding slot: gathers read zero there).
    ``dest [m]``: each row's slot (``slots`` for rows past ``sum(group_sizes)``: gathers read zero there).
    ``tile_group [num_tiles]``: the group whose weight each tile uses (unused trailing tiles hold only padding).
    """

    def __init__(self, group_sizes: jax.Array, m: int, tile: int, num_tiles: int):
        groups = group_sizes.shape[0]
        ends = jnp.cumsum(group_sizes)  # row just past each group
        starts = ends - group_sizes
        padded = -(-group_sizes // tile) * tile  # each group rounded up to whole tiles
        padded_ends = jnp.cumsum(padded)
        padded_starts = padded_ends - padded
        slots = num_tiles * tile

        slot = jnp.arange(slots, dtype=jnp.int32)
        slot_group = jnp.searchsorted(padded_ends, slot, side="right")  # == groups past the last group's tiles
        clamped = jnp.minimum(slot_group, groups - 1)
        offset = slot - padded_starts[clamped]  # position within the group
        real = (slot_group < groups) & (offset < group_sizes[clamped])
        self.source = jnp.where(real, starts[clamped] + offset, m)
        self.tile_group = clamped[::tile]

        row = jnp.arange(m, dtype=jnp.int32)
        row_group = jnp.searchsorted(ends, row, side="right")  # == groups past sum(group_sizes)
        clamped = jnp.minimum(row_group, groups - 1)
        self.dest = jnp.where(row_group < groups, padded_starts[clamped] + row - starts[clamped], slots)


def _gather_rows(a: jax.Array, index: jax.Array) -> jax.Array:
    """``a[index]``, zeros where ``index`` is out of range (padding)."""
    return a.at[index].get(mode="fill", fill_value=0)


def _chunks(layout: _Layout, chunk: int, tile: int) -> tuple[jax.Array, jax.Array]:
    """Scan inputs: each step's ``source`` slots ``[steps, chunk * tile]`` and tile groups ``[steps, chunk]``."""
    return layout.source.reshape(-1, chunk * tile), layout.tile_group.reshape(-1, chunk)


def _tiled_forward(lhs, rhs, group_sizes, tile, chunk, num_tiles, out_dtype):
    m, k = lhs.shape
    layout = _Layout(group_sizes, m, tile, num_tiles)

    def step(carry, inputs):
        source, tile_group = inputs
        x = _gather_rows(lhs, source).reshape(chunk, tile, k)  # c: tiles of this chunk, t: rows of a tile
        w = rhs[tile_group].astype(lhs.dtype)  # [c, k, n]: each tile's group weight, in the compute dtype
        y = jnp.einsum("ctk,ckn->ctn", x, w, preferred_element_type=jnp.float32)
        return carry, y.astype(out_dtype).reshape(chunk * tile, -1)

    _, y = jax.lax.scan(step, None, _chunks(layout, chunk, tile))
    return _gather_rows(y.reshape(num_tiles * tile, -1), layout.dest)


def _tiled_backward(tile, chunk, num_tiles, out_dtype, residuals, dout):
    lhs, rhs, group_sizes = residuals
    m, k = lhs.shape
    layout = _Layout(group_sizes, m, tile, num_tiles)

    def step(drhs, inputs):
        source, tile_group = inputs
        x = _gather_rows(lhs, source).reshape(chunk, tile, k)
        dy = _gather_rows(dout, source).reshape(chunk, tile, -1)
        w = rhs[tile_group].astype(lhs.dtype)  # [c, k, n]
        dx = jnp.einsum("ctn,ckn->ctk", dy, w, preferred_element_type=jnp.float32)
        # Each tile's weight-gradient term; tiles of one group are summed by the scatter-add.
        dw = jnp.einsum("ctk,ctn->ckn", x, dy, preferred_element_type=jnp.float32)
        drhs = drhs.at[tile_group].add(dw)
        return drhs, dx.astype(lhs.dtype).reshape(chunk * tile, k)

    drhs = _varying_like(jnp.zeros(rhs.shape, jnp.float32), rhs, dout)  # the scan carry: the type of rhs
    drhs, dx = jax.lax.scan(step, drhs, _chunks(layout, chunk, tile))
    dlhs = _gather_rows(dx.reshape(num_tiles * tile, k), layout.dest)
    return dlhs, drhs.astype(rhs.dtype), None  # None: group_sizes (integers) get no gradient


def _varying_like(init: jax.Array, *operands: jax.Array) -> jax.Array:
    """``init`` typed as varying over every manual mesh axis that one of ``operands`` varies over (inside
    ``jax.shard_map``; elsewhere the same values and type): adding a zero summed from each operand gives ``init``
    their axes on any jax version (the sums are over empty slices: XLA folds them away)."""
    zero = sum(jnp.sum(a[:0], dtype=init.dtype) for a in operands)
    return init + zero


_tiled_vjp = jax.custom_vjp(_tiled_forward, nondiff_argnums=(3, 4, 5, 6))
_tiled_vjp.defvjp(
    lambda lhs, rhs, group_sizes, tile, chunk, num_tiles, out_dtype: (
        _tiled_forward(lhs, rhs, group_sizes, tile, chunk, num_tiles, out_dtype), (lhs, rhs, group_sizes)),
    _tiled_backward,
)


# ------------------------------------------------------------------------------------------------ dispatching
def _pallas_triton_available() -> bool:
    """Whether this jax ships the Pallas-Triton lowering of ``ragged_dot`` (the public wheels through 0.11.2 have its
    config flag but not the module: on an H100 with jax 0.11.2 ``pallas_triton`` ran ``tiled``)."""
    try:
        return importlib.util.find_spec(_PALLAS_TRITON_MODULE) is not None
    except ModuleNotFoundError:
        return False


__all__ = ["GROUPED_MATMUL_IMPLS", "choose_grouped_matmul_impl", "default_tile", "grouped_matmul"]
