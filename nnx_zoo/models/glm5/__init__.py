"""GLM-5 (HF ``model_type`` ``glm_moe_dsa``): DeepSeek-V3.2's parts with GLM-5's indexer rope and cross-layer
top-k sharing; config with presets and model (the HF key table is DeepSeek's)."""

from nnx_zoo.models.glm5.config import Glm5Config
from nnx_zoo.models.glm5.model import Glm5

__all__ = ["Glm5", "Glm5Config"]
