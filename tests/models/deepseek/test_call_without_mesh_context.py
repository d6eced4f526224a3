"""A sharded model can be called without ``jax.set_mesh``: it uses the mesh its parameters live on."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.sharding import make_mesh


@pytest.mark.parametrize("shard_mode", ["explicit", "auto"])
def test_sharded_model_called_eagerly_and_jitted_without_set_mesh(shard_mode):
    config = DeepSeekV3Config.preset("deepseek3-mini", num_hidden_layers=2)
    ids = jnp.arange(64, dtype=jnp.int32).reshape(4, 16)
    reference = DeepSeekV3.create(config)(ids)
    model = DeepSeekV3.create(config, mesh=make_mesh({"fsdp": 4, "tensor": 2}, shard_mode=shard_mode))
    eager = model(ids)
    jitted = nnx.jit(lambda m, i: m(i))(model, ids)
    np.testing.assert_allclose(eager, reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jitted, reference, rtol=1e-5, atol=1e-5)
