"""A checkpoint of a pipelined run (layers split over ``stage``) restores onto a mesh without ``stage`` and back,
bit for bit, through the trainer's own resume and the ``Checkpointer`` API.

One tiny Llama (2 layers, width 32), batch 8 x 16, Explicit meshes: the trainer runs step 1 pipelined on stage 2 x
FSDP 4 (GPipe, 2 micro-batches), then resumes that run directory on FSDP 8 without a pipeline for step 2 (the mesh
and the model call are free to change on resume). Each checkpoint, restored onto the other mesh, equals the arrays
the run held when it saved them, leaf for leaf (parameters and AdamW state), each on the other mesh's resolved
sharding.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from nnx_zoo import Llama3, Llama3Config
from nnx_zoo.sharding import make_mesh, state_shardings
from nnx_zoo.train import Checkpointer, DataConfig, OptimizerConfig, TrainConfig, make_optimizer, train
from nnx_zoo.train.loop import TrainState
from nnx_zoo.train.optim import trainable_filter

VOCAB = 64
CONFIG = Llama3Config.preset("llama3-tiny", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             max_position_embeddings=32)
OPTIMIZER = OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant")
PIPELINED = {"stage": 2, "fsdp": 4}
FLAT = {"fsdp": 8}


def _make_state() -> TrainState:
    model = Llama3(CONFIG, rngs=nnx.Rngs(0))
    return TrainState(model, make_optimizer(OPTIMIZER, model, 1, wrt=trainable_filter(model)))


def _run(run_dir, steps: int, mesh: dict[str, int], model_kwargs=()) -> dict[int, dict]:
    """Train (or resume) to ``steps``; returns each step's state as the run held it after the step (host copies)."""
    seen: dict[int, dict] = {}

    def after_step(state: TrainState, metrics: dict) -> None:
        seen[int(metrics["step_index"]) + 1] = jax.device_get(nnx.to_pure_dict(nnx.state(state)))

    config = TrainConfig(steps=steps, run_dir=str(run_dir), mesh=mesh, shard_mode="explicit", extend=True,
                         model_kwargs=model_kwargs, checkpoint_every=1, async_checkpoints=False, progress=False,
                         peak_flops_per_device=1e9,
                         optimizer=OPTIMIZER, data=DataConfig(seq_len=16, global_batch=8, synthetic_vocab=VOCAB))
    train(lambda: Llama3(CONFIG, rngs=nnx.Rngs(0)), config, vocab_size=VOCAB, flops_per_token=1.0,
          after_step=after_step)
    return seen


def _restored(run_dir, step: int, sizes: dict[str, int]) -> TrainState:
    """``step`` restored onto a train state of the mesh ``sizes``: abstract arrays carrying the shardings the rules
    resolve there, as the trainer's resume builds them (without compiling an initialisation)."""
    mesh = make_mesh(sizes, shard_mode="explicit")
    state = nnx.eval_shape(_make_state)
    abstract = nnx.state(state)
    shardings = iter(state_shardings(abstract, mesh, "default"))
    nnx.update(state, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=next(shardings)),
                                   abstract))
    checkpoints = Checkpointer(run_dir / "checkpoints", async_save=False)
    try:  # restore_into also checks every array against the checksum recorded when it was saved
        assert checkpoints.restore_into(state, step)[0] == step
    finally:
        checkpoints.close()
    # Each leaf on the target mesh's own resolved sharding: the layer dim on stage only when the mesh has it.
    for leaf, want in zip(jax.tree.leaves(nnx.state(state)), state_shardings(nnx.state(state), mesh, "default"),
                          strict=True):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    return state


def _assert_bit_equal(restored: TrainState, saved: dict) -> None:
    got = jax.tree_util.tree_flatten_with_path(jax.device_get(nnx.to_pure_dict(nnx.state(restored))))[0]
    want = jax.tree.leaves(saved)
    assert len(got) == len(want) and len(got) > 20  # parameters and both AdamW moments of each
    for (path, a), b in zip(got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)  # bit for bit (NaN and -0.0 included)


def test_pipelined_checkpoint_restores_onto_an_unpipelined_mesh_and_back(tmp_path):
    run_dir = tmp_path / "run"
    pipelined = _run(run_dir, 1, PIPELINED, (("pipeline_microbatches", 2), ("pipeline_schedule", "gpipe")))
    flat = _restored(run_dir, 1, FLAT)
    assert flat.model.layers.mlp.up.kernel[...].sharding.spec[0] is None  # whole stack on every device
    _assert_bit_equal(flat, pipelined[1])
    # The trainer resumes the pipelined run without a pipeline and trains on.
    resumed = _run(run_dir, 2, FLAT)
    assert set(resumed) == {2}
    back = _restored(run_dir, 2, PIPELINED)
    assert back.model.layers.mlp.up.kernel[...].sharding.spec[0] == "stage"
    _assert_bit_equal(back, resumed[2])
    assert not np.array_equal(resumed[2]["model"]["embed"]["embedding"], pipelined[1]["model"]["embed"]["embedding"])
