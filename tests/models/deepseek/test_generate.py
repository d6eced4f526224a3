"""Generation with the MLA cache: cached logits equal the full forward's, greedy decoding equals Hugging Face's
``generate`` and teacher forcing, the cache holds ``kv_lora_rank + qk_rope_head_dim`` values per token per layer,
the decode step compiles once, sampling filters, stop tokens, and an 8-device Explicit fsdp mesh.

Models are tiny random HF checkpoints (hf_reference.py) loaded with ``from_pretrained``; row 0 of every batch is
left-padded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_zoo import DeepSeekV3, DeepSeekV3Config, generate
from nnx_zoo.generate import _generate, top_k_filter, top_p_filter
from nnx_zoo.sharding import make_mesh
from tests.models.deepseek.hf_reference import YARN, make_hf_model, rel_l2, save_hf

MODELS = {
    # q_lora, YaRN, interleaved rope, attention biases; scanned layer stacks.
    "qlora-scanned": dict(hf=dict(rope_scaling=YARN, attention_bias=True), ours=dict(moe_impl="dense")),
    # a single q_proj, rotate-half rope, tied embeddings; layers unrolled.
    "noqlora-unscanned": dict(hf=dict(q_lora_rank=None, rope_interleave=False, tie_word_embeddings=True),
                              ours=dict(moe_impl="gmm", scan_layers=False)),
}
PAD = 3  # row 0 is left-padded by this many tokens
# One batch shape for every test (8 rows: the fsdp mesh needs a multiple of 8), so each function compiles once.
BATCH, PROMPT, NEW = 8, 6, 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, HF model)."""
    out = {}
    for seed, (name, case) in enumerate(MODELS.items()):
        hf = make_hf_model(seed=seed, **case["hf"])
        out[name] = (save_hf(hf, tmp_path_factory.mktemp(name)), hf)
    return out


