"""What a run writes besides metrics.jsonl when asked: TensorBoard events and a JAX profiler trace."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from tensorboardX.proto import event_pb2

from nnx_zoo.train import DataConfig, OptimizerConfig, TrainConfig, train
from tests.train.toy_lm import ToyLM


def read_scalars(directory: Path) -> dict[tuple[str, int], float]:
    """Every scalar of the TensorBoard event files under ``directory``: {(tag, step): value}.

    Event files are TFRecords (u64 length, u32 length CRC, the Event proto, u32 data CRC)."""
    scalars = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars[(value.tag, event.step)] = value.simple_value
    return scalars


def _train(run_dir, steps=4, **kwargs):
    config = TrainConfig(steps=steps, run_dir=str(run_dir), progress=False, data=DataConfig(
        seq_len=8, global_batch=8, synthetic_vocab=32), optimizer=OptimizerConfig(warmup_steps=1), **kwargs)
    return train(lambda: ToyLM(32, 16, nnx.Rngs(0)), config, vocab_size=32, flops_per_token=1.0)


def test_tensorboard_scalars_equal_the_jsonl_metrics_and_profile_steps_write_a_trace(tmp_path):
    _train(tmp_path, tensorboard=True, profile_steps=(2, 3))  # one run checks both (each run costs ~10 s)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(tmp_path / "tensorboard")
    expected = {(key, r["step"]): value for r in records for key, value in r.items()
                if key != "step" and isinstance(value, (int, float)) and np.isfinite(value)}  # flags: 0/1
    assert {"loss", "grad_norm", "lr", "tokens_per_s"} <= {tag for tag, _ in expected}
    assert set(scalars) == set(expected)
    for key, value in expected.items():  # TensorBoard stores float32
        assert scalars[key] == np.float32(value), key

    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_bad_profile_steps_are_rejected():
    with pytest.raises(ValueError, match="profile_steps must be"):
        TrainConfig(profile_steps=(3, 2))


def test_checkpoint_cadence_and_divergence_settings_are_checked_and_described():
    from nnx_zoo.train.loop import checkpoint_cadence

    for bad, match in [({"checkpoint_minutes": -1}, "checkpoint_minutes must be >= 0"),
                       ({"checkpoint_minutes": float("inf")}, "checkpoint_minutes must be >= 0"),
                       ({"exploding_loss_factor": 0.5}, "exploding_loss_factor must be > 1"),
                       ({"checkpoint_every": -1}, "checkpoint_every must be >= 0")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad)
    assert checkpoint_cadence(TrainConfig()) == (
        "every 1000 steps and every 30 min, whichever comes first, and at the end and on SIGTERM/SIGINT, keeping the "
        "newest 3")
    assert "a hard kill (OOM, preemption) loses the whole run" in checkpoint_cadence(
        TrainConfig(checkpoint_every=0, checkpoint_minutes=0))
