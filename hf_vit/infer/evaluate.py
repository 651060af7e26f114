"""A saved model's metrics on a data set's split without training: the run's objective (transforms, collator, metrics,
loss) on the splits the run would see, the checkpoint's head as it is (its classes must be the data set's)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from ..data.datasets import (
    SPLIT_FIELDS,
    DataSource,
    file_digest,
    image_folder_root,
    label_names,
    load_datasets,
    local_data_set_fingerprint,
    reorder_classes,
)
from ..data.transforms import apply_transforms, pack_native_batch
from ..metrics import few_images_warning, images_text
from ..outputs.files import RUN_RECORD_FILE, write_beside
from ..outputs.run_record import read_record
from ..tasks.objectives import select_objective
from .loading import load_model, model_inputs, tokens_per_image

logger = logging.getLogger(__name__)


def final_split(ds) -> str:
    """The split a run's final metrics are measured on: test when the data set has one, else validation."""
    return "test" if "test" in ds else "validation"


@dataclass
class EvaluationSplit:
    """A data set's split ready to be measured with any processor: its name, raw examples and objective."""

    name: str
    raw: Any
    objective: Any


def _same_data_set(splits: dict[str, Any], dataset_name: str) -> bool:
    """Whether `dataset_name` is the data set a run's record describes: an image folder holding one of the images the
    run held out (by its path in the folder and its bytes, wherever the folder is now), the same `save_to_disk` folder
    (by its path's digest), or the same name of digits or a Hub data set."""
    root, images = image_folder_root(dataset_name), splits.get("images")
    if isinstance(images, dict):
        held_out = [item for split, names in images.items() if split != "train" for item in names.items()]
        return root is not None and any(
            (root / name).is_file() and file_digest(root / name) == digest for name, digest in held_out
        )
    fingerprint = local_data_set_fingerprint(dataset_name)  # (an image folder's too, in records written before)
    if splits.get("dataset_path_sha256") or fingerprint:
        return fingerprint == splits.get("dataset_path_sha256")
    return splits.get("dataset_name") == dataset_name


def recorded_source(model: str | os.PathLike, source: DataSource, given: dict[str, Any] | None = None) -> DataSource:
    """`source` with its splits made as the run that trained `model` made them (its record,
    `hf_vit.outputs.run_record`) when `source` names that run's data set, so that "validation" is the images the run
    held out; else `source` as it is. `given`: the split flags a user passed (None: not passed); one that contradicts
    the record is refused by name."""
    record = read_record(model) if Path(model).is_dir() else None
    splits = record.get("splits") if record else None
    if not isinstance(splits, dict) or not _same_data_set(splits, source.dataset_name):
        if isinstance(splits, dict) and "images" in splits and image_folder_root(source.dataset_name) is not None:
            logger.warning(
                "%s holds none of the images the run that trained %s held out (by their paths and bytes): it is "
                "measured as a data set of its own, on its own splits.", source.dataset_name, model,
            )  # fmt: skip
        return source
    fields = {field: splits[field] for field in SPLIT_FIELDS if field != "dataset_name" and field in splits}
    for flag, value in (given or {}).items():
        if value is not None and flag in fields and value != fields[flag]:
            raise ValueError(
                f"--{flag} {value}: the run that trained {model} made the splits of {source.dataset_name} with "
                f"--{flag} {fields[flag]} (its record {RUN_RECORD_FILE}), so another value would measure images it "
                f"did not hold out. Leave --{flag} out: the run's splits are used."
            )
    if "images" in splits:  # the run's images themselves, read in memory
        return dataclasses.replace(source, **{**fields, "streaming": False}, recorded_images=splits["images"])
    if fields.get("streaming"):
        logger.warning(
            "%s trained on a stream of %s: its splits are read as the run read them (validation: %s).",
            model, source.dataset_name, splits.get("carved_validation"),
        )  # fmt: skip
    return dataclasses.replace(source, **fields)


