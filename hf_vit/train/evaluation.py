"""Measuring a model: a run's final evaluation (each split on a loader built for it) and the evaluation of a saved
model on a data set's split without training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from ..data.datasets import label_names, load_datasets
from ..data.transforms import apply_transforms, make_eval_transform
from ..metrics import compute_metrics
from ..model.image_processing_vit import VisionTransformerImageProcessor
from .arguments import DataArguments


def final_split(ds) -> str:
    """The split a run's final metrics are measured on: test when the data set has one, else validation."""
    return "test" if "test" in ds else "validation"


def evaluate_split(
    trainer: Trainer, dataset, split: str, loss: Callable[[Any, Any], float] | None = None
) -> dict[str, float]:
    """`trainer`'s metrics of `dataset` (the split `split`), logged as `<split>_*` (so that the curves keep
    validation and test apart).

    The data set gets a data loader built for it: `Trainer.evaluate` hands back the loader it cached for the
    validation split whenever the data loader's workers persist (the scripts' default), whatever data set it is given,
    so the "test" metrics would be the validation split's. With `loss` (the objective's loss of predictions and
    labels), the loss is that of the gathered predictions: Trainer's mean of the processes' batch losses counts the
    examples that pad a streamed split's last batch across processes."""
    output = trainer.predict(dataset, metric_key_prefix=split)
    metrics = dict(output.metrics)
    if loss is not None and output.predictions is not None and output.label_ids is not None:
        predictions = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
        metrics[f"{split}_loss"] = loss(predictions, output.label_ids)
    trainer.log(metrics)
    return metrics


def final_evaluation(trainer: Trainer, ds, loss: Callable[[Any, Any], float] | None = None) -> dict[str, Any]:
    """The run's final metrics on `final_split(ds)`: as `<split>_*`, and as `eval_*` (what `all_results.json`, the
    card and the Hub metadata report), with `eval_split` naming the split (`loss`: see `evaluate_split`)."""
    split = final_split(ds)
    measured = evaluate_split(trainer, ds[split], split, loss)
    metrics: dict[str, Any] = dict(measured)
    metrics.update({"eval_" + key.removeprefix(f"{split}_"): value for key, value in measured.items()})
    metrics["eval_split"] = split
    return metrics


def evaluate_model(
    model: Any,
    processor: VisionTransformerImageProcessor,
    data_args: Any = None,
    split: str | None = "test",
    batch_size: int = 256,
) -> dict[str, float]:
    """Top-1/top-5 accuracy of `model` on a split of `data_args`' data set (digits by default), no training; `split`
    None: the split a run's final metrics are measured on (`final_split`)."""
    return measure_model(model, processor, data_args, split, batch_size)[1]


@torch.no_grad()
def measure_model(
    model: Any,
    processor: VisionTransformerImageProcessor,
    data_args: Any = None,
    split: str | None = None,
    batch_size: int = 256,
) -> tuple[str, dict[str, float]]:
    """`(split, metrics)`: `evaluate_model`'s metrics on `split`, by default the one a run would report: test when
    the data set has one, else validation (the source's, or the part of train a run holds out)."""
    data_args = data_args or DataArguments()
    raw = load_datasets(data_args, seed=0)
    split = split or final_split(raw)
    if split not in raw:
        raise ValueError(f"The data set {data_args.dataset_name!r} has no {split} split (it has {', '.join(raw)}).")
    classes = label_names(raw)
    if len(classes) > model.config.num_labels:
        raise ValueError(
            f"The data set {data_args.dataset_name!r} has {len(classes)} classes but the model predicts "
            f"{model.config.num_labels}: evaluate it on the data set it was trained for, or fine-tune it first."
        )
    evaluation = make_eval_transform(processor)  # the processor alone, on train too: no augmentation is measured
    ds = apply_transforms(raw, evaluation, evaluation)[split]
    model.eval()
    logits, labels = [], []
    for start in range(0, len(ds), batch_size):
        batch = ds[start : start + batch_size]
        inputs = {
            key: batch[key] for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes") if key in batch
        }
        logits.append(model(**inputs).logits.float())
        labels.append(batch["labels"])
    return split, compute_metrics((torch.cat(logits).numpy(), torch.cat(labels).numpy()))
