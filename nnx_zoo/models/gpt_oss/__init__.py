"""GPT-OSS (HF ``model_type`` ``gpt_oss``): config with presets, model, HF key table (MXFP4 experts read)."""

from nnx_zoo.models.gpt_oss.config import GptOssConfig
from nnx_zoo.models.gpt_oss.model import GptOss

__all__ = ["GptOss", "GptOssConfig"]
