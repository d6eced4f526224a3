import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.train import DataConfig, OptimizerConfig, learning_rate_schedule, make_iterator
from nnx_zoo.train.data import local_rows
from nnx_zoo.train.optim import decay_mask
from tests.train.toy_lm import ToyLM


def test_cosine_schedule_warms_up_then_decays_to_floor():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    lr = learning_rate_schedule(cfg, 100)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(100)) == pytest.approx(0.1)
    values = [float(lr(s)) for s in range(10, 101)]
    assert all(a >= b - 1e-7 for a, b in zip(values, values[1:]))


def test_wsd_schedule_is_flat_then_decays_linearly():
    cfg = OptimizerConfig(lr=2.0, warmup_steps=10, min_lr_ratio=0.0, schedule="wsd", wsd_decay_fraction=0.2)
    lr = learning_rate_schedule(cfg, 110)  # 10 warmup, 80 stable, 20 decay
    assert float(lr(10)) == pytest.approx(2.0)
    assert float(lr(89)) == pytest.approx(2.0)
    assert float(lr(100)) == pytest.approx(1.0)
    assert float(lr(110)) == pytest.approx(0.0)


def test_no_weight_decay_on_norm_scales():
    mask = decay_mask(ToyLM(16, 8, nnx.Rngs(0)))
    assert mask["scale"] is False
    assert mask["up"] is True and mask["embed"] is True


def test_optimizer_config_rejects_bad_values():
    with pytest.raises(ValueError, match="lr must be positive"):
        OptimizerConfig(lr=0)
    with pytest.raises(ValueError, match="schedule must be"):
        OptimizerConfig(schedule="linear")


def test_synthetic_data_is_deterministic_and_resumable():
    cfg = DataConfig(seq_len=16, global_batch=4, seed=3, synthetic_vocab=32)
    it = make_iterator(cfg, vocab_size=64)
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    fourth = next(it)
    again = make_iterator(cfg, vocab_size=64)
    assert np.array_equal(next(again)["input_ids"], first[0]["input_ids"])
    again.set_state(state)
    assert np.array_equal(next(again)["input_ids"], fourth["input_ids"])
    batch = first[0]
    assert batch["input_ids"].shape == (4, 16)
    np.testing.assert_array_equal(batch["input_ids"][:, 1:], batch["targets"][:, :-1])  # targets = next tokens
    assert batch["input_ids"].max() < 32


def test_each_process_loads_only_its_rows():
    cfg = DataConfig(seq_len=8, global_batch=4)
    whole = next(make_iterator(cfg, 300, process_index=0, process_count=1))["input_ids"]
    halves = [next(make_iterator(cfg, 300, process_index=i, process_count=2))["input_ids"] for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), whole)
    with pytest.raises(ValueError, match="does not split evenly over 3 processes"):
        local_rows(4, 0, 3)


def test_synthetic_vocab_must_fit_the_model():
    with pytest.raises(ValueError, match="exceeds the model's vocab_size"):
        make_iterator(DataConfig(synthetic_vocab=512), vocab_size=100)
    assert jnp.asarray(0) == 0
