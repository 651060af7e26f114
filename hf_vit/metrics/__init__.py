"""Evaluation metrics shipped with `hf_vit`, loadable without network access.

`load_accuracy()` loads the local `evaluate` module in `hf_vit/metrics/accuracy/` by path, so it never contacts the
Hugging Face Hub (it works with `HF_HUB_OFFLINE=1`). `compute_metrics` plugs it into `transformers.Trainer`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import evaluate

ACCURACY_PATH = str(Path(__file__).resolve().parent / "accuracy")  # the folders of the local metric modules
MULTILABEL_PATH = str(Path(__file__).resolve().parent / "multilabel")

FEW_IMAGES = 50
"""Below this many images a measured figure is said with a warning: one image moves an accuracy by over 2 points."""


def load_accuracy(path: str = ACCURACY_PATH, **kwargs) -> evaluate.EvaluationModule:
    """Return `evaluate.load(path, **kwargs)` of a local metric module: top-1 and top-k accuracy by default,
    `MULTILABEL_PATH` for mean average precision and F1."""
    import evaluate  # imported here: `import evaluate` takes seconds (it imports transformers' pipelines)

    return evaluate.load(path, **kwargs)


load_multilabel = functools.partial(load_accuracy, MULTILABEL_PATH)


@functools.cache
def _metric(path: str) -> evaluate.EvaluationModule:
    """The metric module at `path`, loaded once per process for `compute_metrics`."""
    return load_accuracy(path, keep_in_memory=True)


def compute_metrics(eval_pred) -> dict[str, float]:
    """Trainer `compute_metrics`: `{"accuracy", "top5_accuracy"}` from logits [N, C] and label ids [N]; for
    multi-label classification (multi-hot labels [N, C]), `{"mean_average_precision", "f1_micro", "f1_macro"}`.

    `top5_accuracy` is reported only when C >= 5. `eval_pred` is a `transformers.EvalPrediction` (or a
    `(predictions, label_ids)` pair); when the model returns several outputs, the first one is taken as the logits.
    """
    logits, labels = eval_pred[0], eval_pred[1]
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"compute_metrics expects logits of shape [N, C], got shape {logits.shape}")
    if np.ndim(labels) == 2:
        labels = np.asarray(labels).round().astype(np.int64)
        return _metric(MULTILABEL_PATH).compute(predictions=logits, references=labels)
    top_k = (1, 5) if logits.shape[1] >= 5 else (1,)
    logits, labels = _keep_top_classes(logits, np.asarray(labels, dtype=np.int64), max(top_k))
    return _metric(ACCURACY_PATH).compute(predictions=logits, references=labels, top_k=top_k)


def _keep_top_classes(logits: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Shrink [N, C] logits to [N, k + 1] without changing any top-j accuracy for j <= k.

    Each row keeps its k best classes (by score, ties to the lower id) plus the label's class, or the (k + 1)-th best
    when the label is among the k best; kept columns stay in class-id order, so ties break as before. This keeps
    the metric fast for many classes (it copies every score through Python lists).
    """
    if logits.shape[1] <= k + 1:
        return logits, labels
    kept = np.argsort(-logits, axis=1, kind="stable")[:, : k + 1]
    missed = ~(kept[:, :k] == labels[:, None]).any(axis=1)
    kept[missed, k] = labels[missed]
    kept.sort(axis=1)
    return np.take_along_axis(logits, kept, axis=1), (kept == labels[:, None]).argmax(axis=1)


def images_text(count: int | None) -> str:
    """The number of images a figure was measured on, as the summary, the card and evaluate say it."""
    return "images not counted" if count is None else f"{count} image{'' if count == 1 else 's'}"


def few_images_warning(count: int | None) -> str | None:
    """One line for a figure measured on fewer than `FEW_IMAGES` images; None otherwise."""
    if not count or count >= FEW_IMAGES:  # none counted, or enough
        return None
    return (
        f"measured on only {count} images: one image more or less right moves an accuracy by {100 / count:.1f} "
        f"points, so it tells little; hold out {FEW_IMAGES} or more images for a figure to compare models by."
    )
