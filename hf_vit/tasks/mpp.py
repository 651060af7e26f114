"""Masked patch prediction (section 4.6, appendix B.1.2): the data side of self-supervised pretraining and its run's
pieces for `Trainer`. The paper corrupts 50% of the patch embeddings (80% of them replaced by a learnable [mask]
embedding, 10% by another patch's embedding, 10% kept) and predicts the 3-bit mean colour (512 classes) of every
corrupted patch (`mean_color_classes`, from the pixels before normalisation). The model
(`VisionTransformerForMaskedPatchPrediction`) applies the corruption in its embeddings; this module makes its inputs
and what `Trainer` needs; the image labels of the data set are not used."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from ..data.transforms import Transform, make_eval_transform
from ..model.configuration_vit import VisionTransformerConfig
from ..model.image_processing_vit import VisionTransformerImageProcessor
from ..model.modeling_mpp import (
    PATCH_CLEAN,
    PatchCorruption,
    VisionTransformerForMaskedPatchPrediction,
    draw_patch_corruption,
)
from ..model.pixel_targets import mean_color_classes
from .model_setup import ModelSettings, config_from_preset, load_requested


class MaskedPatchPredictionTransform:
    """`transform` (un-normalised pixels: its processor `with_options(do_rescale=False, do_normalize=False)`) ->
    `pixel_values` normalised by `processor`, mean-colour `labels` (-100 on clean patches) and `patch_corruption`
    codes drawn from torch's generator (with `corruption`'s shares), per example."""

    def __init__(
        self,
        transform: Transform,
        processor: VisionTransformerImageProcessor,
        config: VisionTransformerConfig,
        corruption: PatchCorruption | None = None,
    ) -> None:
        if processor.do_rescale is False and processor.do_normalize is False:
            raise ValueError("`processor` is the one that normalises (the model's); `transform` is built on a copy.")
        self.transform = transform
        self.processor = processor
        self.config = config
        self.corruption = corruption or PatchCorruption()

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, torch.Tensor]:
        raw = self.transform(batch)["pixel_values"]
        scale = self.processor.rescale_factor if self.processor.do_rescale else 1.0
        patch = self.config.patch_size
        targets = mean_color_classes(raw.double() * scale, patch, self.config.mpp_color_bits)
        count = targets.shape[1]
        # One draw per example: under SeededAugmentation each example's draw comes from its own seeded generator.
        plan = torch.cat([draw_patch_corruption(1, count, self.corruption) for _ in range(raw.shape[0])])
        return {
            "pixel_values": self.processor.normalize_batch(raw),
            "labels": targets.masked_fill(plan == PATCH_CLEAN, -100),
            "patch_corruption": plan,
        }


def refuse_drawn_sizes(max_num_patches: int | None, seq_lens: str | None, patch_sizes: str | None) -> None:
    """Refuse, by flag, native-aspect batches and sizes drawn per step: the self-supervised objectives (masked patch
    prediction, SimMIM) pretrain on patches of one size on whole images."""
    for flag, value in (("seq_lens", seq_lens), ("patch_sizes", patch_sizes)):
        if value is not None:
            raise ValueError(
                f"--{flag} trains the classification objectives; the self-supervised ones (mpp, simmim) learn the "
                "patches of one size on whole images of --image_size: drop it, or use --objective classification."
            )
    if max_num_patches is not None:
        raise ValueError(
            "--max_num_patches (native aspect ratio) trains the classification objectives; the self-supervised ones "
            "(mpp, simmim) pretrain on whole images of --image_size: drop --max_num_patches, or use --objective "
            "classification."
        )


def mpp_eval_transform(processor: VisionTransformerImageProcessor, config, make: Callable = make_eval_transform):
    """Masked patch prediction's inputs from `make` (by default the processor alone, no augmentation) on the
    un-normalised pixels, the patches corrupted with the paper's shares."""
    raw = make(processor.with_options(do_rescale=False, do_normalize=False))  # the targets' pixels
    return MaskedPatchPredictionTransform(raw, processor, config)


def stack_examples(examples: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """The transformed examples' `keys` stacked along a new first dimension."""
    return {key: torch.stack([torch.as_tensor(example[key]) for example in examples]) for key in keys}


# `pixel_values` (B, C, H, W), `labels` and `patch_corruption` (B, N)
mpp_collate_fn = partial(stack_examples, keys=("pixel_values", "labels", "patch_corruption"))


def build_mpp_model(settings: ModelSettings, model_class: type = VisionTransformerForMaskedPatchPrediction):
    """The model to pretrain by masked patch prediction (or SimMIM's, `model_class`): `--preset` from scratch, or
    `--model_name_or_path` continued (its head and [mask] embedding new if it has none; see `load_checkpoint`)."""
    if settings.model_name_or_path:
        return load_requested(settings, model_class=model_class)
    return model_class(config_from_preset(settings))


def mpp_preprocess_logits(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
    """`Trainer`'s `preprocess_logits_for_metrics`: keep the predicted classes (B, N), not the (B, N, 512) logits."""
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return logits.argmax(dim=-1)


def mpp_compute_metrics(eval_pred) -> dict[str, float]:
    """`Trainer`'s `compute_metrics`: accuracy of the predicted mean colour on the corrupted patches."""
    predictions, labels = eval_pred.predictions, eval_pred.label_ids
    if isinstance(predictions, (tuple, list)):
        predictions = predictions[0]
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.ndim == labels.ndim + 1:  # logits given without `mpp_preprocess_logits`
        predictions = predictions.argmax(-1)
    scored = labels != -100
    return {"mpp_accuracy": float((predictions[scored] == labels[scored]).mean()) if scored.any() else float("nan")}
