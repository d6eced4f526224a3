"""nnx_zoo: a pure Flax-NNX model zoo for large language models."""

from nnx_zoo import sharding

__all__ = ["sharding"]
__version__ = "0.1.0"
