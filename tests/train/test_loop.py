import json
import os
import re
import shutil
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from nnx_zoo.train import (
    Checkpointer,
    CheckpointError,
    DataConfig,
    ExplodingLossError,
    NonFiniteLossError,
    OptimizerConfig,
    TrainConfig,
    make_iterator,
    train,
)
from tests.train.toy_lm import ToyLM

VOCAB = 64


def config(tmp_path, **kw):
    base = dict(
        steps=6,
        run_dir=str(tmp_path / "run"),
        mesh={"fsdp": 4, "tensor": 2},
        progress=False,
        async_checkpoints=True,
        data=DataConfig(seq_len=16, global_batch=8, synthetic_vocab=32),
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2),
    )
    base.update(kw)
    return TrainConfig(**base)


def run(cfg, after_step=None):
    return train(lambda: ToyLM(VOCAB, 32, nnx.Rngs(0)), cfg, vocab_size=VOCAB, flops_per_token=1e3,
                 after_step=after_step)


@pytest.mark.parametrize("shard_mode", ["auto", "explicit"])
def test_loss_falls_and_metrics_are_written(tmp_path, shard_mode):
    summary = run(config(tmp_path, steps=12, shard_mode=shard_mode))
    assert summary["losses"][-1] < summary["losses"][0] - 0.2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu"):
        assert all(np.isfinite(r[key]) for r in records), key
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(1e-2)


@pytest.fixture(scope="module")
def stopped_after_three(tmp_path_factory):
    """``(the uninterrupted run's losses, the summary of the same run stopped by SIGTERM after step 3, its run
    directory's parent)``, run once for the module: each test resumes its own copy of the stopped run."""
    root = tmp_path_factory.mktemp("stopped")
    whole = run(config(root / "a"))["losses"]
    first = run(config(root / "b"), after_step=stop_after_three)
    return whole, first, root / "b"


def test_stopped_and_resumed_run_repeats_the_uninterrupted_losses(tmp_path, stopped_after_three):
    whole, first, stopped = stopped_after_three
    shutil.copytree(stopped, tmp_path / "b")
    assert first["end_step"] == 3 and first["stopped_by_signal"] == signal.SIGTERM
    assert Checkpointer(tmp_path / "b" / "run" / "checkpoints").latest_step() == 3
    second = run(config(tmp_path / "b"))
    assert second["start_step"] == 3
    np.testing.assert_allclose(first["losses"] + second["losses"], whole, rtol=1e-6)


def stop_after_three(state, metrics):
    if int(metrics["step_index"]) == 2:  # third step done
        os.kill(os.getpid(), signal.SIGTERM)


def test_resume_onto_a_different_mesh(tmp_path, stopped_after_three):
    whole, _, stopped = stopped_after_three
    shutil.copytree(stopped, tmp_path / "b")
    resumed = run(config(tmp_path / "b", mesh={"fsdp": 8}, shard_mode="explicit"))
    assert resumed["start_step"] == 3
    np.testing.assert_allclose(resumed["losses"], whole[3:], rtol=1e-5)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    def poison(state, metrics):
        if int(metrics["step_index"]) == 2:
            state.model.poison[...] = np.float32("nan")

    with pytest.raises(NonFiniteLossError, match="step 4: the loss is not finite .* checkpoint step 2 "):
        run(config(tmp_path, checkpoint_every=2), after_step=poison)
    assert Checkpointer(tmp_path / "run" / "checkpoints").latest_step() == 2


