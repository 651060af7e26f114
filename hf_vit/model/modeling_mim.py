"""Masked image modeling as transformers' `AutoModelForMaskedImageModeling` runs it: SimMIM (Xie et al., 2022).

The encoder is `modeling_vit`'s, built with the [mask] embedding, which replaces the patch embeddings
`bool_masked_pos` marks before the positions are added; a light decoder, one linear map per patch token (the 1x1
convolution of transformers' `ViTForMaskedImageModeling`), predicts the token's `encoder_stride` x `encoder_stride`
pixels, and the loss is the L1 distance on the masked patches' pixels. The model runs at any image size, on
non-square grids and on native-aspect batches (the processor's `max_num_patches`), each image as it runs alone.

`config.masked_image_modeling` chooses what `AutoModelForMaskedImageModeling` builds: this model, or the paper's
masked patch prediction (`modeling_mpp.py`), which computes its targets (`mean_color_classes`) from the same
`pixel_values` when no `labels` are given, so transformers' `run_mim.py` trains either.

This file is also saved next to checkpoints as remote code (`trust_remote_code=True`), so it imports only torch,
transformers and the code files beside it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.modeling_outputs import MaskedImageModelingOutput
from transformers.utils import can_return_tuple

from .configuration_vit import VisionTransformerConfig
from .modeling_vit import VisionTransformerModel, VisionTransformerPreTrainedModel

__all__ = ["VisionTransformerForMaskedImageModeling", "mean_color_classes", "patches_of"]

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


class VisionTransformerForMaskedImageModeling(VisionTransformerPreTrainedModel):
    """ViT pretrained by SimMIM: the patches `bool_masked_pos` marks are replaced by the [mask] embedding, a linear
    decoder predicts every patch token's pixels, and the loss is the mean absolute error on the masked pixels (as
    transformers' `ViTForMaskedImageModeling`, whose weights `hf_vit.convert` reads). The encoder's weights are a
    plain ViT's, so a checkpoint fine-tunes with `VisionTransformerForImageClassification.from_pretrained`.

    With `config.masked_image_modeling == "mpp"`, `AutoModelForMaskedImageModeling` (and this class's
    `from_pretrained` and `from_config`, given such a config) build `VisionTransformerForMaskedPatchPrediction`."""

    _new_weight_prefixes = ("decoder.", "vit.embeddings.mask_token")

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        self.vit = VisionTransformerModel(config, use_mask_token=True)
        stride = config.reconstruction_stride
        # a 1x1 convolution then a pixel shuffle: each token's outputs are its block's pixels, channel-major
        self.decoder = nn.Linear(config.hidden_size, stride * stride * config.num_channels)
        self.post_init()

    @classmethod
    def _chosen_class(cls, config: object) -> type:
        if cls is VisionTransformerForMaskedImageModeling and getattr(config, "masked_image_modeling", None) == "mpp":
            from .modeling_mpp import VisionTransformerForMaskedPatchPrediction

            if VisionTransformerForMaskedPatchPrediction._auto_class is None:  # its saves carry the code too
                VisionTransformerForMaskedPatchPrediction.register_for_auto_class("AutoModelForPreTraining")
            return VisionTransformerForMaskedPatchPrediction
        return cls

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`VisionTransformerPreTrainedModel.from_pretrained`; masked patch prediction's model where the `config`
        given (as the Auto classes give it) chooses it."""
        chosen = cls._chosen_class(kwargs.get("config"))
        if chosen is not cls:
            return chosen.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        chosen = cls._chosen_class(config)
        if chosen is not cls:
            return chosen._from_config(config, **kwargs)
        return super()._from_config(config, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self:
            init.trunc_normal_(self.decoder.weight, std=self.config.initializer_range)
            init.zeros_(self.decoder.bias)

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        bool_masked_pos: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        **kwargs,
    ) -> MaskedImageModelingOutput:
        """`pixel_values`: images `(B, C, H, W)` of any size the patches tile, or a native-aspect batch's flattened
        patches `(B, K, P * P * C)` with `spatial_shapes` and `pixel_attention_mask`. `bool_masked_pos` `(B, N)` (or
        `(B, K)`): the patches the [mask] embedding replaces, whose pixels the loss scores. Returns the `loss` and the
        `reconstruction`, in the layout of `pixel_values`."""
        if kwargs.get("patch_image_index") is not None:
            raise ValueError(
                "SimMIM takes whole images or a padded native-aspect batch, not a packed one (`patch_image_index`): "
                "run the processor without packing."
            )
        stride, patch_size = self.config.reconstruction_stride, self.config.patch_size
        if bool_masked_pos is not None and stride != patch_size:
            raise ValueError(
                f"`encoder_stride` ({stride}) must equal `patch_size` ({patch_size}) when `bool_masked_pos` is given: "
                "each token reconstructs its own patch. Set encoder_stride to the patch size (or leave it None)."
            )
        if bool_masked_pos is not None:
            bool_masked_pos = bool_masked_pos.bool()
        outputs = self.vit(
            pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, bool_masked_pos=bool_masked_pos, **kwargs
        )
        tokens = outputs.last_hidden_state[:, self.config.num_prefix_tokens :]
        blocks = self.decoder(tokens).unflatten(-1, (self.config.num_channels, stride, stride))  # (B, N, C, s, s)
        flat = pixel_values.ndim == 3  # a native-aspect batch: flattened patches, channels last
        loss = None
        if bool_masked_pos is not None:
            target = pixel_values.unflatten(-1, (stride, stride, -1)).permute(0, 1, 4, 2, 3) if flat else None
            target = patches_of(pixel_values, stride) if target is None else target
            masked = bool_masked_pos.to(blocks.device)
            if kwargs.get("pixel_attention_mask") is not None:  # the padding is never scored
                masked = masked & kwargs["pixel_attention_mask"].to(blocks.device).bool()
            errors = F.l1_loss(blocks.float(), target.to(blocks.device).float(), reduction="none").flatten(2)
            scored = masked.sum() * errors.shape[-1]
            loss = (errors.sum(-1) * masked).sum() / scored.clamp(min=1)
        if flat:
            reconstruction = blocks.permute(0, 1, 3, 4, 2).flatten(2)
        else:
            rows, cols = (size // patch_size for size in pixel_values.shape[-2:])
            channels = self.config.num_channels
            reconstruction = blocks.reshape(blocks.shape[0], rows, cols, channels, stride, stride)
            reconstruction = reconstruction.permute(0, 3, 1, 4, 2, 5).reshape(
                -1, channels, rows * stride, cols * stride
            )
        return MaskedImageModelingOutput(
            loss=loss,
            reconstruction=reconstruction,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
