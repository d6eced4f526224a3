"""A left-padded masked batch split over the sequence (the ``context`` mesh axis), as the trainer lays batches
out with ``[activation_batch, activation_length]``: Llama 3 and Qwen3 (GQA) and DeepSeek-V3 (MLA) give
transformers' logits (PyTorch, CPU, float32) under Auto and Explicit meshes, on FSDP 4 x context 2 (default
rules) and on FSDP 4 x expert 2 under ``ep-as-cp`` (the sequence on ``expert``), with the logits in the batch's
sharding. Under Explicit meshes the mask's query and key sides once both sat on the context axis of one
``[b, 1, q, k]`` array, which jax refuses (a spec naming one mesh axis twice). Packed ``segment_ids`` split the
same way give the one-device logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo import AutoConfig, AutoModelForCausalLM
from nnx_zoo.sharding import make_mesh, named_sharding
from tests.models import dense_reference as dense
from tests.models.deepseek import hf_reference as deepseek

MESHES = {"context": ({"fsdp": 4, "context": 2}, "default"), "ep-as-cp": ({"fsdp": 4, "expert": 2}, "ep-as-cp")}
# (family, mesh, mode): GQA and MLA under both modes (Auto never failed: kept cheap), both meshes each.
CASES = [("llama", "context", "explicit"),
         ("qwen3", "ep-as-cp", "explicit"), ("qwen3", "context", "auto"),
         ("deepseek", "ep-as-cp", "explicit"), ("deepseek", "context", "auto")]
BATCH_NAMES = ("activation_batch", "activation_length")
TOL = 1e-5


def _hf_model(family: str):
    if family == "deepseek":
        return deepseek.make_hf_model(seed=1, num_hidden_layers=2)
    return dense.make_hf(family, seed=1)


def _padded(spec) -> tuple:
    """A logits spec with its trailing unsplit dims written out (jit's outputs drop them)."""
    return (*spec, *(None,) * (3 - len(spec)))


def _split_batch(arrays, rules, mesh):
    sharding = named_sharding(BATCH_NAMES, rules, mesh)
    return sharding, [jax.device_put(jnp.asarray(a), sharding) for a in arrays]


@pytest.mark.parametrize(("family", "mesh_name", "mode"), CASES)
def test_sequence_split_mask_matches_transformers(tmp_path, family, mesh_name, mode):
    hf = _hf_model(family)
    path = (deepseek.save_hf if family == "deepseek" else dense.save_hf)(hf, tmp_path / "hf")
    ids, mask = dense.left_padded_batch(hf.config.vocab_size, batch=4, seq=10, pad=3, seed=2)
    want = dense.hf_logits(hf, ids, mask)

    sizes, rules = MESHES[mesh_name]
    mesh = make_mesh(sizes, shard_mode=mode)
    model = AutoModelForCausalLM.from_pretrained(path, mesh=mesh, rules=rules)
    with jax.set_mesh(mesh):
        sharding, (ids_split, mask_split) = _split_batch((ids, mask), model.rules, mesh)
        assert sharding.spec[1] is not None, "the batch's sequence dim should be split"
        logits = nnx.jit(lambda m, i, k: m(i, k))(model, ids_split, mask_split)
    assert _padded(logits.sharding.spec) == (*sharding.spec, None), logits.sharding.spec
    err = dense.rel_err(np.asarray(logits), want, keep=mask)  # padding positions are not compared
    assert err < TOL, err


def test_sequence_split_segments_match_one_device():
    """Two documents packed per row (a boundary at a different place in each row), split over the sequence
    (GQA; MLA builds its mask with the same ``causal_mask``)."""
    config = AutoConfig.preset("qwen3-tiny", num_hidden_layers=2)

    def model_of(mesh):
        return AutoModelForCausalLM.create(config, mesh=mesh, rules="ep-as-cp")

    ids = np.random.default_rng(3).integers(1, config.vocab_size, (4, 8)).astype(np.int32)
    segments = (np.arange(8)[None, :] >= np.array([[2], [3], [5], [7]])).astype(np.int32)
    want = np.asarray(model_of(None)(jnp.asarray(ids), segment_ids=jnp.asarray(segments)))

    mesh = make_mesh(MESHES["ep-as-cp"][0], shard_mode="explicit")
    model = model_of(mesh)
    with jax.set_mesh(mesh):
        sharding, (ids_split, seg_split) = _split_batch((ids, segments), model.rules, mesh)
        logits = nnx.jit(lambda m, i, s: m(i, segment_ids=s))(model, ids_split, seg_split)
    assert _padded(logits.sharding.spec) == (*sharding.spec, None)
    # The packing matters: attending across the boundary would change the second documents' logits.
    crossing = np.asarray(model_of(None)(jnp.asarray(ids)))
    assert dense.rel_err(crossing, want) > 1e-2
    assert dense.rel_err(np.asarray(logits), want) < TOL