def test_an_update_that_overflows_mid_run_saves_the_last_finite_state_and_a_resume_repeats_the_bad_batch(tmp_path):
    """Steps 3 and 4 ran since the last periodic checkpoint (2); step 4's update overflows while its loss is
    finite. The state after step 3 is saved under step 3 with the data position of batch 4, so a resume runs batch 4
    again from that state: here it overflows again, with the same loss to the last printed digit."""
    kept = {}

    def overflow_the_next_update(state, metrics):
        if int(metrics["step_index"]) == 2:  # step 3 done: the loss stays finite, Adam's next update overflows
            kept["params"] = {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(state.model, nnx.Param)).items()}
            for path, node in nnx.iter_graph(state.optimizer):
                if isinstance(node, nnx.Variable) and "mu" in path:
                    node[...] = node[...] * 0 + np.float32(3e38)  # finite; mu / (1 - b1**4) is not

    cfg = config(tmp_path, steps=5, checkpoint_every=2)
    with pytest.raises(NonFiniteLossError, match="step 4: the updated parameters or optimizer state is not finite"
                       ) as first:
        run(cfg, after_step=overflow_the_next_update)
    checkpoints = Checkpointer(tmp_path / "run" / "checkpoints")
    assert checkpoints.all_steps() == [2, 3] and "checkpoint step 3 in" in str(first.value)
    restored = checkpoints.manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                                      data=ocp.args.JsonRestore()))
    checkpoints.close()
    batch_4 = make_iterator(cfg.data, VOCAB)
    for _ in range(3):
        next(batch_4)
    assert dict(restored.data) == batch_4.get_state()  # the bad batch's position, not the one after it
    for name, value in kept["params"].items():  # the state step 4 started from, not the overflowed one
        np.testing.assert_array_equal(np.asarray(restored.state["model"][name]), value)

    with pytest.raises(NonFiniteLossError, match="step 4: ") as again:
        run(cfg)
    assert again.value.summary["start_step"] == 3
    loss = re.search(r"\(loss ([^,]+),", str(first.value)).group(1)
    assert f"(loss {loss}," in str(again.value)  # the same state and the same batch


def test_a_resumed_run_judges_an_exploding_loss_by_the_first_run_s_first_loss(tmp_path):
    first = run(config(tmp_path, steps=2, checkpoint_every=1))
    reference = first["losses"][0]

    def explode_after_step_4(state, metrics):
        if int(metrics["step_index"]) == 3:
            state.model.head[...] = state.model.head[...] * 1e6  # step 5: a loss of thousands of nats

    with pytest.raises(ExplodingLossError) as err:
        run(config(tmp_path, steps=6, checkpoint_every=1, extend=True),
            after_step=explode_after_step_4)
    assert f"the run's first loss {reference:.6g} " in str(err.value)  # not the resumed run's first, step 3's
    assert err.value.summary["start_step"] == 2 and err.value.summary["losses"][0] != reference
    checkpoints = Checkpointer(tmp_path / "run" / "checkpoints")
    # 2 is the first run's, 3 the resumed run's (4's state measured the loss: set aside; 1: beyond keep-3)
    assert checkpoints.all_steps() == [2, 3]
    assert all(checkpoints.read_meta(s)["first_loss"] == reference for s in checkpoints.all_steps())
    checkpoints.close()


def test_corrupt_checkpoint_gives_a_clear_error(tmp_path):
    run(config(tmp_path, steps=2))
    step_dir = tmp_path / "run" / "checkpoints" / "2" / "state"
    for f in step_dir.rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"step 2 .* is damaged: the file \S+/2/state/\S+ has 7 bytes"):
        run(config(tmp_path, steps=4, extend=True))


def test_auto_mesh_state_keeps_its_layout_and_the_step_compiles_once(tmp_path, caplog):
    """Under Auto meshes XLA would pick new layouts for part of the updated state (norm scales split over
    tensor_transpose like the activations they scale): the next step would compile again and the state would
    drift from the rule set's layout. The loop pins the updated state to its input shardings."""

    from nnx_zoo import DeepSeekV3, DeepSeekV3Config
    from nnx_zoo.sharding import make_mesh, state_shardings

    model_config = DeepSeekV3Config.preset("deepseek3-mini", vocab_size=VOCAB, num_hidden_layers=2,
                                           num_nextn_predict_layers=0)
    mesh_sizes = {"fsdp": 4, "tensor_transpose": 2}
    trained = []
    cfg = config(tmp_path, steps=3, mesh=mesh_sizes, checkpoint_every=100)
    with jax.log_compiles(), caplog.at_level("WARNING"):
        train(lambda: DeepSeekV3(model_config, rngs=nnx.Rngs(0)), cfg, vocab_size=VOCAB, flops_per_token=1e3,
              after_step=lambda state, metrics: trained.append(state))
    compiles = [r for r in caplog.records if "Finished XLA compilation of jit(" in r.getMessage()
                and ("jit(step)" in r.getMessage() or "jit(train_step)" in r.getMessage())]
    assert len(compiles) == 1, [r.getMessage() for r in compiles]
    mesh = make_mesh(mesh_sizes)
    model = trained[-1].model
    want = [s.spec for s in state_shardings(nnx.state(model), mesh)]
    got = [x.sharding.spec for x in jax.tree.leaves(nnx.state(model))]
    assert got == want