def evaluation_split(config: Any, source: DataSource, split: str | None = None, seed: int = 0) -> EvaluationSplit:
    """`split` (default: the run's final split, test or else validation) of `source`'s data set, labelled as the
    classification objective labels it; its classes checked against `config`'s. A streamed source (a run's record
    says so, `recorded_source`) is read as a stream, its split then held in memory."""
    raw = load_datasets(source, seed)
    split = split or final_split(raw)
    if split not in raw:
        raise ValueError(f"--split {split}: the data set {source.dataset_name!r} has {', '.join(raw)}.")
    if isinstance(raw[split], datasets.Dataset) and len(raw[split]) == 0:  # the run's images all gone from the folder
        raise ValueError(f"--split {split}: {source.dataset_name!r} holds none of the images of that split.")
    if source.streaming:  # the split read into memory in the stream's order (its images' bytes as they are)
        stream = raw[split].cast_column("image", datasets.Image(decode=False))
        data = datasets.Dataset.from_list(list(stream), features=stream.features)
        raw = datasets.DatasetDict({"train": raw["train"], split: data.cast_column("image", datasets.Image())})
        source = dataclasses.replace(source, streaming=False)  # the train split, which labels the classes, unread
    model_names = [config.id2label[i] for i in range(config.num_labels)] if config.id2label else []
    data_names = label_names(raw)
    if data_names != model_names and sorted(data_names) == sorted(model_names):
        raw = reorder_classes(raw, model_names)  # the same classes, numbered as the model numbers them
    objective = select_objective("finetune", raw, source.dataset_name, streaming=source.streaming)
    raw, labels = objective.labels(raw)
    check_classes(config, labels.id2label, source.dataset_name)
    return EvaluationSplit(split, raw, objective)


@torch.no_grad()
def measure_split(
    classifier, processor, prepared: EvaluationSplit, batch_size: int = 64
) -> tuple[dict[str, Any], np.ndarray | None]:
    """The objective's metrics of `classifier` on the prepared split through `processor` (whole images, or
    native-aspect batches when it has `max_num_patches`, packed when it has `packed_sequence_length`), as `<split>_*`
    with `<split>_loss`, `<split>_tokens_per_image` (the mean number of patches an image was seen as) and the
    confusion matrix (rows: true class, columns: predicted; None for multi-label data)."""
    split, objective = prepared.name, prepared.objective
    evaluation = objective.eval_transform(processor, classifier.config)  # on train too: no augmentation is measured
    data = apply_transforms(prepared.raw, evaluation, evaluation)[split]
    device = next(classifier.parameters()).device
    packed = getattr(processor, "packed_sequence_length", None)  # one example per image, packed here as in training
    logits, targets, tokens = [], [], []
    for start in range(0, len(data), batch_size):
        batch = data[start : start + batch_size]  # the processor runs once per batch (`with_transform`)
        if packed is not None:
            batch = pack_native_batch(batch, packed)
        inputs = model_inputs(batch, device)
        logits.append(classifier(**inputs).logits.float().cpu())
        targets.append(batch["labels"])
        tokens.append(tokens_per_image(inputs, classifier.config.patch_size))
    predictions, references = torch.cat(logits).numpy(), torch.cat(targets).numpy()
    measured = objective.compute_metrics((predictions, references))
    metrics: dict[str, Any] = {f"{split}_{key}": value for key, value in measured.items()}
    metrics[f"{split}_loss"] = objective.loss(predictions, references)
    metrics[f"{split}_samples"] = len(references)
    metrics[f"{split}_tokens_per_image"] = float(torch.cat(tokens).mean())
    confusion = None
    if references.ndim == 1:
        classes = classifier.config.num_labels
        confusion = np.zeros((classes, classes), dtype=np.int64)
        np.add.at(confusion, (references, predictions.argmax(-1)), 1)
    return metrics, confusion


def check_classes(config: Any, id2label: dict[int, str], dataset_name: str) -> None:
    """A checkpoint's head is evaluated as it is: its classes must be the data set's (numbered alike: see
    `evaluation_split`, which maps the data set's labels to the model's ids by name). A head saved without class
    names (transformers' LABEL_0, LABEL_1, ...) is taken by id when it has as many classes as the data set."""
    model_names = [config.id2label[i] for i in range(config.num_labels)]
    data_names = [id2label[i] for i in range(len(id2label))]
    unnamed = model_names == [f"LABEL_{i}" for i in range(config.num_labels)]  # transformers' default: no names saved
    if model_names != data_names and not (unnamed and len(model_names) == len(data_names)):
        raise ValueError(
            f"The model's classes {model_names} are not those of {dataset_name!r} ({data_names}): its head can only "
            "be evaluated on the classes it was trained for. Fine-tune it on this data set first (hf-vit-finetune)."
        )


