"""``layers.scan.segments``: each pattern position of a periodic segment holds the layers the model runs there,
in model order, also when a stack name appears several times in the pattern (Gemma's sliding, sliding, global)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.layers.scan import model_order, segments


class _Stack(nnx.Module):
    """A stand-in layer stack: layer ``i`` holds its own index in its stack."""

    def __init__(self, count: int):
        self.index = nnx.Param(jnp.arange(count, dtype=jnp.float32))


@pytest.mark.parametrize("schedule", ["SSFSSFSSF", "SFSFF", "SSSSSFSSSSSFS", "FSSSF"])
def test_segments_take_the_layers_in_model_order(schedule):
    names = {"S": "sliding_layers", "F": "layers"}
    order = [names[c] for c in schedule]
    stacks = {name: _Stack(order.count(name)) for name in names.values()}
    expected = [order[:i].count(name) for i, name in enumerate(order)]  # each layer's index within its stack
    got, names_run = [], []
    for s in segments(order, stacks):
        per_position = [np.asarray(part.index[...]) for part in s.group]
        for p, values in enumerate(per_position):
            np.testing.assert_array_equal(values, s.starts[p] + s.strides[p] * np.arange(s.repeats))
        got += list(np.asarray(model_order(per_position)))
        names_run += list(s.pattern) * s.repeats
    assert names_run == order and got == expected
