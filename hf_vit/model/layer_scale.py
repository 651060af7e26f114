"""LayerScale (Touvron et al., 2021, "Going deeper with Image Transformers"): a learned per-channel scale of a
residual branch, `layer_scale_init_value` at initialisation; DINOv2's and timm's `init_values`.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerScale(nn.Module):
    """`branch * gamma`, with `gamma` of `dim` channels starting at `init_value`."""

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.init_value = init_value
        self.gamma = nn.Parameter(torch.full((dim,), float(init_value)))

    def forward(self, branch: torch.Tensor) -> torch.Tensor:
        return branch * self.gamma

    def extra_repr(self) -> str:
        return f"init_value={self.init_value}"
