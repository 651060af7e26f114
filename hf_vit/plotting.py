"""Plots: training curves from `Trainer`'s log history, and the figure set-up and saving other plots share."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), imported only when a plot is made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, title: str | None = None, dpi: int = 100) -> Path:
    """Title, lay out and write `fig` to `path` (parent folders created), then close it.

    The figure is written beside `path` and renamed over it: a failed write (a full disk) leaves the old file or
    none, never a truncated one.
    """
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        fig.savefig(partial, dpi=dpi, format=path.suffix.lstrip(".") or "png")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
        pyplot().close(fig)
    return path


def plot_training_curves(log_history: Sequence[dict], path: str | os.PathLike, title: str | None = None) -> Path:
    """Write a PNG with the training and validation loss (left) and the validation accuracy (right) per step."""
    plt = pyplot()

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry and "step" in entry]
        return [s for s, _ in points], [v for _, v in points]

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("loss", "train loss"), ("eval_loss", "validation loss")):
        steps, values = series(key)
        if steps:
            loss_ax.plot(steps, values, marker="." if key == "eval_loss" else None, label=label)
    loss_ax.set(xlabel="step", ylabel="cross-entropy", title="loss")
    _legend_or_note(loss_ax, "no loss logged")
    for key, label in (("eval_accuracy", "top-1"), ("eval_top5_accuracy", "top-5")):
        steps, values = series(key)
        if steps:
            acc_ax.plot(steps, values, marker=".", label=f"validation {label}")
    acc_ax.set(xlabel="step", ylabel="accuracy", title="accuracy", ylim=(0, 1.01))
    _legend_or_note(acc_ax, "no evaluation logged")
    return save_figure(fig, path, title)


def _legend_or_note(ax, note: str) -> None:
    """A legend when the panel has curves, else `note` in its middle: an empty panel says why it is empty."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="gray")
