"""The compute dial of one checkpoint: its accuracy against the tokens each image is seen as (native-aspect batches of
at most K patches, NaFlex) and against the patch size (the patch embedding resampled, FlexiViT), measured on a data
set's split at the end of a run (`compute_dial_after_training`) or on demand (`hf-vit-evaluate --max_num_patches
16,64,144`, `--patch_size 8,16,32`); written as `compute_dial.json` and `compute_dial.png`."""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..data.datasets import DataSource
from ..data.transforms import BatchSizes, decode_rgb
from ..flags import parse_sizes
from .evaluate import EvaluationSplit, evaluation_split, measure_split, write_results
from .loading import check_serving_sizes, load_model, serving_processor

logger = logging.getLogger(__name__)

DIAL_JSON, DIAL_PNG = "compute_dial.json", "compute_dial.png"
# Tokens per image measured by default: the square grids 1x1 .. 24x24, as far as the split's images reach.
DEFAULT_TOKEN_COUNTS = (1, 4, 16, 64, 144, 256, 576)
SIZE_SAMPLE = 256  # images whose sizes bound the default token counts


def token_counts_for(prepared: EvaluationSplit, patch_size: int, trained: Sequence[int] = ()) -> list[int]:
    """The tokens per image a run's dial is measured at: `DEFAULT_TOKEN_COUNTS` up to the patches the largest of the
    split's first `SIZE_SAMPLE` images has at its own resolution (more would only upsample it), and the `trained`
    counts."""
    data = prepared.raw[prepared.name]
    largest = 1
    for index in range(min(len(data), SIZE_SAMPLE)):
        width, height = decode_rgb(data[index]["image"], index).size
        largest = max(largest, math.ceil(height / patch_size) * math.ceil(width / patch_size))
    return sorted({count for count in DEFAULT_TOKEN_COUNTS if count <= largest} | set(trained))


def _row(series: str, patch_size: int, max_num_patches: int | None, split: str, metrics: dict) -> dict[str, Any]:
    measured = {key.removeprefix(f"{split}_"): value for key, value in metrics.items()}
    return {"series": series, "patch_size": patch_size, "max_num_patches": max_num_patches, "split": split, **measured}


def measure_dial(
    classifier,
    processor,
    prepared: EvaluationSplit,
    token_counts: Sequence[int] = (),
    patch_sizes: Sequence[int] = (),
    max_num_patches: int | None = None,
    batch_size: int = 64,
) -> list[dict[str, Any]]:
    """One row per setting, each the objective's metrics on the prepared split with `tokens_per_image`: series
    "tokens", the model at its own patch size on native-aspect batches of each of `token_counts` patches; series
    "patch_size", the model at each of `patch_sizes` on whole images of the processor's size (on native-aspect
    batches of `max_num_patches` when given)."""
    for count in (max_num_patches, *token_counts):
        check_serving_sizes(None, count)
    for size in patch_sizes:
        check_serving_sizes(size, None)
    config, rows = classifier.config, []
    for count in token_counts:  # serving_processor refuses a model that cannot take native-aspect batches
        metrics, _ = measure_split(classifier, serving_processor(processor, config, count), prepared, batch_size)
        rows.append(_row("tokens", config.patch_size, count, prepared.name, metrics))
    # whole images of the processor's size (not packed), unless a number of patches is given
    whole = processor.with_options(max_num_patches=None, packed_sequence_length=None)
    for size in patch_sizes:
        resized = classifier
        if size != config.patch_size:  # a copy, its patch embedding resampled by the pseudo-inverse of the resize
            resized = copy.deepcopy(classifier)
            try:
                resized.set_input_size(patch_size=size)
            except ValueError as error:
                raise ValueError(f"--patch_size {size}: {error}") from error
        served = serving_processor(whole, resized.config, max_num_patches)
        metrics, _ = measure_split(resized, served, prepared, batch_size)
        rows.append(_row("patch_size", size, max_num_patches, prepared.name, metrics))
    return rows


def quality_metric(row: dict[str, Any]) -> str:
    """The metric a dial plots: top-1 accuracy, or mean average precision for multi-label models."""
    return "accuracy" if "accuracy" in row else "mean_average_precision"


