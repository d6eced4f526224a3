"""The explicit-mesh matrix: shard mode x mesh x rule set x batch split, two optimizer steps each.

Every case trains the same tiny DeepSeek-V3 (one dense layer, two scanned MoE layers, an MTP head whose layer is
MoE too) for two AdamW steps on 8 CPU devices and must give the losses and gradients of the single-device run
(float32, relative 1e-5). Which rule sets run on which mesh is decided by ``plan()`` from data: a rule set is left
out of a mesh only when the resolver rejects it there, or when it lays out every parameter and activation exactly
as a rule set already in the list (it maps nothing new); each such pair is listed with its reason in ``SKIPPED``.

``moe_impl`` is ``ep`` wherever the rule set shards the expert dim over a mesh axis (so EP runs under Auto and
Explicit meshes), ``dense`` elsewhere (where ``ep`` would be the local computation anyway).

DeepSeek-V2's router on the same model (``V2_ROUTER``: softmax, group-limited top-k, routed scaling, no selection
bias) runs on FSDP 8 and FSDP 4 x EP 2 under ``default``, ``ep-as-cp`` and ``shard-exp-on-fsdp``, both modes
(``V2_CASES``, run by tests/models/deepseek/test_v2.py); in CI they count towards the matrix's coverage, and no V3
case repeats the mode, mesh, rule set and MoE path of one.

GLM-5 and Mistral 4, DeepSeek's model with their own configs, run one case each (``FAMILY_CASES``): GLM-5 with a
layer reusing the previous layer's top-k under Explicit ``ep-as-cp`` (the sequence split), Mistral 4 with its
router and query scale under Auto FSDP 4 x TP 2 with two micro-batches.

Cost: compilation dominates (one train-step compile per case, ~10-15 s of CPU each). CI runs 9 V3 cases (with
the 5 V2 cases: every mesh, every rule set and every (MoE path, batch split) under both modes, each case covering
one of each; see ``plan``). ``NNX_ZOO_FULL_MATRIX=1`` runs every kept (mesh, rule set) pair in the whole product
(96 cases: 100 passed in 28 min alone on this 2-core machine; the whole suite with it, under pytest-xdist ``-n 2``,
413 passed in 27 min, past the CI budget). Each compiled step is dropped once it has run (see ``run``).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_zoo import AutoModelForCausalLM, DeepSeekV3, DeepSeekV3Config, Glm5Config, Mistral4Config
from nnx_zoo.layers import batch_split
from nnx_zoo.layers.rope import YarnScaling
from nnx_zoo.models.causal_lm import CausalLMOutput
from nnx_zoo.sharding import (
    ShardingError,
    get_rules,
    iter_variables,
    logical_names,
    logical_to_mesh_axes,
    make_abstract_mesh,
    make_mesh,
    record_shardings,
    state_shardings,
)
from nnx_zoo.train.step import loss_terms, shift_left

BATCH, SEQ, VOCAB = 16, 16, 128
MTP_WEIGHT = 0.3
STEPS = 2

MESHES: tuple[dict[str, int], ...] = (
    {"fsdp": 8},
    {"fsdp": 4, "tensor": 2},
    {"fsdp": 4, "tensor_transpose": 2},
    {"fsdp": 4, "expert": 2},
    {"data": 2, "fsdp": 2, "expert": 2},
    {"fsdp": 2, "context": 2, "expert": 2},
)
RULE_ORDER = ("default", "pure-fsdp", "ep-as-cp", "cp-as-ep", "ep-as-dp", "shard-exp-on-fsdp")
MODES = ("auto", "explicit")
BATCH_SPLITS = (1, 2)
FULL = os.environ.get("NNX_ZOO_FULL_MATRIX") == "1"  # run the whole product (4x the CI cases' compiles)


# The families built on DeepSeek's model: config class and the preset tiny_config starts from.
FAMILY_PRESETS = {"deepseek": (DeepSeekV3Config, "deepseek3-mini"), "glm5": (Glm5Config, "glm5-tiny"),
                  "mistral4": (Mistral4Config, "mistral4-tiny")}


def tiny_config(family: str = "deepseek", **overrides) -> DeepSeekV3Config:
    """The smallest V3 with every block kind: 1 dense + 2 MoE layers (8 experts, top-2), an MoE MTP head (or
    ``family``'s config at these dims)."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, num_nextn_predict_layers=1,
    )
    config_cls, preset = FAMILY_PRESETS[family]
    return config_cls.preset(preset, **{**fields, **overrides})


