"""Equation (1) of the Vision Transformer: the patch embedding, the prefix tokens and the position embeddings.

Saved next to checkpoints as remote code with the model, so it imports only torch, transformers and its siblings.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .configuration_vit import VisionTransformerConfig
from .hybrid import ResNetStem
from .resolution import resample_position_embeddings

__all__ = ["VisionTransformerEmbeddings"]


class VisionTransformerEmbeddings(nn.Module):
    """Equation (1): linear patch embedding `E`, the class token, and learned 1D position embeddings `E_pos`; DeiT's
    distillation token after the class token (with a position), register tokens after both (without one).

    In a hybrid the patches come from the ResNet stem's feature map. `use_mask_token` adds the learned [mask]
    embedding of masked patch prediction, put in place of the patch embeddings `bool_masked_pos` marks before the
    positions are added (as BERT's [MASK]; see `modeling_mpp.py`)."""

    def __init__(self, config: VisionTransformerConfig, use_mask_token: bool = False) -> None:
        super().__init__()
        self.config = config
        self.stem = ResNetStem(config) if config.resnet_layers is not None else None
        # A stride-P convolution is the linear map E applied to every flattened P x P patch (of the stem's feature
        # map in a hybrid, where P is `embedding_patch_size`, e.g. 1).
        patch = config.embedding_patch_size
        self.patch_embedding = nn.Conv2d(
            config.stem_channels, config.hidden_size, patch, stride=patch, bias=config.patch_embedding_bias
        )
        width, registers = config.hidden_size, config.num_register_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width)) if config.use_class_token else None
        self.distillation_token = nn.Parameter(torch.zeros(1, 1, width)) if config.use_distillation_token else None
        self.register_tokens = nn.Parameter(torch.zeros(1, registers, width)) if registers else None
        self.mask_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if use_mask_token else None
        num_positions = config.num_patches + config.num_position_prefix_tokens
        self.position_embedding = nn.Parameter(torch.zeros(1, num_positions, config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        pixel_values: torch.Tensor,
        bool_masked_pos: torch.Tensor | None = None,
        spatial_shapes: torch.Tensor | None = None,
        patch_sources: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pixel_values = pixel_values.to(self.patch_embedding.weight.dtype)
        tokens, grid = self.embed_patches(pixel_values, spatial_shapes)  # (B, N, D): x_p^i E
        if bool_masked_pos is not None or patch_sources is not None:
            tokens = self.corrupt(tokens, bool_masked_pos, patch_sources)
        batch, config, positioned = tokens.shape[0], self.config, self.config.num_position_prefix_tokens
        prefix = [
            token.expand(batch, -1, -1) for token in (self.cls_token, self.distillation_token) if token is not None
        ]
        tokens = torch.cat([*prefix, tokens], dim=1)  # [x_class; x_dist; x_p^1 E; ...]
        # E_pos, resampled in 2D when the grid is not the one the model was trained on: in a native-aspect batch to
        # each image's grid, zero on the padding after its patches (masked as keys)
        position_embedding = resample_position_embeddings(
            self.position_embedding, config.grid_size, grid, positioned, config.interpolation_mode,
            config.interpolation_antialias, num_patches=tokens.shape[1] - positioned,
        )  # fmt: skip
        tokens = tokens + position_embedding
        if self.register_tokens is not None:  # registers follow the prefix tokens and have no position
            registers = self.register_tokens.expand(batch, -1, -1)
            tokens = torch.cat([tokens[:, :positioned], registers, tokens[:, positioned:]], dim=1)
        return self.dropout(tokens)

    def embed_patches(
        self, pixel_values: torch.Tensor, spatial_shapes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[int, int] | torch.Tensor]:
        """x_p^i E `(B, N, D)` and the grid of the patches: `(rows, cols)`, or `spatial_shapes` for a native-aspect
        batch, whose patches come flattened `(B, K, P * P * C)` (see `layout.py`)."""
        if spatial_shapes is not None:
            # The convolution's kernel `(D, C, P, P)` is the linear map it applies to each patch, its inputs laid out
            # in the processor's (patch row, patch column, channel) order.
            weight = self.patch_embedding.weight.permute(0, 2, 3, 1).flatten(1)
            return F.linear(pixel_values, weight, self.patch_embedding.bias), spatial_shapes
        # x_p are the image's patches, or the hybrid's patches of the ResNet feature map (section 3.1)
        features = pixel_values if self.stem is None else self.stem(pixel_values)
        patches = self.patch_embedding(features)  # (B, D, H/P, W/P)
        return patches.flatten(2).transpose(1, 2), tuple(patches.shape[2:])

    def corrupt(
        self, tokens: torch.Tensor, bool_masked_pos: torch.Tensor | None, patch_sources: torch.Tensor | None
    ) -> torch.Tensor:
        """Masked patch prediction's corruption of the patch embeddings `(B, N, D)`: those `patch_sources` `(B, N)`
        points elsewhere (an index into the batch's B * N patches, -1 for none) take that patch's embedding, then
        those `bool_masked_pos` `(B, N)` marks take the [mask] embedding."""
        batch, count, dim = tokens.shape
        for name, value in (("bool_masked_pos", bool_masked_pos), ("patch_sources", patch_sources)):
            if value is not None and tuple(value.shape) != (batch, count):
                raise ValueError(
                    f"`{name}` has shape {tuple(value.shape)} but the images have {count} patches each (expected "
                    f"({batch}, {count}))."
                )
        if patch_sources is not None:
            others = tokens.reshape(batch * count, dim)[patch_sources.clamp(min=0)]
            tokens = torch.where((patch_sources >= 0)[..., None], others, tokens)
        if bool_masked_pos is not None:
            if self.mask_token is None:
                raise ValueError(
                    "This model has no [mask] embedding for `bool_masked_pos`: use "
                    "VisionTransformerForMaskedPatchPrediction (or a VisionTransformerModel built with "
                    "use_mask_token=True)."
                )
            tokens = torch.where(bool_masked_pos.bool()[..., None], self.mask_token.to(tokens.dtype), tokens)
        return tokens
