"""Training data through grain: deterministic, checkpointable, each process reading only its rows.

Synthetic data (the default, zero downloads) is a learnable token stream: each sequence follows a fixed random
permutation of a small token set (next = perm[current]) with some random jumps, so the loss falls visibly from
ln(vocab) toward the jump entropy. Batches are a ``grain.MapDataset`` indexed by step, so the iterator state is
one integer and resume is exact.
"""

from __future__ import annotations

import dataclasses

import grain
import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What the batches look like. ``global_batch`` rows of ``seq_len`` tokens per optimizer step."""

    source: str = "synthetic"
    seq_len: int = 128
    global_batch: int = 8
    seed: int = 0
    synthetic_vocab: int = 256  # how many token ids the synthetic stream uses
    synthetic_jump_prob: float = 0.1  # chance that a token ignores the permutation (irreducible loss)

    def __post_init__(self) -> None:
        problems = []
        if self.seq_len < 2:
            problems.append(f"seq_len must be >= 2, got {self.seq_len}")
        if self.global_batch < 1:
            problems.append(f"global_batch must be >= 1, got {self.global_batch}")
        if self.synthetic_vocab < 2:
            problems.append(f"synthetic_vocab must be >= 2, got {self.synthetic_vocab}")
        if not 0 <= self.synthetic_jump_prob <= 1:
            problems.append(f"synthetic_jump_prob must be in [0, 1], got {self.synthetic_jump_prob}")
        if self.source != "synthetic":
            problems.append(f"data source {self.source!r} is not supported yet; use 'synthetic'")
        if problems:
            raise ValueError("invalid data settings: " + "; ".join(problems))


class SyntheticTokens:
    """Row ``i`` of the synthetic stream: ``seq_len + 1`` tokens, a pure function of ``(seed, i)``."""

    def __init__(self, config: DataConfig, vocab_size: int):
        if config.synthetic_vocab > vocab_size:
            raise ValueError(
                f"synthetic_vocab={config.synthetic_vocab} exceeds the model's vocab_size={vocab_size}; lower it"
            )
        self.config = config
        self.perm = np.random.default_rng([config.seed, 0]).permutation(config.synthetic_vocab)

    def __call__(self, row: int) -> np.ndarray:
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, 1, row])
        jumps = rng.random(cfg.seq_len + 1) < cfg.synthetic_jump_prob
        random_tokens = rng.integers(0, cfg.synthetic_vocab, cfg.seq_len + 1)
        tokens = np.empty(cfg.seq_len + 1, np.int32)
        tokens[0] = random_tokens[0]
        for t in range(1, cfg.seq_len + 1):
            tokens[t] = random_tokens[t] if jumps[t] else self.perm[tokens[t - 1]]
        return tokens


def local_rows(global_batch: int, process_index: int | None = None, process_count: int | None = None) -> range:
    """The rows of each global batch that this process loads."""
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if global_batch % count:
        raise ValueError(
            f"global batch {global_batch} does not split evenly over {count} processes; use a multiple of {count}"
        )
    per = global_batch // count
    return range(index * per, (index + 1) * per)


def make_dataset(config: DataConfig, vocab_size: int, **process: int) -> grain.MapDataset:
    """A ``MapDataset`` whose element ``step`` is this process's part of that step's batch:
    ``{"input_ids": [rows, seq_len], "targets": [rows, seq_len], "loss_mask": [rows, seq_len]}``."""
    rows = local_rows(config.global_batch, **process)
    stream = SyntheticTokens(config, vocab_size)

    def batch(step: int) -> dict[str, np.ndarray]:
        tokens = np.stack([stream(step * config.global_batch + r) for r in rows])
        return {
            "input_ids": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "loss_mask": np.ones_like(tokens[:, 1:], np.float32),
        }

    return grain.MapDataset.range(2**40).map(batch)


def make_iterator(config: DataConfig, vocab_size: int, **process: int) -> grain.DatasetIterator:
    """A checkpointable iterator over steps (``get_state()`` / ``set_state()``)."""
    return iter(make_dataset(config, vocab_size, **process).to_iter_dataset())