def _name(sizes: dict[str, int]) -> str:
    return "+".join(f"{axis}{size}" for axis, size in sizes.items())


# ---------------------------------------------------------------------------------------------------------------
# The plan: which (mesh, rule set) pairs run, and why the others do not.


@functools.cache
def _logical_layout() -> tuple[tuple[tuple[str | None, ...], tuple[int, ...]], ...]:
    """Every (logical names, shape) the model lays out: its parameters, and each shard() call of a forward pass
    with MTP (traced on an abstract mesh whose axes all have size 2, so every call records)."""
    model = nnx.eval_shape(lambda: DeepSeekV3(tiny_config(moe_impl="dense"), rngs=nnx.Rngs(0)))
    params = [(logical_names(v), tuple(v.shape)) for _, v in iter_variables(model) if logical_names(v) is not None]
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    mesh = make_abstract_mesh({axis: 2 for axis in ("data", "fsdp", "context", "tensor", "expert")})
    with jax.sharding.use_abstract_mesh(mesh), record_shardings() as seen:
        jax.eval_shape(lambda s, i: nnx.merge(graphdef, s).forward(i, with_mtp=True), state, ids)
    return tuple(dict.fromkeys(params + [(names, shape) for names, shape, _ in seen]))


def _layout(sizes: dict[str, int], rules: str) -> tuple[jax.P, ...]:
    """The spec of every parameter and activation under ``rules`` on the mesh ``sizes`` (ShardingError when a
    dimension does not divide)."""
    mesh = make_abstract_mesh(sizes)
    return tuple(logical_to_mesh_axes(names, rules, mesh, shape=shape) for names, shape in _logical_layout())


def _ep_axes(sizes: dict[str, int], rules: str) -> tuple[str, ...]:
    spec = logical_to_mesh_axes(("exp",), rules, make_abstract_mesh(sizes))[0]
    return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    sizes: tuple[tuple[str, int], ...]
    rules: str
    batch_split: int
    moe_impl: str

    @property
    def id(self) -> str:
        return f"{self.mode}-{_name(dict(self.sizes))}-{self.rules}-split{self.batch_split}-{self.moe_impl}"

    @property
    def key(self) -> tuple[str, tuple[tuple[str, int], ...], str, str]:
        """What a case covers beyond the router and the batch split: (mode, mesh, rule set, MoE path)."""
        return self.mode, self.sizes, self.rules, self.moe_impl


# DeepSeek-V2's router (HF topk_method 'group_limited_greedy'): softmax over the 8 experts, the top 2 within the 2
# of 4 groups holding the best single probabilities, raw probabilities times routed_scaling_factor, no selection
# bias. (V3's tiny_config has one group: of this matrix, only these cases run a group limit under a mesh.)
V2_ROUTER = (("topk_method", "group_limited_greedy"), ("n_group", 4), ("topk_group", 2), ("norm_topk_prob", False),
             ("routed_scaling_factor", 2.5))
