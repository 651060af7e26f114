"""A run's final evaluation: each split measured on a loader built for it, by the run's Trainer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import Trainer

from ..infer.evaluate import final_split


def evaluate_split(
    trainer: Trainer, dataset, split: str, loss: Callable[[Any, Any], float] | None = None
) -> dict[str, float]:
    """`trainer`'s metrics of `dataset` as `<split>_*`, by `predict` (`Trainer.evaluate` hands back the loader it
    cached for the validation split whenever the workers persist, whatever data set it is given). With `loss` (the
    objective's), the loss is that of the gathered predictions: Trainer's mean of the processes' batch losses counts
    the examples that pad a streamed split's last batch across processes."""
    output = trainer.predict(dataset, metric_key_prefix=split)
    metrics = dict(output.metrics)
    predictions = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
    if predictions is not None:
        metrics[f"{split}_samples"] = len(predictions)  # the images measured, said beside every figure
    if loss is not None and predictions is not None and output.label_ids is not None:
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
