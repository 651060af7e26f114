"""Mixup and CutMix of a training batch, with timm's meanings (`timm.data.Mixup`, batch mode).

For each batch, with probability `prob`, the batch is mixed with itself reversed (image `i` with image `N-1-i`):

* Mixup (`mixup_alpha > 0`): `x = lam * x + (1 - lam) * x.flip(0)`, `lam ~ Beta(mixup_alpha, mixup_alpha)`;
* CutMix (`cutmix_alpha > 0`): a box of image `N-1-i` is pasted into image `i`. The box has the sides
  `int(H * sqrt(1 - lam))` x `int(W * sqrt(1 - lam))`, `lam ~ Beta(cutmix_alpha, cutmix_alpha)`, centred on a
  random pixel and clipped to the image (or, with `cutmix_minmax`, sides drawn uniformly between those fractions of
  the image's); `lam` is then corrected to the share of the image the box leaves, `1 - box area / image area`;
* both: CutMix with probability `switch_prob`, Mixup otherwise.

A native-aspect batch (`spatial_shapes` given: `pixel_values` (N, K, P*P*C), each image's patches first, row by row
of its grid) is cut in patches, on the images' grids: image `i`'s box is a box of whole patches of the grid that it
and image `N-1-i` share (the smaller rows and columns of the two, from the top left), its sides from `lam` (or
`cutmix_minmax`) as above but rounded to whole patches (a grid has few: flooring would leave most boxes empty), the
box of `lam` centred on a random patch; the partner's patches at the same grid places replace `i`'s, and `i`'s `lam`
is corrected to the share of its own patches the box leaves. Each image draws its own box, so the targets are mixed
per image. Mixup there blends, on the same shared grid, image `i`'s patches with the partner's at the same grid places
(`lam * x + (1 - lam) * partner`); `i`'s patches outside it and its padding are kept, so no pixel is blended with
padding, and `i`'s `lam` becomes `1 - (1 - lam) * shared patches / its patches`, the share of it that stayed its own.

The targets are mixed with the same `lam`: `lam * y + (1 - lam) * y.flip(0)`, where `y` is the one-hot (or for
multi-label data the multi-hot) target with label smoothing `s`: `1 - s + s / C` for a class of the image, `s / C`
for the others. A batch that is not mixed keeps its images and gets the smoothed targets (`lam = 1`).

The random numbers come from a generator the caller seeds (`mixing_seed(seed, step, micro_batch)`): every process of
a run draws the same `lam` and box for the same step, and a resumed run draws what the uninterrupted run drew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..seeding import seeded_int


@dataclass(frozen=True)
class Mixing:
    """The mixing of a run's training batches (timm's `Mixup` arguments)."""

    num_classes: int
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    cutmix_minmax: tuple[float, float] | None = None
    prob: float = 1.0
    switch_prob: float = 0.5
    label_smoothing: float = 0.0
    multi_label: bool = False  # targets are multi-hot vectors [N, C], learnt with sigmoid cross-entropy

    def __post_init__(self) -> None:
        for flag, value in (("--mixup_alpha", self.mixup_alpha), ("--cutmix_alpha", self.cutmix_alpha)):
            if not value >= 0:
                raise ValueError(f"{flag} must be 0 (off) or positive (a Beta distribution's alpha), got {value}.")
        for flag, value in (("--mixup_prob", self.prob), ("--mixup_switch_prob", self.switch_prob)):
            if not 0 <= value <= 1:
                raise ValueError(f"{flag} must be a probability in [0, 1], got {value}.")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"--label_smoothing_factor must be in [0, 1), got {self.label_smoothing}.")
        if self.cutmix_minmax is not None:
            if len(self.cutmix_minmax) != 2:
                raise ValueError(f"--cutmix_minmax takes two fractions (min max), got {list(self.cutmix_minmax)}.")
            low, high = self.cutmix_minmax
            if not 0 < low < high <= 1:
                raise ValueError(
                    f"--cutmix_minmax takes two fractions of the image side, 0 < min < max <= 1, got {low} {high}."
                )
        if self.num_classes < 2:
            raise ValueError(f"Mixing targets needs at least two classes, got {self.num_classes}.")

    @property
    def uses_cutmix(self) -> bool:
        # As in timm, a box size range turns CutMix on (with alpha 1 for lam, which the box then replaces).
        return self.cutmix_alpha > 0 or self.cutmix_minmax is not None

    @property
    def enabled(self) -> bool:
        return (self.mixup_alpha > 0 or self.uses_cutmix) and self.prob > 0


def mixing_seed(seed: int, step: int, micro_batch: int = 0) -> int:
    """The seed of the mixing of optimiser step `step`'s `micro_batch`-th batch in a run with `seed`."""
    return seeded_int("mix", seed, step, micro_batch)