V2_MESHES = ((("fsdp", 8),), (("fsdp", 4), ("expert", 2)))
V2_RULES = ("default", "ep-as-cp", "shard-exp-on-fsdp")
# CI: the five distinct (mesh, rule set) pairs (on FSDP 8, ep-as-cp maps nothing new: the plan skips it), each
# once, both modes on each mesh; plan() counts them towards CI's coverage and picks V3 cases for the rest.
V2_CI_CASES = [Case(mode, sizes, rules, 1, impl) for sizes, rules, impl, mode in (
    (V2_MESHES[0], "default", "dense", "auto"),
    (V2_MESHES[0], "shard-exp-on-fsdp", "ep", "explicit"),
    (V2_MESHES[1], "default", "ep", "auto"),
    (V2_MESHES[1], "ep-as-cp", "ep", "explicit"),  # experts and the sequence split over 'expert'
    (V2_MESHES[1], "shard-exp-on-fsdp", "ep", "auto"),
)]
V2_CASES = V2_CI_CASES if not FULL else [  # 12 cases: both meshes, the three rule sets, both modes
    Case(mode, sizes, rules, 1, "ep" if _ep_axes(dict(sizes), rules) else "dense")
    for sizes in V2_MESHES for rules in V2_RULES for mode in MODES
]


def covers(case: Case) -> set[tuple]:
    """What CI asks of the matrix, per mode: each mesh, each rule set, and each (MoE path, batch split) runs."""
    return {("mesh", case.sizes, case.mode), ("rules", case.rules, case.mode),
            ("path", case.moe_impl, case.batch_split, case.mode)}


def plan(full: bool = FULL) -> tuple[list[Case], list[tuple[str, str, str]]]:
    """(cases to run, skipped (mesh, rule set, reason)). Deterministic: meshes, rule sets, modes in order.

    ``full``: every kept (mesh, rule set) pair under both modes and both batch splits (96 compiles). Otherwise
    (CI: compiles cost ~10-15 s of CPU each) the fewest cases, chosen greedily in plan order, such that with the
    ``V2_CI_CASES`` (V2's router on five of the pairs) every mesh, every rule set and every (MoE path, batch
    split) runs under both modes (``covers``; ``test_plan_covers_every_mesh_rule_set_and_mode``): each case
    stands for one mesh, one rule set and one path at once. No CI case repeats the (mode, mesh, rule set, MoE
    path) of a V2 case.
    """
    kept, skipped = [], []
    for sizes in MESHES:
        layouts: dict[tuple[jax.P, ...], str] = {}
        for rules in RULE_ORDER:
            try:
                layout = _layout(sizes, rules)
            except ShardingError as e:
                skipped.append((_name(sizes), rules, f"resolver rejects it: {e}"))
                continue
            if layout in layouts:
                skipped.append((_name(sizes), rules, f"maps nothing new: same layout as {layouts[layout]!r}"))
                continue
            layouts[layout] = rules
            kept.append((tuple(sizes.items()), rules, "ep" if _ep_axes(sizes, rules) else "dense"))
    candidates = [Case(mode, sizes, rules, split, impl) for sizes, rules, impl in kept for split in BATCH_SPLITS
                  for mode in MODES]
    if full:
        return candidates, skipped
    v2 = {c.key for c in V2_CI_CASES}
    candidates = [c for c in candidates if c.key not in v2]
    wanted = set().union(*map(covers, candidates))
    done = set().union(*map(covers, V2_CI_CASES))
    cases = []
    while wanted - done:  # greedy set cover: the first case that covers the most not yet covered
        best = max(candidates, key=lambda c: len(covers(c) - done))
        cases.append(best)
        done |= covers(best)
    order = {c: i for i, c in enumerate(candidates)}
    return sorted(cases, key=order.__getitem__), skipped


CASES, SKIPPED = plan()


# ---------------------------------------------------------------------------------------------------------------
# Running two optimizer steps: one compiled step, called twice.


# AdamW without the trainer's global-norm clipping: a real optimizer state sharded like the parameters. (The
# clipping made each compile ~40% slower here; it runs under meshes in tests/train.) A small learning rate keeps Adam's
# near-sign first update from amplifying float32 rounding in the second step's gradients.
_TX = optax.adamw(1e-3, weight_decay=0.1)


