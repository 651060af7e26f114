"""SimMIM (Xie et al., 2022): the data side of masked image modeling and its run's pieces for `Trainer`.

The model (`VisionTransformerForMaskedImageModeling`) replaces the masked patches by its [mask] embedding and
reconstructs their pixels; this module makes its inputs as transformers' `run_mim.py` does (`SimMIMMasking`: SimMIM's
32-pixel blocks, 60% of them). The image labels are not used; the logs carry the L1 loss on the masked pixels."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..data.transforms import Transform, make_eval_transform
from ..model.image_processing_vit import VisionTransformerImageProcessor
from .mpp import stack_examples


@dataclass(frozen=True)
class SimMIMMasking:
    """SimMIM's random masking: the patch grid is cut into square blocks of `mask_patch_size` pixels (at least one
    patch), and `mask_ratio` of the blocks (rounded up) are masked, drawn from torch's generator."""

    mask_patch_size: int = 32
    mask_ratio: float = 0.6

    def __call__(self, rows: int, cols: int, patch_size: int) -> torch.Tensor:
        """A mask `(rows * cols,)` of a `rows` x `cols` patch grid: True on the masked patches."""
        block = max(self.mask_patch_size // patch_size, 1)
        block_rows, block_cols = math.ceil(rows / block), math.ceil(cols / block)
        count = math.ceil(block_rows * block_cols * self.mask_ratio)
        chosen = torch.zeros(block_rows * block_cols, dtype=torch.bool)
        chosen[torch.randperm(block_rows * block_cols)[:count]] = True
        grid = chosen.view(block_rows, block_cols).repeat_interleave(block, 0).repeat_interleave(block, 1)
        return grid[:rows, :cols].flatten()


class SimMIMTransform:
    """`transform` (normalised `pixel_values`) with a `bool_masked_pos` per example, drawn by SimMIM's masking."""

    def __init__(self, transform: Transform, patch_size: int) -> None:
        self.transform, self.patch_size, self.masking = transform, patch_size, SimMIMMasking()

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, torch.Tensor]:
        pixel_values = self.transform(batch)["pixel_values"]
        rows, cols = (size // self.patch_size for size in pixel_values.shape[-2:])
        # One draw per example: under SeededAugmentation each example's draw comes from its own seeded generator.
        masks = torch.stack([self.masking(rows, cols, self.patch_size) for _ in range(pixel_values.shape[0])])
        return {"pixel_values": pixel_values, "bool_masked_pos": masks}


def simmim_eval_transform(processor: VisionTransformerImageProcessor, config, make: Callable = make_eval_transform):
    """SimMIM's inputs from `make` (by default the processor alone, no augmentation), a mask per example."""
    return SimMIMTransform(make(processor), config.patch_size)


# `pixel_values` (B, C, H, W) and `bool_masked_pos` (B, N), as `run_mim.py`
simmim_collate_fn = partial(stack_examples, keys=("pixel_values", "bool_masked_pos"))


def simmim_compute_metrics(eval_pred) -> dict[str, float]:
    """Nothing beyond the loss: `Trainer` reports the L1 reconstruction loss as `eval_loss`."""
    return {}


def simmim_preprocess_logits(outputs, labels) -> torch.Tensor:
    """One zero per image: no reconstruction (a whole image per example) is kept among the gathered predictions (the
    loss is the metric), but the images measured are counted."""
    reconstruction = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    return reconstruction.new_zeros(reconstruction.shape[0])
