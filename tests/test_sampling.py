"""``nnx_zoo.generate``'s sampling, on a stub model whose every step offers the same fixed logits (no weights, one
small compile shared by both tests): draws are independent across decode steps, and the distribution sampled is
transformers' ``TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper`` (temperature first)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from nnx_zoo import generate

ROWS, NEW, VOCAB = 512, 8, 8  # one shape for both tests: one compile


class _FixedLogits(nnx.Module):
    """The cached-decoding trio of ``generate``'s contract, every step returning ``logits [vocab]`` for each row."""

    def __init__(self, logits: np.ndarray):
        self.logits = nnx.Variable(jnp.asarray(logits, jnp.float32))

    def init_cache(self, batch: int, max_len: int) -> jnp.ndarray:
        return jnp.zeros((), jnp.int32)

    def prefill(self, input_ids, attention_mask, cache):
        return jnp.broadcast_to(self.logits[...], (*input_ids.shape, VOCAB)), cache

    def decode_step(self, tokens, cache):
        return jnp.broadcast_to(self.logits[...], (tokens.shape[0], VOCAB)), cache + 1


def _sample(logits: np.ndarray, **kw) -> np.ndarray:
    """``[ROWS, NEW]`` tokens generated from one prompt token per row."""
    out = generate(_FixedLogits(logits), jnp.ones((ROWS, 1), jnp.int32), max_new_tokens=NEW, rng=0, **kw)
    return np.asarray(out.tokens)[:, 1:]


def test_draws_are_independent_across_decode_steps():
    """Uniform over 4 tokens: two different steps of a row agree with probability 1/4 when each step draws with
    its own key; a key reused across steps makes them agree always. Every pair of the 8 steps agrees on at most
    35% of the 512 rows (1/4 is the expectation; 35% is 4.6 standard deviations above it), and each step's
    marginal is near uniform."""
    logits = np.full(VOCAB, -np.inf, np.float32)
    logits[:4] = 0.0
    tokens = _sample(logits, temperature=1.0)
    assert set(np.unique(tokens)) == {0, 1, 2, 3}
    for a in range(NEW):
        counts = np.bincount(tokens[:, a], minlength=4) / ROWS
        assert np.all(np.abs(counts - 0.25) < 0.08), (a, counts)  # 4 standard deviations
        for b in range(a + 1, NEW):
            agree = np.mean(tokens[:, a] == tokens[:, b])
            assert agree < 0.35, f"steps {a} and {b} drew the same token in {agree:.0%} of the rows"


def _transformers_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The probabilities transformers samples from: its warpers in ``generate``'s order, then softmax."""
    scores = torch.as_tensor(logits[None], dtype=torch.float32)
    ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)):
        scores = warper(ids, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


def test_temperature_comes_before_top_k_and_top_p_as_in_transformers():
    """Probabilities ``[.5, .2, .12, .08, .05, .03, .015, .005]`` at temperature 2, top-k 5, top-p 0.8: tempered
    first (transformers' order), the nucleus holds 4 tokens; filtered on the raw logits it would hold 3. The
    empirical frequencies of 4096 draws (512 rows x 8 steps) equal transformers' distribution within 0.03 (4
    standard deviations at most), so the support and the tempered weights both count."""
    probs = np.asarray([0.5, 0.2, 0.12, 0.08, 0.05, 0.03, 0.015, 0.005])
    logits = np.log(probs).astype(np.float32)
    expected = _transformers_distribution(logits, 2.0, 5, 0.8)
    assert np.count_nonzero(expected) == 4  # the case tells the two orders apart
    assert np.count_nonzero(_transformers_distribution(logits, 1.0, 5, 0.8)) == 3  # the raw logits' nucleus
    tokens = _sample(logits, temperature=2.0, top_k=5, top_p=0.8)
    freq = np.bincount(tokens.ravel(), minlength=VOCAB) / tokens.size
    assert set(np.flatnonzero(freq)) == set(np.flatnonzero(expected)), (freq, expected)
    np.testing.assert_allclose(freq, expected, atol=0.03)