def _with_optimizer(model: DeepSeekV3) -> tuple[DeepSeekV3, nnx.Optimizer]:
    return model, nnx.Optimizer(model, _TX, wrt=nnx.Param)


def _model(config: DeepSeekV3Config, **kwargs) -> DeepSeekV3:
    return AutoModelForCausalLM.model_class(config)(config, rngs=nnx.Rngs(0), **kwargs)


@functools.cache
def _graphdef(rules: str, batch_split: int, moe_impl: str, config_overrides: tuple = (), family: str = "deepseek"):
    config = tiny_config(family, batch_split_factor=batch_split, moe_impl=moe_impl, **dict(config_overrides))
    return nnx.graphdef(nnx.eval_shape(lambda: _with_optimizer(_model(config, rules=rules))))


@functools.cache
def _initial_state(config_overrides: tuple = (), family: str = "deepseek") -> nnx.State:
    """Model and optimizer state, drawn with numpy (the model's own initializers would compile one program per
    parameter shape): weights N(0, 0.02) (a V3.2 indexer's N(0, 0.5)), norm scales 1, the router bias and the
    optimizer's moments 0."""
    config = tiny_config(family, **dict(config_overrides))
    abstract = nnx.state(nnx.eval_shape(lambda: _with_optimizer(_model(config))))
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        is_model, name = path[0].key == 0, jax.tree_util.keystr(path)
        if is_model and "['scale']" in name:  # RMSNorm scales
            return jnp.ones(leaf.shape, leaf.dtype)
        if is_model and leaf.ndim >= 2:
            # A V3.2 indexer drawn larger: its scores then spread, and its KL (and gradient) is O(1), not float32
            # rounding around a near-uniform distribution.
            std = 0.5 if "indexer" in name else 0.02
            return jnp.asarray(rng.normal(0.0, std, leaf.shape), leaf.dtype)
        return jnp.zeros(leaf.shape, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@functools.cache
def _batch() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    mask = np.ones((BATCH, SEQ), np.int32)
    mask[0, :3] = 0  # some left padding
    return {"input_ids": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32),
            "attention_mask": jnp.asarray(mask), "loss_mask": jnp.asarray(mask)}


def _train_step(graphdef, state, batch):
    """One AdamW step on the trainer's loss (with the MTP term): (new state, (cross-entropy, parameter grads))."""
    model, optimizer = nnx.merge(graphdef, state)
    model_graph, params, rest = nnx.split(model, nnx.Param, ...)
    mtp = model.mtp_layers is not None

    def loss(p):
        total, metrics = loss_terms(nnx.merge(model_graph, p, rest), batch, MTP_WEIGHT if mtp else 0.0,
                                    (("with_mtp", True),) if mtp else ())
        return total / metrics["tokens"], metrics["ce_sum"] / metrics["tokens"]

    (_, ce), grads = jax.value_and_grad(loss, has_aux=True)(params)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), (ce, grads)


# Cheaper LLVM optimization: the programs are tiny and run twice, compilation is the cost (float semantics are
# the same at every level: XLA:CPU does not enable fast math).
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run needs: model options and, for a sharded run, the mesh."""

    rules: str = "default"
    batch_split: int = 1
    moe_impl: str = "dense"
    sizes: tuple[tuple[str, int], ...] = ()  # () = one device
    mode: str = "explicit"
    devices: int = 8
    config: tuple[tuple[str, object], ...] = ()  # tiny_config overrides (e.g. another router)
    family: str = "deepseek"  # tiny_config's family (FAMILY_PRESETS)

    @classmethod
    def of(cls, case: Case, config: tuple[tuple[str, object], ...] = ()) -> Setup:
        return cls(case.rules, case.batch_split, case.moe_impl, case.sizes, case.mode, config=config)

    def mesh(self):
        return make_mesh(dict(self.sizes), shard_mode=self.mode, devices=jax.devices()[: self.devices])


def _place(tree, mesh, rules):
    shardings = state_shardings(tree, mesh, get_rules(rules))
    leaves = [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(tree), shardings)]
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


@functools.cache
def _inputs(setup: Setup):
    """(graphdef, state, batch), placed on the setup's mesh."""
    graphdef = _graphdef(setup.rules, setup.batch_split, setup.moe_impl, setup.config, setup.family)
    state, batch = _initial_state(setup.config, setup.family), _batch()
    if not setup.sizes:
        return graphdef, state, batch
    mesh = setup.mesh()
    batch_spec = logical_to_mesh_axes(("activation_batch", None), setup.rules, mesh)
    return graphdef, _place(state, mesh, setup.rules), jax.device_put(batch, jax.NamedSharding(mesh, batch_spec))