def _load(checkpoints, name: str, **kw) -> DeepSeekV3:
    return DeepSeekV3.from_pretrained(checkpoints[name][0], **{**MODELS[name]["ours"], **kw})


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    ids = np.random.default_rng(seed).integers(1, vocab, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    mask[0, :PAD], ids[0, :PAD] = 0, 0
    return jnp.asarray(ids), jnp.asarray(mask)


def _positions(mask: jax.Array) -> jax.Array:
    """Rope positions of a left-padded row: its real tokens count 0, 1, 2, ... (HF generate's position_ids)."""
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


@nnx.jit
def _forward(model, ids, mask):
    return model(ids, mask, position_ids=_positions(mask))


@nnx.jit
def _prefill(model, ids, mask, cache):
    return model.prefill(ids, mask, cache)


@nnx.jit
def _decode(model, tokens, cache):
    return model.decode_step(tokens, cache)


class _AdaptedLinear(nnx.Module):
    """A stack of linear maps that is not a plain ``Linear`` (as a LoRA wrapper is): base + a low-rank delta."""

    def __init__(self, base, layers: int, rank: int, rngs: nnx.Rngs):
        self.base = base
        self.a = nnx.Param(jax.random.normal(rngs.params(), (layers, base.in_features[0], rank)))
        self.b = nnx.Param(jax.random.normal(rngs.params(), (layers, rank, *base.out_features)) * 0.3)

    def __call__(self, x, out_names=None):  # called per layer (inside the stack's scan), so a, b are 2-D / 3-D
        return self.base(x, out_names) + jnp.einsum("...c,cr,rhd->...hd", x, self.a[...], self.b[...])


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_logits_equal_full_forward(checkpoints, name):
    """Prefill 6 tokens, then decode 8 more one at a time (teacher forced): every step's logits equal the full
    forward's at that position (float32). In the second model every ``kv_b_proj`` is wrapped with an adapter:
    the absorbed decode must read the wrapped map (off the identity), or the logits would differ."""
    model = _load(checkpoints, name)
    if name == "noqlora-unscanned":
        for i, stack in enumerate((model.dense_layers, model.moe_layers)):
            layers = stack.attn.kv_b_proj.kernel.shape[0]
            stack.attn.kv_b_proj = _AdaptedLinear(stack.attn.kv_b_proj, layers, 2, nnx.Rngs(i))
    ids, mask = _prompts(BATCH, PROMPT + NEW, model.config.vocab_size)
    reference = np.asarray(_forward(model, ids, mask))

    cache = model.init_cache(batch=BATCH, max_len=PROMPT + NEW)
    logits, cache = _prefill(model, ids[:, :PROMPT], mask[:, :PROMPT], cache)
    real = np.asarray(mask[:, :PROMPT], bool)  # padding queries see nothing; their outputs are unused
    assert rel_l2(np.asarray(logits)[real], reference[:, :PROMPT][real]) < 1e-5
    for i in range(PROMPT, PROMPT + NEW):
        logits, cache = _decode(model, ids[:, i], cache)
        assert rel_l2(logits, reference[:, i]) < 1e-5, f"decode step at position {i}"
    assert int(cache.length) == PROMPT + NEW
    np.testing.assert_array_equal(cache.next_position, np.asarray(mask).sum(axis=1))


@pytest.fixture(scope="module")
def greedy(checkpoints):
    """(model, ids, mask, greedy output) for the q_lora model."""
    model = _load(checkpoints, "qlora-scanned")
    ids, mask = _prompts(BATCH, PROMPT, model.config.vocab_size, seed=1)
    return model, ids, mask, generate(model, ids, mask, max_new_tokens=NEW)


def _teacher_forced_logits(model, ids, mask, out):
    full_mask = jnp.concatenate([mask, jnp.ones((BATCH, NEW), jnp.int32)], axis=1)
    return _forward(model, out.tokens, full_mask)[:, PROMPT - 1:-1]  # the logits each new token was drawn from


def test_greedy_equals_hf_generate_and_teacher_forcing(checkpoints, greedy):
    model, ids, mask, out = greedy
    assert out.tokens.dtype == jnp.int32 and out.tokens.shape == (BATCH, PROMPT + NEW)
    np.testing.assert_array_equal(out.tokens[:, :PROMPT], ids)  # the prompt as given, padding kept
    np.testing.assert_array_equal(out.lengths, [NEW] * BATCH)

    hf = checkpoints["qlora-scanned"][1]
    with torch.no_grad():
        expected = hf.generate(torch.tensor(np.asarray(ids)), attention_mask=torch.tensor(np.asarray(mask)),
                               max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected.numpy())

    # Teacher forcing: the full forward over prompt + generated tokens predicts every generated token.
    argmax = np.asarray(jnp.argmax(_teacher_forced_logits(model, ids, mask, out), axis=-1))
    np.testing.assert_array_equal(argmax, np.asarray(out.tokens)[:, PROMPT:])


def test_cache_bytes_per_token_per_layer(checkpoints):
    model = _load(checkpoints, "qlora-scanned")
    c = model.config
    cache = model.init_cache(batch=2, max_len=5)
    assert cache.latent.shape == (c.num_hidden_layers, 2, 5, c.kv_lora_rank)
    assert cache.k_rope.shape == (c.num_hidden_layers, 2, 5, c.qk_rope_head_dim)
    per_token = (cache.latent.nbytes + cache.k_rope.nbytes) / (c.num_hidden_layers * 2 * 5)
    assert per_token == cache.bytes_per_token_per_layer() == (c.kv_lora_rank + c.qk_rope_head_dim) * 4

    # DeepSeek-V3 itself in bfloat16 (abstract: no memory): (512 + 64) * 2 bytes, against 128 heads of full keys
    # (192) and values (128) = 81920 bytes.
    v3 = DeepSeekV3Config.preset("deepseek3-671b", dtype="bfloat16", param_dtype="bfloat16")
    abstract = nnx.eval_shape(lambda: DeepSeekV3(v3, rngs=nnx.Rngs(0)))
    shapes = nnx.eval_shape(lambda m: m.init_cache(batch=1, max_len=4096), abstract)
    per_token = sum(np.prod(a.shape) * a.dtype.itemsize for a in (shapes.latent, shapes.k_rope)) / (61 * 4096)
    assert per_token == (512 + 64) * 2 == 1152


def test_decode_step_compiles_once_across_tokens_and_settings(greedy, monkeypatch):
    """Sampling with new temperatures, top-k, top-p, stop tokens and seeds reuses one compiled generation, whose
    decode step was traced once for all tokens. Top-k = 1 sampling equals greedy."""
    model, ids, mask, expected = greedy
    traces = []
    original = DeepSeekV3.decode_step

    def counted(self, tokens, cache):
        traces.append(tokens.shape)
        return original(self, tokens, cache)

    monkeypatch.setattr(DeepSeekV3, "decode_step", counted)
    # Another test (test_sampling_keeps_to_the_filtered_tokens) may already have compiled this sampling
    # generation in this process: a cache hit would trace nothing here. Start from an empty cache so the test
    # counts its own compile whatever ran before it.
    _generate.clear_cache()
    compiled_before = _generate._cache_size()
    for temperature, seed in ((0.7, 0), (1.3, 1), (2.0, 2)):
        sampled = generate(model, ids, mask, max_new_tokens=NEW, temperature=temperature, top_k=1, rng=seed)
        np.testing.assert_array_equal(sampled.tokens, expected.tokens)
    generate(model, ids, mask, max_new_tokens=NEW, temperature=1.0, top_k=5, top_p=0.5, stop_tokens=(1, 2, 3))
    assert len(traces) == 1, f"the decode step was traced {len(traces)} times for 4 x {NEW - 1} decoded tokens"
    assert compiled_before == 0 and _generate._cache_size() == 1


def test_sampling_keeps_to_the_filtered_tokens(greedy):
    """Temperature + top-k + top-p samples: every token lies in the set the filters keep for its position (from
    the full forward), equal seeds repeat, other seeds differ."""
    model, ids, mask, _ = greedy
    kw = dict(max_new_tokens=NEW, temperature=1.5, top_k=6, top_p=0.6)
    first, again, other = (generate(model, ids, mask, rng=seed, **kw) for seed in (7, 7, 8))
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert not np.array_equal(first.tokens, other.tokens)
    for out in (first, other):
        logits = _teacher_forced_logits(model, ids, mask, out) / 1.5
        allowed = np.isfinite(np.asarray(top_p_filter(top_k_filter(logits, 6), 0.6)))
        chosen = np.take_along_axis(allowed, np.asarray(out.tokens)[:, PROMPT:, None], axis=-1)
        assert chosen.all()
        assert allowed.sum(-1).max() > 1  # the filters left a real choice somewhere


def test_top_k_and_top_p_filters_on_known_logits():
    logits = jnp.log(jnp.asarray([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]]))
    kept = lambda x: np.isfinite(np.asarray(x))  # noqa: E731
    np.testing.assert_array_equal(kept(top_k_filter(logits, 2)), [[0, 1, 0, 1], [1, 1, 1, 1]])  # ties kept
    np.testing.assert_array_equal(kept(top_k_filter(logits, 9)), np.ones((2, 4), bool))
    # Row 0 sorted: 0.4, 0.3, 0.2, 0.1 (cumulative 0.4, 0.7, 0.9, 1.0): the smallest set reaching p.
    for p, row0 in ((0.3, [0, 1, 0, 0]), (0.4, [0, 1, 0, 0]), (0.5, [0, 1, 0, 1]), (0.7, [0, 1, 0, 1]),
                    (0.75, [0, 1, 1, 1]), (1.0, [1, 1, 1, 1])):
        np.testing.assert_array_equal(kept(top_p_filter(logits, p))[0], row0, err_msg=f"p={p}")
    np.testing.assert_array_equal(kept(top_p_filter(logits, 0.3))[1], [1, 1, 1, 1])  # ties with the kept one
    np.testing.assert_array_equal(top_p_filter(logits, 0.5)[0, 1], logits[0, 1])  # kept logits are unchanged
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        top_k_filter(logits, 0)


