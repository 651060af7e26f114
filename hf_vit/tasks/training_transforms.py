"""Each objective's training splits: its training images augmented (`hf_vit.data.augment`), the other splits through
the objective's evaluation transform. Only training imports this module (serving evaluates with
`Objective.eval_transform` and never loads the augmentations); `TRAINING_TRANSFORMS` has a row per objective of
`objectives.OBJECTIVES`, by its name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from ..data.augment.train_transform import make_train_transform
from ..data.transforms import Augmentation, apply_transforms, make_eval_transform
from ..model.image_processing_vit import VisionTransformerImageProcessor
from .mpp import mpp_eval_transform
from .simmim import simmim_eval_transform


def _crop_and_flip(augmentation: Augmentation) -> dict[str, Any]:
    """`make_train_transform`'s arguments for `augmentation`'s random resized crop and flip."""
    scale = (augmentation.crop_scale_min, 1.0)
    return dict(random_resized_crop=augmentation.random_resized_crop, scale=scale, hflip=augmentation.hflip)


def classification_transforms(
    raw, augmentation: Augmentation, processor: VisionTransformerImageProcessor, config: Any = None
):
    """`raw` with on-the-fly augmentation (crop, flip, RandAugment, random erasing) on train, the processor alone on
    the other splits."""
    train_transform = make_train_transform(
        processor,
        **_crop_and_flip(augmentation),
        **{name: getattr(augmentation, name) for name in ("rand_augment", "reprob", "remode", "recount")},
        token_drop_rate=augmentation.token_drop_rate,
    )
    return apply_transforms(raw, train_transform, make_eval_transform(processor))


def self_supervised_transforms(inputs: Callable, raw, augmentation: Augmentation, processor, config):
    """`raw`'s splits with a self-supervised objective's `inputs` (`mpp_eval_transform`, `simmim_eval_transform`):
    training images cropped and flipped as `augmentation` says (its colour changes are refused for these
    objectives), the other splits resized by the processor only."""
    train = inputs(processor, config, partial(make_train_transform, **_crop_and_flip(augmentation)))
    return apply_transforms(raw, train, inputs(processor, config))


with_mpp_transforms = partial(self_supervised_transforms, mpp_eval_transform)


TRAINING_TRANSFORMS: dict[str, Callable[[Any, Augmentation, VisionTransformerImageProcessor, Any], Any]] = {
    "classification": classification_transforms,
    "multi_label_classification": classification_transforms,
    "mpp": with_mpp_transforms,
    "simmim": partial(self_supervised_transforms, simmim_eval_transform),
}