def evaluate_saved_model(
    model: str | os.PathLike,
    dataset_name: str,
    split: str | None = None,
    output_dir: str | os.PathLike | None = None,
    source: DataSource | None = None,
    max_num_patches: int | None = None,
    patch_size: int | None = None,
) -> dict[str, Any]:
    """`model` (`max_num_patches`, `patch_size`: as for `load_model`) measured on `split` of `dataset_name` (`source`:
    its columns and splits when not the defaults; a run's own data set on the run's splits, `recorded_source`), the
    results written to `output_dir` by `write_evaluation`."""
    source = recorded_source(model, source or DataSource(dataset_name=dataset_name))
    classifier, processor = load_model(model, patch_size, max_num_patches)
    metrics, confusion = measure_split(classifier, processor, evaluation_split(classifier.config, source, split))
    split = next(key for key in metrics if key.endswith("_samples")).removesuffix("_samples")
    served = {"patch_size": classifier.config.patch_size, "max_num_patches": processor.max_num_patches}
    metrics = {"model": os.fspath(model), "dataset_name": dataset_name, "split": split, **served, **metrics}
    metrics = with_per_class(metrics, split, confusion, classifier.config.id2label)
    if output_dir is not None:
        write_evaluation(Path(output_dir), split, metrics, confusion, classifier.config.id2label)
    return metrics


def per_class_metrics(confusion: np.ndarray, names: list[str]) -> dict[str, dict[str, float | int]]:
    """Each class's precision, recall, F1 and support (its true images) from the confusion matrix (rows: true class,
    columns: predicted); a ratio with nothing to divide by is 0, as scikit-learn's `zero_division=0` gives it."""
    hits = np.diag(confusion).astype(np.float64)
    predicted, support = confusion.sum(0), confusion.sum(1)
    precision = np.divide(hits, predicted, out=np.zeros_like(hits), where=predicted > 0)
    recall = np.divide(hits, support, out=np.zeros_like(hits), where=support > 0)
    both = precision + recall
    f1 = np.divide(2 * precision * recall, both, out=np.zeros_like(hits), where=both > 0)
    return {
        name: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(n)}
        for name, p, r, f, n in zip(names, precision, recall, f1, support)
    }


def with_per_class(metrics: dict[str, Any], split: str, confusion: np.ndarray | None, id2label: dict) -> dict:
    """`metrics` with `<split>_per_class` (`per_class_metrics`) and `<split>_confusion_matrix` (rows: true class,
    columns: predicted, in the order of `<split>_classes`) for single-label data."""
    if confusion is None:
        return metrics
    names = [id2label[i] for i in range(len(confusion))]
    return {
        **metrics,
        f"{split}_classes": names,
        f"{split}_per_class": per_class_metrics(confusion, names),
        f"{split}_confusion_matrix": confusion.tolist(),
    }


def per_class_table(metrics: dict[str, Any], split: str, max_matrix_classes: int = 20) -> str | None:
    """The per-class metrics and the confusion matrix of `with_per_class` as a compact text table (the matrix up to
    `max_matrix_classes` classes; beyond, in the JSON only); None for data without them."""
    per_class = metrics.get(f"{split}_per_class")
    if not per_class:
        return None
    names = list(per_class)
    width = max(5, *(len(name) for name in names))
    lines = [f"{'class':<{width}}  precision  recall      f1  support"] + [
        f"{name:<{width}}  {row['precision']:9.4f}  {row['recall']:6.4f}  {row['f1']:6.4f}  {row['support']:7d}"
        for name, row in per_class.items()
    ]
    matrix = metrics[f"{split}_confusion_matrix"]
    if len(names) > max_matrix_classes:
        lines.append(f"confusion matrix ({len(names)} classes): in the JSON, {split}_confusion_matrix")
        return "\n".join(lines)
    cell = max(width, *(len(str(count)) for row in matrix for count in row))
    lines += ["confusion matrix (rows: true class, columns: predicted):"]
    for name, row in [("", names), *zip(names, matrix)]:  # the header row, then a row per true class
        lines.append(f"{name:<{width}}" + "".join(f"  {count:>{cell}}" for count in row))
    return "\n".join(lines)


