"""The MTP heads on a batch whose sequence dim is split over devices (context parallelism), as the training loop
lays batches out, under an Explicit mesh: the heads shift the tokens left, which once sliced a sharded dim and
failed to trace. Logits equal the one-device model's."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo import DeepSeekV3
from nnx_zoo.sharding import make_mesh
from tests.models.deepseek.small import small_config


def test_mtp_heads_take_a_sequence_sharded_batch():
    config = small_config()
    assert config.num_nextn_predict_layers == 1
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (4, 8)).astype(np.int32)

    def mtp_logits(model, ids):
        return model.forward(ids, with_mtp=True).mtp_logits

    want = nnx.jit(mtp_logits)(DeepSeekV3.create(config), ids)
    mesh = make_mesh({"fsdp": 4, "context": 2}, shard_mode="explicit")
    model = DeepSeekV3.create(config, mesh=mesh)
    with jax.set_mesh(mesh):
        got = nnx.jit(mtp_logits)(model, jax.device_put(ids, NamedSharding(mesh, P("fsdp", "context"))))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