def compiled_step(setup: Setup) -> jax.stages.Compiled:
    """The setup's train step, compiled (``run`` caches its numbers and frees it)."""
    graphdef, state, batch = _inputs(setup)
    if setup.sizes:
        # The new state keeps the input's shardings. (Under Auto, XLA would otherwise choose its own for some of it,
        # e.g. norm scales sharded like the activations they scale, and the second call would not match.)
        step = jax.jit(_train_step, static_argnums=0, out_shardings=(jax.tree.map(lambda a: a.sharding, state), None))
        with jax.set_mesh(setup.mesh()):
            lowered = step.trace(graphdef, state, batch).lower()
    else:
        lowered = jax.jit(_train_step, static_argnums=0).trace(graphdef, state, batch).lower()
    return lowered.compile(_COMPILER_OPTIONS)


@functools.cache
def run(setup: Setup):
    """(cross-entropy per step [STEPS], parameter gradients per step) as numpy.

    The compiled step is dropped afterwards, from JAX's caches too: each one holds ~1500 memory mappings on
    XLA:CPU, and the matrix's steps all kept alive took the test process past the kernel's limit
    (vm.max_map_count, 65530), after which the next compile segfaulted."""
    step = compiled_step(setup)
    _, state, batch = _inputs(setup)
    losses, grads = [], []
    for _ in range(STEPS):
        state, (loss, g) = step(state, batch)
        losses.append(loss)
        grads.append(g)
    result = jax.device_get((np.stack(losses), jax.tree.map(lambda *a: np.stack(a), *grads)))
    del step
    jax.clear_caches()
    return result


GRAD_RTOL = 2e-5  # a norm scale's gradient sums every token's contribution with cancellation: a sharded mesh's
# reduction order moved the q_a_norm scale's second-step gradient by 1.03e-5 (relative L2, float32 noise)


def assert_same(got, want, what: str = "") -> None:
    """Losses equal to rtol 1e-5; each gradient tensor of each step within ``GRAD_RTOL`` of the reference in
    relative L2 norm (element-wise relative error is meaningless for entries that are float32 rounding noise
    around 0)."""
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg=f"{what} losses")
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1]), strict=True):
        for step in range(STEPS):
            error = np.linalg.norm(g[step] - r[step]) / max(np.linalg.norm(r[step]), 1e-30)
            assert error <= GRAD_RTOL, (f"{what} step {step} grad {jax.tree_util.keystr(path)}: relative error "
                                        f"{error:.2e}")


