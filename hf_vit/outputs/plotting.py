"""Plots: training curves from `Trainer`'s log history, the section 4.5 analysis figures (the paper's Figures 6 and
7), and the figure set-up and saving other plots share."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from .files import write_beside

logger = logging.getLogger(__name__)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), imported only when a plot is made."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, title: str | None = None, dpi: int = 100) -> Path:
    """Title, lay out and write `fig` to `path` through `write_beside` (parent folders created), then close it."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return write_beside(path, lambda file: fig.savefig(file, dpi=dpi, format=path.suffix.lstrip(".") or "png"))
    finally:
        pyplot().close(fig)


def plot_training_curves(
    log_history: Sequence[dict], path: str | os.PathLike, title: str | None = None
) -> Path | None:
    """A PNG of losses and validation accuracy per step; without matplotlib, one log line."""
    try:
        plt = pyplot()
    except ModuleNotFoundError:
        logger.warning("%s not drawn: matplotlib is not installed (pip install 'hf-vit[plot]').", Path(path).name)
        return None

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry and "step" in entry]
        return [s for s, _ in points], [v for _, v in points]

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    curves = (
        (loss_ax, "loss", None, "train loss"), (loss_ax, "eval_loss", ".", "validation loss"),
        (acc_ax, "eval_accuracy", ".", "validation top-1"), (acc_ax, "eval_top5_accuracy", ".", "validation top-5"),
    )  # fmt: skip
    for ax, key, marker, label in curves:
        if (points := series(key))[0]:
            ax.plot(*points, marker=marker, label=label)
    loss_ax.set(xlabel="step", ylabel="cross-entropy", title="loss")
    _legend_or_note(loss_ax, "no loss logged")
    acc_ax.set(xlabel="step", ylabel="accuracy", title="accuracy", ylim=(0, 1.01))
    _legend_or_note(acc_ax, "no evaluation logged")
    return save_figure(fig, path, title)


def _legend_or_note(ax, note: str) -> None:
    """A legend when the panel has curves, else `note` in its middle: an empty panel says why it is empty."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend()
    else:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="gray")


def _mosaic(tiles, columns: int, gap: int = 1, fill: float = float("nan")):
    """Tiles `(K, h, w[, channels])` laid out row by row on `columns` columns with `gap`-pixel borders of `fill`."""
    import numpy as np

    tiles = np.asarray(tiles, dtype=np.float64)
    count, height, width = tiles.shape[:3]
    rows = -(-count // columns)
    shape = (rows * (height + gap) - gap, columns * (width + gap) - gap) + tiles.shape[3:]
    mosaic = np.full(shape, fill)
    for index, tile in enumerate(tiles):
        top, left = (index // columns) * (height + gap), (index % columns) * (width + gap)
        mosaic[top : top + height, left : left + width] = tile
    return mosaic


def plot_embedding_analysis(
    filter_images,
    similarity,
    distances,
    path: str | os.PathLike,
    patch_size: int | None = None,
    title: str | None = None,
) -> Path:
    """The paper's Figure 7: filters' components, position similarity, attention distances."""
    import numpy as np

    plt = pyplot()
    filter_images, similarity, distances = (
        np.asarray(a, dtype=np.float64) for a in (filter_images, similarity, distances)
    )
    fig, (filters_ax, position_ax, distance_ax) = plt.subplots(1, 3, figsize=(15, 4.8))

    columns = min(7, len(filter_images))
    filters_ax.imshow(_mosaic(filter_images, columns, fill=1.0), interpolation="nearest")
    filters_ax.set_title(f"RGB embedding filters\n(first {len(filter_images)} principal components)")
    filters_ax.axis("off")

    rows, cols = similarity.shape[:2]
    maps = similarity.reshape(rows * cols, rows, cols)
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")  # the gaps between the small maps
    image = position_ax.imshow(_mosaic(maps, cols), cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    # Ticks at the centre of each small map name the patch it belongs to.
    position_ax.set_xticks([c * (cols + 1) + (cols - 1) / 2 for c in range(cols)], [str(c + 1) for c in range(cols)])
    position_ax.set_yticks([r * (rows + 1) + (rows - 1) / 2 for r in range(rows)], [str(r + 1) for r in range(rows)])
    position_ax.set(xlabel="input patch column", ylabel="input patch row", title="position embedding similarity")
    position_ax.tick_params(length=0)
    fig.colorbar(image, ax=position_ax, fraction=0.046, pad=0.04, label="cosine similarity")

    layers, heads = distances.shape
    depth = np.arange(1, layers + 1)
    for head in range(heads):
        distance_ax.scatter(depth, distances[:, head], s=18, label=f"head {head + 1}")
    distance_ax.set(xlabel="network depth (layer)", ylabel="mean attention distance (pixels)")
    distance_ax.set_title("mean attention distance" + (f" (patch {patch_size} px)" if patch_size else ""))
    distance_ax.set_xticks(depth if layers <= 12 else depth[::2])
    distance_ax.set_ylim(bottom=0)
    if heads <= 16:
        distance_ax.legend(fontsize="x-small", ncol=2 if heads > 8 else 1, loc="lower right")
    return save_figure(fig, path, title)


def plot_attention_rollout(
    images,
    maps,
    path: str | os.PathLike,
    captions: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """The paper's Figure 6: each image, its rollout map and the image weighted by it."""
    import numpy as np

    plt = pyplot()
    images, maps = np.asarray(images, dtype=np.float64), np.asarray(maps, dtype=np.float64)
    count = len(images)
    height, width = images.shape[1:3]
    side = 1.8
    figsize = (side * count * max(width / height, 0.5) + 0.8, side * 3 * max(height / width, 0.5) + 0.8)
    fig, axes = plt.subplots(3, count, figsize=figsize, squeeze=False)
    for index in range(count):
        weights = maps[index] / max(maps[index].max(), 1e-12)
        axes[0, index].imshow(images[index], interpolation="nearest")
        axes[1, index].imshow(weights, cmap="inferno", vmin=0, vmax=1, interpolation="nearest")
        axes[2, index].imshow(images[index] * weights[..., None], interpolation="nearest")
        if captions is not None:
            axes[0, index].set_title(captions[index], fontsize="small")
        for ax in axes[:, index]:
            ax.set_xticks([])
            ax.set_yticks([])
    for ax, label in zip(axes[:, 0], ("input", "rollout", "input x rollout")):
        ax.set_ylabel(label)
    return save_figure(fig, path, title)


