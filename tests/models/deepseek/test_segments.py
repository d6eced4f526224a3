"""Packed documents: with segment ids, each document's logits equal those of the document run alone."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo import DeepSeekV3, DeepSeekV3Config


def test_packed_documents_do_not_see_each_other():
    config = DeepSeekV3Config.preset("deepseek3-mini", num_hidden_layers=2, vocab_size=256)
    model = DeepSeekV3(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, 256, (1, 5)), rng.integers(0, 256, (1, 7))
    packed = jnp.asarray(np.concatenate([first, second], axis=1))
    segments = jnp.asarray([[1] * 5 + [2] * 7])
    out = model.forward(packed, segment_ids=segments, with_mtp=True)
    alone = [model.forward(jnp.asarray(doc), with_mtp=True) for doc in (first, second)]
    # RoPE scores depend only on relative positions, so the second document's offset does not matter.
    np.testing.assert_allclose(out.logits[:, :5], alone[0].logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.logits[:, 5:], alone[1].logits, rtol=1e-5, atol=1e-5)
    # Without segment ids the second document does see the first.
    mixed = model(packed)
    assert float(jnp.max(jnp.abs(mixed[:, 5:] - alone[1].logits))) > 1e-3
    # MTP depth 1 at the last position of a document reads the next document's first token (as in an unpacked
    # stream), so compare only positions whose shifted token is in the same document.
    np.testing.assert_allclose(out.mtp_logits[:, :, :4], alone[0].mtp_logits[:, :, :4], rtol=1e-5, atol=1e-5)
    assert jax.tree.leaves(out)  # a pytree
