"""Rule sets as data.

A rule set is an ordered tuple of ``(logical_name, mesh_axes)`` pairs; ``mesh_axes`` is one mesh axis, a tuple
of them, or ``None`` for replicated. A logical name may appear several times: later entries are fallbacks, tried
(in order) when an earlier entry's mesh axes are already bound to another dimension of the same array. A rule may
name a mesh axis the current mesh lacks or has at size 1; the resolver drops it. A shared logical name that a
rule set does not mention is replicated, except one with a ``SHARED_LIKE`` (``latent``: placed like ``embed``).
Rule sets name only the family-neutral vocabulary of ``axes.py``; a name a family declared (``declare_axis(name,
like=...)``) and that a rule set does not mention is placed by copies of its ``like`` name's rules
(``expand_rules``), so no rule set is edited per family.

Switching parallelism strategy is choosing another set by name: ``get_rules("ep-as-cp")``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Union

from nnx_zoo.sharding.axes import MESH_AXES, SHARED_LIKE, declarations_version, declared_axes, like_chain

MeshAxes = Union[str, tuple[str, ...], None]
Rule = tuple[str, MeshAxes]
Rules = tuple[Rule, ...]

# Weights: the model width is sharded by every data-parallel-like axis (FSDP); fallbacks drop the axes that a
# tensor-parallel dimension of the same weight already took.
_EMBED = (
    ("embed", ("fsdp", "fsdp_transpose", "tensor_transpose", "context", "expert")),
    ("embed", ("fsdp", "tensor_transpose", "context", "expert")),
    ("embed", ("fsdp", "fsdp_transpose", "context", "expert")),
    ("embed", ("fsdp", "context", "expert")),
)
# Expert weights: like embed, but never on the axes that shard the expert dim.
_EMBED_NO_EXP = (
    ("embed_no_exp", ("fsdp", "fsdp_transpose", "tensor_transpose", "context")),
    ("embed_no_exp", ("fsdp", "tensor_transpose", "context")),
    ("embed_no_exp", ("fsdp", "fsdp_transpose", "context")),
    ("embed_no_exp", ("fsdp", "context")),
)


def _latent(drop: tuple[str, ...] = ()) -> Rules:
    """The ``latent`` rules: embed's ladder without the mesh axes ``drop`` (repeats after the drop removed).

    Listed after ``embed``'s rules, so a down-projection ``[embed, latent]`` gives ``embed`` its axes first and the
    latent keeps what is left (nothing: every rung has ``fsdp``), as MaxText's ``*_lora_up_proj -> []``. Sets drop
    axes where MaxText keeps latents (512-1536 wide) on fewer axes than the width, so that they divide at scale.
    """
    rungs = (tuple(a for a in axes if a not in drop) for _, axes in _EMBED)
    return tuple(("latent", axes) for axes in dict.fromkeys(rungs))


_TENSOR_PARAMS = (
    ("vocab", ("tensor", "tensor_transpose")),
    ("mlp", ("fsdp_transpose", "tensor")),
    ("moe_mlp", ("fsdp_transpose", "tensor")),
    ("heads", ("tensor", "tensor_transpose")),
    ("heads", "tensor"),
    ("kv_heads", ("tensor", "tensor_transpose")),
    ("kv_heads", "tensor"),
)
_REPLICATED = (
    ("kv", None),
    ("norm", None),
    ("bias", None),
    ("exp_router", None),
    ("lora_rank", None),
    # Pipeline parallelism: a mesh with a ``stage`` axis gives each stage a contiguous block of every layer stack
    # (stage s holds layers s*L/S .. (s+1)*L/S - 1); without one (size 1) the resolver drops it: replicated.
    ("layers", "stage"),
    ("unpipelined_layers", None),  # stacks that run outside the pipeline stay whole on every stage
)
_ACT_COMMON = (
    ("activation_embed", "tensor_transpose"),
    ("activation_heads", ("tensor", "tensor_transpose")),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", ("tensor", "tensor_transpose")),
    ("activation_kv_heads", "tensor"),
    ("cache_kv_heads", ("tensor", "tensor_transpose")),
    ("cache_kv_heads", "tensor"),
    ("activation_mlp", ("tensor", "tensor_transpose")),
    ("activation_moe_mlp", ("tensor", "tensor_transpose")),
    ("activation_vocab", ("tensor", "tensor_transpose")),
    ("activation_vocab", "tensor"),
    ("activation_kv", None),
    ("activation_kv_length", None),
    ("activation_topk", None),
    ("activation_stack", None),
    ("activation_microbatch", None),
    ("cache_length", None),
    ("cache_kv", None),
)



def _outside_pipeline(batch_axes: tuple[str, ...]) -> Rules:
    """The batch outside the pipeline (``activation_embed_and_logits_batch``, MaxText's name): the batch's axes,
    then ``stage``, so the embedding, the final norm, the head and the loss (a dense prefix, MTP heads) split the
    batch over the stages instead of every stage computing them whole. ``stage`` last: a mesh without it (or at
    size 1) resolves exactly as ``activation_batch``; a batch that divides the batch's axes but not ``stage`` too
    falls back (``allow_partial``) to them."""
    return (("activation_embed_and_logits_batch", (*batch_axes, "stage")),)


# default: FSDP over data-like axes, TP over tensor axes, EP over expert (expert also acts as extra FSDP for the
# non-expert weights and as data parallelism for activations outside the MoE core), CP over context.
# In every set activation_tokens ([batch, seq] flattened, for the MoE block) takes the batch's axes, then the
# sequence's, in order: the flatten is then a reshape. With context before expert the MoE block's input was laid
# out again (dense MoE on fsdp 2 x context 2 x expert 2: 10.07 -> 9.82 MiB of collectives per step, Explicit).
DEFAULT: Rules = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    *_outside_pipeline(("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_tokens", ("data", "fsdp", "fsdp_transpose", "expert", "context")),
    ("activation_length", "context"),
    ("activation_exp", "expert"),
    ("cache_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    *_ACT_COMMON,
    *_TENSOR_PARAMS,
    ("exp", "expert"),
    *_EMBED,
    *_latent(),
    *_EMBED_NO_EXP,
    *_REPLICATED,
)

# pure-fsdp: only data/fsdp are used; every other mesh axis (if present) replicates.
PURE_FSDP: Rules = (
    ("activation_batch", ("data", "fsdp")),
    *_outside_pipeline(("data", "fsdp")),
    ("activation_tokens", ("data", "fsdp")),
    ("cache_batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("latent", "fsdp"),
    ("embed_no_exp", "fsdp"),
    ("vocab", "fsdp"),
    ("mlp", "fsdp"),
    ("moe_mlp", "fsdp"),
    ("heads", "fsdp"),
    ("kv_heads", "fsdp"),
    ("exp", None),
    *_REPLICATED,
)

# ep-as-cp: the expert axis shards the sequence (context parallelism) everywhere except inside the MoE core,
# where it shards experts. The batch no longer uses it.
EP_AS_CP: Rules = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose")),
    *_outside_pipeline(("data", "fsdp", "fsdp_transpose")),
    ("activation_tokens", ("data", "fsdp", "fsdp_transpose", "context", "expert")),
    ("activation_length", ("context", "expert")),
    ("activation_exp", "expert"),
    ("cache_batch", ("data", "fsdp", "fsdp_transpose")),
    *_ACT_COMMON,
    *_TENSOR_PARAMS,
    ("exp", "expert"),
    *_EMBED,
    # MaxText: q_lora/kv_lora -> fsdp only. fsdp x expert (2,048 at 256 x 8) does not divide a 512-wide latent.
    *_latent(drop=("expert",)),
    *_EMBED_NO_EXP,
    *_REPLICATED,
)

# cp-as-ep: the context axis shards the sequence outside the MoE core and also shards experts inside it.
CP_AS_EP: Rules = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    *_outside_pipeline(("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_tokens", ("data", "fsdp", "fsdp_transpose", "expert", "context")),
    ("activation_length", "context"),
    ("activation_exp", ("context", "expert")),  # MaxText's order (no byte difference measured either way)
    ("cache_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    *_ACT_COMMON,
    *_TENSOR_PARAMS,
    ("exp", ("context", "expert")),
    ("exp", "expert"),
    *_EMBED,
    *_latent(),
    ("embed_no_exp", ("fsdp", "fsdp_transpose", "tensor_transpose")),
    ("embed_no_exp", ("fsdp", "tensor_transpose")),
    ("embed_no_exp", ("fsdp", "fsdp_transpose")),
    ("embed_no_exp", "fsdp"),
    *_REPLICATED,
)

# ep-as-dp (MaxText's ep-as-dp.yml): outside the MoE core the expert axis is pure data parallelism: it splits the
# batch, and non-expert weights are replicated over it (FSDP over fsdp/fsdp_transpose only), so no weight of
# attention or the dense MLP is cut 'fsdp x expert' ways (MaxText: "removes the constraint where FSDPxEP is limited
# by specific model dimensions"). Inside the MoE core the routed experts stay split over expert.
EP_AS_DP: Rules = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    *_outside_pipeline(("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_tokens", ("data", "fsdp", "fsdp_transpose", "expert", "context")),
    ("activation_length", "context"),
    ("activation_exp", "expert"),
    ("cache_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    *_ACT_COMMON,
    *_TENSOR_PARAMS,
    ("exp", "expert"),
    *((("embed", axes) for _, axes in _EMBED_NO_EXP)),  # embed's ladder without expert
    # MaxText: q_lora/kv_lora -> fsdp only (embed also takes fsdp_transpose): the latent divides however large
    # fsdp x fsdp_transpose grows.
    *_latent(drop=("expert", "fsdp_transpose")),
    *_EMBED_NO_EXP,
    *_REPLICATED,
)

# shard-exp-on-fsdp: FSDP shards the expert dim of MoE weights (exp -> expert x fsdp) instead of their model
# width, so each device holds whole expert matrices (what non-elementwise optimizers such as Muon want).
SHARD_EXP_ON_FSDP: Rules = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    *_outside_pipeline(("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_tokens", ("data", "fsdp", "fsdp_transpose", "expert", "context")),
    ("activation_length", "context"),
    ("activation_exp", ("expert", "fsdp")),
    ("activation_exp", "expert"),
    ("cache_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("exp", ("expert", "fsdp")),
    ("exp", "expert"),
    *_ACT_COMMON,
    *_TENSOR_PARAMS,
    *_EMBED,
    # MaxText: q_lora/kv_lora -> (fsdp, fsdp_transpose, expert), without the context axis embed also takes.
    *_latent(drop=("context",)),
    *_EMBED_NO_EXP,
    # MaxText: embed_moe -> context here. With exp on (expert, fsdp) every rule above is blocked by fsdp; the expert
    # weights' width still takes the axes fsdp does not use.
    ("embed_no_exp", ("tensor_transpose", "context")),
    ("embed_no_exp", "context"),
    *_REPLICATED,
)

# pipeline-large-moe (MaxText's configs/custom_mesh_and_rule/pipeline-large-moe.yml, for pipelined large MoE runs
# such as DeepSeek-V3): layer stacks on `stage`; the batch on (data, fsdp, expert); experts on `expert`; the
# non-expert weights' width on (fsdp, expert) and nothing else (no context, no fsdp_transpose, no fallback ladder);
# the routed experts' width and the attention latents on fsdp alone (MaxText: embed_moe, q_lora, kv_lora -> fsdp),
# so a 512-wide latent divides however large fsdp x expert grows; tensor shards heads, MLP widths, the vocabulary
# and the activations' width. MaxText -> ours: activation_batch(_attn), activation_kv_batch -> activation_batch;
# activation_batch_moe (data, fsdp) -> activation_tokens, see below; activation_length(_attn), activation_q_length,
# activation_norm_length(_moe) -> activation_length (context); activation_embed(_attn, _moe) -> activation_embed;
# activation_mlp(_moe) -> activation_mlp, activation_moe_mlp; activation_heads, activation_kv_heads,
# activation_vocab, activation_exp alike; embed, embed_vocab -> embed; embed_moe -> embed_no_exp; q_lora, kv_lora
# -> latent (DeepSeek declares q_lora, kv_lora like it); mlp_moe -> moe_mlp; q_heads -> heads; cache_heads ->
# cache_kv_heads; layers -> layers (and the stack names declared like it). What differs (README, "Pipeline
# parallelism"): MaxText's norm -> tensor and activation_kv(_head_dim) -> tensor are replicated here (norm scales
# are tiny, and a scale sharded on an axis the activation's other dims use fails under Explicit meshes);
# activation_embed_and_logits_batch -> the same name (every set has it: the batch over stage too, outside the
# pipeline); activation_batch_moe leaves the MoE's tokens unsplit over
# expert, while ours keep them split as they arrive and the `ep` path all-gathers them over expert itself (the
# same tokens meet the same experts); exp_with_fsdp, paged_kv_heads, engram_dim name nothing of ours.
PIPELINE_LARGE_MOE: Rules = (
    ("activation_batch", ("data", "fsdp", "expert")),
    *_outside_pipeline(("data", "fsdp", "expert")),
    ("activation_tokens", ("data", "fsdp", "expert", "context")),
    ("activation_length", "context"),
    ("activation_exp", "expert"),
    ("cache_batch", ("data", "fsdp", "expert")),
    ("activation_embed", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("cache_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_moe_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("activation_kv", None),
    ("activation_kv_length", None),
    ("activation_topk", None),
    ("activation_stack", None),
    ("activation_microbatch", None),
    ("cache_length", None),
    ("cache_kv", None),
    ("vocab", "tensor"),
    ("mlp", "tensor"),
    ("moe_mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("exp", "expert"),
    ("embed", ("fsdp", "expert")),
    ("latent", "fsdp"),
    ("embed_no_exp", "fsdp"),
    *_REPLICATED,
)

RULE_SETS: dict[str, Rules] = {
    "default": DEFAULT,
    "pure-fsdp": PURE_FSDP,
    "ep-as-cp": EP_AS_CP,
    "cp-as-ep": CP_AS_EP,
    "ep-as-dp": EP_AS_DP,
    "shard-exp-on-fsdp": SHARD_EXP_ON_FSDP,
    "pipeline-large-moe": PIPELINE_LARGE_MOE,
}


def _normalize_axes(logical: str, axes: object) -> MeshAxes:
    if axes is None or isinstance(axes, str):
        return axes
    if isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
        return tuple(axes)
    raise TypeError(
        f"rule for {logical!r} maps to {axes!r}; a rule's mesh axes must be a mesh axis name, a tuple of them, "
        "or None (replicated)"
    )


def validate_rules(rules: Iterable[Sequence[object]]) -> Rules:
    """Check a user-supplied rule set and return it as a tuple of ``(name, axes)`` pairs.

    Mesh axes must come from ``MESH_AXES``; a typo there would otherwise silently replicate.
    """
    if isinstance(rules, Mapping):
        raise TypeError(
            "a rule set must be an ordered sequence of (logical_name, mesh_axes) pairs, not a dict: a dict keeps "
            "only one entry per name, which loses the fallback rules"
        )
    out = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise TypeError(f"rule #{i} is {rule!r}; each rule must be a pair (logical_name, mesh_axes)")
        name, axes = rule[0], _normalize_axes(rule[0], rule[1])
        listed = (axes,) if isinstance(axes, str) else axes or ()
        unknown = [a for a in listed if a not in MESH_AXES]
        if unknown:
            raise ValueError(
                f"rule #{i} ({name!r} -> {axes!r}) names unknown mesh axes {unknown}; mesh axes are {MESH_AXES}"
            )
        repeated = sorted({a for a in listed if listed.count(a) > 1})
        if repeated:
            raise ValueError(
                f"rule #{i} ({name!r} -> {axes!r}) names mesh axes {repeated} more than once; a mesh axis can "
                "shard a dimension only once"
            )
        out.append((name, axes))
    return tuple(out)


def get_rules(name_or_rules: str | Iterable[Sequence[object]]) -> Rules:
    """A named rule set (``default``, ``pure-fsdp``, ``ep-as-cp``, ``cp-as-ep``, ``ep-as-dp``,
    ``shard-exp-on-fsdp``, ``pipeline-large-moe``), or a user-supplied sequence of ``(logical_name, mesh_axes)``
    validated as such.

    >>> get_rules("pure-fsdp")[0]
    ('activation_batch', ('data', 'fsdp'))
    """
    if isinstance(name_or_rules, str):
        try:
            return RULE_SETS[name_or_rules]
        except KeyError:
            raise ValueError(
                f"unknown rule set {name_or_rules!r}; choose one of {sorted(RULE_SETS)} or pass your own "
                "sequence of (logical_name, mesh_axes) pairs"
            ) from None
    if any(name_or_rules is named for named in RULE_SETS.values()) or any(
            name_or_rules is derived for _, derived in _OUTSIDE.values()):
        return name_or_rules  # already valid (and this is the hot path: one call per resolved array)
    return validate_rules(name_or_rules)


_OUTSIDE: dict[int, tuple[Rules, Rules]] = {}  # id(rules) -> (rules, outside_pipeline(rules))


def outside_pipeline(rules: Rules) -> Rules:
    """``rules`` for layers that run outside the pipeline (DeepSeek's dense prefix before it, its MTP heads after):
    ``activation_batch`` placed as ``activation_embed_and_logits_batch`` (the batch over ``stage`` too) and
    ``activation_tokens`` ([batch, seq] flattened) as those axes then its own, so that those layers, like the
    embedding and the head, split the batch over the stages instead of each stage running them whole. Rules put
    first (Linen's first match wins); without a ``stage`` axis they resolve as ``rules`` do.

    >>> outside_pipeline(get_rules("pure-fsdp"))[:2]
    (('activation_batch', ('data', 'fsdp', 'stage')), ('activation_tokens', ('data', 'fsdp', 'stage')))
    """
    cached = _OUTSIDE.get(id(rules))
    if cached is not None and cached[0] is rules:
        return cached[1]
    first = {}
    for name, axes in expand_rules(rules):
        first.setdefault(name, () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes))
    batch = first.get("activation_embed_and_logits_batch")
    if batch is None:  # the batch outside is not placed (replicated): so are these layers' activations
        out = rules
    else:
        tokens = (*batch, *(a for a in first.get("activation_tokens", ()) if a not in batch))
        out = (("activation_batch", batch), ("activation_tokens", tokens), *rules)
    if len(_OUTSIDE) > 64:
        _OUTSIDE.clear()
    _OUTSIDE[id(rules)] = (rules, out)
    return out


def context_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes acting as context parallelism: those of the first rule for ``activation_length``."""
    for name, axes in rules:
        if name == "activation_length":
            if axes is None:
                return ()
            return (axes,) if isinstance(axes, str) else tuple(axes)
    return ()


_EXPANDED: dict[int, tuple[Rules, int, Rules]] = {}  # id(rules) -> (rules, declarations version, expanded)


def expand_rules(rules: Rules) -> Rules:
    """``rules`` with rules added for the family-declared names it does not mention (``axes.declare_axis``), and
    for the shared names with a ``SHARED_LIKE`` (``latent``) it does not mention.

    Each such name gets a copy of every rule of the first name of its ``like`` chain that ``rules`` mentions,
    placed right after the rule it copies (names with the same anchor follow in declaration order). The result
    resolves an array holding both a declared name and its ``like`` exactly as Linen's first match would with
    hand-written rules listed after the ``like``'s: the ``like`` name picks its mesh axes first. A declared name
    whose chain reaches no mentioned name gets no rule (replicated, as any known name the set does not mention).

    >>> _ = declare_axis("my_latent", like="latent", doc="my family's attention latent width")
    >>> [r for r in expand_rules((("embed", "fsdp"), ("mlp", "tensor"))) if r[0] == "my_latent"]  # via latent
    [('my_latent', 'fsdp')]
    """
    version = declarations_version()
    cached = _EXPANDED.get(id(rules))
    if cached is not None and cached[0] is rules and cached[1] == version:
        return cached[2]
    mentioned = {name for name, _ in rules}
    followers: dict[str, list[str]] = {}
    for name in (*SHARED_LIKE, *declared_axes()):
        if name not in mentioned:
            anchor = next((n for n in like_chain(name)[1:] if n in mentioned), None)
            if anchor is not None:
                followers.setdefault(anchor, []).append(name)
    expanded = tuple(rule for name, axes in rules
                     for rule in ((name, axes), *((f, axes) for f in followers.get(name, ()))))
    if len(_EXPANDED) > 64:  # user rule sets built on the fly: keep the cache bounded
        _EXPANDED.clear()
    _EXPANDED[id(rules)] = (rules, version, expanded)
    return expanded
