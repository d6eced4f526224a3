"""``config.json`` (and the index, also JSON) in and out, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nnx_zoo.hf.errors import CheckpointFormatError


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words ("an array", "a string", ...), for messages."""
    kinds = ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string"),
             ((int, float), "a number"), (type(None), "null"))
    return next(name for t, name in kinds if isinstance(value, t))


def config_json_path(dir_or_file: str | Path) -> Path:
    """``config.json`` of a checkpoint directory, or the file itself when given one."""
    path = Path(dir_or_file)
    if path.is_dir():
        if not (path / "config.json").exists():
            _refuse_training_run(path)
        return path / "config.json"
    if not path.exists():
        raise CheckpointFormatError(f"{path}: no such file or directory; pass a checkpoint directory (the one "
                                    "holding config.json and *.safetensors) or its config.json")
    return path


def _refuse_training_run(path: Path) -> None:
    """A training run directory (``checkpoints/<step>/`` inside) or one of its checkpoint steps is not a Hugging
    Face checkpoint: say so, with the export command that makes one of it."""
    if (path / "checkpoints").is_dir():
        run, step = path, None
    elif path.parent.name == "checkpoints" and path.name.isdigit():
        run, step = path.parent.parent, path.name
    else:
        return
    out = Path("exports") / (run.name + (f"-step{step}" if step else ""))
    command = f"python recipes/export_hf.py {run} {out}" + (f" --step {step}" if step else "")
    raise CheckpointFormatError(
        f"{path} is a training run's {'checkpoint step' if step else 'directory'}, not a Hugging Face checkpoint "
        f"(no config.json); export it first with `{command}`, then load {out}")


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in file ``path`` (``what`` it is, for messages); ``CheckpointFormatError`` otherwise."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise CheckpointFormatError(f"{path}: no such file; a checkpoint directory needs its {what}") from None
    except IsADirectoryError:
        raise CheckpointFormatError(f"{path}: is a directory, not the {what} file") from None
    except UnicodeDecodeError as err:
        raise CheckpointFormatError(f"{path}: the {what} is not UTF-8 text ({err.reason} at byte {err.start}); "
                                    "the file is corrupt or is not JSON") from None
    except OSError as err:
        raise CheckpointFormatError(f"{path}: cannot read the {what} ({err.strerror})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointFormatError(f"{path}: the {what} is not valid JSON ({err.msg} at line {err.lineno} column "
                                    f"{err.colno}); the file is corrupt or truncated") from None
    if not isinstance(value, dict):
        raise CheckpointFormatError(f"{path}: the {what} holds {json_kind(value)}, not a JSON object ({{...}})")
    return value


def write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2))


def fp8_block_size(config: dict[str, Any], source: Path) -> tuple[int, int]:
    """The float8 ``quantization_config.weight_block_size`` of a ``config.json`` dict read from ``source``
    ([128, 128], DeepSeek-V3's, when it names none)."""
    quantization = config.get("quantization_config") or {}
    if not isinstance(quantization, dict):
        raise CheckpointFormatError(f"{source}: quantization_config must be a JSON object, got "
                                    f"{json_kind(quantization)}")
    block = quantization.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CheckpointFormatError(f"{source}: quantization_config.weight_block_size must be two positive "
                                    f"integers, got {block!r}")
    return block[0], block[1]


def fp4_experts(config: dict[str, Any], source: Path) -> bool:
    """Whether a ``config.json`` dict read from ``source`` declares FP4 weights (``expert_dtype: "fp4"``, in
    ``quantization_config`` or, as DeepSeek-V4's own files have it, at the top level): only then is an ``I8``
    weight read as packed E2M1 pairs. ``"fp8"`` or absent: no FP4."""
    quantization = config.get("quantization_config") or {}
    if not isinstance(quantization, dict):
        raise CheckpointFormatError(f"{source}: quantization_config must be a JSON object, got "
                                    f"{json_kind(quantization)}")
    where = "quantization_config.expert_dtype" if "expert_dtype" in quantization else "expert_dtype"
    value = quantization.get("expert_dtype", config.get("expert_dtype", "fp8"))
    if value not in ("fp8", "fp4", None):
        raise CheckpointFormatError(f"{source}: {where} must be \"fp8\" or \"fp4\", got {value!r}")
    return value == "fp4"


def mxfp4_blocks(config: dict[str, Any], source: Path) -> bool:
    """Whether a ``config.json`` dict read from ``source`` declares HF's MXFP4 format (``quantization_config``
    ``quant_method: "mxfp4"``, GPT-OSS's release): only then is a ``U8`` tensor ``<name>_blocks`` read as packed
    E2M1 values with its ``<name>_scales``."""
    quantization = config.get("quantization_config") or {}
    if not isinstance(quantization, dict):
        raise CheckpointFormatError(f"{source}: quantization_config must be a JSON object, got "
                                    f"{json_kind(quantization)}")
    return quantization.get("quant_method") == "mxfp4"