def test_stop_tokens_end_a_row_and_pad_the_rest(greedy):
    model, ids, mask, free = greedy
    free = np.asarray(free.tokens)[:, PROMPT:]
    stop = int(free[0, 2])  # row 0 stops after its third new token
    pad = model.config.vocab_size + 5  # outside the vocabulary, so padding is unmistakable
    out = generate(model, ids, mask, max_new_tokens=NEW, stop_tokens=(stop, 10_000), pad_token_id=pad)
    for row in range(BATCH):
        hits = np.flatnonzero(free[row] == stop)
        length = hits[0] + 1 if hits.size else NEW
        expected = np.concatenate([free[row, :length], np.full(NEW - length, pad)])
        np.testing.assert_array_equal(np.asarray(out.tokens)[row, PROMPT:], expected)
        assert int(out.lengths[row]) == length
    assert int(out.lengths[0]) == 3
    np.testing.assert_array_equal(out.tokens[:, :PROMPT], ids)


@pytest.mark.parametrize("sizes, shard_mode, rules", [
    ({"fsdp": 8}, "explicit", "default"),
    # context parallelism: one decoded token is not split over the sequence axes (DeepSeekV3._decoding_rules)
    ({"fsdp": 2, "context": 2, "expert": 2}, "explicit", "ep-as-cp"),
    ({"fsdp": 4, "tensor": 2}, "auto", "default"),  # vocab split over tensor: logits are gathered to sample
])
def test_generation_on_meshes_equals_unsharded(checkpoints, greedy, sizes, shard_mode, rules):
    _, ids, mask, expected = greedy
    mesh = make_mesh(sizes, shard_mode=shard_mode)
    model = _load(checkpoints, "qlora-scanned", mesh=mesh, rules=rules)
    assert len(model.embed.embedding[...].sharding.device_set) == 8
    out = generate(model, ids, mask, max_new_tokens=NEW, temperature=1.0, top_k=1)  # top-k = 1 sorts the vocab
    np.testing.assert_array_equal(out.tokens, expected.tokens)
    if shard_mode == "explicit":
        # The cache is laid out like the activations, batch over fsdp (types carry shardings: nothing compiles).
        _, cache = nnx.eval_shape(lambda m: m.prefill(ids, mask, m.init_cache(batch=BATCH, max_len=PROMPT)), model)
        assert cache.latent.sharding.spec == P(None, "fsdp", None, None)
        assert cache.k_rope.sharding.spec == P(None, "fsdp", None, None)


def test_bad_arguments_are_explained(checkpoints):
    model = _load(checkpoints, "noqlora-unscanned")
    ids = jnp.ones((2, 4), jnp.int32)
    right_padded = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"rows \[0\] end in padding: pad prompts on the left"):
        generate(model, ids, right_padded)
    with pytest.raises(ValueError, match=r"rows \[0\] end in padding"):  # the method is the same function
        model.generate(ids, right_padded, max_new_tokens=4)
    with pytest.raises(ValueError, match="add a batch dim"):
        generate(model, ids[0])
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        generate(model, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p must be None or in"):
        generate(model, ids, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, ids, temperature=-1.0)
    with pytest.raises(ValueError, match="stop_tokens must be a sequence"):
        generate(model, ids, stop_tokens=2)
    with pytest.raises(TypeError, match=r"lacks \['init_cache', 'prefill', 'decode_step'\]"):
        generate(object(), ids)
    with pytest.raises(ValueError, match="does not fit a cache of 3 slots"):
        model.prefill(ids, None, model.init_cache(batch=2, max_len=3))

