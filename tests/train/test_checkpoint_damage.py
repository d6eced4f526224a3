"""A checkpoint altered on disk is reported as damaged (the step, the file, the command that resumes from the
previous checkpoint), never trained on or reported as divergence; the command, followed literally, resumes.

One toy run with checkpoints at steps 1, 2, 3 is saved once; each case damages step 3 of its own copy."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from nnx_zoo.train import DamagedCheckpointError, DataConfig, OptimizerConfig, TrainConfig, train
from nnx_zoo.train.checkpoint import FILES_MANIFEST
from tests.train.toy_lm import ToyLM

VOCAB = 64


def run(run_dir):
    config = TrainConfig(steps=3, run_dir=str(run_dir), mesh={"fsdp": 4, "tensor": 2}, progress=False,
                         checkpoint_every=1, data=DataConfig(seq_len=16, global_batch=8, synthetic_vocab=32),
                         optimizer=OptimizerConfig(lr=1e-2, warmup_steps=2))
    return train(lambda: ToyLM(VOCAB, 32, nnx.Rngs(0)), config, vocab_size=VOCAB, flops_per_token=1.0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    losses = run(run_dir)["losses"]
    return run_dir, losses


def largest_array_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)),
               key=lambda p: p.stat().st_size)


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def rewrite_one_bit(step_dir):
    """Bit rot that the reader decodes without complaint (where a flipped byte inside compressed data may come out
    as a decoding error or as other values): the state rewritten with one bit of one array flipped."""
    arrays = ocp.StandardCheckpointer().restore(step_dir / "state")
    embed = np.array(arrays["model"]["embed"])
    embed.view(np.uint32)[3, 5] ^= 1 << 20
    arrays["model"]["embed"] = embed
    shutil.rmtree(step_dir / "state")
    with ocp.StandardCheckpointer() as writer:
        writer.save(step_dir / "state", arrays)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# The advice is the same command in every case: one case follows it (a resume compiles the step: seconds).
@pytest.mark.parametrize(("damage", "said", "follow"), [
    (flip_a_byte, "changed after it was saved", True),
    (truncate, "when saved (truncated or overwritten)", False),
    (lambda path: path.unlink(), "is missing", False),
    # Without the file manifest (a run killed before it was written), the arrays' own checksums catch a changed bit.
    ("rewrite without manifest", "differ from the checksums recorded when they were saved (model/embed)", False),
], ids=["flipped-byte", "truncated", "missing", "array-bit-without-manifest"])
def test_a_damaged_newest_checkpoint_is_named_and_the_advice_resumes_from_the_previous_one(saved, tmp_path, damage,
                                                                                          said, follow):
    source, losses = saved
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    step_dir = run_dir / "checkpoints" / "3"
    victim = largest_array_file(step_dir)
    if damage == "rewrite without manifest":
        (step_dir / FILES_MANIFEST).unlink()
        rewrite_one_bit(step_dir)
    else:
        damage(victim)

    with pytest.raises(DamagedCheckpointError) as raised:
        run(run_dir)
    message = str(raised.value)
    assert message.startswith(f"checkpoint step 3 in {run_dir / 'checkpoints'} is damaged: ") and said in message
    assert str(victim if "checksums" not in said else step_dir / "state") in message
    assert "learning rate" not in message and "previous checkpoint (step 2)" in message

    command = re.search(r"rerun the same command: (.*)$", message).group(1)
    if not follow:
        return
    subprocess.run(command, shell=True, check=True)  # the advice, literally
    resumed = run(run_dir)
    assert resumed["start_step"] == 2
    np.testing.assert_array_equal(resumed["losses"], losses[2:])  # step 3 again, bit for bit
    assert (run_dir / "checkpoints-set-aside" / "3").is_dir()  # kept, out of the way
