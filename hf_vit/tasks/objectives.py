"""What a run learns, as a table (`OBJECTIVES`, looked up by `select_objective`) of the parts a run calls instead of
branching on the objective, as big_vision's trainer loads its model module by name. An objective's training transform,
which loads the augmentations, is looked up by its name in `training_transforms`."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import datasets
import numpy as np
import torch
from torch.nn import functional as F

from ..data.datasets import is_multi_label, label_names, to_multi_hot
from ..data.transforms import Transform, collate_fn, make_eval_transform
from ..metrics import compute_metrics
from ..model.image_processing_vit import VisionTransformerImageProcessor
from ..model.modeling_mim import VisionTransformerForMaskedImageModeling
from ..model.modeling_mpp import VisionTransformerForMaskedPatchPrediction
from .model_setup import ModelSettings, build_classifier
from .mpp import (
    build_mpp_model,
    mpp_collate_fn,
    mpp_compute_metrics,
    mpp_eval_transform,
    mpp_preprocess_logits,
    refuse_drawn_sizes,
)
from .simmim import (
    simmim_collate_fn,
    simmim_compute_metrics,
    simmim_eval_transform,
    simmim_preprocess_logits,
)

logger = logging.getLogger(__name__)

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification")


@dataclass(frozen=True)
class Labels:
    """What the model predicts: its classes (empty for self-supervised objectives) and transformers' problem type."""

    id2label: dict[int, str] = field(default_factory=dict)
    problem_type: str | None = None


@dataclass(frozen=True)
class Objective:
    """The parts of a run that depend on what it learns."""

    name: str
    tasks: tuple[str, ...]  # the scripts that train it
    labels: Callable[[Any], tuple[Any, Labels]]  # raw splits -> (splits with targets, Labels)
    build_model: Callable[[str, ModelSettings, Labels], Any]  # (task, model settings, labels) -> model
    # (processor, config) -> the transform of the splits it is evaluated on (training's: see the module docstring)
    eval_transform: Callable[[VisionTransformerImageProcessor, Any], Transform]
    collator: Callable
    compute_metrics: Callable
    preprocess_logits: Callable | None = None
    streaming: bool = True  # whether it trains on streamed data sets
    # Whether its training images may be mixed (Mixup, CutMix) and RandAugmented: not when it learns the pixels.
    augmentable: bool = True
    # The loss of the gathered predictions and labels, for the final evaluation (None: Trainer's mean of the batches'
    # losses, which counts the padding of a streamed split's last batch when several processes evaluate it).
    loss: Callable[[Any, Any], float] | None = None
    # Refuses, by flag, the native-aspect and drawn sizes it cannot train: (max_num_patches, seq_lens, patch_sizes).
    check_sizes: Callable[[int | None, str | None, str | None], None] | None = None
    # Model flags it has no use for (masked patch prediction has no classification head): given, each is said to
    # have no effect, in one warning line.
    idle_flags: tuple[str, ...] = ()
    # The inputs Trainer takes as labels (`TrainingArguments.label_names`); none where the model computes its loss
    # from the inputs alone (SimMIM), which Trainer then asks for in evaluation too.
    label_names: tuple[str, ...] = ("labels",)


def cross_entropy(logits, labels) -> float:
    """The model's single-label loss (mean cross-entropy) of `logits` [N, C] and class ids [N]."""
    return float(F.cross_entropy(torch.as_tensor(logits).float(), torch.as_tensor(labels).long()))


def binary_cross_entropy(logits, labels) -> float:
    """The model's multi-label loss (mean sigmoid cross-entropy) of `logits` [N, C] and multi-hot targets [N, C]."""
    return float(F.binary_cross_entropy_with_logits(torch.as_tensor(logits).float(), torch.as_tensor(labels).float()))


def _class_labels(raw, multi_label: bool = False) -> tuple[Any, Labels]:
    labels = Labels(dict(enumerate(label_names(raw))), PROBLEM_TYPES[multi_label])
    if multi_label:
        raw = to_multi_hot(raw, len(labels.id2label))
    check_labels(raw, labels.id2label)
    return raw, labels


def _masked_model(model_class: type, name: str) -> Callable[[str, ModelSettings, Labels], Any]:
    """A self-supervised objective's builder (`build_mpp_model`); the model's config names it, so
    `AutoModelForMaskedImageModeling` loads the saved folder as this objective's model."""

    def build_model(task: str, settings: ModelSettings, labels: Labels):
        model = build_mpp_model(settings, model_class)
        model.config.masked_image_modeling = name
        return model

    return build_model


