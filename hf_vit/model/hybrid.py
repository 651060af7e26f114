"""The ResNet stem of the hybrid architecture (section 3.1): the patch embedding reads its feature map, not the image.

The stem is the one of the authors' code (`vit_jax`), so that their hybrid checkpoints (R50+ViT-B/16, R26+ViT-S/32,
...) compute here what they compute there.

Padding is Flax's "SAME", which is asymmetric for strided layers: a 7x7 stride-2 convolution pads 2 before and 3
after, a 3x3 stride-2 one 0 and 1, where PyTorch's symmetric padding would shift every feature map by a pixel. The
padding is computed for sides divisible by the layer's stride, which every input the model accepts has (its sides are
multiples of `patch_size`, itself a multiple of the stem's stride); it is then a constant, so exported graphs take
any such size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .configuration_vit import RESNET_GROUPS, VisionTransformerConfig

GROUP_NORM_EPS = 1e-6  # flax.linen.GroupNorm's default
WEIGHT_STANDARDIZATION_EPS = 1e-5  # the authors' StdConv


def same_padding(kernel_size: int, stride: int) -> tuple[int, int]:
    """Flax/TensorFlow "SAME" padding `(before, after)` of one side divisible by `stride`: `kernel - stride` pixels
    in all (none if negative), the odd one after."""
    total = max(kernel_size - stride, 0)
    return total // 2, total - total // 2


class StdConv2d(nn.Conv2d):
    """A bias-free convolution with weight standardisation and "SAME" padding."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, bias=False)
        before, after = same_padding(kernel_size, stride)
        # Symmetric padding goes to the convolution itself; only the asymmetric case needs a padded copy.
        self.conv_padding = before if before == after else 0
        self.pad = None if before == after else (before, after, before, after)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        mean = weight.mean(dim=(1, 2, 3), keepdim=True)
        std = weight.std(dim=(1, 2, 3), keepdim=True, correction=0)
        weight = (weight - mean) / (std + WEIGHT_STANDARDIZATION_EPS)
        if self.pad is not None:
            hidden_states = F.pad(hidden_states, self.pad)
        return F.conv2d(hidden_states, weight, None, self.stride, self.conv_padding)


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(RESNET_GROUPS, channels, eps=GROUP_NORM_EPS)


class ResNetUnit(nn.Module):
    """A post-activation bottleneck unit: `relu(shortcut(x) + gn3(conv3(relu(gn2(conv2(relu(gn1(conv1(x)))))))))`."""

    def __init__(self, in_channels: int, features: int, stride: int) -> None:
        super().__init__()
        out_channels = 4 * features
        self.conv1 = StdConv2d(in_channels, features, 1)
        self.gn1 = _group_norm(features)
        self.conv2 = StdConv2d(features, features, 3, stride)
        self.gn2 = _group_norm(features)
        self.conv3 = StdConv2d(features, out_channels, 1)
        self.gn3 = _group_norm(out_channels)
        self.conv_proj = self.gn_proj = None
        if in_channels != out_channels or stride != 1:
            self.conv_proj = StdConv2d(in_channels, out_channels, 1, stride)
            self.gn_proj = _group_norm(out_channels)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shortcut = hidden_states if self.conv_proj is None else self.gn_proj(self.conv_proj(hidden_states))
        residual = F.relu(self.gn1(self.conv1(hidden_states)))
        residual = F.relu(self.gn2(self.conv2(residual)))
        residual = self.gn3(self.conv3(residual))
        return F.relu(shortcut + residual)


class ResNetStage(nn.Sequential):
    """`depth` units named `unit1`..`unit<depth>` (the authors' names); the first one carries the stride."""

    def __init__(self, in_channels: int, features: int, depth: int, stride: int) -> None:
        super().__init__()
        for index in range(depth):
            self.add_module(f"unit{index + 1}", ResNetUnit(in_channels, features, stride if index == 0 else 1))
            in_channels = 4 * features


class ResNetStem(nn.Module):
    """The root (`conv_root`, `gn_root`, ReLU, max pooling) and the stages `block1`..`block<n>` of
    `config.resnet_layers`; outputs `config.stem_channels` maps at `1 / config.stem_stride` of the input size."""

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__()
        width = config.resnet_width
        self.conv_root = StdConv2d(config.num_channels, width, 7, 2)
        self.gn_root = _group_norm(width)
        self.pool_padding = same_padding(3, 2) * 2  # (left, right, top, bottom)
        channels = width
        for index, depth in enumerate(config.resnet_layers or []):
            features = width * 2**index
            self.add_module(f"block{index + 1}", ResNetStage(channels, features, depth, 1 if index == 0 else 2))
            channels = 4 * features

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden_states = F.relu(self.gn_root(self.conv_root(pixel_values)))
        # Flax's max pooling pads with -inf, so padded pixels never win.
        hidden_states = F.pad(hidden_states, self.pool_padding, value=float("-inf"))
        hidden_states = F.max_pool2d(hidden_states, kernel_size=3, stride=2)
        for stage in self.children():
            if isinstance(stage, ResNetStage):
                hidden_states = stage(hidden_states)
        return hidden_states
