"""Equation (1) of the Vision Transformer: the patch embedding, the prefix tokens and the position embeddings."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .configuration_vit import VisionTransformerConfig
from .hybrid import ResNetStem
from .layout import BatchLayout
from .resolution import position_embeddings_at, resample_position_embeddings


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
        layout: BatchLayout | None = None,
        patch_sources: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The blocks' input: `(B, prefix + N, D)` for whole images; for a native-aspect batch of flattened patches
        (`layout`, see `layout.py`), each slot embedded where it lies, at its own grid's place."""
        pixel_values = pixel_values.to(self.patch_embedding.weight.dtype)
        if layout is not None:
            return self.dropout(self.embed_slots(pixel_values, layout, bool_masked_pos, patch_sources))
        # x_p are the image's patches, or the hybrid's patches of the ResNet feature map (section 3.1)
        patches = self.patch_embedding(pixel_values if self.stem is None else self.stem(pixel_values))
        grid = tuple(patches.shape[2:])  # (B, D, H/P, W/P) -> (B, N, D): x_p^i E
        tokens = self.corrupt(patches.flatten(2).transpose(1, 2), bool_masked_pos, patch_sources)
        config, positioned = self.config, self.config.num_position_prefix_tokens
        # E_pos, resampled in 2D when the grid is not the one the model was trained on
        position_embedding = resample_position_embeddings(
            self.position_embedding, config.grid_size, grid, positioned, config.interpolation_mode,
            config.interpolation_antialias,
        )  # fmt: skip
        prefix = self.prefix_tokens(position_embedding[:, :positioned])
        tokens = tokens + position_embedding[:, positioned:]
        return self.dropout(torch.cat([prefix.expand(tokens.shape[0], -1, -1), tokens], dim=1))

    def prefix_tokens(self, positions: torch.Tensor) -> torch.Tensor:
        """`(1, prefix, D)`: [x_class; x_dist] with their `positions`, then the registers (which have none)."""
        positioned = [token for token in (self.cls_token, self.distillation_token) if token is not None]
        parts = [torch.cat(positioned, dim=1) + positions] if positioned else []
        if self.register_tokens is not None:
            parts.append(self.register_tokens)
        return torch.cat(parts, dim=1) if parts else positions[:, :0]

    def embed_slots(
        self,
        pixel_values: torch.Tensor,
        layout: BatchLayout,
        bool_masked_pos: torch.Tensor | None,
        patch_sources: torch.Tensor | None,
    ) -> torch.Tensor:
        """A native-aspect batch's slots `(R, L, P * P * C)` embedded where they lie: x_p^i E, the corruption, each
        slot's position embedding at its place of its own grid; then each image's prefix tokens placed before its
        patches (`BatchLayout.blocks_input`)."""
        # E `(D, C, P, P)` as a linear map of patches in the processor's (patch row, patch column, channel) order
        weight = self.patch_embedding.weight.permute(0, 2, 3, 1).flatten(1)
        tokens = F.linear(pixel_values, weight, self.patch_embedding.bias)
        if bool_masked_pos is not None:  # given per image patch, as the outputs: moved to the slots
            bool_masked_pos = layout.to_slots(bool_masked_pos.bool(), False)
        if patch_sources is not None:
            patch_sources = layout.to_slots(patch_sources, -1, patch_index=True)
        tokens = self.corrupt(tokens, bool_masked_pos, patch_sources)
        config, positioned = self.config, self.config.num_position_prefix_tokens
        positions = position_embeddings_at(
            self.position_embedding, config.grid_size, layout.slot_grids, layout.slot_places, positioned,
            config.interpolation_mode, config.interpolation_antialias,
        )  # fmt: skip
        tokens = tokens + positions.view_as(tokens)
        return layout.blocks_input(self.prefix_tokens(self.position_embedding[:, :positioned]), tokens)

    def corrupt(
        self, tokens: torch.Tensor, bool_masked_pos: torch.Tensor | None, patch_sources: torch.Tensor | None
    ) -> torch.Tensor:
        """Masked patch prediction's corruption of the patch embeddings `(B, N, D)`: those `patch_sources` `(B, N)`
        points elsewhere (an index into the batch's B * N patches, -1 for none) take that patch's embedding, then
        those `bool_masked_pos` `(B, N)` marks take the [mask] embedding."""
        if bool_masked_pos is None and patch_sources is None:
            return tokens
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
