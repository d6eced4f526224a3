"""Grouped-query ``Attention`` against transformers' own Llama/Qwen2/Qwen3 attention (float32, CPU, tiny random
configs): GQA ratios 1, 2, 4 and a single KV head, head_dim unequal to hidden / heads, biases, Qwen3's q/k norm,
every rope type, a left-padded batch; the cached decode path against the full forward; and the forward under
Explicit and Auto meshes against one device, handed back in its input's sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from nnx_zoo.layers import Attention, KVCache, causal_mask, dot_product_attention, rope_from_hf
from nnx_zoo.layers.rope import rope_cos_sin, rope_frequencies
from nnx_zoo.sharding import make_mesh, state_shardings, use_rules

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
             "beta_slow": 1.0},
}

# (family, hidden, heads, kv heads, head_dim, bias, rope type). head_dim != hidden / heads in most rows.
CASES = [
    ("llama", 64, 4, 4, 16, False, "default"),  # MHA
    ("llama", 64, 4, 2, 24, True, "linear"),  # GQA 2, with biases
    ("llama", 48, 8, 2, 16, False, "llama3"),  # GQA 4
    ("llama", 64, 4, 1, 32, True, "yarn"),  # one KV head
    ("qwen3", 64, 8, 2, 16, False, "default"),  # q/k norm, GQA 4
    ("qwen3", 48, 4, 1, 32, True, "yarn"),  # q/k norm, one KV head, biases
    ("qwen3", 32, 4, 4, 16, False, "llama3"),  # q/k norm, MHA
    ("qwen2", 64, 4, 2, 16, True, "default"),  # q/k/v biases without an o_proj bias
]
MODULES = {"llama": (LlamaConfig, LlamaAttention), "qwen2": (Qwen2Config, Qwen2Attention),
           "qwen3": (Qwen3Config, Qwen3Attention)}
BATCH, SEQ = 3, 9
PADS = (0, 4, 8)  # left padding per row (the last row has one real token)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hf_config(family: str, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, rope: str):
    cls = MODULES[family][0]
    rope_parameters = dict(ROPES[rope] or {"rope_type": "default"}, rope_theta=500.0)
    config = cls(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                 attention_bias=bias, rope_parameters=rope_parameters, max_position_embeddings=64,
                 rms_norm_eps=1e-6, intermediate_size=4 * hidden, vocab_size=32)
    config._attn_implementation = "eager"
    return config


def build_pair(case, seed: int = 0) -> tuple[torch.nn.Module, Attention, object]:
    """transformers' attention with random weights (biases and norm scales included) and ours holding a copy."""
    family, hidden, heads, kv_heads, head_dim, bias, rope = case
    config = hf_config(*case)
    torch.manual_seed(seed)
    ref = MODULES[family][1](config, layer_idx=0).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ours = Attention(hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, use_bias=bias,
                     o_bias=bias and family != "qwen2", qk_norm=family == "qwen3", norm_eps=config.rms_norm_eps,
                     rngs=nnx.Rngs(1))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    for name, n in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
        getattr(ours, name).kernel[...] = jnp.asarray(sd[f"{name}.weight"].T.reshape(hidden, n, head_dim))
        if bias:
            getattr(ours, name).bias[...] = jnp.asarray(sd[f"{name}.bias"].reshape(n, head_dim))
    ours.o_proj.kernel[...] = jnp.asarray(sd["o_proj.weight"].T.reshape(heads, head_dim, hidden))
    assert (ours.o_proj.bias is None) == ("o_proj.bias" not in sd)
    if "o_proj.bias" in sd:
        ours.o_proj.bias[...] = jnp.asarray(sd["o_proj.bias"])
    if family == "qwen3":
        ours.q_norm.scale[...] = jnp.asarray(sd["q_norm.weight"])
        ours.k_norm.scale[...] = jnp.asarray(sd["k_norm.weight"])
    return ref, ours, config


