"""The errors of Hugging Face checkpoint I/O: one family, ``CheckpointError`` (a ``ValueError``).

- ``CheckpointFormatError``: a file or directory that cannot be read as a checkpoint (missing or broken
  ``config.json`` / index / safetensors file, a truncated file, non-finite weights). The message names the file
  (or directory) and says what is wrong with it.
- ``CheckpointMismatchError``: readable files that do not fit the model; every missing, unexpected, wrongly
  shaped and wrongly typed (integer / bool where a float belongs) key is listed in one error.
"""

from __future__ import annotations


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
