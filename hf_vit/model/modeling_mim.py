"""Masked image modeling as transformers' `AutoModelForMaskedImageModeling` runs it: SimMIM (Xie et al., 2022), or
the paper's masked patch prediction (`modeling_mpp.py`), as `config.masked_image_modeling` says; both compute their
targets from `pixel_values` alone, so transformers' `run_mim.py` trains either.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.modeling_outputs import MaskedImageModelingOutput
from transformers.utils import can_return_tuple

from .configuration_vit import VisionTransformerConfig
from .modeling_mpp import VisionTransformerForMaskedPatchPrediction
from .modeling_vit import VisionTransformerModel, VisionTransformerPreTrainedModel
from .pixel_targets import patches_of


class VisionTransformerForMaskedImageModeling(VisionTransformerPreTrainedModel):
    """ViT pretrained by SimMIM: the patches `bool_masked_pos` marks are replaced by the [mask] embedding, a linear
    decoder (transformers' 1x1 convolution) predicts every patch token's `encoder_stride`-square block of pixels, and
    the loss is the mean absolute error on the masked pixels (as transformers' `ViTForMaskedImageModeling`, whose
    weights `hf_vit.convert` reads), at any image size and on native-aspect batches. The encoder's weights are a
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
            if VisionTransformerForMaskedPatchPrediction._auto_class is None:  # its saves carry the code too
                VisionTransformerForMaskedPatchPrediction.register_for_auto_class("AutoModelForPreTraining")
            return VisionTransformerForMaskedPatchPrediction
        return cls

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`VisionTransformerPreTrainedModel.from_pretrained`; masked patch prediction's model where the `config`
        given (as the Auto classes give it) chooses it."""
        chosen = cls._chosen_class(kwargs.get("config"))
        load = super().from_pretrained if chosen is cls else chosen.from_pretrained
        return load(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        chosen = cls._chosen_class(config)
        return (super()._from_config if chosen is cls else chosen._from_config)(config, **kwargs)

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
        return_loss: bool = True,
        **kwargs,
    ) -> MaskedImageModelingOutput:
        """`pixel_values`: images `(B, C, H, W)` of any size the patches tile, or a native-aspect batch's flattened
        patches `(B, K, P * P * C)` with `spatial_shapes` and `pixel_attention_mask`. `bool_masked_pos` `(B, N)` (or
        `(B, K)`): the patches the [mask] embedding replaces, whose pixels the loss scores. Returns the `loss` (unless
        `return_loss=False`; its default tells `Trainer` that the model computes a loss without labels, so evaluation
        reports it) and the `reconstruction`, in the layout of `pixel_values`."""
        if kwargs.get("image_slot_index") is not None:
            raise ValueError(
                "SimMIM takes whole images or a padded native-aspect batch, not a packed one (`image_slot_index`): "
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
        if bool_masked_pos is not None and return_loss:
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
            # (B, rows, cols, C, s, s) -> (B, C, rows, s, cols, s) -> (B, C, rows * s, cols * s)
            reconstruction = blocks.unflatten(1, (rows, cols)).permute(0, 3, 1, 4, 2, 5).flatten(4, 5).flatten(2, 3)
        return MaskedImageModelingOutput(
            loss=loss,
            reconstruction=reconstruction,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
