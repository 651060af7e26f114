import socket
from pathlib import Path

import numpy as np
import pytest
from transformers import EvalPrediction

from hf_vit.metrics import ACCURACY_PATH, compute_metrics, load_accuracy


@pytest.fixture(scope="module")
def accuracy():
    return load_accuracy(keep_in_memory=True)


def _top_k_by_hand(scores, labels, k):
    """Fraction of rows whose label is among the k best classes (stable sort: ties go to the lower class id)."""
    best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float(np.mean([label in row for row, label in zip(best, labels)]))


def test_top1_from_class_ids(accuracy):
    predictions, references = [0, 1, 2, 2, 1, 0, 3], [0, 1, 1, 2, 1, 2, 3]
    assert accuracy.compute(predictions=predictions, references=references) == {"accuracy": 5 / 7}
    rng = np.random.default_rng(0)
    predictions, references = rng.integers(0, 4, 500), rng.integers(0, 4, 500)
    result = accuracy.compute(predictions=predictions, references=references)
    assert result == {"accuracy": pytest.approx(np.mean(predictions == references))}


def test_top_k_from_logits(accuracy):
    rng = np.random.default_rng(1)
    logits, labels = rng.standard_normal((400, 10)), rng.integers(0, 10, 400)
    result = accuracy.compute(predictions=logits, references=labels, top_k=(1, 3, 5))
    assert set(result) == {"accuracy", "top3_accuracy", "top5_accuracy"}
    assert result["accuracy"] == pytest.approx(np.mean(logits.argmax(1) == labels))
    for k in (3, 5):
        assert result[f"top{k}_accuracy"] == pytest.approx(_top_k_by_hand(logits, labels, k))
    assert 0 < result["accuracy"] < result["top3_accuracy"] < result["top5_accuracy"] < 1
    assert accuracy.compute(predictions=logits, references=labels) == {
        "accuracy": result["accuracy"],
        "top5_accuracy": result["top5_accuracy"],
    }
    assert accuracy.compute(predictions=logits, references=labels, top_k=2) == {
        "top2_accuracy": pytest.approx(_top_k_by_hand(logits, labels, 2))
    }


def test_small_hand_example_and_ties(accuracy):
    scores = [[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.4, 0.4, 0.2]]
    # row 0: label 2 is 2nd; row 1: label 1 is 3rd; row 2: tie between 0 and 1, broken towards 0 like argmax
    assert accuracy.compute(predictions=scores, references=[2, 1, 1], top_k=(1, 2, 3)) == {
        "accuracy": 0.0,
        "top2_accuracy": pytest.approx(2 / 3),
        "top3_accuracy": 1.0,
    }
    assert accuracy.compute(predictions=scores, references=[1, 0, 0]) == {"accuracy": 1.0}  # C < 5: no top-5
    rng = np.random.default_rng(2)
    logits, labels = rng.integers(0, 3, (300, 8)).astype(float), rng.integers(0, 8, 300)  # many ties
    result = accuracy.compute(predictions=logits, references=labels)
    assert result["accuracy"] == pytest.approx(np.mean(logits.argmax(1) == labels))
    assert result["top5_accuracy"] == pytest.approx(_top_k_by_hand(logits, labels, 5))


def test_add_batch_then_compute(accuracy):
    rng = np.random.default_rng(3)
    logits, labels = rng.standard_normal((60, 6)), rng.integers(0, 6, 60)
    for start in range(0, 60, 25):
        accuracy.add_batch(predictions=logits[start : start + 25], references=labels[start : start + 25])
    assert accuracy.compute(top_k=(1, 5)) == accuracy.compute(predictions=logits, references=labels)


def test_invalid_top_k(accuracy):
    with pytest.raises(ValueError, match="scores or logits"):
        accuracy.compute(predictions=[0, 1], references=[0, 1], top_k=(1, 5))
    with pytest.raises(ValueError, match="number of classes"):
        accuracy.compute(predictions=[[0.2, 0.8]], references=[1], top_k=(1, 5))


@pytest.mark.parametrize("num_classes", [3, 5, 50, 1000])
def test_compute_metrics_for_trainer(num_classes):
    rng = np.random.default_rng(num_classes)
    logits = rng.standard_normal((500, num_classes)).astype(np.float32)
    logits[:100] = np.round(logits[:100])  # ties, which must break as in argmax
    labels = rng.integers(0, num_classes, 500)
    logits[np.arange(500), labels] += rng.uniform(0, 3, 500).astype(np.float32)  # labels at all kinds of ranks
    result = compute_metrics(EvalPrediction(predictions=logits, label_ids=labels))
    expected = {"accuracy": pytest.approx(np.mean(logits.argmax(1) == labels))}
    if num_classes >= 5:
        expected["top5_accuracy"] = pytest.approx(_top_k_by_hand(logits, labels, 5))
    assert result == expected
    assert compute_metrics(((logits, np.zeros(3)), labels)) == result  # extra model outputs are ignored


def test_load_accuracy_offline(tmp_path, monkeypatch):
    """With the offline switches on, an empty module cache and every network connection refused, it still loads."""
    import datasets
    import evaluate
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)
    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path / "modules")

    def refuse(*args, **kwargs):
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    metric = load_accuracy(cache_dir=str(tmp_path / "metrics"))
    assert metric.compute(predictions=[[0.1, 0.9], [0.8, 0.2]], references=[1, 1]) == {"accuracy": 0.5}
    copied = list((tmp_path / "modules").rglob("accuracy.py"))
    assert len(copied) == 1 and copied[0].read_text() == (Path(ACCURACY_PATH) / "accuracy.py").read_text()


def _average_precision(scores, truth):
    """AP of one class, written out: the mean over positives of the precision at their rank (no tied scores)."""
    order = np.argsort(-scores)
    hits = truth[order]
    precision_at = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    return precision_at[hits == 1].mean()


def test_multilabel_metrics_against_a_written_out_computation():
    from hf_vit.metrics import compute_metrics

    rng = np.random.default_rng(0)
    truth = (rng.random((40, 5)) < 0.3).astype(np.int64)
    truth[:, 4] = 0  # a class no example has: left out of the mean average precision
    logits = rng.normal(size=(40, 5)) + 2 * truth
    result = compute_metrics((logits, truth.astype(np.float32)))  # multi-hot labels as the model's float targets
    expected_map = np.mean([_average_precision(logits[:, c], truth[:, c]) for c in range(4)])
    assert result["mean_average_precision"] == pytest.approx(expected_map)
    predicted = logits > 0  # sigmoid > 0.5
    tp, fp, fn = (predicted & (truth == 1)).sum(), (predicted & (truth == 0)).sum(), (~predicted & (truth == 1)).sum()
    assert result["f1_micro"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert set(result) == {"mean_average_precision", "f1_micro", "f1_macro"}


def test_multilabel_metrics_without_a_positive_label_give_nan_not_an_error():
    """A small validation split where no image has any class: the run must go on (it raised after the first epoch)."""
    from hf_vit.metrics import compute_metrics

    logits = np.random.default_rng(1).normal(size=(6, 3))
    truth = np.zeros((6, 3), dtype=np.float32)
    result = compute_metrics((logits, truth))
    assert np.isnan(result["mean_average_precision"])
    predicted = (logits > 0).sum()
    assert result["f1_micro"] == pytest.approx(0.0) and predicted > 0  # every predicted class is a false positive