def padded_inputs(hidden: int, seed: int = 0, batch: int = BATCH):
    """``x [batch, SEQ, hidden]``, a left-padding mask (row ``r`` has ``PADS[r % 3]`` pads) and the rope positions
    generation gives such rows (``cumsum(mask) - 1``)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, SEQ, hidden)).astype(np.float32)
    mask = np.ones((batch, SEQ), np.int32)
    for row in range(batch):
        mask[row, :PADS[row % len(PADS)]] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return x, mask, positions


def ours_rope(config, positions):
    theta, scaling = rope_from_hf(config.to_dict())
    inv_freq, factor = rope_frequencies(config.head_dim, theta, scaling)
    return inv_freq, rope_cos_sin(jnp.asarray(positions), inv_freq, factor)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_matches_transformers(case):
    ref, ours, config = build_pair(case)
    x, mask, positions = padded_inputs(case[1])
    inv_freq, (cos, sin) = ours_rope(config, positions)

    rotary = LlamaRotaryEmbedding(config)
    x_t = torch.as_tensor(x)
    cos_t, sin_t = rotary(x_t, torch.as_tensor(positions))
    np.testing.assert_allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([cos, cos], -1), cos_t.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([sin, sin], -1), sin_t.numpy(), rtol=1e-6, atol=1e-6)

    visible = np.tril(np.ones((SEQ, SEQ), bool))[None, None] & mask.astype(bool)[:, None, None, :]
    additive = torch.as_tensor(np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32))
    with torch.no_grad():
        want, _ = ref(x_t, position_embeddings=(cos_t, sin_t), attention_mask=additive)
    got = nnx.jit(lambda attn, *a: attn(*a))(ours, jnp.asarray(x), cos, sin, causal_mask(SEQ, jnp.asarray(mask)))

    assert np.isfinite(np.asarray(got)).all()  # fully masked rows (left padding) stay finite
    real = mask.astype(bool)
    assert rel_err(np.asarray(got)[real], want.numpy()[real]) < 1e-6
    assert rel_err(got, want.numpy()) < 1e-6  # padded queries too: uniform over all keys in both


def test_grouped_attention_equals_repeated_kv_heads():
    """GQA with ``n`` KV heads is MHA with each KV head repeated for its ``h / n`` query heads (HF's repeat_kv)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 5, 6, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 5, 2, 8)), jnp.float32) for _ in range(2))
    mask = causal_mask(5, jnp.asarray([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    attend = jax.jit(dot_product_attention, static_argnums=4)
    grouped = attend(q, k, v, mask, 0.3)
    repeated = attend(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), mask, 0.3)
    np.testing.assert_allclose(grouped, repeated, rtol=1e-6, atol=1e-6)
    assert rel_err(grouped[:, :, :3], grouped[:, :, 3:]) > 0.1  # the two groups really use different KV heads


def test_bad_head_counts_are_clear_errors():
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must be a positive divisor of num_heads \(4\)"):
        Attention(32, num_heads=4, num_kv_heads=3, head_dim=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="head_dim must be even"):
        Attention(32, num_heads=4, num_kv_heads=2, head_dim=7, rngs=nnx.Rngs(0))


def _rope(head_dim: int, positions):
    inv_freq, factor = rope_frequencies(head_dim, 500.0)
    return rope_cos_sin(jnp.asarray(positions), inv_freq, factor)


@nnx.jit
def _forward(attn, x, positions, mask):
    with use_rules("default"):
        return attn(x, *_rope(attn.head_dim, positions), causal_mask(x.shape[1], mask))


@nnx.jit
def _extend(attn, x, token_mask, cache):
    """One ``prefill``/``decode_step`` of a one-layer model: book the new tokens, attend, write layer 0."""
    with use_rules("default"):
        start = cache.length
        positions, visible, cache = cache.advance(token_mask)
        out, k, v = attn.decode(x, *_rope(attn.head_dim, positions), cache.k[0], cache.v[0], start, visible)
    return out, positions, cache._replace(k=cache.k.at[0].set(k), v=cache.v.at[0].set(v))


def _decode_all(attn: Attention, x, mask, prompt: int, max_len: int):
    """Prefill ``prompt`` tokens into a fresh cache, then the rest one slot at a time (the padding of a row may
    run past the prompt). Returns ``(outputs [b, s, embed], rope positions [b, s], cache)``."""
    cache = KVCache.zeros(num_layers=1, batch=x.shape[0], max_len=max_len, num_kv_heads=attn.num_kv_heads,
                          head_dim=attn.head_dim, dtype=jnp.float32)
    outs, seen = [], []
    for lo, hi in [(0, prompt)] + [(t, t + 1) for t in range(prompt, x.shape[1])]:
        out, positions, cache = _extend(attn, x[:, lo:hi], mask[:, lo:hi], cache)
        outs.append(out)
        seen.append(positions)
    return jnp.concatenate(outs, axis=1), np.concatenate(seen, axis=1), cache


@pytest.mark.parametrize("qk_norm", [False, True])
def test_cached_decode_equals_full_forward(qk_norm):
    """Prefill a left-padded prompt into a KVCache, then decode the rest one token at a time: every real token's
    output equals the full forward's at that position (rope positions counting only real tokens)."""
    attn = Attention(32, num_heads=4, num_kv_heads=2, head_dim=16, use_bias=True, qk_norm=qk_norm,
                     kernel_init=nnx.initializers.normal(0.3), rngs=nnx.Rngs(0))
    x, mask, positions = padded_inputs(32, seed=1)
    full = _forward(attn, jnp.asarray(x), jnp.asarray(positions), jnp.asarray(mask))
    cached, seen, cache = _decode_all(attn, jnp.asarray(x), jnp.asarray(mask), prompt=5, max_len=SEQ + 2)

    real = mask.astype(bool)
    np.testing.assert_array_equal(seen[real], positions[real])
    assert int(cache.length) == SEQ and cache.next_position.tolist() == real.sum(1).tolist()
    assert rel_err(np.asarray(cached)[real], np.asarray(full)[real]) < 1e-6
    # The cache holds the real tokens' keys at their slots; padding slots are marked invalid, free slots empty.
    k_full = attn.project(jnp.asarray(x), *_rope(16, positions))[1]
    np.testing.assert_allclose(np.asarray(cache.k[0, :, :SEQ])[real], np.asarray(k_full)[real], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(cache.valid, np.pad(real, ((0, 0), (0, 2))))
    assert not np.asarray(cache.k[0, :, SEQ:]).any()
    assert cache.bytes_per_token_per_layer() == 2 * 2 * 16 * 4


def _place(module: nnx.Module, mesh) -> nnx.Module:
    graphdef, state = nnx.split(module)
    leaves = [jax.device_put(a, s) for a, s in zip(jax.tree.leaves(state), state_shardings(state, mesh, "default"))]
    return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), leaves))


SHARDED = [  # (mesh sizes, shard mode, kv heads, input specs)
    ({"fsdp": 4, "tensor": 2}, "explicit", 2, (P("fsdp", None, None), P(None, None, None), P("fsdp", None, "tensor"))),
    ({"fsdp": 4, "tensor": 2}, "auto", 2, (P("fsdp", None, None),)),
    ({"fsdp": 8}, "explicit", 1, (P("fsdp", None, None),)),
]


@pytest.mark.parametrize(("sizes", "mode", "kv_heads", "specs"), SHARDED, ids=lambda v: str(v).replace(" ", ""))
def test_sharded_forward_equals_one_device_and_keeps_input_sharding(sizes, mode, kv_heads, specs):
    """FSDP 4 x TP 2 (KV heads split over tensor) and FSDP 8 with one KV head, under the default rules: the
    forward and the cached decode give the one-device numbers, handed back in the input's sharding."""
    attn = Attention(32, num_heads=4, num_kv_heads=kv_heads, head_dim=16, use_bias=True, qk_norm=True,
                     kernel_init=nnx.initializers.normal(0.3), rngs=nnx.Rngs(0))
    x_np, mask_np, positions = padded_inputs(32, seed=2, batch=8)
    want = _forward(attn, jnp.asarray(x_np), jnp.asarray(positions), jnp.asarray(mask_np))
    mesh = make_mesh(sizes, shard_mode=mode)
    sharded = _place(attn, mesh)
    for spec in specs:
        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.asarray(x_np), NamedSharding(mesh, spec))
            got = _forward(sharded, x, jnp.asarray(positions), jnp.asarray(mask_np))
        assert rel_err(got, want) < 1e-6, spec
        # Under Explicit axes the type carries the layout (restored); under Auto both types say "Auto".
        assert jax.typeof(got).sharding == jax.typeof(x).sharding, spec

    # The cached decode path on the same mesh: the cache laid out by its names, outputs in their input's layout.
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(x_np), NamedSharding(mesh, specs[0]))
        cached, _, cache = _decode_all(sharded, x, jnp.asarray(mask_np), prompt=5, max_len=SEQ)
    real = mask_np.astype(bool)
    assert rel_err(np.asarray(cached)[real], np.asarray(want)[real]) < 1e-6
    assert jax.typeof(cached).sharding == jax.typeof(x).sharding
    if mode == "explicit":
        assert cache.k.sharding.spec == P(None, "fsdp", None, "tensor" if "tensor" in sizes else None, None)
