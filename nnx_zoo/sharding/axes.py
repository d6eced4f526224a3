"""The vocabulary: every mesh axis, the family-neutral logical axis names, and the names families declare.

Model code names dimensions with logical names; rule sets (``rules.py``) map them to the mesh axes. The shared
names below are family-neutral (any decoder has heads, an embedding width, MLP widths, experts...). A family that
needs a name of its own declares it in its own folder with ``declare_axis(name, like=shared_name, doc=...)``:
every rule set that does not mention the name itself places it with the rules of its ``like`` name, so no rule
set is edited per family. A logical name that is neither shared, nor declared, nor mentioned by the rule set in
use is a typo, and the resolver rejects it in strict mode, so that a misspelt name cannot silently replicate a
large tensor.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Mapping, Set
from types import MappingProxyType

# Physical mesh axes, in mesh order (outermost first).
MESH_AXES: tuple[str, ...] = (
    "stage",  # pipeline parallelism: each position holds a contiguous block of the layer stacks' layers
    "data",  # pure data parallelism: batch split, parameters replicated
    "fsdp",  # data parallelism with parameters (and optimizer state) sharded
    "fsdp_transpose",  # a second FSDP axis that shards the other matrix dimension
    "context",  # context (sequence) parallelism
    "tensor",  # tensor parallelism (Megatron-style: heads and MLP width)
    "tensor_transpose",  # tensor parallelism over the model width
    "expert",  # expert parallelism
)

# Family-neutral logical names (what the shared layers and every rule set use).
LOGICAL_AXES: dict[str, str] = {
    # ---- parameters ----
    "vocab": "vocabulary rows of the token embedding and the output head",
    "embed": "model width (hidden_size) of non-expert weights",
    "embed_no_exp": "model width of routed-expert weights (never bound to the axes that shard experts)",
    "latent": "low-rank latent width of a factorized projection (the input dim of its up-projection)",
    "mlp": "hidden width of a dense (SwiGLU) MLP, including the shared experts",
    "moe_mlp": "hidden width of one routed expert",
    "exp": "routed-expert index of the stacked expert weights",
    "exp_router": "expert dim of the router weight and its correction bias (replicated: top-k needs all scores)",
    "heads": "attention heads",
    "kv_heads": "key/value heads of grouped-query attention weights (num_key_value_heads; heads when MHA)",
    "kv": "per-head feature width (query/key width or value width)",
    "norm": "RMSNorm scale vectors",
    "bias": "bias vectors",
    "lora_rank": "rank of a LoRA adapter",
    "layers": "leading stack axis of scanned decoder layers (one entry per layer; the pipeline's stage axis splits it)",
    "unpipelined_layers": "leading stack axis of scanned layers that run outside the pipeline, whole on every stage "
                          "(a dense prefix, multi-token-prediction heads): never split over 'stage'",
    "hc_streams": "residual streams of a hyper-connection's weights (hc_mult; a handful: replicated)",
    "hc_mix": "a hyper-connection's mixing coefficients (pre, post and the streams x streams matrix)",
    # ---- activations ----
    "activation_batch": "batch dim of activations",
    "activation_embed_and_logits_batch": "batch dim of the activations outside the pipeline (the embedding's output, "
                                         "the final hidden state, logits and loss inputs, a dense prefix's and the "
                                         "MTP heads' activations): the batch's axes plus 'stage', so no stage repeats "
                                         "another's work (MaxText's name)",
    "activation_length": "sequence dim of activations (the context-parallel dim)",
    "activation_kv_length": "key/value sequence dim inside attention",
    "activation_embed": "model-width dim of activations",
    "activation_heads": "attention-head dim of activations",
    "activation_kv_heads": "key/value-head dim of grouped-query attention's keys, values and scores",
    "activation_kv": "per-head feature dim of activations",
    "activation_mlp": "hidden dim of dense-MLP activations",
    "activation_vocab": "vocabulary dim of logits",
    "activation_hc": "residual-stream dim of hyper-connection activations ([batch, seq, streams, embed])",
    "activation_exp": "expert dim of activations inside the MoE block",
    "activation_moe_mlp": "hidden dim of expert activations",
    "activation_tokens": "flattened token dim (batch x length) inside the MoE block",
    "activation_topk": "the k selected experts of each token",
    "activation_stack": "stacked (scanned) layer dim of per-layer outputs",
    "activation_microbatch": "micro-batch index of the batch-split schedule",
    "cache_batch": "batch dim of a decoding cache",
    "cache_length": "sequence dim of a decoding cache",
    "cache_kv": "feature dim of a decoding cache",
    "cache_kv_heads": "key/value-head dim of a grouped-query attention decoding cache",
}

# Shared names that a rule set which does not mention them places like another shared name (as a declared name's
# ``like``): a user's own rule set written before ``latent`` existed still FSDP-shards latents like the width.
# A set that does not mention the batch outside the pipeline splits it as the batch inside (as before the name).
SHARED_LIKE: Mapping[str, str] = MappingProxyType({"latent": "embed",
                                                   "activation_embed_and_logits_batch": "activation_batch"})

# Shared names that are leading layer-stack axes (one entry per layer, never a matrix dim). A declared name
# placed like one of them is a stack axis too (``STACK_AXES``).
UNPIPELINED_STACK = "unpipelined_layers"  # the stack axis of layers that run outside the pipeline
_SHARED_STACK_AXES = frozenset({"layers", UNPIPELINED_STACK})


@dataclasses.dataclass(frozen=True)
class DeclaredAxis:
    """A logical name a model family declared (``declare_axis``): placed like ``like`` unless a rule set names it.

    ``like=None``: replicated unless a rule set names it. ``where``: the ``file:line`` of the declaration.
    """

    name: str
    like: str | None
    doc: str
    where: str

    def same_meaning(self, other: DeclaredAxis) -> bool:
        return (self.like, self.doc) == (other.like, other.doc)


_DECLARED: dict[str, DeclaredAxis] = {}
_version = 0  # bumped by every new declaration; rules.py caches expanded rule sets against it


def declare_axis(name: str, *, like: str | None, doc: str) -> str:
    """Declare a family's own logical name, placed by every rule set like the known name ``like``.

    A rule set that mentions ``name`` itself places it by its own rules; any other rule set (the named ones and
    a user's own) uses the rules of ``like`` (or of ``like``'s ``like``, for a chain of declared names) at their
    position, after ``like`` itself: in an array that has both names, ``like`` picks its mesh axes first.
    ``like=None`` replicates the name unless a rule set names it. A name placed like a stack axis (``layers``) is
    a stack axis. Declaring the same name again with the same ``like`` and ``doc`` is a no-op (module reloads);
    with another meaning it is an error naming both places. Returns ``name``.

    >>> MY_LATENT = declare_axis("my_latent", like="latent", doc="my family's attention latent width")
    >>> like_chain("my_latent"), placed_like("my_latent")
    (('my_latent', 'latent', 'embed'), 'embed')
    """
    global _version
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"declare_axis: a logical name must be an identifier-like string, got {name!r}")
    if not doc:
        raise ValueError(f"declare_axis({name!r}): give doc=, one line on what the dimension is")
    if name in LOGICAL_AXES:
        raise ValueError(
            f"declare_axis({name!r}): {name!r} is a shared logical name (nnx_zoo/sharding/axes.py: "
            f"{LOGICAL_AXES[name]!r}); use it as it is, or declare a name of your own"
        )
    if like is not None and not is_known(like):
        raise ValueError(
            f"declare_axis({name!r}, like={like!r}): {like!r} is not a known logical name; `like` must be a shared "
            f"name (nnx_zoo/sharding/axes.py) or one declared before, e.g. like='embed'"
        )
    frame = sys._getframe(1)
    new = DeclaredAxis(name, like, doc, f"{frame.f_code.co_filename}:{frame.f_lineno}")
    old = _DECLARED.get(name)
    if old is not None:
        if old.same_meaning(new):
            return name
        raise ValueError(
            f"logical name {name!r} declared twice with different meanings: at {old.where} like={old.like!r} "
            f"({old.doc!r}), and at {new.where} like={new.like!r} ({new.doc!r}). Use one declaration (import it) "
            "or give one of them another name"
        )
    _DECLARED[name] = new
    _version += 1
    return name


def declared_axes() -> Mapping[str, DeclaredAxis]:
    """The family-declared names so far (read-only), in declaration order."""
    return MappingProxyType(_DECLARED)


def declarations_version() -> int:
    """A number that changes whenever a name is declared (for caches of expanded rule sets)."""
    return _version


def is_known(name: str) -> bool:
    """Whether ``name`` is a shared or a declared logical name."""
    return name in LOGICAL_AXES or name in _DECLARED


def _like(name: str) -> str | None:
    if name in _DECLARED:
        return _DECLARED[name].like
    return SHARED_LIKE.get(name)


def like_chain(name: str) -> tuple[str, ...]:
    """``name`` then each ``like`` it is placed by (declared names, then ``SHARED_LIKE``), ending at a shared
    name without one (or at a ``like=None`` name). A rule set places ``name`` by the first of these it mentions.

    >>> import nnx_zoo.models.deepseek  # declares DeepSeek's names
    >>> like_chain("moe_layers")  # declared like 'layers'
    ('moe_layers', 'layers')
    >>> like_chain("q_lora")  # declared like 'latent', which a set that does not mention it places like 'embed'
    ('q_lora', 'latent', 'embed')
    """
    chain = [name]
    while (like := _like(chain[-1])) is not None:
        chain.append(like)  # acyclic: `like` must be known when a name is declared
    return tuple(chain)


def placed_like(name: str) -> str | None:
    """The shared name at the root of ``name``'s like chain (``name`` itself when it is a shared name without a
    ``SHARED_LIKE``; None when it is replicated). ``placed_like("q_lora") == "embed"``: an FSDP-gathered width."""
    root = like_chain(name)[-1]
    return root if root in LOGICAL_AXES else None


def describe(name: str) -> str:
    """One line on what a logical axis name means (KeyError for unknown names)."""
    if name in LOGICAL_AXES:
        return LOGICAL_AXES[name]
    decl = _DECLARED[name]
    placed = f"placed like {decl.like!r}" if decl.like else "replicated unless a rule set names it"
    return f"{decl.doc} ({placed}; declared at {decl.where})"


class _StackAxes(Set):
    """Live set of the stack-axis names: the shared ones and every declared name placed like one of them."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and is_known(name) and placed_like(name) in _SHARED_STACK_AXES

    def __iter__(self) -> Iterator[str]:
        yield from sorted(_SHARED_STACK_AXES)
        yield from (n for n in _DECLARED if n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _from_iterable(cls, it: object) -> frozenset[str]:  # set operators (STACK_AXES | {...}) give a snapshot
        return frozenset(it)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"STACK_AXES({sorted(self)})"


# Leading layer-stack axes (the ``axis_name`` of ``nnx_zoo.layers.scan.create_stack``): one entry per layer,
# never a matrix dim, so per-matrix optimizers (Muon) treat them as batch dims. Live: includes names declared
# later.
STACK_AXES: Set[str] = _StackAxes()
