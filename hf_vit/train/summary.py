"""The end of a run, said in a few lines: where the model is, its headline metric on which split, the commands to
run next with the real paths, and a warning when the training loss stayed at chance level."""

from __future__ import annotations

import logging
import math
import os
import shlex
from typing import Any

from ..metrics import few_images_warning, images_text

logger = logging.getLogger(__name__)

# The metric a run is judged by, per objective, as the final evaluation reports it (`eval_*`).
HEADLINE_METRICS = ("accuracy", "mean_average_precision", "mpp_accuracy", "loss")
CHANCE_MARGIN = 0.05  # a final training loss within 5% of chance is "at chance"


def final_training_loss(log_history: list[dict[str, Any]], metrics: dict[str, Any]) -> float | None:
    """The last logged training loss (the run's mean training loss when no step was logged)."""
    for entry in reversed(log_history):
        if "loss" in entry:
            return float(entry["loss"])
    value = metrics.get("train_loss")
    return float(value) if value is not None else None


def chance_warning(
    loss: float | None,
    num_classes: int,
    problem_type: str | None,
    learning_rate: float,
    max_steps: int = -1,
    epochs_done: float | None = None,
) -> str | None:
    """The warning for a single-label run whose final training loss is within 5% of chance, ln C for C classes (a
    model answering every class at 1/C); None otherwise. Its advice names the flag that set the run's length:
    `--max_steps` when it was given (> 0), else `--num_train_epochs` with the epochs the run did."""
    if loss is None or problem_type != "single_label_classification" or num_classes < 2:
        return None
    chance = math.log(num_classes)
    if abs(loss - chance) > CHANCE_MARGIN * chance:
        return None
    if max_steps > 0:
        longer = f"more --max_steps (this run: {max_steps})"
    else:
        longer = "more --num_train_epochs" + (f" (this run: {epochs_done:g})" if epochs_done is not None else "")
    return (
        f"The final training loss {loss:.4f} is at chance level: ln {num_classes} = {chance:.4f} for {num_classes} "
        f"classes, the loss of a model that answers every class at 1/{num_classes} whatever the image. It has "
        f"learned nothing yet. Try a higher --learning_rate (this run: {learning_rate:g}), {longer}, or the "
        'README\'s "Your own image folder" commands.'
    )


def headline(metrics: dict[str, Any]) -> tuple[str, float] | None:
    """(name, value) of the final evaluation's headline metric."""
    for name in HEADLINE_METRICS:
        if isinstance(metrics.get(f"eval_{name}"), (int, float)):
            return name, float(metrics[f"eval_{name}"])
    return None


def next_commands(
    output_dir: str, dataset_name: str | None, task: str, split: str = "test", validation_fraction: float = 0.1
) -> list[str]:
    """What to run on the saved model next, with its path (and the data set's, a local one made absolute); a run that
    held out another share than the default passes it on, so that "validation" names the same images."""
    model = shlex.quote(output_dir)
    commands = [f"hf-vit-predict --model {model} IMAGE_OR_FOLDER..."]
    if dataset_name:
        data = os.path.abspath(dataset_name) if os.path.exists(dataset_name) else dataset_name
        evaluate = f"hf-vit-evaluate --model {model} --dataset_name {shlex.quote(data)} --split {split}"
        if split == "validation" and validation_fraction != 0.1:
            evaluate += f" --validation_fraction {validation_fraction:g}"
        commands.append(evaluate)
    commands.append(f"hf-vit-export --model {model} --format onnx --output {shlex.quote(output_dir + '.onnx')}")
    commands.append(f"hf-vit-push --model {model} --hub_model_id YOUR_NAME/{os.path.basename(output_dir) or task}")
    return commands


def summarize_run(
    task: str,
    output_dir: str | os.PathLike,
    metrics: dict[str, Any],
    log_history: list[dict[str, Any]],
    config: Any,
    learning_rate: float,
    max_steps: int,
    dataset_name: str | None = None,
    validation_fraction: float = 0.1,
) -> list[str]:
    """Print the run's summary, with the chance-level warning when it applies (and log it at DEBUG). Returns the
    lines."""
    output_dir = os.path.abspath(os.fspath(output_dir))
    lines = [f"hf-vit {task}: the model is in {output_dir}"]
    found, split = headline(metrics), metrics.get("eval_split", "validation")
    if found is not None:
        name, value = found
        count = metrics.get("eval_samples")
        lines.append(f"  {name} on the {split} split: {value:.4f} ({images_text(count)})")
        if few := few_images_warning(count):
            lines.append(f"  WARNING: {few}")
    lines.append("  next:")
    lines.extend(
        f"    {command}" for command in next_commands(output_dir, dataset_name, task, split, validation_fraction)
    )
    problem_type = getattr(config, "problem_type", None)
    num_classes = len(getattr(config, "id2label", None) or {})
    epochs = metrics.get("epoch")  # the epochs done (a fraction when --max_steps ended the run)
    warning = chance_warning(
        final_training_loss(log_history, metrics), num_classes, problem_type, learning_rate, max_steps,
        round(epochs, 2) if isinstance(epochs, (int, float)) else None,
    )  # fmt: skip
    if warning:
        lines.append(f"  WARNING: {warning}")
    # Printed once, on standard output; the log keeps it at DEBUG only, since a terminal shows both streams.
    for line in lines:
        logger.debug("%s", line)
    print("\n".join(lines), flush=True)
    return lines
