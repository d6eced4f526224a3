"""The one small random-init config the non-HF DeepSeek tests share.

Creating a model compiles its random initializers once per parameter shape (~10 s on CPU the first time), so
tests that build models from scratch use these dims, and vary only what does not change parameter shapes.
"""

from __future__ import annotations

from typing import Any

from nnx_zoo import DeepSeekV3Config


def small_config(**overrides: Any) -> DeepSeekV3Config:
    """deepseek3-mini dims with a 256-token vocab and 2 layers (1 dense, 1 MoE) plus one MTP head."""
    return DeepSeekV3Config.preset("deepseek3-mini", **{"vocab_size": 256, "num_hidden_layers": 2, **overrides})
