"""nnx_zoo.hf: Hugging Face checkpoint I/O shared by every model family (see ``errors`` for what it raises)."""

from nnx_zoo.hf.errors import CheckpointError, CheckpointFormatError, CheckpointMismatchError, read_json_object

__all__ = ["CheckpointError", "CheckpointFormatError", "CheckpointMismatchError", "read_json_object"]
