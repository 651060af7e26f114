"""Multi-label classification metrics as a local `evaluate` metric module: mean average precision and F1.

Load it offline with `hf_vit.metrics.load_multilabel()` (or `evaluate.load("<path to this directory>")`).
This file is parsed by `evaluate`, which reads its imports line by line: keep one `import` statement per line.
"""

import datasets
import evaluate
import numpy as np
from sklearn.metrics import average_precision_score, f1_score

_DESCRIPTION = """
For multi-label classification, where each example has any number of the C classes. Mean average precision (mAP) is
the mean over classes of the average precision of ranking the examples by that class's score (classes without a
positive example are left out, as their precision is undefined; with no positive example at all, as in a small
validation split, it is NaN, not an error, so that a training run goes on). F1 compares the predicted label sets, a
class being predicted when its score is above `threshold` (0 for logits: a sigmoid probability above 0.5),
micro-averaged (over all example-class pairs) and macro-averaged (the mean of the classes' F1).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` or `np.ndarray`): scores or logits, shape [N, C].
    references (`list` or `np.ndarray`): multi-hot reference labels, shape [N, C], 0 or 1.
    threshold (`float`, *optional*, defaults to 0.0): scores above it count as predicted (0 for logits).

Returns:
    `dict`: `"mean_average_precision"`, `"f1_micro"`, `"f1_macro"`, each a float in [0, 1] (the mean average
    precision is NaN when no reference is positive).

Examples:
    >>> metric = hf_vit.metrics.load_multilabel()
    >>> metric.compute(predictions=[[2.0, -1.0], [-3.0, 0.5]], references=[[1, 0], [0, 1]])
    {'mean_average_precision': 1.0, 'f1_micro': 1.0, 'f1_macro': 1.0}
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MultiLabel(evaluate.Metric):
    """Mean average precision and F1 for multi-label classification."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.List(datasets.Value("float64")),
                    "references": datasets.List(datasets.Value("int64")),
                }
            ),
        )

    def _compute(self, predictions, references, threshold=0.0) -> dict:
        scores = np.asarray(predictions, dtype=np.float64)
        truth = np.asarray(references, dtype=np.int64)
        if scores.ndim != 2 or scores.shape != truth.shape:
            raise ValueError(f"predictions {scores.shape} and references {truth.shape} must both be [N, C]")
        if not np.isin(truth, (0, 1)).all():
            raise ValueError("references must be multi-hot: 0 or 1 for every class")
        present = truth.sum(axis=0) > 0
        # Undefined without a positive label: NaN (as for an empty class in the mean), not an error that would end a
        # training run at its first evaluation.
        mean_ap = (
            average_precision_score(truth[:, present], scores[:, present], average="macro")
            if present.any()
            else float("nan")
        )
        predicted = (scores > threshold).astype(np.int64)
        return {
            "mean_average_precision": float(mean_ap),
            "f1_micro": float(f1_score(truth, predicted, average="micro", zero_division=0)),
            "f1_macro": float(f1_score(truth, predicted, average="macro", zero_division=0)),
        }
