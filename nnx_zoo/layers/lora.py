"""LoRA: low-rank adapters on chosen projections, trained alone, then merged back into the base weights.

``apply_lora(model, pattern=..., rank=r, alpha=a)`` replaces, in place, every ``Linear`` (and, when the pattern
asks for them, every ``RoutedExperts``) whose '/'-joined module path matches the regex ``pattern`` (default: the
model's own ``lora_targets``, which each family declares in its folder) by a wrapper that adds
``(alpha / r) * (x @ A) @ B`` to the base projection. ``A [*in, r]`` and ``B [r, *out]`` are ``LoRAParam``
Variables (a subclass of ``nnx.Param``): ``nnx.Optimizer(model, tx, wrt=LoRAParam)`` trains only them, while
``nnx.Param`` filters still see the frozen base weights too. ``B`` starts at zero, so an adapted model
computes exactly what its base did until the first update.

Sharding: each factor reuses the base kernel's logical names for the dims it shares with it (A: the kernel's input
names, B: its output names, both: any leading stack or expert names) and ``lora_rank`` (replicated in every rule
set) for the rank dim, and is placed on the mesh the base kernel lives on, through the same resolver.

Scanned layer stacks: a stacked kernel ``[layers, *in, *out]`` gets stacked factors ``[layers, *in, r]`` /
``[layers, r, *out]`` under the same leading logical name, so the layer scan slices them with the base weights.
Routed experts ``[E, in, out]`` get one adapter per expert, ``[E, in, r]`` / ``[E, r, out]``, on each of
``wi_gate``, ``wi_up`` and ``wo``; their forward pass adds the low-rank delta to the expert weights (a transient
array the size of those weights) and runs the unchanged expert computation.

``merge_lora(model)`` folds ``W += (alpha / r) A @ B`` into every adapted weight and puts the plain modules back,
so ``model.save_pretrained(dir)`` writes ordinary Hugging Face weights. A pretraining run (``nnx_zoo.train.train``)
with adapters records them in its model settings as ``{"lora": lora_settings(...)}``; ``nnx_zoo.train.export_run``
(``recipes/export_hf.py``) then exports its checkpoints merged.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.moe import RoutedExperts
from nnx_zoo.layers.spec import weight_einsum, without_reduced
from nnx_zoo.sharding import get_rules, shard, shard_mode_of, variable_spec
from nnx_zoo.sharding.rules import Rules

# Transitional: the pattern that was the default before families declared ``lora_targets`` (it equals
# ``DeepSeekV3.lora_targets``); use ``apply_lora(model)`` or ``type(model).lora_targets`` instead.
DEFAULT_PATTERN = r"(^|/)attn/(q|q_a|q_b|kv_a|kv_b|o)_proj$"
# Add this to the pattern (with '|') to adapt the routed experts as well.
EXPERTS_PATTERN = r"(^|/)mlp/experts$"
RANK_NAME = "lora_rank"
_EXPERT_WEIGHTS = ("wi_gate", "wi_up", "wo")


class LoRAParam(nnx.Param):
    """A LoRA factor. Being an ``nnx.Param``, it is trained by default; filter on it to train only adapters:

    >>> optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=LoRAParam)
    """


class LoRALinear(nnx.Module):
    """``base(x) + scale * (x @ lora_a) @ lora_b``: a ``Linear`` with a low-rank adapter (made by ``apply_lora``).

    ``lora_a [*stack, *in, r]``, ``lora_b [*stack, r, *out]`` (``*stack``: the leading layer dim of a scanned
    stack, sliced away by the scan). ``scale = alpha / r``.

    >>> proj = Linear(64, 32, kernel_names=("embed", "mlp"), rngs=nnx.Rngs(0))
    >>> holder = nnx.Dict(proj=proj)
    >>> adapted_paths = apply_lora(holder, pattern="proj", rank=4, alpha=8)
    >>> type(holder.proj).__name__, holder.proj.lora_b.shape
    ('LoRALinear', (4, 32))
    """

    def __init__(self, base: Linear, lora_a: LoRAParam, lora_b: LoRAParam, *, rank: int, alpha: float):
        self.base = base
        self.lora_a = lora_a
        self.lora_b = lora_b
        self.rank = rank
        self.alpha = alpha

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def __call__(self, x: jax.Array, out_names: tuple[str | None, ...] | None = None) -> jax.Array:
        base = self.base
        n_in, n_out = len(base.in_features), len(base.out_features)
        y = base(x, out_names)
        letters = string.ascii_lowercase
        ins, outs, r = letters[:n_in], letters[n_in : n_in + n_out], letters[n_in + n_out]
        lead = letters[n_in + n_out + 1 : n_in + n_out + 1 + x.ndim - n_in]
        down, up = f"{lead}{ins},{ins}{r}->{lead}{r}", f"{lead}{r},{r}{outs}->{lead}{outs}"
        x = x.astype(base.dtype)
        a, b = self.lora_a[...].astype(base.dtype), self.lora_b[...].astype(base.dtype)
        if out_names is None:
            h = jnp.einsum(down, x, a)
            return y + self.scale * jnp.einsum(up, h, b)
        h_names = tuple(out_names[: len(lead)]) + (None,)  # the rank dim of the activation is replicated
        h = shard(weight_einsum(down, x, a, h_names), h_names)
        return shard(y + self.scale * weight_einsum(up, h, b, out_names), out_names)


class LoRAExperts(nnx.Module):
    """``RoutedExperts`` whose ``wi_gate``, ``wi_up`` and ``wo`` each carry one adapter per expert (``apply_lora``).

    ``{name}_a [*stack, E, in, r]``, ``{name}_b [*stack, E, r, out]``; the forward pass runs the base experts
    with ``W + scale * A @ B`` in place of each ``W``.
    """

    def __init__(self, base: RoutedExperts, factors: dict[str, tuple[LoRAParam, LoRAParam]], *, rank: int,
                 alpha: float):
        self.base = base
        for name in _EXPERT_WEIGHTS:
            setattr(self, f"{name}_a", factors[name][0])
            setattr(self, f"{name}_b", factors[name][1])
        self.rank = rank
        self.alpha = alpha

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def factors(self, name: str) -> tuple[LoRAParam, LoRAParam]:
        return getattr(self, f"{name}_a"), getattr(self, f"{name}_b")

    def cast_once_names(self, impl: str, capacity_factor: float | None = None) -> tuple[str, ...]:
        """None (``RoutedExperts.cast_once_names``): each layer merges its adapters into the stored weights before
        any cast, so a layer scan has nothing to cast beforehand."""
        return ()

    def __call__(self, x: jax.Array, expert_idx: jax.Array, weights: jax.Array, **kwargs: Any) -> Any:
        """Same arguments and results as ``RoutedExperts.__call__``."""
        graphdef, state = nnx.split(self.base)
        for name in _EXPERT_WEIGHTS:
            a, b = self.factors(name)
            w = state[name]
            # Merged here, so a base weight or factor typed reduced (gathered once for several uses) is summed
            # over those axes first: an elementwise sum takes no mixed reduced inputs.
            base, a, b = (without_reduced(v[...]) for v in (w, a, b))
            state[name] = w.copy(base + (self.scale * low_rank_delta(a, b, n_in=1, like=base)).astype(w.dtype))
        return nnx.merge(graphdef, state)(x, expert_idx, weights, **kwargs)


def low_rank_delta(a: jax.Array, b: jax.Array, *, n_in: int, like: jax.Array) -> jax.Array:
    """``A @ B`` over the rank dim: ``a [*lead, *in, r]``, ``b [*lead, r, *out]`` -> ``[*lead, *in, *out]``.

    Under an Explicit mesh the factors are first laid out like the matching dims of ``like`` (the base weight),
    and the product comes out with ``like``'s sharding: each factor was resolved on its own, so a mesh axis that
    the base weight could give only one of its dims may shard both A's input and B's output dim.
    """
    n_lead = a.ndim - n_in - 1
    n_out = b.ndim - n_lead - 1
    letters = string.ascii_lowercase
    lead, ins = letters[:n_lead], letters[n_lead : n_lead + n_in]
    outs, r = letters[n_lead + n_in : n_lead + n_in + n_out], letters[n_lead + n_in + n_out]
    equation = f"{lead}{ins}{r},{lead}{r}{outs}->{lead}{ins}{outs}"
    sharding = jax.typeof(like).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or shard_mode_of(mesh) != "explicit":
        return jnp.einsum(equation, a, b)
    spec = tuple(sharding.spec) + (None,) * (like.ndim - len(sharding.spec))
    a = jax.reshard(a, NamedSharding(mesh, PartitionSpec(*spec[: n_lead + n_in], None)))
    b = jax.reshard(b, NamedSharding(mesh, PartitionSpec(*spec[:n_lead], None, *spec[n_lead + n_in :])))
    return jnp.einsum(equation, a, b, out_sharding=NamedSharding(mesh, PartitionSpec(*spec)))


# ---------------------------------------------------------------- adding adapters
def apply_lora(
    model: nnx.Module,
    *,
    pattern: str | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    rules: Rules | str | None = None,
) -> list[str]:
    """Wrap, in place, every ``Linear`` / ``RoutedExperts`` of ``model`` whose module path matches ``pattern``.

    ``pattern`` is a regex searched in '/'-joined module paths such as ``layers/attn/q_proj`` or
    ``moe_layers/mlp/experts``; None (the default) takes the model's ``lora_targets`` (Llama / Qwen3: attention's
    q/k/v/o and the MLP's gate/up/down; DeepSeek-V3: MLA's projections); add ``EXPERTS_PATTERN`` for routed
    experts. ``A`` starts uniform in ``+-1/sqrt(fan_in)``, ``B`` at zero;
    the update is scaled by ``alpha / rank``. Adapters are placed on the mesh of their base weights, resolved with
    ``rules`` (default: ``model.rules``, else the ``default`` set). Returns the adapted module paths.

    >>> adapted = apply_lora(model, rank=8, alpha=16)                     # the family's default targets
    >>> adapted = apply_lora(model, pattern=type(model).lora_targets + "|" + EXPERTS_PATTERN)  # plus experts
    >>> optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=LoRAParam)
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be positive, got {alpha!r} (the update is scaled by alpha / rank)")
    if pattern is None:
        pattern = getattr(type(model), "lora_targets", None)
        if not isinstance(pattern, str):
            raise ValueError(f"{type(model).__name__} declares no default LoRA targets (a class attribute "
                             "lora_targets); pass pattern=, a regex over '/'-joined module paths")
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise ValueError(f"LoRA pattern {pattern!r} is not a valid regular expression: {err}") from None
    rules = get_rules(rules if rules is not None else getattr(model, "rules", "default"))

    candidates, adapted_already = [], []
    for path, node, parent in _walk(model):
        if isinstance(node, (LoRALinear, LoRAExperts)):
            if regex.search(path):
                adapted_already.append(path)
        elif isinstance(node, (Linear, RoutedExperts)) and not isinstance(parent, (LoRALinear, LoRAExperts)):
            candidates.append(path)
    if adapted_already:
        raise ValueError(f"LoRA pattern {pattern!r} matches modules that already have adapters: {adapted_already}; "
                         "call merge_lora(model) first, or narrow the pattern")
    chosen = [p for p in candidates if regex.search(p)]
    if not chosen:
        raise ValueError(f"LoRA pattern {pattern!r} matches no Linear or RoutedExperts module; module paths are: "
                         f"{candidates}")

    rng = np.random.default_rng(seed)
    for path in chosen:
        parent, attr = _locate(model, path)
        node = _get_child(parent, attr)
        if isinstance(node, Linear):
            _check_rank(path, rank, math.prod(node.in_features), math.prod(node.out_features))
            a, b = _factors(node.kernel, f"{path}/kernel", len(node.in_features), len(node.out_features), rank,
                            rules, rng)
            wrapper: nnx.Module = LoRALinear(node, a, b, rank=rank, alpha=alpha)
        else:
            _check_rank(path, rank, node.wi_gate.shape[-2], node.wi_gate.shape[-1])
            pairs = {name: _factors(getattr(node, name), f"{path}/{name}", 1, 1, rank, rules, rng)
                     for name in _EXPERT_WEIGHTS}
            wrapper = LoRAExperts(node, pairs, rank=rank, alpha=alpha)
        _set_child(parent, attr, wrapper)
    return chosen