# What the classification objectives share, and what the self-supervised ones (which learn the pixels) share.
_CLASSIFYING = dict(
    tasks=("pretrain", "finetune"),
    build_model=build_classifier,
    eval_transform=lambda processor, config=None: make_eval_transform(processor),
    collator=collate_fn,
    compute_metrics=compute_metrics,
)
_SELF_SUPERVISED = dict(
    tasks=("pretrain",),
    labels=lambda raw: (raw, Labels()),
    augmentable=False,
    check_sizes=refuse_drawn_sizes,
    idle_flags=("representation_size", "problem_type", "keep_head"),
)
OBJECTIVES: dict[str, Objective] = {
    "classification": Objective(name="classification", labels=_class_labels, loss=cross_entropy, **_CLASSIFYING),
    "multi_label_classification": Objective(
        name="multi_label_classification",
        labels=partial(_class_labels, multi_label=True),
        streaming=False,
        loss=binary_cross_entropy,
        **_CLASSIFYING,
    ),
    "mpp": Objective(
        name="mpp",
        build_model=_masked_model(VisionTransformerForMaskedPatchPrediction, "mpp"),
        eval_transform=mpp_eval_transform,
        collator=mpp_collate_fn,
        compute_metrics=mpp_compute_metrics,
        preprocess_logits=mpp_preprocess_logits,
        **_SELF_SUPERVISED,
    ),
    "simmim": Objective(
        name="simmim",
        build_model=_masked_model(VisionTransformerForMaskedImageModeling, "simmim"),
        eval_transform=simmim_eval_transform,
        collator=simmim_collate_fn,
        compute_metrics=simmim_compute_metrics,
        preprocess_logits=simmim_preprocess_logits,
        label_names=(),
        **_SELF_SUPERVISED,
    ),
}


def select_objective(
    task: str,
    raw,
    dataset_name: str,
    objective: str = "classification",
    problem_type: str | None = None,
    streaming: bool = False,
) -> Objective:
    """The objective of a run: `objective` (`--objective`: classification, mpp or simmim), a classification being
    multi-label when the label column of `raw` (the data set `dataset_name`) holds lists of classes (checked against
    `problem_type`, `--problem_type`, when given)."""
    if objective not in ("classification", "mpp", "simmim"):
        raise ValueError(f"--objective must be classification, mpp or simmim, got {objective!r}.")
    name = objective
    if objective == "classification":  # checked against the label column: lists of classes make it multi-label
        if problem_type is not None and problem_type not in PROBLEM_TYPES:
            raise ValueError(f"--problem_type must be one of {PROBLEM_TYPES}, got {problem_type!r}.")
        lists = is_multi_label(raw)
        if problem_type is not None and problem_type != PROBLEM_TYPES[lists]:
            holds = "a list of classes" if lists else "one class"
            raise ValueError(
                f"--problem_type {problem_type}, but the label column of {dataset_name!r} holds {holds} per image. "
                "For multi-label classification the label column must hold a list of classes per image."
            )
        name = PROBLEM_TYPES[1] if lists else "classification"
    chosen = OBJECTIVES[name]
    if task not in chosen.tasks:
        raise ValueError(f"--objective {objective} is a pretraining objective: use it with pretrain.py.")
    if streaming and not chosen.streaming:
        raise ValueError("Multi-label data sets are supported without --streaming only.")
    return chosen


def check_labels(raw, id2label: dict[int, str]) -> None:
    """Refuse a data set a classifier cannot learn from, and name classes that have no training images."""
    if len(id2label) < 2:
        raise ValueError(
            f"The data set has {len(id2label)} class(es) ({list(id2label.values())}): classification needs at least "
            "two (with one, the model would fit a constant). Check --dataset_name and --label_column_name."
        )
    train = raw["train"]
    if isinstance(train, datasets.IterableDataset):
        return
    labels = train["label"]
    if labels and isinstance(labels[0], list):  # multi-hot vectors (multi-label classification)
        sums = np.asarray(labels).sum(axis=0)
        counts = Counter({index: int(total) for index, total in enumerate(sums)})
    else:
        counts = Counter(labels)
    empty = [name for index, name in id2label.items() if counts[index] == 0]
    if empty:
        logger.warning(
            "Class(es) %s have no training images (they appear only in other splits, or nowhere): the model cannot "
            "learn them.",
            empty,
        )
