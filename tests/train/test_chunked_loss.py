"""The output head + cross-entropy in chunks (``chunked_head_cross_entropy``, the trainer's ``loss_terms``) against
independent references: the trainer's loss over the model's whole logits (``loss_chunk_tokens=0``, today's path)
for the loss and every parameter's gradient (head, tied embedding table, layers), and a float64 numpy
cross-entropy written out on the model's own logits; on one device and on Explicit and Auto meshes, with the
sequence split (context parallelism) or not. Chunk sizes are picked so the last chunk is padded, and the loss
masks have zeros (a whole chunk of them in one row); each case also checks, from the traced program, that it ran
in the number of chunks it should (a silent fall-back to one chunk would pass the equalities).

Memory: the AOT-compiled gradient of a head + loss at a 32k vocabulary and 4,096 tokens holds less than half of
one float32 ``[tokens, vocab]`` array in XLA temporaries with chunking, more than one without.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3, DeepSeekV3Config, Llama3, Llama3Config, Qwen3, Qwen3Config
from nnx_zoo.sharding import abstract_module, get_rules, logical_to_mesh_axes, make_mesh, state_shardings
from nnx_zoo.train.loss import chunked_head_cross_entropy, default_chunk_tokens, token_cross_entropy
from nnx_zoo.train.step import loss_terms

BATCH, SEQ, VOCAB = 8, 16, 320  # a vocab no other dim shares
MTP_WEIGHT = 0.3
RTOL = 1e-5


def _dense(cls, config_cls, preset, **overrides):
    return cls, config_cls.preset(preset, vocab_size=VOCAB, num_hidden_layers=2, **overrides)


MODELS = {
    "llama3": _dense(Llama3, Llama3Config, "llama3-tiny", tie_word_embeddings=False),  # its own head
    "qwen3-tied": _dense(Qwen3, Qwen3Config, "qwen3-tiny"),  # the embedding table is the head
    # The mesh matrix's smallest V3 (1 dense + 2 MoE layers) with its MTP head: two heads' losses.
    "deepseek-mtp": (DeepSeekV3, DeepSeekV3Config.preset(
        "deepseek3-mini", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, routed_scaling_factor=1.0, num_nextn_predict_layers=1, moe_impl="dense")),
}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    chunk_tokens: int
    chunks: int  # how many chunks that makes (checked in the traced program)
    sizes: tuple[tuple[str, int], ...] = ()  # () = one device
    mode: str = "explicit"
    rules: str = "default"

    @property
    def id(self) -> str:
        where = "+".join(f"{a}{n}" for a, n in self.sizes) + f"-{self.mode}-{self.rules}" if self.sizes else "1dev"
        return f"{self.model}-{where}"


CASES = [
    # One device: 8 rows x 16 positions (x 2 heads for DeepSeek); 48 tokens a chunk -> 6 (3) positions of each
    # row, in 3 (6) chunks of 6 (3) positions: the last one padded by 2.
    Case("llama3", 48, 3),
    Case("qwen3-tied", 48, 3),
    Case("deepseek-mtp", 48, 6),
    # fsdp 4 x tensor 2: 2 rows a device, the vocab over tensor; 12 tokens -> 6 positions, 3 chunks, last padded.
    Case("llama3", 12, 3, (("fsdp", 4), ("tensor", 2)), "explicit"),
    # Context parallelism: the sequence split over context (default rules; 4 rows, 8 positions a device) or over
    # expert (ep-as-cp; 2 rows x 2 heads, 8 positions): each device's 8 positions in 3 chunks of 3, the last
    # padded by 1. (The mesh matrix runs DeepSeek's whole-batch-in-one-chunk step on Auto meshes too.)
    Case("qwen3-tied", 12, 3, (("fsdp", 2), ("context", 2), ("tensor", 2)), "auto"),
    Case("deepseek-mtp", 12, 3, (("fsdp", 4), ("expert", 2)), "explicit", "ep-as-cp"),
]
EXPLICIT_EP_AS_CP = CASES[5]
# Cheaper LLVM optimization: the programs are tiny and run once, compilation is the cost (float semantics are the
# same at every level: XLA:CPU does not enable fast math).
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@functools.cache
def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    attention = np.ones((BATCH, SEQ), np.int32)
    attention[0, :3] = 0  # left padding
    loss_mask = attention.astype(np.float32)
    loss_mask[1, 5:12] = 0.0  # covers a whole chunk of that row
    loss_mask[2, -1] = 0.0
    loss_mask[3, 4] = 0.5  # a weight, not just 0/1
    targets = ids[:, 1:].copy()
    targets[2, -1] = -100  # an ignore index where the mask is 0 (HF's convention)
    return {"input_ids": ids[:, :-1].astype(np.int32), "targets": targets.astype(np.int32),
            "attention_mask": attention, "loss_mask": loss_mask}


def _model_kwargs(name: str) -> tuple[tuple[str, bool], ...]:
    return (("with_mtp", True),) if name == "deepseek-mtp" else ()


def _loss_fn(name: str, graphdef, rest, chunk_tokens: int):
    def loss(params, batch):
        model = nnx.merge(graphdef, params, rest)
        total, metrics = loss_terms(model, batch, MTP_WEIGHT, _model_kwargs(name), loss_chunk_tokens=chunk_tokens)
        aux = {k: v for k, v in metrics.items() if k.endswith(("_sum", "tokens"))}
        if chunk_tokens == 0:  # the reference run: also the model's own logits, for the numpy cross-entropy
            out = model.forward(batch["input_ids"], batch["attention_mask"], **dict(_model_kwargs(name)))
            aux["logits"] = out.logits if out.mtp_logits is None else jnp.concatenate([out.logits[None],
                                                                                     out.mtp_logits])
        return total, aux

    return jax.value_and_grad(loss, has_aux=True)


def _scan_lengths(jaxpr) -> list[int]:
    lengths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.append(eqn.params["length"])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    lengths += _scan_lengths(inner)
    return lengths


def _place(tree, mesh, rules):
    leaves = [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(tree), state_shardings(tree, mesh, rules))]
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


@functools.cache
def _model(name: str) -> nnx.Module:
    """The model with random weights drawn in numpy (the models' own initializers compile once per shape: ~9 s
    for the DeepSeek one): norm scales near 1, biases (DeepSeek's router correction) 0, the rest ~N(0, 0.05)."""
    cls, config = MODELS[name]
    graphdef, state = nnx.split(abstract_module(lambda: cls(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)

    def draw(path, x):
        where = jax.tree_util.keystr(path)
        if "bias" in where:
            return jnp.zeros(x.shape, x.dtype)
        value = 1.0 + 0.1 * rng.standard_normal(x.shape) if "scale" in where else 0.05 * rng.standard_normal(x.shape)
        return jnp.asarray(value, x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


@functools.cache
def _run(case: Case):
    """((loss, metrics), grads) as numpy, the traced program's scan lengths, and the compiled HLO text."""
    cls, config = MODELS[case.model]
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    mesh = make_mesh(dict(case.sizes), shard_mode=case.mode) if case.sizes else None
    # The one-device model's weights, placed on the mesh by the case's rules (cheaper than creating it there).
    graphdef, params, rest = nnx.split(abstract_module(lambda: cls(config, rngs=nnx.Rngs(0), rules=case.rules)),
                                       nnx.Param, ...)
    params, rest = nnx.split(_model(case.model), nnx.Param, ...)[1:]
    if mesh is not None:
        rules = get_rules(case.rules)
        params, rest = (_place(s, mesh, rules) for s in (params, rest))
        batch_spec = logical_to_mesh_axes(("activation_batch", None), rules, mesh)
        batch = jax.device_put(batch, jax.NamedSharding(mesh, batch_spec))
    fn = jax.jit(_loss_fn(case.model, graphdef, rest, case.chunk_tokens))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        traced = fn.trace(params, batch)
        compiled = traced.lower().compile(_COMPILER_OPTIONS)
        out = compiled(params, batch)
    return jax.device_get(out), _scan_lengths(traced.jaxpr.jaxpr), compiled.as_text()


def _assert_close(got, want, what: str) -> None:
    (got_total, got_metrics), got_grads = got
    (want_total, want_metrics), want_grads = want
    np.testing.assert_allclose(got_total, want_total, rtol=RTOL, err_msg=f"{what}: loss")
    assert got_metrics.keys() == want_metrics.keys()
    for name in want_metrics:
        np.testing.assert_allclose(got_metrics[name], want_metrics[name], rtol=RTOL, err_msg=f"{what}: {name}")
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads),
                            strict=True):
        # Relative L2 per tensor: element-wise relative error is meaningless for float32 noise around 0.
        error = np.linalg.norm(np.asarray(g) - np.asarray(w)) / max(np.linalg.norm(np.asarray(w)), 1e-30)
        assert error <= RTOL, f"{what}: gradient {jax.tree_util.keystr(path)} off by {error:.2e} (relative L2)"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chunked_equals_the_whole_logits_loss_and_gradients(case):
    got, lengths, _ = _run(case)
    assert case.chunks in lengths, f"expected a scan over {case.chunks} chunks, got scans of lengths {lengths}"
    (want_total, want_metrics), want_grads = _run(Case(case.model, 0, 1))[0]  # whole logits on one device
    want_metrics = {k: v for k, v in want_metrics.items() if k != "logits"}
    _assert_close(got, ((want_total, want_metrics), want_grads), case.id)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_loss_equals_a_numpy_cross_entropy_on_the_model_logits(name):
    """The independent reference: log-sum-exp minus the target's logit, in float64 numpy, on the logits of
    ``model.forward`` (each MTP depth against the targets ``k`` places further), masked and summed."""
    batch = _batch()
    (_, reference), _ = _run(Case(name, 0, 1))[0]
    logits = reference["logits"] if reference["logits"].ndim == 4 else reference["logits"][None]
    (_, metrics), _ = _run(next(c for c in CASES if c.model == name and not c.sizes))[0]  # chunked, one device
    for k, head_logits in enumerate(logits):
        lg = np.asarray(head_logits, np.float64)
        targets = np.pad(batch["targets"][:, k:], ((0, 0), (0, k)))
        mask = np.pad(batch["loss_mask"][:, k:], ((0, 0), (0, k)))
        log_z = np.log(np.sum(np.exp(lg - lg.max(-1, keepdims=True)), -1)) + lg.max(-1)
        picked = np.take_along_axis(lg, np.clip(targets, 0, None)[..., None], -1)[..., 0]
        want = np.sum((log_z - picked) * mask)
        name_k = "ce_sum" if k == 0 else f"mtp{k}_sum"
        np.testing.assert_allclose(metrics[name_k], want, rtol=RTOL, err_msg=name_k)
        np.testing.assert_allclose(metrics["tokens" if k == 0 else f"mtp{k}_tokens"], mask.sum(), rtol=0)


def test_the_head_is_gathered_and_reduced_once_for_all_chunks():
    """Under an Explicit mesh (ep-as-cp: tokens over fsdp and expert, the head stored over fsdp) the head's weight
    is gathered once for every chunk and MTP depth, and its gradient reduced once: no head-sized collective runs
    inside a loop (the chunk scan's, or any other)."""
    _, _, hlo = _run(EXPLICIT_EP_AS_CP)
    hidden = MODELS["deepseek-mtp"][1].hidden_size
    head = re.compile(rf"f32\[(?:{VOCAB},{hidden}|{hidden},{VOCAB})\]")
    collectives = [line for line in hlo.splitlines()
                   if re.search(r" (?:all-gather|all-reduce|reduce-scatter)\(", line) and head.search(line)]
    gathers = [c for c in collectives if " all-gather(" in c]
    reductions = [c for c in collectives if " all-gather(" not in c]
    assert len(gathers) == 1 and len(reductions) == 1, collectives
    in_loops = _loop_computations(hlo)
    assert in_loops, "the program has no loop: was it chunked?"
    assert not [c for c in collectives if _computation_of(hlo, c) in in_loops], collectives


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO computation name -> its instruction lines."""
    out, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.-]+) .*\{$", line)
        if header and not line.startswith(" "):
            name = header.group(1)
            out[name] = []
        elif name is not None and line.startswith(" "):
            out[name].append(line)
    return out


def _loop_computations(hlo: str) -> set[str]:
    """The computations that run inside a while loop: loop bodies and conditions, and all they call."""
    computations = _computations(hlo)
    called = {name: set(re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%([\w.-]+)",
                                   "\n".join(lines))) for name, lines in computations.items()}
    todo = [c for lines in computations.values() for line in lines if " while(" in line
            for c in re.findall(r"(?:body|condition)=%([\w.-]+)", line)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += called.get(name, ())
    return seen


def _computation_of(hlo: str, instruction: str) -> str:
    return next(name for name, lines in _computations(hlo).items() if instruction in lines)


def test_chunked_head_cross_entropy_alone_and_its_shapes():
    """The function by itself, with a plain matmul head: leading dims give one sum per leading index; chunk 0 and
    a chunk of the whole batch are the unchunked program; mismatched shapes say what is expected."""
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(2, 3, 7, 16)), jnp.float32)  # [lead, batch, seq, embed]
    weight = jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, (2, 3, 7)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 3, 7)) > 0.2, jnp.float32)

    weights = jnp.array([1.0, 0.3])  # a different cotangent for each leading index

    def whole(w, h):
        logits = h @ w
        sums = jnp.stack([token_cross_entropy(logits[k], targets[k], mask[k])[0] for k in range(2)])
        return sums @ weights, sums

    (_, want), want_grads = jax.value_and_grad(whole, argnums=(0, 1), has_aux=True)(weight, hidden)
    for chunk_tokens in (0, 6, 12, 10_000):  # 6: one position a chunk; 12: 2 positions, 4 chunks, last padded
        def chunked(w, h, n=chunk_tokens):
            sums, counts = chunked_head_cross_entropy(h, lambda x: x @ w, targets, mask, chunk_tokens=n)
            return sums @ weights, (sums, counts)

        (_, (sums, counts)), grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(
            weight, hidden)
        assert sums.shape == counts.shape == (2,)
        np.testing.assert_allclose(sums, want, rtol=RTOL)
        np.testing.assert_allclose(counts, mask.sum((1, 2)), rtol=0)
        for g, w in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-6)
    total, count = chunked_head_cross_entropy(hidden[0], lambda x: x @ weight, targets[0], mask[0], chunk_tokens=6)
    assert total.shape == count.shape == ()
    np.testing.assert_allclose(total, want[0], rtol=RTOL)
    with pytest.raises(ValueError, match="targets and mask of its leading shape"):
        chunked_head_cross_entropy(hidden, lambda x: x @ weight, targets[0], mask[0])
    assert default_chunk_tokens(128256) == 1046 and default_chunk_tokens(32000) == 4194


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_the_default_chunks_except_where_an_auto_mesh_would_reduce_the_head_per_chunk(mode):
    """Tokens split over fsdp 8: the default chunks under an Explicit mesh (the head's gradient reduced once), and
    under an Auto mesh stays one chunk (XLA reduces the head's gradient inside the loop, once per chunk: see the
    docstring), unless ``chunk_tokens`` asks. Traced only: 128 tokens a device at a 2**20 vocabulary, whose
    default chunk is 128 tokens."""
    mesh = make_mesh({"fsdp": 8}, shard_mode=mode)
    vocab = 2**20
    shape = jax.ShapeDtypeStruct

    def lengths(chunk_tokens):
        sharding = jax.NamedSharding(mesh, jax.P("fsdp"))
        args = (shape((16, 512, 4), jnp.float32, sharding=sharding), shape((4, vocab), jnp.float32),
                shape((16, 512), jnp.int32, sharding=sharding), shape((16, 512), jnp.float32, sharding=sharding))

        def loss(h, w, t, m):
            return chunked_head_cross_entropy(h, lambda x: x @ w, t, m, chunk_tokens=chunk_tokens)[0]

        with jax.set_mesh(mesh):
            return _scan_lengths(jax.make_jaxpr(loss)(*args).jaxpr)

    assert lengths(None) == ([8] if mode == "explicit" else [])  # 2 x 512 tokens a device, 128 a chunk
    assert lengths(256) == [4]


def _head_loss_temp_bytes(chunk_tokens: int, tokens: int, vocab: int, embed: int) -> int:
    """XLA temp bytes of the compiled gradient (head weight and hidden) of a head + loss over ``tokens``."""
    batch, seq = 2, tokens // 2
    hidden = jax.ShapeDtypeStruct((batch, seq, embed), jnp.float32)
    weight = jax.ShapeDtypeStruct((embed, vocab), jnp.float32)
    targets = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq), jnp.float32)

    def loss(w, h, t, m):
        total, count = chunked_head_cross_entropy(h, lambda x: x @ w, t, m, chunk_tokens=chunk_tokens)
        return total / count

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(weight, hidden, targets, mask).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunking_keeps_the_whole_batch_logits_out_of_memory():
    """Vocab 32,000, 4,096 tokens: one float32 [tokens, vocab] array is 500 MiB. Chunks of 512 tokens keep XLA's
    temporaries under half of it (the chunk's logits, their gradient, the head's gradient); the whole batch at
    once holds more than one such array (measured: 190 MiB chunked, 1,000 MiB whole)."""
    tokens, vocab, embed = 4096, 32_000, 64
    logits_bytes = tokens * vocab * 4
    chunked = _head_loss_temp_bytes(512, tokens, vocab, embed)
    whole = _head_loss_temp_bytes(0, tokens, vocab, embed)
    assert chunked < 0.5 * logits_bytes < logits_bytes < whole, (chunked / 2**20, whole / 2**20)
