"""Top-1 and top-k classification accuracy as a local `evaluate` metric module.

Load it offline with `hf_vit.metrics.load_accuracy()` (or `evaluate.load("<path to this directory>")`).
This file is parsed by `evaluate`, which reads its imports line by line: keep one `import` statement per line.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Accuracy is the fraction of examples whose reference class is predicted. Given predicted class ids, it is the
top-1 accuracy. Given scores or logits of shape [N, C], the k highest scoring classes of each example are its
top-k predictions, and top-k accuracy is the fraction of examples whose reference is among them (ties are broken
towards the lower class id, as `numpy.argmax` does, so top-1 from scores equals accuracy of `argmax`).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` or `np.ndarray`): either predicted class ids, shape [N], or scores/logits, shape [N, C].
    references (`list` or `np.ndarray` of `int`): reference class ids, shape [N].
    top_k (`int` or sequence of `int`, *optional*): which k to report. Default: `(1,)` for class ids and
        `(1, 5)` for scores, where 5 is left out when C < 5. k > 1 requires scores; k > C is an error.

Returns:
    `dict`: `"accuracy"` for k = 1 and `"top{k}_accuracy"` for every other k, each a float in [0, 1].

Examples:
    >>> accuracy = hf_vit.metrics.load_accuracy()
    >>> accuracy.compute(predictions=[0, 1, 2, 2], references=[0, 1, 1, 2])
    {'accuracy': 0.75}
    >>> accuracy.compute(predictions=[[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]], references=[2, 1], top_k=(1, 2))
    {'accuracy': 0.0, 'top2_accuracy': 0.5}
"""

_CITATION = ""


def _key(k: int) -> str:
    return "accuracy" if k == 1 else f"top{k}_accuracy"


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    """Top-1 accuracy from class ids, top-k accuracy from scores or logits."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            # The first feature set matching the first example is used: class ids, then score vectors.
            features=[
                datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
                datasets.Features(
                    {"predictions": datasets.List(datasets.Value("float64")), "references": datasets.Value("int64")}
                ),
            ],
        )

    def _compute(self, predictions, references, top_k=None) -> dict:
        predictions = np.asarray(predictions)
        references = np.asarray(references, dtype=np.int64)
        if len(references) == 0:
            raise ValueError("accuracy needs at least one prediction/reference pair")
        if predictions.ndim == 1:
            ks = (1,) if top_k is None else _as_tuple(top_k)
            if ks != (1,) * len(ks):
                raise ValueError(f"top_k={top_k} needs scores or logits of shape [N, C], not class ids")
            return {"accuracy": float(np.mean(predictions == references))}

        num_classes = predictions.shape[1]
        ks = tuple(k for k in (1, 5) if k <= num_classes) if top_k is None else _as_tuple(top_k)
        if any(not 1 <= k <= num_classes for k in ks):
            raise ValueError(f"every k in top_k={top_k} must be in [1, {num_classes}] (the number of classes)")
        # Rank of the reference class: classes scoring higher, plus equal-scoring classes with a lower id.
        true_scores = predictions[np.arange(len(references)), references][:, None]
        lower_id = np.arange(num_classes)[None, :] < references[:, None]
        rank = (predictions > true_scores).sum(1) + ((predictions == true_scores) & lower_id).sum(1)
        return {_key(k): float(np.mean(rank < k)) for k in ks}


def _as_tuple(top_k) -> tuple:
    return (int(top_k),) if np.isscalar(top_k) else tuple(int(k) for k in top_k)
