"""nnx_zoo.train: optimizer, data, step, metrics, checkpoints and the loop, for any model with the
``model(input_ids, attention_mask=None) -> logits`` signature."""

from nnx_zoo.train.checkpoint import Checkpointer, CheckpointError, DamagedCheckpointError
from nnx_zoo.train.data import DataConfig, make_dataset, make_iterator
from nnx_zoo.train.export import ExportError, export_run
from nnx_zoo.train.loop import (
    DivergenceError,
    ExplodingLossError,
    NonFiniteLossError,
    TrainConfig,
    TrainState,
    train,
)
from nnx_zoo.train.loss import chunked_head_cross_entropy
from nnx_zoo.train.metrics import MetricsWriter, Peak, peak_flops_per_device, resolve_peak
from nnx_zoo.train.optim import (
    OptimizerConfig,
    learning_rate_schedule,
    make_optimizer,
    make_tx,
    trainable_filter,
)
from nnx_zoo.train.run_lock import RunDirLockedError, RunLock
from nnx_zoo.train.step import token_cross_entropy, train_step

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "DamagedCheckpointError",
    "DataConfig",
    "DivergenceError",
    "ExplodingLossError",
    "ExportError",
    "MetricsWriter",
    "NonFiniteLossError",
    "OptimizerConfig",
    "Peak",
    "RunDirLockedError",
    "RunLock",
    "TrainConfig",
    "TrainState",
    "chunked_head_cross_entropy",
    "export_run",
    "learning_rate_schedule",
    "make_dataset",
    "make_iterator",
    "make_optimizer",
    "make_tx",
    "peak_flops_per_device",
    "resolve_peak",
    "token_cross_entropy",
    "train",
    "train_step",
    "trainable_filter",
]
