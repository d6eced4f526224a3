"""allow_partial under Explicit meshes: activations fall back to the longest dividing prefix of their rule's mesh
axes exactly as the weights do (``use_rules(rules, allow_partial=True)``, which the trainer and a model created or
loaded with ``allow_partial=True`` enter), the weight einsums work with a weight on such a prefix, and the HF
loader places tensors with the same fallback. The default stays strict.

llama3-tiny has 2 key/value heads, which do not divide over tensor=4 (the Auto-mesh case is
tests/recipes/test_pretrain_families.py::test_a_mesh_that_does_not_divide_needs_allow_partial_and_then_trains_the_same).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from nnx_zoo.sharding import ShardingError, make_mesh, shard, use_rules
from tests.recipes.test_pretrain_families import SHORT, TINY, VOCAB, first_batch, recipe, records, transformers_loss

UNEVEN = ["--mesh", "fsdp=2,tensor=4", "--shard-mode", "explicit"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama 3 checkpoint written by our save_pretrained (transformers reads it in transformers_loss)."""
    from nnx_zoo import Llama3, Llama3Config

    directory = tmp_path_factory.mktemp("llama3") / "ckpt"
    config = Llama3Config.preset("llama3-tiny", num_hidden_layers=1, vocab_size=VOCAB, initializer_range=0.2)
    Llama3.create(config, seed=7).save_pretrained(directory)
    return directory


def test_use_rules_allow_partial_places_activations_on_the_dividing_prefix_and_is_strict_by_default():
    mesh = make_mesh({"fsdp": 2, "tensor": 4}, shard_mode="explicit")
    names = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
    x = jnp.arange(8 * 4 * 2 * 3, dtype=jnp.float32).reshape(8, 4, 2, 3)
    with jax.set_mesh(mesh):
        with pytest.raises(ShardingError, match="allow_partial=True"):
            shard(x, names)
        with use_rules("default", allow_partial=True):
            y = shard(x, names)
            assert jax.typeof(y).sharding.spec == P("fsdp", None, None, None)  # kv heads: 2 over tensor=4 -> none
            with use_rules("default"):  # a model entering its own rules keeps the enclosing setting
                assert jax.typeof(shard(x, names)).sharding.spec == P("fsdp", None, None, None)
            with use_rules("default", allow_partial=False), pytest.raises(ShardingError):
                shard(x, names)
            with pytest.raises(ShardingError, match="unknown logical axis name"):  # typos stay errors
                shard(x, ("activation_batch", "activation_lenght", None, None))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_explicit_mesh_trains_with_allow_partial_like_fsdp8_and_refuses_without(tmp_path, capsys):
    """FSDP 8 (everything divides) equals one device: tests/models/test_dense_sharding.py."""
    args = ["--model", "llama3-tiny", *TINY, *SHORT, "--steps", "2"]
    assert recipe.main([*args, *UNEVEN, "--run-dir", str(tmp_path / "strict")]) == 2
    assert "--allow-partial" in capsys.readouterr().err
    assert recipe.main([*args, *UNEVEN, "--allow-partial", "--run-dir", str(tmp_path / "partial")]) == 0
    assert recipe.main([*args, "--mesh", "fsdp=8", "--run-dir", str(tmp_path / "fsdp")]) == 0
    got = [r["loss"] for r in records(tmp_path / "partial")]
    want = [r["loss"] for r in records(tmp_path / "fsdp")]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_from_pretrained_with_allow_partial_on_an_explicit_mesh_starts_from_the_checkpoint(tmp_path, checkpoint):
    run_dir = tmp_path / "run"
    assert recipe.main(["--from-pretrained", str(checkpoint), *SHORT, "--steps", "1", *UNEVEN, "--allow-partial",
                        "--run-dir", str(run_dir)]) == 0
    np.testing.assert_allclose(records(run_dir)[0]["loss"], transformers_loss(checkpoint, first_batch()), rtol=2e-5)


def test_a_model_loaded_with_allow_partial_carries_it_to_its_activations(checkpoint):
    """Outside the trainer: from_pretrained(..., allow_partial=True) on an Explicit mesh places the k/v kernels on
    a prefix (here: off 'tensor'), and the model's own forward pass falls back the same way; strict refuses."""
    import torch
    from transformers import AutoModelForCausalLM as HFModel

    from nnx_zoo import AutoModelForCausalLM

    mesh = make_mesh({"fsdp": 2, "tensor": 4}, shard_mode="explicit")
    with pytest.raises(ShardingError, match="allow_partial=True"):
        AutoModelForCausalLM.from_pretrained(checkpoint, mesh=mesh)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, mesh=mesh, allow_partial=True)
    assert "tensor" not in jax.tree.leaves(tuple(model.layers.attn.k_proj.kernel[...].sharding.spec))
    ids = first_batch()["input_ids"]
    with jax.set_mesh(mesh):
        logits = jax.jit(lambda m, i: m(i))(model, jnp.asarray(ids))
    hf = HFModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    error = np.linalg.norm(np.asarray(logits) - want) / np.linalg.norm(want)
    assert error < 1e-5, error  # relative L2, as the model tests compare logits with transformers
