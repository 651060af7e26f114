"""A saved model at work without training: its metrics on a data set's split (`evaluate_saved_model`, with a
confusion matrix and a results file) and its top classes for image files (`predict_files`).

Both take what a run or a user has: an hf-vit folder, a foreign checkpoint by Hub id or folder (converted on load),
or a LoRA run's folder (merged on load, see `hf_vit.run.lora`). The evaluation is the run's: the objective's
transforms, collator, metrics and loss (`hf_vit.run.objectives`), on the splits the run would see
(`hf_vit.run.datasets`); the checkpoint's head is used as it is, so its classes must be the data set's.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from transformers.utils import logging as transformers_logging

from ..model.image_processing_vit import VisionTransformerImageProcessor
from ..model.modeling_vit import VisionTransformerForImageClassification
from ..model.resolution import MAX_PATCH_POSITIONS
from .arguments import DataArguments
from .datasets import label_names, load_datasets, reorder_classes
from .evaluation import final_split
from .lora import is_lora_folder, load_lora_model
from .objectives import select_objective
from .transforms import decode_image

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}


def load_model(
    model: str | os.PathLike, patch_size: int | None = None, max_num_patches: int | None = None
) -> tuple[VisionTransformerForImageClassification, Any]:
    """The classifier and image processor saved at `model` (an hf-vit folder, a foreign checkpoint by Hub id or
    folder, or a LoRA run's folder, merged), in eval mode. `patch_size`: the checkpoint loaded at another patch size
    (FlexiViT: `from_pretrained(..., patch_size=)`, the patch embedding resampled by the pseudo-inverse of the
    resize). `max_num_patches`: the processor returns native-aspect batches of at most that many patches per image
    (see `serving_processor`)."""
    check_serving_sizes(patch_size, max_num_patches)
    source = model_source(model)
    try:
        if is_lora_folder(source):
            classifier = load_lora_model(source)
            if patch_size is not None:
                classifier.set_input_size(patch_size=patch_size)
        else:
            resize = {} if patch_size is None else {"patch_size": patch_size}
            verbosity = transformers_logging.get_verbosity()
            transformers_logging.set_verbosity_error()  # a missing head is refused below, in one line
            try:
                classifier, loading = VisionTransformerForImageClassification.from_pretrained(
                    source, output_loading_info=True, **resize
                )
            finally:
                transformers_logging.set_verbosity(verbosity)
            check_has_head(model, classifier.config.num_labels, loading["missing_keys"])
    except ValueError as error:
        if patch_size is None:
            raise
        raise ValueError(f"--patch_size {patch_size}: {error}") from error
    processor = VisionTransformerImageProcessor.from_pretrained(source)
    return classifier.eval(), serving_processor(processor, classifier.config, max_num_patches)


def check_has_head(model: str | os.PathLike, num_labels: int, missing_keys: Iterable[str]) -> None:
    """Refuse a checkpoint without a classification head: loaded as a classifier it would get a fresh random head
    (or, with no classes, give its features as "logits"), whose scores and metrics mean nothing."""
    if num_labels < 1 or any(key.startswith("classifier.") for key in missing_keys):
        raise ValueError(
            f"--model {model} has no classification head (an encoder or backbone checkpoint): predicting or "
            "measuring classes needs a model trained to classify. Fine-tune it on your classes first: "
            f"hf-vit-finetune --model_name_or_path {model} --dataset_name YOUR_IMAGES --output_dir ..."
        )


def check_serving_sizes(patch_size: int | None = None, max_num_patches: int | None = None) -> None:
    """Refuse, by flag, a patch size or a number of patches that is not a positive int."""
    for flag, value in (("--patch_size", patch_size), ("--max_num_patches", max_num_patches)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{flag} must be a positive int, got {value!r}.")
    if max_num_patches is not None and max_num_patches > MAX_PATCH_POSITIONS:
        raise ValueError(
            f"--max_num_patches {max_num_patches} is over the {MAX_PATCH_POSITIONS} patch positions hf-vit takes."
        )


def check_native_model(config: Any) -> None:
    """Refuse, naming `--max_num_patches`, a model that cannot take native-aspect batches."""
    if config.resnet_layers is not None or config.classifier not in ("token", "gap"):
        raise ValueError(
            "--max_num_patches: native-aspect batches need a model without a ResNet stem whose classifier is 'token' "
            f"or 'gap'; this one has resnet_layers={config.resnet_layers}, classifier={config.classifier!r}. Leave "
            "--max_num_patches out: its images are resized to the model's size."
        )


def serving_processor(processor: Any, config: Any, max_num_patches: int | None = None) -> Any:
    """A copy of `processor` that serves `config`'s model: with `max_num_patches` (or the processor's own saved
    field), native-aspect batches of at most that many patches of the model's patch size, each image kept whole (no
    centre crop); else the processor as saved."""
    processor = copy.deepcopy(processor)
    if max_num_patches is not None:
        check_native_model(config)
        processor.max_num_patches, processor.do_center_crop = max_num_patches, False
    if processor.max_num_patches is not None:
        check_native_model(config)
        processor.patch_size = config.patch_size
    return processor


def model_inputs(batch: dict[str, Any], device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The model's inputs in a processed batch: `pixel_values`, and a native-aspect batch's mask and grids."""
    inputs = {key: batch[key] for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes") if key in batch}
    return {key: value.to(device) for key, value in inputs.items()} if device is not None else inputs


def tokens_per_image(inputs: dict[str, torch.Tensor], patch_size: int) -> torch.Tensor:
    """The patches each image of a batch is seen as: its grid's in a native-aspect batch, else the image's."""
    if "spatial_shapes" in inputs:
        return inputs["spatial_shapes"].prod(-1).float().cpu()
    height, width = inputs["pixel_values"].shape[-2:]
    return torch.full((len(inputs["pixel_values"]),), float((height // patch_size) * (width // patch_size)))


def model_source(model: str | os.PathLike) -> str:
    """`model` as a local folder or a Hub id; a path that is neither is refused before anything loads."""
    source = os.fspath(model)
    local = os.path.expanduser(source)
    if os.path.exists(local):
        if not os.path.isdir(local):
            raise ValueError(f"--model {model}: a file, not a model folder (pass the folder holding config.json).")
        return local
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ValueError(f"--model {model}: no such folder (and not a Hugging Face Hub id).")
    return source


def image_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Every image named in `paths`, a folder standing for the images under it (sorted, recursively)."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not inside:
                raise ValueError(f"{path} holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))}).")
            found.extend(inside)
        elif path.is_file():
            found.append(path)
        else:
            raise ValueError(f"{path}: no such image file or folder.")
    return found


def scores(model, logits: torch.Tensor) -> torch.Tensor:
    """The model's class scores: independent sigmoids for multi-label models, a softmax otherwise (as
    `pipeline("image-classification")` gives them)."""
    if model.config.problem_type == "multi_label_classification":
        return logits.float().sigmoid()
    return logits.float().softmax(-1)


@torch.no_grad()
def predict_files(
    model: str | os.PathLike,
    images: Sequence[str | os.PathLike],
    top_k: int = 5,
    batch_size: int = 32,
    max_num_patches: int | None = None,
    patch_size: int | None = None,
) -> list[dict[str, Any]]:
    """Each image's `top_k` classes with their scores, best first: `{"image", "predictions": [{"label", "score"}]}`;
    `max_num_patches` and `patch_size` as for `load_model`."""
    if top_k < 1:
        raise ValueError(f"--top_k must be at least 1, got {top_k}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch_size must be a positive number of images, got {batch_size!r}.")
    model_source(model)
    check_serving_sizes(patch_size, max_num_patches)
    files = image_files(images)
    classifier, processor = load_model(model, patch_size, max_num_patches)
    names = classifier.config.id2label
    top_k = min(top_k, classifier.config.num_labels)
    rows = []
    for start in range(0, len(files), batch_size):
        batch = files[start : start + batch_size]
        inputs = model_inputs(processor([decode_image(str(path)) for path in batch], return_tensors="pt"))
        probabilities = scores(classifier, classifier(**inputs).logits)
        best = probabilities.topk(top_k, dim=-1)
        for path, values, indices in zip(batch, best.values.tolist(), best.indices.tolist()):
            labels = [{"label": names[index], "score": value} for value, index in zip(values, indices)]
            rows.append({"image": str(path), "predictions": labels})
    return rows


def write_predictions(rows: list[dict[str, Any]], output: str | os.PathLike | None = None) -> str:
    """`rows` as JSON lines (one image a line), or as CSV (image, rank, label, score) for a `.csv` `output`; written
    to `output` (a new file: an existing one is refused) and returned."""
    if output is not None and Path(output).suffix.lower() == ".csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["image", "rank", "label", "score"])
        for row in rows:
            for rank, item in enumerate(row["predictions"], 1):
                writer.writerow([row["image"], rank, item["label"], f"{item['score']:.6g}"])
        text = buffer.getvalue()
    else:
        text = "".join(json.dumps(row) + "\n" for row in rows)
    if output is not None:
        path = Path(output)
        if path.suffix.lower() not in (".csv", ".jsonl", ".json"):
            raise ValueError(f"--output {output}: name a .jsonl or .csv file.")
        if path.exists():
            raise ValueError(f"--output {output} exists: name a new file (it is never overwritten).")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text


@dataclass
class EvaluationSplit:
    """A data set's split ready to be measured with any processor: its name, raw examples and objective."""

    name: str
    raw: Any
    objective: Any
    data_args: Any


def evaluation_split(config: Any, data_args: Any, split: str | None = None, seed: int = 0) -> EvaluationSplit:
    """`split` (default: the run's final split, test or else validation) of `data_args`' data set, labelled as the
    classification objective labels it; its classes checked against `config`'s."""
    raw = load_datasets(data_args, seed)
    split = split or final_split(raw)
    if split not in raw:
        raise ValueError(f"--split {split}: the data set {data_args.dataset_name!r} has {', '.join(raw)}.")
    model_names = [config.id2label[i] for i in range(config.num_labels)] if config.id2label else []
    data_names = label_names(raw)
    if data_names != model_names and sorted(data_names) == sorted(model_names):
        raw = reorder_classes(raw, model_names)  # the same classes, numbered as the model numbers them
    wanted = SimpleNamespace(objective="classification", problem_type=None)
    objective = select_objective("finetune", wanted, data_args, raw)
    raw, labels = objective.labels(raw, data_args)
    check_classes(config, labels.id2label, data_args.dataset_name)
    return EvaluationSplit(split, raw, objective, data_args)


@torch.no_grad()
def measure_split(
    classifier, processor, prepared: EvaluationSplit, batch_size: int = 64
) -> tuple[dict[str, Any], np.ndarray | None]:
    """The objective's metrics of `classifier` on the prepared split through `processor` (whole images, or
    native-aspect batches when it has `max_num_patches`), as `<split>_*` with `<split>_loss`,
    `<split>_tokens_per_image` (the mean number of patches an image was seen as) and the confusion matrix (rows: true
    class, columns: predicted; None for multi-label data)."""
    split, objective = prepared.name, prepared.objective
    data = objective.transforms(prepared.raw, prepared.data_args, processor, classifier.config)[split]
    device = next(classifier.parameters()).device
    logits, targets, tokens = [], [], []
    for start in range(0, len(data), batch_size):
        batch = data[start : start + batch_size]  # the processor runs once per batch (`with_transform`)
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


def evaluate_loaded(
    classifier, processor, data_args: Any, split: str | None = None, batch_size: int = 64, seed: int = 0
) -> tuple[dict[str, Any], np.ndarray | None]:
    """The metrics of the objective of `classifier` (single- or multi-label classification) on `split` (default: the
    run's final split, test or else validation) of `data_args`' data set, and the confusion matrix: see
    `measure_split`."""
    prepared = evaluation_split(classifier.config, data_args, split, seed)
    return measure_split(classifier, processor, prepared, batch_size)


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
    data_args: Any = None,
    max_num_patches: int | None = None,
    patch_size: int | None = None,
) -> dict[str, Any]:
    """Evaluate the model at `model` on `split` of `dataset_name` (see `evaluate_loaded`; `max_num_patches` and
    `patch_size` as for `load_model`); with `output_dir`, write `<split>_results.json` and, for single-label data,
    `<split>_confusion_matrix.png` there (matplotlib needed: without it the plot is skipped and said so). Existing
    files of those names are refused, never overwritten."""
    data_args = data_args or DataArguments(dataset_name=dataset_name)
    classifier, processor = load_model(model, patch_size, max_num_patches)
    metrics, confusion = evaluate_loaded(classifier, processor, data_args, split)
    split = next(key for key in metrics if key.endswith("_samples")).removesuffix("_samples")
    served = {"patch_size": classifier.config.patch_size, "max_num_patches": processor.max_num_patches}
    metrics = {"model": os.fspath(model), "dataset_name": dataset_name, "split": split, **served, **metrics}
    if output_dir is not None:
        write_evaluation(Path(output_dir), split, metrics, confusion, classifier.config.id2label)
    return metrics


def write_evaluation(folder: Path, split: str, metrics: dict, confusion, id2label: dict[int, str]) -> list[Path]:
    """The results JSON (and the confusion matrix's PNG when there is one and matplotlib is installed) in `folder`."""
    results = folder / f"{split}_results.json"
    plot = folder / f"{split}_confusion_matrix.png"
    for path in (results, plot):
        if path.exists():
            raise ValueError(f"{path} exists: pass another output folder (files are never overwritten).")
    folder.mkdir(parents=True, exist_ok=True)
    written = [results]
    results.write_text(json.dumps(metrics, indent=2) + "\n")
    if confusion is not None:
        try:
            written.append(plot_confusion_matrix(confusion, [id2label[i] for i in range(len(confusion))], plot))
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


def evaluate_checkpoint(task: str, model_args: Any, data_args: Any, training_args: Any) -> dict[str, Any]:
    """`--do_train False`: the checkpoint `--model_name_or_path`, head and all, measured on the validation split
    (`--do_eval`) and the test split (`--do_predict`); `<split>_results.json` (and the confusion matrix) go to
    `--output_dir`. No model is written."""
    if not model_args.model_name_or_path:
        raise ValueError(
            f"--do_train False evaluates a saved model: pass --model_name_or_path (hf-vit-{task} trains nothing "
            "without --do_train)."
        )
    splits = [split for split, wanted in (("validation", training_args.do_eval), ("test", training_args.do_predict))
              if wanted]  # fmt: skip
    if not splits:
        raise ValueError("--do_train False with neither --do_eval nor --do_predict: there is nothing to do.")
    classifier, processor = load_model(model_args.model_name_or_path)
    results: dict[str, Any] = {"model": model_args.model_name_or_path, "dataset_name": data_args.dataset_name}
    for split in splits:
        metrics, confusion = evaluate_loaded(
            classifier, processor, data_args, split, training_args.per_device_eval_batch_size, training_args.seed
        )
        write_evaluation(Path(training_args.output_dir), split, {**results, "split": split, **metrics}, confusion,
                         classifier.config.id2label)  # fmt: skip
        results.update(metrics)
    shown = ", ".join(f"{key} {value:.4f}" for key, value in results.items() if isinstance(value, float))
    message = (
        f"Evaluated {model_args.model_name_or_path} as it is (no training, no model written) on "
        f"{data_args.dataset_name}: {shown}. Results in {os.path.abspath(training_args.output_dir)}."
    )
    logger.info("%s", message)
    print(message, flush=True)
    return results
