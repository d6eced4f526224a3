"""The errors of Hugging Face checkpoint I/O: one family, ``CheckpointError`` (a ``ValueError``).

- ``CheckpointFormatError``: a file or directory that cannot be read as a checkpoint (missing or broken
  ``config.json`` / index / safetensors file, a truncated file, non-floating or non-finite weights). The message
  names the file (or directory) and says what is wrong with it.
- ``CheckpointMismatchError``: readable files that do not fit the model; every missing, unexpected, wrongly
  shaped and wrongly typed key is listed in one error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (base of ``CheckpointFormatError`` and ``CheckpointMismatchError``)."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint file or directory that is unreadable or holds unusable data; the message names the file."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that does not fit the model; lists every missing, unexpected, misshapen and mistyped key."""

    def __init__(self, missing: list[str], unexpected: list[str], wrong: list[str], source: str,
                 wrong_dtypes: list[str] | None = None):
        self.missing, self.unexpected, self.wrong = missing, unexpected, wrong
        self.wrong_dtypes = list(wrong_dtypes or [])
        parts = [f"checkpoint {source} does not match the model:"]
        for title, items in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", wrong),
                             ("wrong dtypes", self.wrong_dtypes)):
            if items:
                parts.append(f"{len(items)} {title}:\n    " + "\n    ".join(items))
        super().__init__("\n  ".join(parts))


def config_json_path(dir_or_file: str | Path) -> Path:
    """``config.json`` of a checkpoint directory, or the file itself when given one."""
    path = Path(dir_or_file)
    if path.is_dir():
        return path / "config.json"
    if not path.exists():
        raise CheckpointFormatError(f"{path}: no such file or directory; pass a checkpoint directory (the one "
                                    "holding config.json and *.safetensors) or its config.json")
    return path


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


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words ("an array", "a string", ...), for messages."""
    kinds = ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string"),
             ((int, float), "a number"), (type(None), "null"))
    return next(name for t, name in kinds if isinstance(value, t))
