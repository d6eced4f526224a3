"""Training data through grain: deterministic, checkpointable, each process reading only its rows.

Synthetic data (the default, zero downloads) is a learnable token stream: each sequence follows a fixed random
permutation of a small token set (next = perm[current]) with some random jumps, so the loss falls visibly from
ln(vocab) toward the jump entropy.

Local files (``.txt``: one document per file; ``.jsonl``: a ``text`` field per line; ``.parquet``: a ``text``
column, needs pyarrow) are tokenized (built-in bytes, or a ``tokenizers`` JSON file), joined with an end-of-
sequence token after each document, and packed into rows of ``seq_len + 1`` tokens. ``segment_ids`` number the
documents within a row, so attention can stay inside a document; the target that would cross into the next
document's first token is kept (it is predicted from the EOS token, as in ordinary pretraining).

Batches are a ``grain.MapDataset`` indexed by step, so the iterator state is one integer and resume is exact.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grain
import jax
import numpy as np

from nnx_zoo.train.tokenize import load_tokenizer


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What the batches look like. ``global_batch`` rows of ``seq_len`` tokens per optimizer step."""

    source: str = "synthetic"  # or a file / directory of .txt, .jsonl, .parquet files
    tokenizer: str = "bytes"  # 'bytes' or a tokenizer.json path (local files only)
    eos_token: str | None = None  # the token a tokenizer.json ends each document with; None: a usual name it has
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
        if self.source != "synthetic" and not Path(self.source).exists():
            problems.append(f"data source {self.source!r} is neither 'synthetic' nor an existing file or directory")
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


DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")


def data_files(source: str) -> list[Path]:
    """The data files of ``source`` (a file, or every data file under a directory, sorted)."""
    path = Path(source)
    files = sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES) if path.is_dir() else [path]
    bad = [f for f in files if f.suffix not in DATA_SUFFIXES]
    if not files or bad:
        raise ValueError(f"data source {source}: expected {'/'.join(DATA_SUFFIXES)} files, found "
                         f"{[str(f) for f in bad] or 'none'}")
    return files


def read_documents(path: Path) -> list[str]:
    """The text documents of one file."""
    try:
        if path.suffix == ".txt":
            return [path.read_text(encoding="utf-8")]
        if path.suffix == ".jsonl":
            docs = []
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:  # its own numbers count within the line: say which line
                        raise ValueError(f"line {n} is not valid JSON ({err.msg} at column {err.colno}); each line "
                                         'must be one JSON object such as {"text": "..."}: fix or remove line '
                                         f"{n}") from None
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"line {n} has no string field 'text'")
                    docs.append(record["text"])
            return docs
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise RuntimeError(f"reading {path} needs pyarrow: pip install pyarrow") from err
        table = pq.read_table(path, columns=["text"])
        return [t for t in table.column("text").to_pylist() if t]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"cannot read data file {path}: {err}") from err


class PackedTokens:
    """Every document of ``source``, tokenized, each followed by EOS, cut into rows of ``seq_len + 1`` tokens."""

    def __init__(self, config: DataConfig, vocab_size: int):
        tokenizer = load_tokenizer(config.tokenizer, eos_token=config.eos_token)
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(f"tokenizer {config.tokenizer!r} has {tokenizer.vocab_size} tokens but the model's "
                             f"vocab_size is {vocab_size}; use a model vocab at least that large")
        ids, segments, segment = [], [], 0
        for path in data_files(config.source):
            for doc in read_documents(path):
                tokens = tokenizer.encode(doc) + [tokenizer.eos_id]
                ids.extend(tokens)
                segments.extend([segment] * len(tokens))
                segment += 1
        width = config.seq_len + 1
        self.num_rows = len(ids) // width
        if self.num_rows == 0:
            raise ValueError(f"data source {config.source} holds {len(ids)} tokens, fewer than one row of {width}")
        self.ids = np.asarray(ids[: self.num_rows * width], np.int32).reshape(self.num_rows, width)
        self.segments = np.asarray(segments[: self.num_rows * width], np.int64).reshape(self.num_rows, width)
        self.order = np.random.default_rng([config.seed, 2]).permutation(self.num_rows)

    def __call__(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``row`` of the stream (epochs repeat in a fixed shuffled order): tokens and 1-based segment ids."""
        index = self.order[row % self.num_rows]
        segments = self.segments[index]
        return self.ids[index], (segments - segments[0] + 1).astype(np.int32)


def check_token_range(tokens: np.ndarray, vocab_size: int, source: str) -> np.ndarray:
    """``tokens`` (a host batch) after checking every id is in ``0 .. vocab_size - 1``: on device the embedding
    lookup would clamp a bad id silently, and the train step (jitted) cannot look without a host sync."""
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"data {source}: a batch holds token ids {int(tokens.min())} .. {int(tokens.max())}, outside "
                         f"the model's vocabulary 0 .. {vocab_size - 1}; use a tokenizer (or --synthetic-vocab) that "
                         "fits the model's vocab_size, or a model with a larger one")
    return tokens


def make_dataset(config: DataConfig, vocab_size: int, **process: int) -> grain.MapDataset:
    """A ``MapDataset`` whose element ``step`` is this process's part of that step's batch:
    ``input_ids``, ``targets``, ``loss_mask`` ``[rows, seq_len]``, and for packed files ``segment_ids``."""
    rows = local_rows(config.global_batch, **process)
    if config.source == "synthetic":
        synthetic = SyntheticTokens(config, vocab_size)

        def batch(step: int) -> dict[str, np.ndarray]:
            tokens = check_token_range(np.stack([synthetic(step * config.global_batch + r) for r in rows]),
                                       vocab_size, config.source)
            return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:],
                    "loss_mask": np.ones_like(tokens[:, 1:], np.float32)}
    else:
        packed = PackedTokens(config, vocab_size)

        def batch(step: int) -> dict[str, np.ndarray]:
            tokens, segments = map(np.stack, zip(*(packed(step * config.global_batch + r) for r in rows)))
            check_token_range(tokens, vocab_size, config.source)
            return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
                    "loss_mask": np.ones_like(tokens[:, 1:], np.float32)}

    return grain.MapDataset.range(2**40).map(batch)


def make_iterator(config: DataConfig, vocab_size: int, **process: int) -> grain.DatasetIterator:
    """A checkpointable iterator over steps (``get_state()`` / ``set_state()``)."""
    return iter(make_dataset(config, vocab_size, **process).to_iter_dataset())
