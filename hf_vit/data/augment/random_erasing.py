"""Random erasing (Zhong et al. 2017, "Random Erasing Data Augmentation"), with timm's `RandomErasing` meanings:
`--reprob`, `--remode`, `--recount`.

On a normalised `[C, H, W]` image, with probability `probability`, `count` rectangles are erased (`count` uniform in
`min_count..max_count`, or `min_count` when they are equal). Each rectangle takes up to 10 attempts: a target area
uniform in `[min_area, max_area]` of the image divided by `count` and an aspect ratio log-uniform in
`[min_aspect, max_aspect]` (default `1 / min_aspect`) give `h = round(sqrt(area * aspect))` and
`w = round(sqrt(area / aspect))`; the first attempt with `h < H` and `w < W` is placed at a uniform position and
filled: per-pixel standard normal noise (`pixel`), one standard normal value per channel (`rand`), or zeros
(`const`), which on a normalised image are noise of the data's own spread, a random colour, or the mean colour. A
rectangle whose 10 attempts all fail is left out.

Every random number comes from the generator passed in (the training transform's, seeded per example and epoch like
the crop, the flip and RandAugment), drawn in this order per image: the decision, the count (only when it varies),
then per rectangle its attempts (area, aspect) and, once placed, its top, its left and its fill. So a resumed run
draws what the uninterrupted one did. At `probability` 0 nothing is drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MODES = ("pixel", "rand", "const")
ATTEMPTS = 10

Box = tuple[int, int, int, int]  # top, left, height, width


def check_random_erasing(probability: float, mode: str = "pixel", count: int = 1) -> None:
    """Refuse, by flag name, an erasing probability outside [0, 1], an unknown mode or a count below 1."""
    if not 0 <= probability <= 1:
        raise ValueError(f"--reprob is the probability of erasing an image: it must be in [0, 1], got {probability}.")
    if mode not in MODES:
        raise ValueError(f"--remode must be one of {', '.join(MODES)}, got {mode!r}.")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"--recount is the largest number of rectangles erased per image: at least 1, got {count}.")


@dataclass(frozen=True)
class RandomErasing:
    """Erase random rectangles of normalised `[C, H, W]` float images (see the module's docstring)."""

    probability: float
    mode: str = "pixel"
    max_count: int = 1
    min_count: int = 1
    min_area: float = 0.02
    max_area: float = 1 / 3
    min_aspect: float = 0.3
    max_aspect: float | None = None

    def __post_init__(self) -> None:
        check_random_erasing(self.probability, self.mode, self.max_count)
        if not 1 <= self.min_count <= self.max_count:
            raise ValueError(f"Need 1 <= min_count <= max_count, got {self.min_count} and {self.max_count}.")
        if not 0 < self.min_area <= self.max_area <= 1:
            raise ValueError(f"Need 0 < min_area <= max_area <= 1, got {self.min_area} and {self.max_area}.")
        if not 0 < self.min_aspect <= (self.max_aspect or 1 / self.min_aspect):
            raise ValueError(f"Need 0 < min_aspect <= max_aspect, got {self.min_aspect} and {self.max_aspect}.")

    def __call__(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """`image` with its rectangles erased (in place), drawing from `generator` (None: torch's global one)."""
        self.erase(image, generator)
        return image

    def erase(self, image: torch.Tensor, generator: torch.Generator | None = None) -> list[Box]:
        """Erase `image` (a float `[C, H, W]` tensor) in place; return the rectangles erased, in order."""
        if not image.is_floating_point() or image.ndim != 3:
            raise TypeError(
                f"Random erasing takes a normalised float [C, H, W] image, got {image.dtype} {image.shape}."
            )
        if self.probability == 0 or torch.rand((), generator=generator).item() >= self.probability:
            return []
        channels, height, width = image.shape
        count = self.min_count
        if self.max_count != self.min_count:
            count = int(torch.randint(self.min_count, self.max_count + 1, (), generator=generator))
        log_aspect = (math.log(self.min_aspect), math.log(self.max_aspect or 1 / self.min_aspect))
        boxes = []
        for _ in range(count):
            for _ in range(ATTEMPTS):
                area = height * width * _uniform(self.min_area, self.max_area, generator) / count
                aspect = math.exp(_uniform(*log_aspect, generator))
                box_height, box_width = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
                if box_height < height and box_width < width:
                    top = int(torch.randint(0, height - box_height + 1, (), generator=generator))
                    left = int(torch.randint(0, width - box_width + 1, (), generator=generator))
                    region = image[:, top : top + box_height, left : left + box_width]
                    region.copy_(self._fill((channels, box_height, box_width), generator))
                    boxes.append((top, left, box_height, box_width))
                    break
        return boxes

    def _fill(self, shape: tuple[int, int, int], generator: torch.Generator | None) -> torch.Tensor:
        if self.mode == "pixel":
            return torch.randn(shape, generator=generator)
        if self.mode == "rand":
            return torch.randn((shape[0], 1, 1), generator=generator).expand(shape)
        return torch.zeros(())


def _uniform(low: float, high: float, generator: torch.Generator | None) -> float:
    return torch.empty((), dtype=torch.float64).uniform_(low, high, generator=generator).item()
