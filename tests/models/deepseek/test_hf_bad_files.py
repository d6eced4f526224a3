"""Unreadable checkpoints: each broken file, directory or tensor raises one ``CheckpointError`` that names the file
(or key) and says what is wrong, through ``DeepSeekV3.from_pretrained`` and ``DeepSeekV3Config.from_hf`` alike.

Every case starts from a tiny checkpoint written by ``save_pretrained`` and breaks one thing in a copy of it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from nnx_zoo import DeepSeekV3, DeepSeekV3Config
from nnx_zoo.hf import CheckpointError, CheckpointFormatError, CheckpointMismatchError, nonfinite_count

TINY = DeepSeekV3Config.preset(
    "deepseek3-mini", vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
    num_hidden_layers=2, num_attention_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
    qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
    num_nextn_predict_layers=0)
SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base")
    DeepSeekV3.create(TINY).save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", SHARD, INDEX]
    return path


@pytest.fixture
def ckpt(base: Path, tmp_path: Path) -> Path:
    """A fresh copy of the good checkpoint, to break."""
    return Path(shutil.copytree(base, tmp_path / "ckpt"))


def load(path: Path) -> DeepSeekV3:
    return DeepSeekV3.from_pretrained(path, moe_impl="dense")


def expect(error: type[CheckpointError], call: Callable[[], object], *phrases: str) -> str:
    """Run ``call``, assert it raises ``error`` whose message holds every phrase; return the message."""
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in:\n{message}"
    return message


def header_of(file: Path) -> tuple[int, dict, bytes]:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(file: Path, header: object, data: bytes) -> None:
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)


def edit_tensors(path: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors = load_file(path / SHARD)
    edit(tensors)
    save_file(tensors, str(path / SHARD))


# ---------------------------------------------------------------- safetensors files
def _truncate(p: Path) -> None:
    data = (p / SHARD).read_bytes()
    (p / SHARD).write_bytes(data[: len(data) // 2])


def _set_length(value: int) -> Callable[[Path], None]:
    def corrupt(p: Path) -> None:
        data = (p / SHARD).read_bytes()
        (p / SHARD).write_bytes(value.to_bytes(8, "little") + data[8:])
    return corrupt


def _garbage_header(p: Path) -> None:
    data = bytearray((p / SHARD).read_bytes())
    data[8:40] = b"\xff" * 32
    (p / SHARD).write_bytes(bytes(data))


def _edit_header(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    """Change the header in place with ``edit`` (its return value is ignored)."""
    def corrupt(p: Path) -> None:
        _, header, data = header_of(p / SHARD)
        edit(header)
        write_header(p / SHARD, header, data)
    return corrupt


def _array_header(p: Path) -> None:
    _, _, data = header_of(p / SHARD)
    write_header(p / SHARD, [1, 2], data)


def _offsets_past_end(header: dict) -> None:
    start, end = header["lm_head.weight"]["data_offsets"]
    header["lm_head.weight"]["data_offsets"] = [start, end + 10**6]


def _bytes_do_not_fit_shape(header: dict) -> None:
    header["model.norm.weight"]["shape"] = [17]


FILE_CASES = {
    "truncated": (_truncate, ["truncated", "past the end of the file"]),
    "zero bytes": (lambda p: (p / SHARD).write_bytes(b""), ["0 bytes, too short for a safetensors file"]),
    "three bytes": (lambda p: (p / SHARD).write_bytes(b"abc"), ["3 bytes, too short"]),
    "garbage header": (_garbage_header, ["header is not valid JSON", "corrupt"]),
    "absurd header length": (_set_length(2**63), ["header length field says 9223372036854775808 bytes"]),
    "header length past the end": (_set_length(10**6), ["header length field says 1000000 bytes"]),
    "header is an array": (_array_header, ["header holds an array, not a JSON object"]),
    "offsets past the end": (_edit_header(_offsets_past_end), ["lm_head.weight: data at bytes", "past the end"]),
    "entry without dtype": (_edit_header(lambda h: h["model.norm.weight"].pop("dtype")),
                            ["header is corrupt", "model.norm.weight: malformed entry"]),
    "bytes do not fit the shape": (_edit_header(_bytes_do_not_fit_shape),
                                   ["model.norm.weight: shape [17] of F32 needs 68 bytes, its data_offsets span 64"]),
    "negative offsets": (_edit_header(lambda h: h["model.norm.weight"].update(data_offsets=[-4, 60])),
                         ["model.norm.weight: data_offsets [-4, 60] are not [start, end]"]),
}


def test_same_key_in_two_files(ckpt):
    (ckpt / INDEX).unlink()
    shutil.copy(ckpt / SHARD, ckpt / "copy.safetensors")
    expect(CheckpointFormatError, lambda: load(ckpt), "is in both", str(ckpt / SHARD), str(ckpt / "copy.safetensors"))


# ---------------------------------------------------------------- tensor data
@pytest.mark.parametrize("dtype, name", [(np.int32, "I32"), (np.int8, "I8"), (np.bool_, "BOOL")])
def test_integer_or_bool_weights_are_refused(ckpt, dtype, name):
    def to_int(t: dict[str, np.ndarray]) -> None:
        t["model.norm.weight"] = t["model.norm.weight"].astype(dtype)
        t["lm_head.weight"] = t["lm_head.weight"].astype(dtype)
    edit_tensors(ckpt, to_int)
    with pytest.raises(CheckpointMismatchError) as info:
        load(ckpt)
    assert info.value.wrong_dtypes == [f"{key}: {name} in {SHARD}, where a floating-point weight belongs"
                                       for key in ("lm_head.weight", "model.norm.weight")]
    assert not info.value.missing and not info.value.unexpected and not info.value.wrong
    assert "2 wrong dtypes" in str(info.value) and str(ckpt) in str(info.value)


def test_nan_and_inf_weights_are_all_named(ckpt):
    def poison(t: dict[str, np.ndarray]) -> None:
        t["model.norm.weight"][3] = np.nan
        t["lm_head.weight"][1, 1:3] = [np.inf, -np.inf]
        t["model.layers.1.mlp.experts.2.up_proj.weight"][0, 0] = np.nan
    edit_tensors(ckpt, poison)
    message = expect(CheckpointFormatError, lambda: load(ckpt), str(ckpt), "3 weights hold NaN or infinite values",
                     f"lm_head.weight in {SHARD}: 2 of 1024 values", f"model.norm.weight in {SHARD}: 1 of 16 values",
                     "model.layers.1.mlp.experts.2.up_proj.weight")
    assert "kv_a_proj" not in message  # only the poisoned keys


def _to_fp8(t: dict[str, np.ndarray], scale: float) -> None:
    t["lm_head.weight"] = t["lm_head.weight"].astype(ml_dtypes.float8_e4m3fn)
    t["lm_head.weight_scale_inv"] = np.full((1, 1), scale, np.float32)


def test_float8_weight_with_infinite_scale_is_named(ckpt):
    edit_tensors(ckpt, lambda t: _to_fp8(t, np.inf))
    expect(CheckpointFormatError, lambda: load(ckpt), "1 weights hold NaN or infinite values", "lm_head.weight in")


def test_float8_scale_of_integers_is_refused(ckpt):
    def int_scale(t: dict[str, np.ndarray]) -> None:
        _to_fp8(t, 1.0)
        t["lm_head.weight_scale_inv"] = t["lm_head.weight_scale_inv"].astype(np.int32)
    edit_tensors(ckpt, int_scale)
    with pytest.raises(CheckpointMismatchError) as info:
        load(ckpt)
    want = f"lm_head.weight_scale_inv: I32 in {SHARD}, where a floating-point scale belongs"
    assert info.value.wrong_dtypes == [want]


def test_good_float8_checkpoint_still_loads(ckpt):
    want = load_file(ckpt / SHARD)["lm_head.weight"].astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 0.5
    edit_tensors(ckpt, lambda t: _to_fp8(t, 0.5))
    np.testing.assert_array_equal(np.asarray(load(ckpt).lm_head.kernel[...]), want.T)


def test_nonfinite_count_across_chunks():
    a = np.arange(10, dtype=np.float32)
    a[[0, 3, 9]] = [np.nan, np.inf, -np.inf]
    assert nonfinite_count(a, chunk=4) == 3 and nonfinite_count(a.astype(ml_dtypes.bfloat16), chunk=3) == 3
    assert nonfinite_count(np.ones((5, 7), np.float32), chunk=4) == 0


# ---------------------------------------------------------------- config.json
def _set_config(p: Path, **fields: object) -> None:
    config = json.loads((p / "config.json").read_text())
    config.update(fields)
    (p / "config.json").write_text(json.dumps(config))


CONFIG_CASES = {
    "not JSON": (lambda p: (p / "config.json").write_text('{"vocab_size": 64,'),
                 ["model config is not valid JSON", "truncated"]),
    "not an object": (lambda p: (p / "config.json").write_text("[1, 2]"),
                      ["holds an array, not a JSON object"]),
    "not UTF-8": (lambda p: (p / "config.json").write_bytes(b"\xff\xfe{}"), ["not UTF-8 text"]),
    "missing": (lambda p: (p / "config.json").unlink(), ["no such file"]),
    "a number of the wrong type": (lambda p: _set_config(p, rms_norm_eps="tiny"),
                                   ["rms_norm_eps must be a positive number, got 'tiny'"]),
    "a count of the wrong type": (lambda p: _set_config(p, first_k_dense_replace=None),
                                  ["first_k_dense_replace must be an integer, got None"]),
    "rope scaling not an object": (lambda p: _set_config(p, rope_scaling="yarn"),
                                   ["rope_scaling / rope_parameters must be a JSON object or null, got 'yarn'"]),
    "rope factor of the wrong type": (
        lambda p: _set_config(p, rope_scaling={"type": "yarn", "factor": [4], "original_max_position_embeddings": 8}),
        ["wrong type"]),
    "another model type": (lambda p: _set_config(p, model_type="llama"), ["'llama' is not a DeepSeek V2/V3 model"]),
}


@pytest.mark.parametrize("reader", ["from_pretrained", "from_hf"])
@pytest.mark.parametrize("case", CONFIG_CASES)
def test_broken_config_is_named(ckpt, case, reader):
    corrupt, phrases = CONFIG_CASES[case]
    corrupt(ckpt)
    call = (lambda: load(ckpt)) if reader == "from_pretrained" else (lambda: DeepSeekV3Config.from_hf(ckpt))
    expect(CheckpointFormatError, call, str(ckpt / "config.json"), *phrases)


def test_config_dict_errors_stay_value_errors():
    with pytest.raises(ValueError, match="rms_norm_eps must be a positive number"):
        DeepSeekV3Config.from_hf({**TINY.to_hf_dict(), "rms_norm_eps": "tiny"})
    with pytest.raises(TypeError, match="unknown DeepSeekV3Config fields"):
        DeepSeekV3Config.from_hf(TINY.to_hf_dict(), not_a_field=1)


@pytest.mark.parametrize("quantization, phrase", [
    ("fp8", "quantization_config must be a JSON object, got a string"),
    ({"weight_block_size": [0, 128]}, "weight_block_size must be two positive integers, got [0, 128]"),
])
def test_bad_quantization_config_is_named(ckpt, quantization, phrase):
    _set_config(ckpt, quantization_config=quantization)
    expect(CheckpointFormatError, lambda: load(ckpt), str(ckpt / "config.json"), phrase)


# ---------------------------------------------------------------- the index
def _set_index(p: Path, index: object) -> None:
    (p / INDEX).write_text(json.dumps(index))


def _misplace_key(p: Path) -> None:
    save_file({"extra.weight": np.zeros(2, np.float32)}, str(p / "other.safetensors"))
    index = json.loads((p / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "other.safetensors"
    _set_index(p, index)


INDEX_CASES = {
    "not JSON": (lambda p: (p / INDEX).write_text("{oops"), ["safetensors index is not valid JSON"]),
    "no weight_map": (lambda p: _set_index(p, {"metadata": {}}), ["'weight_map' must be an object", "got null"]),
    "empty weight_map": (lambda p: _set_index(p, {"weight_map": {}}), ["'weight_map' is empty"]),
    "missing shard": (lambda p: _set_index(p, {"weight_map": {"lm_head.weight": "model-00002.safetensors"}}),
                      ["names 1 safetensors file(s) that are not in", "'model-00002.safetensors'"]),
    "key in another file": (_misplace_key, ["not in the file the index names",
                                            "model.norm.weight (in other.safetensors, absent there)"]),
}


# case -> (the file the error must name, how to break it, what the error must say)
BROKEN_FILES = {**{f"safetensors {k}": (SHARD, *v) for k, v in FILE_CASES.items()},
                **{f"index {k}": (INDEX, *v) for k, v in INDEX_CASES.items()}}


@pytest.mark.parametrize("case", BROKEN_FILES)
def test_broken_file_is_named(ckpt, case):
    name, corrupt, phrases = BROKEN_FILES[case]
    corrupt(ckpt)
    expect(CheckpointFormatError, lambda: load(ckpt), str(ckpt / name), *phrases)


# ---------------------------------------------------------------- the directory
def test_a_file_instead_of_the_directory(ckpt):
    expect(CheckpointFormatError, lambda: load(ckpt / SHARD), str(ckpt / SHARD),
           "is a file, not a checkpoint directory", f"(perhaps {ckpt})")


def test_a_directory_that_does_not_exist(tmp_path):
    absent = tmp_path / "nowhere"
    expect(CheckpointFormatError, lambda: load(absent), f"{absent}: no such directory")
    expect(CheckpointFormatError, lambda: DeepSeekV3Config.from_hf(absent), f"{absent}: no such file or directory")


def test_a_directory_without_safetensors(ckpt):
    (ckpt / SHARD).unlink()
    (ckpt / INDEX).unlink()
    expect(CheckpointFormatError, lambda: load(ckpt), f"{ckpt}: holds no *.safetensors files")
    (ckpt / "pytorch_model.bin").write_bytes(b"pickle")
    expect(CheckpointFormatError, lambda: load(ckpt), "['pytorch_model.bin'] are PyTorch pickles")


def test_the_good_checkpoint_loads(base):
    model = load(base)
    np.testing.assert_array_equal(np.asarray(model.norm.scale[...]), load_file(base / SHARD)["model.norm.weight"])