def write_compute_dial(
    rows: list[dict[str, Any]], folder: str | os.PathLike, title: str | None = None, overwrite: bool = False
) -> list[Path]:
    """`compute_dial.json` (the rows) and `compute_dial.png` (with matplotlib; without it the plot is skipped and said
    so) in `folder`; existing files are refused unless `overwrite` (a run rewriting its own results)."""
    folder = Path(folder)

    def draw() -> Path:
        from ..outputs.plotting import plot_compute_dial

        return plot_compute_dial(rows, folder / DIAL_PNG, quality_metric(rows[0]) if rows else "accuracy", title)

    return write_results(folder / DIAL_JSON, rows, folder / DIAL_PNG, draw, overwrite)


def evaluate_dial(
    model: str | os.PathLike,
    source: DataSource,
    split: str | None = None,
    output_dir: str | os.PathLike | None = None,
    token_counts: Sequence[int] = (),
    patch_sizes: Sequence[int] = (),
    batch_size: int = 64,
) -> list[dict[str, Any]]:
    """The dial of the checkpoint at `model` on `split` of `source`'s data set, written to `output_dir` when given.
    Several `token_counts` are the tokens series (at the one patch size of `patch_sizes` when it names one, else at the
    model's); several `patch_sizes`, the patch size series (at the one number of patches of `token_counts` when it
    names one, else on whole images)."""
    counts, sizes = list(token_counts), list(patch_sizes)
    if len(counts) < 2 and len(sizes) < 2:
        raise ValueError("A compute dial needs several --max_num_patches or several --patch_size values.")
    for name in (DIAL_JSON, DIAL_PNG) if output_dir is not None else ():
        if (Path(output_dir) / name).exists():  # before any work
            raise ValueError(f"{Path(output_dir) / name} exists: pass another --output_dir (never overwritten).")
    at_patch = sizes[0] if len(sizes) == 1 else None
    at_count = counts[0] if len(counts) == 1 else None
    classifier, processor = load_model(model, at_patch)
    prepared = evaluation_split(classifier.config, source, split)
    rows = measure_dial(
        classifier, processor, prepared, counts if at_count is None else [], sizes if at_patch is None else [],
        at_count, batch_size,
    )  # fmt: skip
    if output_dir is not None:
        write_compute_dial(rows, output_dir, f"Compute dial ({Path(os.fspath(model)).name}, {prepared.name} split)")
    return rows


def compute_dial_after_training(
    model,
    processor,
    source: DataSource,
    sizes: BatchSizes,
    output_dir: str | os.PathLike,
    batch_size: int = 64,
    seed: int = 0,
) -> Path | None:
    """A run's dial, when it trained with native-aspect batches (`--max_num_patches`, `--seq_lens`: the tokens series
    at `token_counts_for`) or with patch sizes drawn per batch (`--patch_sizes`: the patch size series, whole images):
    measured on the run's final split of `source` and written to `output_dir`; the PNG's path (None when the run
    trained neither way, or the plot could not be drawn)."""
    seq_lens = parse_sizes(sizes.seq_lens, "--seq_lens") or []
    patch_sizes = parse_sizes(sizes.patch_sizes, "--patch_sizes") or []
    native = [count for count in [sizes.max_num_patches, *seq_lens] if count is not None]
    if not native and not patch_sizes:
        return None
    if source.streaming:
        logger.warning("No compute dial: it measures an in-memory split, and this run streamed its data.")
        return None
    if hasattr(model, "merge_and_unload"):  # a LoRA model: the dial of the merged weights, on a copy
        model = copy.deepcopy(model).merge_and_unload()
    model.eval()
    prepared = evaluation_split(model.config, source, None, seed)
    patch = model.config.patch_size
    counts = token_counts_for(prepared, patch, native) if native else []
    rows = measure_dial(model, processor, prepared, counts, sorted(set(patch_sizes)), batch_size=batch_size)
    written = write_compute_dial(rows, output_dir, "Compute dial", overwrite=True)
    for row in rows:
        logger.info(
            "Compute dial: patch %d, %s tokens per image (%.1f on average): %s %.4f", row["patch_size"],
            row["max_num_patches"] or "whole images", row["tokens_per_image"], quality_metric(row),
            row[quality_metric(row)],
        )  # fmt: skip
    return written[-1] if written[-1].suffix == ".png" else None
