"""A saved model's top classes for image files (`predict_files`), as JSON lines or CSV (`write_predictions`)."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..data.transforms import decode_image
from ..flags import positive_int
from ..outputs.files import write_beside
from .loading import check_serving_sizes, load_model, model_inputs, model_source

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}


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
    positive_int(batch_size, "--batch_size", "number of images")
    model_source(model)
    check_serving_sizes(patch_size, max_num_patches)
    files = image_files(images)
    classifier, processor = load_model(model, patch_size, max_num_patches)
    names = classifier.config.id2label
    top_k = min(top_k, classifier.config.num_labels)
    multi_label = classifier.config.problem_type == "multi_label_classification"
    rows = []
    for start in range(0, len(files), batch_size):
        batch = files[start : start + batch_size]
        inputs = model_inputs(processor([decode_image(str(path)) for path in batch], return_tensors="pt"))
        logits = classifier(**inputs).logits.float()
        # independent sigmoids for multi-label models, a softmax otherwise (as `pipeline("image-classification")`)
        best = (logits.sigmoid() if multi_label else logits.softmax(-1)).topk(top_k, dim=-1)
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
        if os.path.lexists(path):
            raise ValueError(f"--output {output} exists: name a new file (it is never overwritten).")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_beside(path, text)
    return text
