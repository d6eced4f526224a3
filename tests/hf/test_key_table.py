"""The shared checkpoint seam fits a second family: a Llama-shaped module plugs in with a small ``KeyTable`` and
round-trips transformers' own ``LlamaForCausalLM`` weights, tied head included; table mistakes are reported."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from nnx_zoo.hf import (
    DENSE,
    CheckpointMismatchError,
    Dense,
    KeyTable,
    Row,
    SafetensorsCheckpoint,
    Stack,
    load_module,
    save_module,
)
from nnx_zoo.layers.embed import Embed
from nnx_zoo.layers.linear import Linear
from nnx_zoo.layers.norm import RMSNorm
from nnx_zoo.layers.scan import create_stack
from nnx_zoo.sharding import abstract_module, get_rules, iter_variables, make_mesh, variable_spec

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INNER, VOCAB, LAYERS = 16, 4, 2, 4, 24, 32, 2


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.input_norm, self.post_attn_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.q = Linear(HIDDEN, (HEADS, HEAD_DIM), kernel_names=("embed", "heads", "kv"), rngs=rngs)
        self.k = Linear(HIDDEN, (KV_HEADS, HEAD_DIM), kernel_names=("embed", "kv_heads", "kv"), rngs=rngs)
        self.v = Linear(HIDDEN, (KV_HEADS, HEAD_DIM), kernel_names=("embed", "kv_heads", "kv"), rngs=rngs)
        self.o = Linear((HEADS, HEAD_DIM), HIDDEN, kernel_names=("heads", "kv", "embed"), rngs=rngs)
        self.gate = Linear(HIDDEN, INNER, kernel_names=("embed", "mlp"), rngs=rngs)
        self.up = Linear(HIDDEN, INNER, kernel_names=("embed", "mlp"), rngs=rngs)
        self.down = Linear(INNER, HIDDEN, kernel_names=("mlp", "embed"), rngs=rngs)


class TinyLlama(nnx.Module):
    """Parameters only (the seam does not run the model)."""

    def __init__(self, tied: bool, rngs: nnx.Rngs):
        self.embed = Embed(VOCAB, HIDDEN, rngs=rngs)
        self.layers = create_stack(Layer, LAYERS, rngs, "dense_layers")
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = None if tied else Linear(HIDDEN, VOCAB, kernel_names=("embed", "vocab"), rngs=rngs)


LAYER_ROWS = (
    Row("input_layernorm.weight", "input_norm.scale"),
    Row("post_attention_layernorm.weight", "post_attn_norm.scale"),
    Row("self_attn.q_proj.weight", "q.kernel", DENSE),
    Row("self_attn.k_proj.weight", "k.kernel", DENSE),
    Row("self_attn.v_proj.weight", "v.kernel", DENSE),
    Row("self_attn.o_proj.weight", "o.kernel", Dense(n_in=2)),
    Row("mlp.gate_proj.weight", "gate.kernel", DENSE),
    Row("mlp.up_proj.weight", "up.kernel", DENSE),
    Row("mlp.down_proj.weight", "down.kernel", DENSE),
)


def llama_table(tied: bool) -> KeyTable:
    return KeyTable(
        top=(Row("model.embed_tokens.weight", "embed.embedding"), Row("model.norm.weight", "norm.scale"),
             Row("lm_head.weight", "lm_head.kernel", DENSE)),
        stacks=(Stack("layers", "model.layers.{i}.", range(LAYERS), LAYER_ROWS),),
        ignored=(r"^lm_head\.weight$",) if tied else (),
        source="tests/hf/test_key_table.py")


def hf_llama(path: Path, tied: bool) -> dict[str, np.ndarray]:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INNER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(path)
    return {k: v.numpy() for k, v in model.state_dict().items()}


def load(path: Path, tied: bool, mesh=None) -> TinyLlama:
    rules = get_rules("default")
    with SafetensorsCheckpoint(path) as ckpt:
        abstract = abstract_module(lambda: TinyLlama(tied, nnx.Rngs(0)))
        return load_module(ckpt, llama_table(tied), abstract, mesh=mesh, rules=rules)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_weights_round_trip(tmp_path, tied):
    ref = hf_llama(tmp_path / "hf", tied)
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model = load(tmp_path / "hf", tied, mesh)
    q = model.layers.q.kernel[...]  # [layer, hidden, heads, head_dim] <- HF [heads * head_dim, hidden]
    np.testing.assert_array_equal(np.asarray(q[1]), ref["model.layers.1.self_attn.q_proj.weight"].T.reshape(
        HIDDEN, HEADS, HEAD_DIM))
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), ref["model.embed_tokens.weight"])
    for p, var in iter_variables(model):  # each Variable born on its resolved sharding
        assert var[...].sharding.spec == variable_spec(p, var, get_rules("default"), mesh), p

    save_module(model, tmp_path / "ours", llama_table(tied), {"model_type": "llama"})
    written = load_file(tmp_path / "ours" / "model-00001-of-00001.safetensors")
    want = {k: v for k, v in ref.items() if not (tied and k == "lm_head.weight")}  # tied: HF stores no head
    assert written.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    again = load(tmp_path / "ours", tied)
    for (p, a), (_, b) in zip(iter_variables(again), iter_variables(model)):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(jax.device_get(b[...])), err_msg=p)


def test_untied_model_needs_its_head(tmp_path):
    hf_llama(tmp_path / "hf", tied=True)
    with pytest.raises(CheckpointMismatchError) as info:
        load(tmp_path / "hf", tied=False)
    assert info.value.missing == ["lm_head.weight"] and not info.value.unexpected


def test_a_variable_without_a_row_names_the_table(tmp_path):
    hf_llama(tmp_path / "hf", tied=False)
    table = llama_table(False)
    short = KeyTable(top=table.top, stacks=(Stack("layers", "model.layers.{i}.", range(LAYERS), LAYER_ROWS[:-1]),),
                     source=table.source)
    abstract = abstract_module(lambda: TinyLlama(False, nnx.Rngs(0)))
    with SafetensorsCheckpoint(tmp_path / "hf") as ckpt, pytest.raises(ValueError) as info:
        load_module(ckpt, short, abstract, mesh=None, rules=get_rules("default"))
    assert "['layers.down.kernel']" in str(info.value) and "tests/hf/test_key_table.py" in str(info.value)


def test_tied_model_skips_a_stored_head(tmp_path):
    ref = hf_llama(tmp_path / "hf", tied=True)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["lm_head.weight"] = np.zeros((VOCAB, HIDDEN), np.float32)  # some tied checkpoints store the head
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    model = load(tmp_path / "hf", tied=True)
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), ref["model.embed_tokens.weight"])
    with pytest.raises(CheckpointMismatchError) as info:  # without the table's ignore, it is unexpected
        with SafetensorsCheckpoint(tmp_path / "hf") as ckpt:
            abstract = abstract_module(lambda: TinyLlama(True, nnx.Rngs(0)))
            table = llama_table(True)
            untied_ignores = KeyTable(top=table.top, stacks=table.stacks, source=table.source)
            load_module(ckpt, untied_ignores, abstract, mesh=None, rules=get_rules("default"))
    assert info.value.unexpected == ["lm_head.weight"]
