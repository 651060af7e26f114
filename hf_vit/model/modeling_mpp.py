"""Masked patch prediction (the paper's section 4.6 and appendix B.1.2): some patch embeddings x_p^i E are corrupted
before the position embeddings are added, and a head predicts the mean colour of each corrupted patch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.utils import ModelOutput, can_return_tuple

from .configuration_vit import VisionTransformerConfig
from .layout import batch_fields
from .modeling_vit import VisionTransformerModel, VisionTransformerPreTrainedModel
from .pixel_targets import mean_color_classes, unnormalized_pixels
from .weight_init import lecun_normal_

# What masked patch prediction does to each patch embedding (a `patch_corruption` tensor holds these codes): left
# alone, replaced by the [mask] embedding, replaced by another patch's embedding, or kept but predicted all the same.
PATCH_CLEAN, PATCH_MASKED, PATCH_RANDOM, PATCH_KEPT = 0, 1, 2, 3


@dataclass(frozen=True)
class PatchCorruption:
    """How masked patch prediction corrupts the patches, B.1.2 of the paper by default: `corrupt_ratio` of each
    image's patches are corrupted, each replaced by the [mask] embedding with probability `mask_ratio`, by another
    patch's embedding with probability `random_ratio`, and kept otherwise. Settings of a run (what it draws), not of
    the architecture: the model's config does not hold them."""

    corrupt_ratio: float = 0.5
    mask_ratio: float = 0.8
    random_ratio: float = 0.1

    def __post_init__(self) -> None:
        for name in ("corrupt_ratio", "mask_ratio", "random_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"`{name}` must be a number in [0, 1], got {value!r}.")
        if self.mask_ratio + self.random_ratio > 1.0:
            raise ValueError(
                f"`mask_ratio` + `random_ratio` ({self.mask_ratio} + {self.random_ratio}) must be at most 1: they are "
                "shares of the same corrupted patches."
            )


def draw_patch_corruption(
    batch_size: int,
    num_patches: int,
    corruption: PatchCorruption = PatchCorruption(),
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    patch_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked patch prediction's corruption of `batch_size` images of `num_patches` patches (`corruption`'s shares;
    the count per image rounded half up). Returns `(batch_size, num_patches)` int64 codes (`PATCH_CLEAN`,
    `PATCH_MASKED`, `PATCH_RANDOM`, `PATCH_KEPT`). `patch_mask` `(batch_size, num_patches)` marks each image's
    patches in a padded native-aspect batch: the share is of those, and the padding stays clean."""
    count = int(corruption.corrupt_ratio * num_patches + 0.5)
    draws = torch.rand(batch_size, num_patches, generator=generator, device=device)
    if patch_mask is not None:  # padding draws last, and each image corrupts its share of its own patches
        patch_mask = patch_mask.to(draws.device).bool()
        draws = draws.masked_fill(~patch_mask, 2.0)
        count = (corruption.corrupt_ratio * patch_mask.sum(dim=1, keepdim=True) + 0.5).long()
    # The ranks of uniform draws are a uniform random permutation: the `count` lowest are corrupted.
    ranks = draws.argsort(dim=1).argsort(dim=1)
    kind = torch.rand(batch_size, num_patches, generator=generator, device=device)
    mask_ratio, random_ratio = corruption.mask_ratio, corruption.random_ratio
    codes = torch.where(
        kind < mask_ratio, PATCH_MASKED, torch.where(kind < mask_ratio + random_ratio, PATCH_RANDOM, PATCH_KEPT)
    )
    return torch.where(ranks < count, codes, PATCH_CLEAN)


def draw_patch_sources(
    patch_corruption: torch.Tensor, patch_mask: torch.Tensor | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The encoder's `patch_sources` for `patch_corruption` codes `(B, N)`: for each `PATCH_RANDOM` patch, another
    patch drawn uniformly from the whole batch (as BERT's random token is drawn from the vocabulary rather than from
    its own sentence), of the images' own patches where `patch_mask` `(B, N)` marks them in a native-aspect batch, as
    an index into the batch's B * N patches; -1 elsewhere. Drawn from torch's generator on `device`."""
    batch, count = patch_corruption.shape
    patch_mask = torch.ones(batch, count, dtype=torch.bool) if patch_mask is None else patch_mask
    # the images' own patches, counted on the device (no read: their number is a tensor)
    ranks = patch_mask.to(device).flatten().long().cumsum(0)  # each valid patch's place among them, from 1
    total = ranks[-1]
    place = (ranks - 1).clamp(min=0)
    # Draw among the total - 1 other patches: values at or above a patch's own place move up by one.
    draw = torch.rand(batch * count, device=device) * (total - 1).clamp(min=1)
    source = torch.minimum(draw.long(), (total - 2).clamp(min=0))
    source = torch.where(total > 1, source + (source >= place).long(), source)
    sources = torch.searchsorted(ranks, source + 1).view(batch, count)  # the patch that is that valid one
    return torch.where(patch_corruption.to(sources.device) == PATCH_RANDOM, sources, -1)


@dataclass
class MaskedPatchPredictionOutput(ModelOutput):
    """Outputs of masked patch prediction: the cross-entropy over the corrupted patches (`loss`), the mean-colour
    logits of every patch `(B, N, classes)`, and the corruption codes used (`patch_corruption`, None if none)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    patch_corruption: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class VisionTransformerForMaskedPatchPrediction(VisionTransformerPreTrainedModel):
    """ViT pretrained by masked patch prediction: a linear head predicts, from each corrupted patch's final
    representation, its mean colour at `config.mpp_color_bits` bits per channel (512 classes for RGB at 3 bits).

    The corruption is drawn here while training, with the paper's shares (`PatchCorruption()`), unless
    `patch_corruption` (or `bool_masked_pos`) is given (the data pipeline of `hf_vit.tasks.mpp` draws it per example,
    with its run's shares); outside training, only a given corruption corrupts anything.
    `labels` are the colour classes `(B, N)` of the patches (`pixel_targets.mean_color_classes`), -100 where
    none; where a corruption is given or drawn without them, they are computed from `pixel_values` (normalised with
    the config's `mpp_pixel_mean` and `mpp_pixel_std`). The loss is their cross-entropy over the corrupted patches,
    or over every labelled patch when nothing is corrupted. The encoder's weights are a plain ViT's, so a checkpoint
    fine-tunes with `VisionTransformerForImageClassification.from_pretrained` like any other (the [mask] embedding
    and this head are left out).
    """

    _new_weight_prefixes = ("mpp_head.", "vit.embeddings.mask_token")

    def __init__(self, config: VisionTransformerConfig) -> None:
        super().__init__(config)
        self.vit = VisionTransformerModel(config, use_mask_token=True)
        self.mpp_head = nn.Linear(config.hidden_size, config.mpp_num_classes)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self:
            lecun_normal_(self.mpp_head.weight)
            init.zeros_(self.mpp_head.bias)

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        patch_corruption: torch.Tensor | None = None,
        interpolate_pos_encoding: bool | None = None,
        bool_masked_pos: torch.Tensor | None = None,
        **kwargs,
    ) -> MaskedPatchPredictionOutput:
        """`patch_corruption`: the corruption codes `(B, N)` (`draw_patch_corruption`); or `bool_masked_pos` `(B, N)`,
        as transformers' `ViTForMaskedImageModeling` takes it: the patches the [mask] embedding replaces, and the
        only ones predicted. A packed batch (`image_slot_index`, see `layout.py`) gives `labels`, `patch_corruption`
        and `bool_masked_pos` per patch slot `(rows, L)` and gets its outputs per image, as the native-aspect batch of
        the same images: `logits` and `patch_corruption` `(images, patches, ...)`."""
        patch_mask, per_image = None, None
        if kwargs.get("spatial_shapes") is not None:  # a native-aspect batch: the padding is neither corrupted nor
            layout = self.vit.batch_layout(pixel_values, **batch_fields(kwargs))  # predicted
            # packed: what is given per slot goes one image per row, as the outputs (the encoder embeds the slots)
            per_image = layout.unpack_patches
            labels, patch_corruption, bool_masked_pos = (
                None if value is None else per_image(value) for value in (labels, patch_corruption, bool_masked_pos)
            )
            kwargs.update(layout=layout)
            patch_mask = layout.patch_mask
        given = "patch_corruption" if bool_masked_pos is None else "bool_masked_pos"
        if bool_masked_pos is not None:
            if patch_corruption is not None:
                raise ValueError("Pass `patch_corruption` or `bool_masked_pos`, not both.")
            patch_corruption = torch.where(bool_masked_pos.bool(), PATCH_MASKED, PATCH_CLEAN)
        # the encoder checks the pixels; a grid they do not tile is refused there, before the codes are used
        if isinstance(pixel_values, torch.Tensor) and pixel_values.ndim == (4 if patch_mask is None else 3):
            rows, cols = (size // self.config.patch_size for size in pixel_values.shape[-2:])
            shape = (pixel_values.shape[0], rows * cols) if patch_mask is None else tuple(patch_mask.shape)
            if patch_corruption is None and self.training:  # the paper's shares
                patch_corruption = draw_patch_corruption(*shape, device=pixel_values.device, patch_mask=patch_mask)
            elif patch_corruption is not None and tuple(patch_corruption.shape) != shape:
                raise ValueError(
                    f"`{given}` has shape {tuple(patch_corruption.shape)} but the images have {shape[1]} patches "
                    f"each (expected {shape})."
                )
        if labels is None and patch_corruption is not None and isinstance(pixel_values, torch.Tensor):
            # no labels: the targets are the corrupted patches' mean colours, from the pixels (as SimMIM's collator
            # gives only the pixels and the mask)
            pixels = unnormalized_pixels(pixel_values, self.config)
            labels = mean_color_classes(pixels, self.config.patch_size, self.config.mpp_color_bits)
            labels = labels if per_image is None else per_image(labels)
        masked = sources = None
        if patch_corruption is not None:
            masked = patch_corruption == PATCH_MASKED
            sources = draw_patch_sources(patch_corruption, patch_mask, self.vit.embeddings.position_embedding.device)
        outputs = self.vit(
            pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, bool_masked_pos=masked,
            patch_sources=sources, **kwargs,
        )  # fmt: skip
        logits = self.mpp_head(outputs.last_hidden_state[:, self.config.num_prefix_tokens :])
        loss = None
        if labels is not None:
            targets = labels.to(logits.device)
            if patch_corruption is not None:
                targets = targets.masked_fill(patch_corruption.to(logits.device) == PATCH_CLEAN, -100)
            if patch_mask is not None:
                targets = targets.masked_fill(~patch_mask.to(logits.device), -100)
            # A sum over the labelled patches divided by their number (at least 1): no NaN for a batch without any.
            flat_logits, flat_targets = logits.flatten(0, 1).float(), targets.flatten()
            total = F.cross_entropy(flat_logits, flat_targets, ignore_index=-100, reduction="sum")
            loss = total / (flat_targets != -100).sum().clamp(min=1)
        return MaskedPatchPredictionOutput(
            loss=loss,
            logits=logits,
            patch_corruption=patch_corruption,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