# The (mesh, rule set) pairs the matrix runs, with the MoE path. Pinned so that a resolver or rule change that
# drops or adds a pair shows up here, with the plan's reasons, instead of silently changing what CI covers.
KEPT = {
    "fsdp8": {"default": "dense", "shard-exp-on-fsdp": "ep"},
    "fsdp4+tensor2": {"default": "dense", "pure-fsdp": "dense", "shard-exp-on-fsdp": "ep"},
    "fsdp4+tensor_transpose2": {"default": "dense", "pure-fsdp": "dense", "shard-exp-on-fsdp": "ep"},
    # ep-as-dp splits the routed experts over expert (MaxText's meaning), so it runs expert parallelism: "ep".
    "fsdp4+expert2": {"default": "ep", "pure-fsdp": "dense", "ep-as-cp": "ep", "ep-as-dp": "ep",
                      "shard-exp-on-fsdp": "ep"},
    "data2+fsdp2+expert2": {"default": "ep", "pure-fsdp": "dense", "ep-as-cp": "ep", "ep-as-dp": "ep",
                            "shard-exp-on-fsdp": "ep"},
    "fsdp2+context2+expert2": {"default": "ep", "pure-fsdp": "dense", "ep-as-cp": "ep", "cp-as-ep": "ep",
                               "ep-as-dp": "ep", "shard-exp-on-fsdp": "ep"},
}


@pytest.mark.parametrize("full", [True, False])
def test_plan_covers_every_mesh_rule_set_and_mode(full):
    cases, skipped = plan(full)
    if not full:  # V2's cases count towards CI's coverage; no V3 case repeats one of their keys
        assert not {c.key for c in cases} & {c.key for c in V2_CI_CASES}
        v2_pairs = {(_name(dict(c.sizes)), c.rules, c.moe_impl) for c in V2_CI_CASES}
        assert v2_pairs == {(mesh, rules, impl) for mesh, sets in KEPT.items() for rules, impl in sets.items()
                            if mesh in ("fsdp8", "fsdp4+expert2") and rules in V2_RULES}
        assert {(c.sizes, c.mode) for c in V2_CI_CASES} == {(m, mode) for m in V2_MESHES for mode in MODES}
        cases = cases + V2_CI_CASES
    runs: dict[tuple[str, str, str], set[tuple[str, int]]] = {}
    for c in cases:
        runs.setdefault((_name(dict(c.sizes)), c.rules, c.moe_impl), set()).add((c.mode, c.batch_split))
    kept = {(mesh, rules, impl) for mesh, sets in KEPT.items() for rules, impl in sets.items()}
    # Left out only as a duplicate layout of a kept rule set (every rule set resolves on every mesh here).
    assert all("maps nothing new" in reason for *_, reason in skipped), skipped
    assert len(skipped) + len(kept) == len(MESHES) * len(RULE_ORDER)
    assert {mesh for mesh, *_ in kept} == {_name(m) for m in MESHES}
    assert {rules for _, rules, _ in kept} == set(RULE_ORDER)
    every = {(mode, split) for mode in MODES for split in BATCH_SPLITS}
    if full:  # the whole product: 24 pairs x {auto, explicit} x batch split {1, 2}
        assert set(runs) == kept, "the plan keeps other (mesh, rule set) pairs: " + repr(skipped)
        assert all(done == every for done in runs.values()) and len(cases) == 4 * len(kept) == 96
    else:  # kept pairs only; every mesh, rule set and (MoE path, batch split) under both modes, in few compiles
        assert set(runs) <= kept, "the plan runs a pair it does not keep: " + repr(set(runs) - kept)
        for key in (0, 1):
            for value in {k[key] for k in kept}:
                assert {mode for k, done in runs.items() if k[key] == value for mode, _ in done} == set(MODES), value
        assert {(impl, mode, split) for (_, _, impl), done in runs.items() for mode, split in done} == {
            (impl, mode, split) for impl in ("dense", "ep") for mode, split in every}
        assert len(cases) - len(V2_CI_CASES) == 9  # 8 would leave a mesh or a rule set to one mode


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matrix(case):
    assert_same(run(Setup.of(case)), run(Setup(batch_split=case.batch_split)), case.id)


# ---------------------------------------------------------------------------------------------------------------
# Seed regressions and the MTP head under batch split.

# Seed 004: FSDP 2 + CP 2 and FSDP 2 + EP-as-CP 2 (4 devices each, one sequence shard pair per batch shard) must
# give the same loss: the expert axis, acting as context parallelism outside the MoE core, changes no number.
SEED004 = (
    Setup(rules="default", sizes=(("fsdp", 2), ("context", 2)), devices=4),
    Setup(rules="ep-as-cp", moe_impl="ep", sizes=(("fsdp", 2), ("expert", 2)), devices=4),
)


