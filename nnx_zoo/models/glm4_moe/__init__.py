"""GLM-4.5 (HF ``model_type`` ``glm4_moe``): config with presets, model, HF key table."""

from nnx_zoo.models.glm4_moe.config import Glm4MoEConfig
from nnx_zoo.models.glm4_moe.model import Glm4MoE

__all__ = ["Glm4MoE", "Glm4MoEConfig"]
