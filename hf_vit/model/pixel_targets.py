"""The pixels a masked image modeling head predicts, from the images it is given: each patch's pixels (SimMIM) and
each patch's mean colour class (masked patch prediction, section 4.6).
"""

from __future__ import annotations

import torch

from .configuration_vit import VisionTransformerConfig

# Float error allowance when binning a mean colour: a mean on a bin edge (k / 2**bits) goes to the upper bin as exact
# arithmetic puts it. For 8-bit images a mean is at least 1 / (255 * pixels) away from an edge otherwise, far more.
_EDGE_TOLERANCE = 1e-6


def patches_of(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """The `(B, N, C, P, P)` patches of images `(B, C, H, W)`, in the model's token order (rows of patches)."""
    batch, channels, height, width = pixels.shape
    rows, cols = height // patch_size, width // patch_size
    grid = pixels[..., : rows * patch_size, : cols * patch_size]
    grid = grid.reshape(batch, channels, rows, patch_size, cols, patch_size)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(batch, rows * cols, channels, patch_size, patch_size)


def mean_color_classes(pixels: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """Masked patch prediction's targets: the mean-colour class `(B, N)` of every patch of `pixels` with values in
    [0, 1], images `(B, C, H, W)` cut into `patch_size` patches, or a native-aspect batch's flattened patches
    `(B, K, P * P * C)` (channels last, as the processor lays them out): each channel's mean over the patch quantised
    to `bits` bits (`floor(mean * 2**bits)`, 1.0 in the top bin), the channels' bins combined as one class, red most
    significant: `2 ** (bits * C)` classes."""
    if pixels.ndim == 4:
        means = patches_of(pixels.double(), patch_size).flatten(3).mean(dim=3)  # (B, N, C)
    elif pixels.ndim == 3 and pixels.shape[-1] % (patch_size * patch_size) == 0:
        means = pixels.double().unflatten(-1, (patch_size * patch_size, -1)).mean(dim=2)
    else:
        raise ValueError(
            "`pixels` must be images (batch, channels, height, width) or flattened patches (batch, patches, "
            f"{patch_size}*{patch_size}*channels), got shape {tuple(pixels.shape)}."
        )
    levels = 2**bits
    bins = torch.floor(means * levels + _EDGE_TOLERANCE).clamp_(0, levels - 1).long()
    weights = levels ** torch.arange(bins.shape[-1] - 1, -1, -1, device=bins.device)
    return (bins * weights).sum(dim=-1)


def unnormalized_pixels(pixel_values: torch.Tensor, config: VisionTransformerConfig) -> torch.Tensor:
    """`pixel_values` normalised with the config's `mpp_pixel_mean` and `mpp_pixel_std`, back in [0, 1]."""
    shape = [-1, 1, 1] if pixel_values.ndim == 4 else [-1]  # channels first, or last in flattened patches
    mean, std = (
        torch.as_tensor(value, dtype=torch.float64, device=pixel_values.device).reshape(shape)
        for value in (config.mpp_pixel_mean, config.mpp_pixel_std)
    )
    return pixel_values.double() * std + mean