def test_seed004_context_parallel_equals_expert_as_context_parallel():
    cp, ep_as_cp = (run(setup) for setup in SEED004)
    mesh = SEED004[1].mesh()
    # ep-as-cp really splits the sequence over 'expert' here, and the experts too.
    assert logical_to_mesh_axes(("activation_batch", "activation_length"), "ep-as-cp", mesh) == jax.P("fsdp", "expert")
    assert _ep_axes(dict(SEED004[1].sizes), "ep-as-cp") == ("expert",)
    assert_same(ep_as_cp, cp, "fsdp2+expert2 (ep-as-cp) vs fsdp2+context2")
    assert_same(cp, run(Setup()), "fsdp2+context2 vs one device")


def test_mtp_head_splits_its_batch(monkeypatch):
    # The MTP head's decoder layer is MoE: with batch_split_factor > 1 it must run as micro-batches like the main
    # MoE stack. Count the batch-split calls traced with and without the MTP head.
    import nnx_zoo.models.deepseek.model as model_module

    factors = []

    def counting(fn, x, *args, factor):
        factors.append(factor)
        return batch_split(fn, x, *args, factor=factor)

    monkeypatch.setattr(model_module, "batch_split", counting)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepSeekV3(tiny_config(batch_split_factor=2),
                                                                  rngs=nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    jax.eval_shape(lambda s, i: nnx.merge(graphdef, s)(i), state, ids)
    without_mtp = list(factors)
    jax.eval_shape(lambda s, i: nnx.merge(graphdef, s).forward(i, with_mtp=True), state, ids)
    assert without_mtp == [2]  # the scanned MoE stack's body
    assert factors[len(without_mtp):] == [2, 2]  # the MoE stack again, and the MTP head


def test_shift_left_keeps_a_sequence_sharded_layout():
    # The trainer's MTP loss shifts targets and mask left; under an Explicit mesh with the sequence sharded
    # (context parallelism, ep-as-cp) slicing x[:, 1:] is a sharding type error, so shift_left gathers first.
    mesh = make_mesh({"fsdp": 4, "context": 2}, shard_mode="explicit")
    values = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    with jax.set_mesh(mesh):
        x = jax.device_put(values, jax.P("fsdp", "context"))
        with pytest.raises(Exception, match="not divisible"):
            jax.jit(lambda x: x[:, 1:])(x)
        out = jax.jit(shift_left, static_argnums=1)(x, 3)
    np.testing.assert_array_equal(out, np.pad(values[:, 3:], ((0, 0), (0, 3))))
    assert jax.typeof(out).sharding.spec == jax.typeof(x).sharding.spec


def test_mtp_loss_equals_the_sliced_formula():
    # shift_left moves targets, not logits: the MTP term must still be the mean CE of head k's logits at t against
    # the target at t + k + 1, over positions whose shifted target counts.
    rng = np.random.default_rng(1)
    b, s, v = 2, 6, 5
    logits, mtp = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((b, s, v), (2, b, s, v)))
    batch = {"input_ids": jnp.zeros((b, s), jnp.int32), "targets": jnp.asarray(rng.integers(0, v, (b, s))),
             "loss_mask": jnp.asarray(rng.integers(0, 2, (b, s)), jnp.float32)}

    class Fixed:
        def forward(self, ids, attention_mask=None):
            return CausalLMOutput(logits=logits, mtp_logits=mtp)

    total, metrics = loss_terms(Fixed(), batch, 0.5)

    def ce(lg, t, m):
        nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(lg)), np.asarray(t)[..., None], -1)[..., 0]
        return float(np.sum(nll * np.asarray(m))), float(np.sum(m))

    main, tokens = ce(logits, batch["targets"], batch["loss_mask"])
    want = main
    for k in range(2):
        shift = k + 1
        part, count = ce(mtp[k][:, :-shift], batch["targets"][:, shift:], batch["loss_mask"][:, shift:])
        want += 0.5 / 2 * part * tokens / max(count, 1.0)
    np.testing.assert_allclose(float(total), want, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3.2: the same model with a lightning indexer keeping 6 of the 16 keys, its KL trained ("sparse"), so
# the selection, the gather over sequence shards and the indexer's loss all run under the mesh.

V32 = (("index_topk", 6), ("index_n_heads", 4), ("index_head_dim", 16), ("indexer_training", "sparse"))
V32_MESHES = ((("fsdp", 8),), (("fsdp", 4), ("expert", 2)))
# CI: FSDP 8 under Auto. FSDP 4 x EP 2 under Explicit ep-as-cp (the sequence split over 'expert': a query's top-k
# spans the sequence shards) runs in CI as GLM-5's case below, which is this V3.2 indexer (and its trained KL) too.
# NNX_ZOO_FULL_MATRIX=1: 24 cases, both meshes, every named rule set, both modes.
V32_CASES = [Setup("default", 1, "dense", V32_MESHES[0], "auto", config=V32)] if not FULL else [
    Setup(rules, 1, "ep" if _ep_axes(dict(sizes), rules) else "dense", sizes, mode, config=V32)
    for sizes in V32_MESHES for rules in RULE_ORDER for mode in MODES
]


@pytest.mark.parametrize("setup", V32_CASES, ids=lambda s: f"{s.mode}-{_name(dict(s.sizes))}-{s.rules}")
def test_v32_sparse_attention_on_meshes(setup):
    assert_same(run(setup), run(Setup(config=V32)), f"V3.2 {setup}")


# ---------------------------------------------------------------------------------------------------------------
# The families on DeepSeek's parts, one case each in CI (both modes and meshes with NNX_ZOO_FULL_MATRIX=1).
# GLM-5 at these dims: layer 0 dense with an indexer, layer 1 MoE reusing its top-k (6 of 16 keys, the indexer's KL
# trained), layer 2 MoE with an indexer, an MTP head; Explicit FSDP 4 x EP 2 under ep-as-cp splits the sequence, so
# the reused top-k travels the layer scan split over 'expert'. Mistral 4: its router limited to 1 of 2 groups, YaRN
# and the query scale over 4 positions (three steps in 16), no MTP head; Auto FSDP 4 x TP 2, two micro-batches.
GLM5 = (*V32, ("index_rope_interleave", True))
MISTRAL4 = (("n_group", 2), ("topk_group", 1), ("num_nextn_predict_layers", 0), ("rope_scaling", YarnScaling(
    factor=4.0, original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)))
FAMILY_SETUPS = {"glm5": GLM5, "mistral4": MISTRAL4}
FAMILY_CASES = [
    Setup("ep-as-cp", 1, "ep", V32_MESHES[1], "explicit", config=GLM5, family="glm5"),
    Setup("default", 2, "dense", (("fsdp", 4), ("tensor", 2)), "auto", config=MISTRAL4, family="mistral4"),
] if not FULL else [
    Setup(rules, 2 if family == "mistral4" else 1, "ep" if _ep_axes(dict(sizes), rules) else "dense", sizes, mode,
          config=config, family=family)
    for family, config in FAMILY_SETUPS.items() for sizes in V32_MESHES for rules in ("default", "ep-as-cp")
    for mode in MODES
]


@pytest.mark.parametrize("setup", FAMILY_CASES,
                         ids=lambda s: f"{s.family}-{s.mode}-{_name(dict(s.sizes))}-{s.rules}")
def test_glm5_and_mistral4_on_meshes(setup):
    assert_same(run(setup), run(Setup(config=setup.config, family=setup.family)), f"{setup.family} {setup}")