def plot_compute_dial(
    rows: Sequence[dict], path: str | os.PathLike, metric: str = "accuracy", title: str | None = None
) -> Path:
    """The compute dial: `metric` against tokens per image and against the patch size."""
    plt = pyplot()
    fig, (tokens_ax, patch_ax) = plt.subplots(1, 2, figsize=(10, 4))
    tokens = sorted((row for row in rows if row["series"] == "tokens"), key=lambda row: row["tokens_per_image"])
    if tokens:
        xs, ys = [row["tokens_per_image"] for row in tokens], [row[metric] for row in tokens]
        tokens_ax.plot(xs, ys, marker="o", label=f"patch {tokens[0]['patch_size']}")
        for row, x, y in zip(tokens, xs, ys):
            tokens_ax.annotate(f"K={row['max_num_patches']}", (x, y), textcoords="offset points", xytext=(4, -10),
                               fontsize="x-small")  # fmt: skip
        tokens_ax.set_xscale("log", base=2)
        tokens_ax.set_xticks(xs, [f"{x:.3g}" for x in xs], fontsize="small")
        tokens_ax.minorticks_off()
    tokens_ax.set(xlabel="tokens per image (mean patches)", ylabel=metric, title="native aspect ratio (NaFlex)")
    tokens_ax.set_ylim(0, 1.01)
    _legend_or_note(tokens_ax, "not measured")
    patches = sorted((row for row in rows if row["series"] == "patch_size"), key=lambda row: row["patch_size"])
    if patches:
        xs, ys = [row["patch_size"] for row in patches], [row[metric] for row in patches]
        patch_ax.plot(xs, ys, marker="o", label="whole images" if patches[0]["max_num_patches"] is None else
                      f"at most {patches[0]['max_num_patches']} patches")  # fmt: skip
        for row, x, y in zip(patches, xs, ys):
            patch_ax.annotate(f"{row['tokens_per_image']:g} tokens", (x, y), textcoords="offset points",
                              xytext=(4, -10), fontsize="x-small")  # fmt: skip
        patch_ax.set_xticks(xs)
    patch_ax.set(xlabel="patch size (pixels)", ylabel=metric, title="patch size (FlexiViT)", ylim=(0, 1.01))
    _legend_or_note(patch_ax, "not measured")
    return save_figure(fig, path, title)