def write_evaluation(folder: Path, split: str, metrics: dict, confusion, id2label: dict[int, str]) -> list[Path]:
    """The results JSON (and the confusion matrix's PNG when there is one and matplotlib is installed) in `folder`."""
    plot = folder / f"{split}_confusion_matrix.png"
    names = [id2label[i] for i in range(len(confusion))] if confusion is not None else []
    draw = None if confusion is None else (lambda: plot_confusion_matrix(confusion, names, plot))
    return write_results(folder / f"{split}_results.json", metrics, plot, draw)


def write_results(results: Path, data: Any, plot: Path, draw: Any = None, overwrite: bool = False) -> list[Path]:
    """`data` as JSON at `results`, and the PNG `draw()` writes at `plot` (without matplotlib it is skipped and said
    so); existing files of those names are refused unless `overwrite` (a run rewriting its own results)."""
    for path in (results, plot):
        if os.path.lexists(path) and not overwrite:
            raise ValueError(f"{path} exists: pass another output folder (files are never overwritten).")
    results.parent.mkdir(parents=True, exist_ok=True)
    written = [write_beside(results, json.dumps(data, indent=2) + "\n")]
    try:
        written += [draw()] if draw is not None else []
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (pip install 'hf-vit[plot]').", plot.name)
    return written


def plot_confusion_matrix(confusion: np.ndarray, names: list[str], path: Path) -> Path:
    """The confusion matrix (rows: true class, columns: predicted) as a PNG with the counts written in."""
    from ..outputs.plotting import pyplot, save_figure

    plt = pyplot()
    size = max(4.0, 0.45 * len(names) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(confusion, cmap="Blues")
    ax.set(xlabel="predicted", ylabel="true", xticks=range(len(names)), yticks=range(len(names)))
    ax.set_xticklabels(names, rotation=90)
    ax.set_yticklabels(names)
    if len(names) <= 30:
        peak = confusion.max() or 1
        for (row, column), count in np.ndenumerate(confusion):
            color = "white" if count > peak / 2 else "black"
            ax.text(column, row, str(count), ha="center", va="center", color=color, fontsize=8)
    return save_figure(fig, path, title=f"Confusion matrix ({int(confusion.sum())} images)")


def evaluate_checkpoint(
    task: str,
    model_name_or_path: str | None,
    source: DataSource,
    output_dir: str | os.PathLike,
    do_eval: bool,
    do_predict: bool,
    batch_size: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """`--do_train False`: the checkpoint, head and all, measured on the validation (`do_eval`) and test
    (`do_predict`) splits, the results written to `output_dir`; no model is written."""
    if not model_name_or_path:
        raise ValueError(
            f"--do_train False evaluates a saved model: pass --model_name_or_path (hf-vit-{task} trains nothing "
            "without --do_train)."
        )
    splits = [split for split, wanted in (("validation", do_eval), ("test", do_predict)) if wanted]
    if not splits:
        raise ValueError("--do_train False with neither --do_eval nor --do_predict: there is nothing to do.")
    classifier, processor = load_model(model_name_or_path)
    results: dict[str, Any] = {"model": model_name_or_path, "dataset_name": source.dataset_name}
    for split in splits:
        prepared = evaluation_split(classifier.config, source, split, seed)
        metrics, confusion = measure_split(classifier, processor, prepared, batch_size)
        metrics = with_per_class(metrics, split, confusion, classifier.config.id2label)
        write_evaluation(Path(output_dir), split, {**results, "split": split, **metrics}, confusion,
                         classifier.config.id2label)  # fmt: skip
        results.update(metrics)
    shown = ", ".join(f"{key} {value:.4f}" for key, value in results.items() if isinstance(value, float))
    counts = [results.get(f"{split}_samples") for split in splits]
    measured = ", ".join(f"{split} on {images_text(count)}" for split, count in zip(splits, counts))
    message = (
        f"Evaluated {model_name_or_path} as it is (no training, no model written) on "
        f"{source.dataset_name}: {shown} ({measured}). Results in {os.path.abspath(output_dir)}."
    )
    if few := few_images_warning(min(counts)):
        message += f"\nWARNING: {few}"
    print(message, flush=True)  # once: the summary is not logged as well
    return results