def draw_lambda(mixing: Mixing, rng: np.random.Generator) -> tuple[float, bool]:
    """(lam, whether CutMix) of one batch: lam = 1 when the batch is not mixed."""
    if not mixing.enabled or rng.random() >= mixing.prob:
        return 1.0, False
    cutmix_alpha = mixing.cutmix_alpha if mixing.cutmix_alpha > 0 else 1.0
    if mixing.mixup_alpha > 0 and mixing.uses_cutmix:
        use_cutmix = bool(rng.random() < mixing.switch_prob)
    else:
        use_cutmix = mixing.uses_cutmix
    alpha = cutmix_alpha if use_cutmix else mixing.mixup_alpha
    return float(rng.beta(alpha, alpha)), use_cutmix


def cutmix_box(
    height: int, width: int, lam: float, rng: np.random.Generator, minmax: tuple[float, float] | None = None
) -> tuple[tuple[int, int, int, int], float]:
    """The pasted box `(top, bottom, left, right)` (rows top:bottom, columns left:right) and `lam` corrected to
    `1 - box area / image area`."""
    if minmax is not None:
        cut_h = int(rng.integers(int(height * minmax[0]), int(height * minmax[1])))
        cut_w = int(rng.integers(int(width * minmax[0]), int(width * minmax[1])))
        top = int(rng.integers(0, height - cut_h)) if height > cut_h else 0
        left = int(rng.integers(0, width - cut_w)) if width > cut_w else 0
        bottom, right = top + cut_h, left + cut_w
    else:
        ratio = math.sqrt(1.0 - lam)
        cut_h, cut_w = int(height * ratio), int(width * ratio)
        cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
        top, bottom = np.clip([cy - cut_h // 2, cy + cut_h // 2], 0, height).tolist()
        left, right = np.clip([cx - cut_w // 2, cx + cut_w // 2], 0, width).tolist()
    corrected = 1.0 - (bottom - top) * (right - left) / float(height * width)
    return (int(top), int(bottom), int(left), int(right)), corrected


def smooth_targets(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """Float32 [N, C] targets of class ids [N] or multi-hot [N, C] labels, smoothed (see the module docstring)."""
    if labels.ndim == 1:
        hot = torch.zeros(labels.shape[0], num_classes, device=labels.device)
        hot.scatter_(1, labels.long()[:, None], 1.0)
    else:
        hot = labels.float()
    off = smoothing / num_classes
    return hot * (1.0 - smoothing) + off


@torch.no_grad()
def mix_batch(
    pixel_values: torch.Tensor,
    labels: torch.Tensor,
    mixing: Mixing,
    rng: np.random.Generator,
    spatial_shapes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The batch mixed as `mixing` says: (images [N, C, H, W], or a native-aspect batch's patches [N, K, P*P*C] with
    its grids `spatial_shapes` [N, 2]; soft targets [N, classes]; lam, the images' mean where CutMix cut each its own
    box)."""
    targets = smooth_targets(labels, mixing.num_classes, mixing.label_smoothing)
    lam, use_cutmix = draw_lambda(mixing, rng)
    if lam == 1.0:
        return pixel_values, targets, 1.0
    if spatial_shapes is not None:
        pixel_values, lams = mix_patches(pixel_values, spatial_shapes, lam, rng, mixing.cutmix_minmax, use_cutmix)
        lams = lams.to(targets.device)[:, None]
        return pixel_values, targets * lams + targets.flip(0) * (1.0 - lams), float(lams.mean())
    flipped = pixel_values.flip(0)
    if use_cutmix:
        (top, bottom, left, right), lam = cutmix_box(*pixel_values.shape[-2:], lam, rng, mixing.cutmix_minmax)
        pixel_values = pixel_values.clone()
        pixel_values[..., top:bottom, left:right] = flipped[..., top:bottom, left:right]
    else:
        pixel_values = pixel_values * lam + flipped * (1.0 - lam)
    return pixel_values, targets * lam + targets.flip(0) * (1.0 - lam), lam


def patch_box(
    rows: int, cols: int, lam: float, rng: np.random.Generator, minmax: tuple[float, float] | None = None
) -> tuple[int, int, int, int]:
    """A CutMix box `(top, bottom, left, right)` of whole patches in a grid of `rows` x `cols` (module docstring)."""
    if minmax is not None:
        side_h = int(rng.integers(round(rows * minmax[0]), round(rows * minmax[1]) + 1))
        side_w = int(rng.integers(round(cols * minmax[0]), round(cols * minmax[1]) + 1))
        top, left = int(rng.integers(0, rows - side_h + 1)), int(rng.integers(0, cols - side_w + 1))
        return top, top + side_h, left, left + side_w
    ratio = math.sqrt(1.0 - lam)
    side_h, side_w = round(rows * ratio), round(cols * ratio)
    centre_y, centre_x = int(rng.integers(0, rows)), int(rng.integers(0, cols))
    top, left = centre_y - side_h // 2, centre_x - side_w // 2
    return max(top, 0), min(top + side_h, rows), max(left, 0), min(left + side_w, cols)


def mix_patches(
    patches: torch.Tensor,
    spatial_shapes: torch.Tensor,
    lam: float,
    rng: np.random.Generator,
    minmax: tuple[float, float] | None = None,
    cutmix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CutMix (`cutmix`) or Mixup of a native-aspect batch, as the module docstring says: the mixed patches
    [N, K, P*P*C] and each image's corrected lam [N]."""
    grids = [(int(rows), int(cols)) for rows, cols in spatial_shapes.tolist()]
    mixed, partner = patches.clone(), patches.flip(0)
    lams = torch.ones(len(grids))
    for image, (rows, cols) in enumerate(grids):
        other_rows, other_cols = grids[len(grids) - 1 - image]
        shared = (min(rows, other_rows), min(cols, other_cols))
        top, bottom, left, right = patch_box(*shared, lam, rng, minmax) if cutmix else (0, shared[0], 0, shared[1])
        if bottom <= top or right <= left:
            continue
        # the box's slots in the image and in its partner (each image's patches row by row of its own grid)
        places, columns = torch.arange(top, bottom)[:, None], torch.arange(left, right)[None, :]
        own = (places * cols + columns).flatten().to(patches.device)
        theirs = (places * other_cols + columns).flatten().to(patches.device)
        if cutmix:
            mixed[image, own] = partner[image, theirs]
            lams[image] = 1.0 - own.numel() / (rows * cols)
        else:
            mixed[image, own] = lam * patches[image, own] + (1.0 - lam) * partner[image, theirs]
            lams[image] = 1.0 - (1.0 - lam) * own.numel() / (rows * cols)
    return mixed, lams


def soft_target_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch: torch.Tensor | int | None = None
) -> torch.Tensor:
    """Cross-entropy of `logits` [N, C] against probability targets [N, C]: the mean over the batch, or the sum
    divided by `num_items_in_batch` (Trainer's count of the examples of all accumulated batches)."""
    losses = -(targets.to(logits.device) * torch.log_softmax(logits.float(), dim=-1)).sum(dim=-1)
    if num_items_in_batch is None:
        return losses.mean()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(losses.device)
    return losses.sum() / num_items_in_batch
