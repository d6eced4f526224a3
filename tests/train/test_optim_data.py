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


def _reference_lr(schedule, step, peak, floor, warmup, total, decay_fraction):
    """The documented schedule, restated in plain numpy: linear 0 -> peak over ``warmup`` steps, then constant
    (``constant``) or constant until the last ``round(decay_fraction * (total - warmup))`` steps, which fall
    linearly to ``floor`` (``wsd``)."""
    step = np.asarray(step, np.float64)
    lr = np.where(step < warmup, peak * step / max(warmup, 1), peak)
    if schedule == "wsd":
        decay = max(1, round(decay_fraction * (total - warmup)))
        start = total - decay
        lr = np.where(step >= start, peak + (floor - peak) * np.clip((step - start) / decay, 0, 1), lr)
    return lr


@pytest.mark.parametrize("schedule", ["wsd", "constant"])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_wsd_and_constant_warmup_match_a_numpy_reference(schedule, warmup):
    """The learning rate at every warmup step and every step after (to the end of a 40-step run) equals the
    numpy restatement ``_reference_lr``: a warmup that starts at the peak, ends a step early or late, or is
    skipped by one of the schedules fails."""
    cfg = OptimizerConfig(lr=0.6, warmup_steps=warmup, min_lr_ratio=0.25, schedule=schedule,
                          wsd_decay_fraction=0.25)
    lr = learning_rate_schedule(cfg, 40)
    steps = np.arange(41)
    ours = np.asarray([float(lr(s)) for s in steps])
    expected = _reference_lr(schedule, steps, 0.6, 0.15, warmup, 40, 0.25)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-7)
    if warmup:
        assert ours[0] == 0.0 and ours[warmup] == pytest.approx(0.6)


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


def _corpus(tmp_path):
    import json

    (tmp_path / "a.txt").write_text("the first document, a whole file of it.")
    (tmp_path / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in ["second document", "third, a bit longer document"]) + "\n"
    )
    return tmp_path


def test_local_files_are_tokenized_packed_and_segmented(tmp_path):
    from nnx_zoo.train.tokenize import ByteTokenizer

    cfg = DataConfig(source=str(_corpus(tmp_path)), seq_len=15, global_batch=2, seed=1)
    tok = ByteTokenizer()
    stream = []
    for text in ["the first document, a whole file of it.", "second document", "third, a bit longer document"]:
        stream += tok.encode(text) + [tok.eos_id]
    rows = {tuple(stream[i : i + 16]) for i in range(0, len(stream) - 15, 16)}
    seen = set()
    it = make_iterator(cfg, vocab_size=300)
    for _ in range(3):
        batch = next(it)
        for ids, tgt, seg in zip(batch["input_ids"], batch["targets"], batch["segment_ids"]):
            seen.add(tuple(ids) + (tgt[-1],))
            # a new segment starts right after each EOS, and only there
            starts = [i for i in range(1, 15) if seg[i] != seg[i - 1]]
            assert starts == [i for i in range(1, 15) if ids[i - 1] == tok.eos_id]
            assert seg[0] == 1
    assert seen == rows  # every packed row is served (3 steps x 2 rows cover the 5 rows of the epoch)


def test_bad_data_sources_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="neither 'synthetic' nor an existing file"):
        DataConfig(source=str(tmp_path / "missing"))
    (tmp_path / "bad.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match="line 1 has no string field 'text'"):
        make_iterator(DataConfig(source=str(tmp_path / "bad.jsonl"), seq_len=4, global_batch=1), 300)
    (tmp_path / "tiny.txt").write_text("ab")
    with pytest.raises(ValueError, match="fewer than one row"):
        make_iterator(DataConfig(source=str(tmp_path / "tiny.txt"), seq_len=64, global_batch=1), 300)
    with pytest.raises(ValueError, match="has 258 tokens but the model's vocab_size is 100"):
        make_iterator(DataConfig(source=str(tmp_path / "tiny.txt"), seq_len=2, global_batch=1), 100)


def test_batches_with_ids_outside_the_vocabulary_are_refused_on_the_host(monkeypatch):
    from nnx_zoo.train import data

    # A source whose ids escape the model's vocabulary (here by a patched stream) is stopped at the batch, before
    # the jitted step would clamp the ids silently.
    monkeypatch.setattr(data.SyntheticTokens, "__call__", lambda self, row: np.full(17, 40 if row else -1))
    iterator = make_iterator(DataConfig(seq_len=16, global_batch=2, synthetic_vocab=32), vocab_size=32)
    with pytest.raises(ValueError, match=r"token ids -1 \.\. 40, outside the model's vocabulary 0 \.\. 31"):
        next(iterator)