def lora_settings(*, pattern: str | None = None, rank: int = 8, alpha: float = 16.0) -> dict[str, Any]:
    """The record of ``apply_lora(model, pattern=, rank=, alpha=)`` that a training run keeps in its model settings,
    so that ``nnx_zoo.train.export_run`` can rebuild the adapted model and export merged weights (the adapters'
    alpha and pattern are not in the checkpoint's weights). ``pattern=None``: the family's ``lora_targets``.

    >>> adapt = dict(pattern=None, rank=8, alpha=16.0)
    >>> def make_model():
    ...     model = Llama3(config, rngs=nnx.Rngs(0))
    ...     apply_lora(model, **adapt)
    ...     return model
    >>> train(make_model, train_config, vocab_size=config.vocab_size, flops_per_token=...,
    ...       model_structure=structure, model_settings={**settings, "lora": lora_settings(**adapt)})
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be positive, got {alpha!r}")
    return {"pattern": pattern, "rank": rank, "alpha": float(alpha)}


def _check_rank(path: str, rank: int, fan_in: int, fan_out: int) -> None:
    if rank > min(fan_in, fan_out):
        raise ValueError(f"LoRA rank {rank} exceeds the rank of {path}'s weight ({fan_in} x {fan_out}); choose a "
                         f"rank of at most {min(fan_in, fan_out)}")


def _factors(kernel: nnx.Variable, path: str, n_in: int, n_out: int, rank: int, rules: Rules,
             rng: np.random.Generator) -> tuple[LoRAParam, LoRAParam]:
    """``A [*lead, *in, r]`` (uniform in +-1/sqrt(fan_in)) and ``B [*lead, r, *out]`` (zeros) for a kernel
    ``[*lead, *in, *out]``: its logical names plus ``lora_rank``, on the mesh the kernel lives on (each factor's
    names resolved with ``rules``).

    Values are drawn on the host with numpy and each device receives only its shards: no compilation per factor
    shape (XLA:CPU takes ~0.3 s to compile one threefry draw), and the same values whatever the mesh.
    """
    shape = tuple(kernel.shape)
    names = tuple(kernel.get_metadata().get("out_sharding") or (None,) * len(shape))
    n_lead = len(shape) - n_in - n_out
    a_shape, a_names = shape[: n_lead + n_in] + (rank,), names[: n_lead + n_in] + (RANK_NAME,)
    b_shape = shape[:n_lead] + (rank,) + shape[n_lead + n_in :]
    b_names = names[:n_lead] + (RANK_NAME,) + names[n_lead + n_in :]
    bound = 1.0 / math.sqrt(math.prod(shape[n_lead : n_lead + n_in]))
    a_host = ((2 * rng.random(a_shape, dtype=np.float32) - 1) * bound).astype(kernel.dtype)
    b_host = np.zeros(b_shape, kernel.dtype)
    mesh = _mesh_of(kernel[...])

    def place(host: np.ndarray, names: tuple[str | None, ...], suffix: str) -> LoRAParam:
        if mesh is None:
            value = jnp.asarray(host)
        else:
            probe = LoRAParam(jax.ShapeDtypeStruct(host.shape, host.dtype), out_sharding=names, eager_sharding=False)
            sharding = NamedSharding(mesh, variable_spec(f"{path}.{suffix}", probe, rules, mesh))
            value = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
        return LoRAParam(value, out_sharding=names, eager_sharding=False)

    return place(a_host, a_names, "lora_a"), place(b_host, b_names, "lora_b")


def _mesh_of(value: Any) -> jax.sharding.Mesh | None:
    """The device mesh a concrete array is laid out on (None for single-device or abstract values)."""
    sharding = getattr(value, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh) and not mesh.empty and mesh.size > 1:
        return mesh
    return None


# ---------------------------------------------------------------- merging
def merge_lora(model: nnx.Module) -> int:
    """Fold every adapter into its base weight (``W += (alpha / r) A @ B``, kept on ``W``'s sharding) and put the
    plain ``Linear`` / ``RoutedExperts`` back in place. Returns how many modules were merged.

    The adapted weights are updated in one compiled call that reuses their buffers (donated), so merging needs
    no second copy of them.

    >>> merged_count = merge_lora(model)
    >>> model.save_pretrained("/tmp/finetuned")  # plain Hugging Face weights
    """
    wrappers = [(path, node) for path, node, _ in _walk(model) if isinstance(node, (LoRALinear, LoRAExperts))]
    folds: list[tuple[nnx.Variable, LoRAParam, LoRAParam, int, float]] = []
    for _, node in wrappers:
        if isinstance(node, LoRALinear):
            folds.append((node.base.kernel, node.lora_a, node.lora_b, len(node.base.in_features), node.scale))
        else:
            folds += [(getattr(node.base, name), *node.factors(name), 1, node.scale) for name in _EXPERT_WEIGHTS]

    def fold_all(kernels: list[jax.Array], a: list[jax.Array], b: list[jax.Array]) -> list[jax.Array]:
        out = []
        for w, a_i, b_i, (_, _, _, n_in, scale) in zip(kernels, a, b, folds):
            delta = low_rank_delta(a_i.astype(jnp.float32), b_i.astype(jnp.float32), n_in=n_in, like=w)
            out.append((w.astype(jnp.float32) + scale * delta).astype(w.dtype))
        return out

    kernels = [kernel[...] for kernel, *_ in folds]
    merged = jax.jit(fold_all, donate_argnums=0, out_shardings=[getattr(w, "sharding", None) for w in kernels])(
        kernels, [a[...] for _, a, *_ in folds], [b[...] for _, _, b, *_ in folds])
    for (kernel, *_), value in zip(folds, merged):
        kernel.set_value(value)  # a whole new array: the old one was donated
    for path, node in wrappers:
        _set_child(*_locate(model, path), node.base)
    return len(wrappers)


# ---------------------------------------------------------------- graph walking
def _walk(model: nnx.Module) -> Iterator[tuple[str, Any, Any]]:
    """``('/'-joined path, node, parent node)`` for every module of ``model``, parents before children."""
    seen: set[int] = set()

    def visit(node: Any, path: tuple[str, ...], parent: Any) -> Iterator[tuple[str, Any, Any]]:
        if id(node) in seen:
            return
        seen.add(id(node))
        yield "/".join(path), node, parent
        for name, child in nnx.iter_children(node):
            if isinstance(child, nnx.Module):
                yield from visit(child, path + (str(name),), node)

    yield from visit(model, (), None)


def _locate(model: nnx.Module, path: str) -> tuple[Any, str]:
    *parents, attr = path.split("/")
    node = model
    for name in parents:
        node = _get_child(node, name)
    return node, attr


def _get_child(parent: Any, name: str) -> Any:
    return parent[int(name) if name.isdigit() else name] if not hasattr(parent, name) else getattr(parent, name)


def _set_child(parent: Any, name: str, value: Any) -> None:
    if hasattr(parent, name):
        setattr(parent, name, value)
    else:
        parent[int(name) if name.isdigit() else name] = value
