"""RandAugment on uint8 images, in timm's notation and with timm's operations and magnitudes.

`--rand_augment rand-m9-mstd0.5-inc1` is parsed by `parse_rand_augment` into a `RandAugment`:

* `m` the magnitude (0..10, default 10), `n` the operations per image (default 2), `mstd` the standard deviation of
  the magnitude's noise (each operation draws `N(m, mstd)`, clipped to `[0, mmax]`; above 100: uniform in `[0, m]`),
  `mmax` the largest magnitude (default 10), `inc1` the variants whose strength increases with the magnitude
  (timm's `_RAND_INCREASING_TRANSFORMS`), `inc0` the others (timm's `_RAND_TRANSFORMS`).
* Each image draws `n` operations (with replacement), and applies each with probability 1/2.
* Magnitude `M` of 10: Rotate by +-`M/10 * 30` degrees, ShearX/Y by +-`M/10 * 0.3`, TranslateX/YRel by +-`M/10 * 0.45`
  of the side, Color/Contrast/Brightness/Sharpness by the factor `M/10 * 1.8 + 0.1` (increasing: `1 +- M/10 * 0.9`,
  at least 0.1), Posterize keeps `int(M/10 * 4)` bits (increasing: `4 - int(M/10 * 4)`), Solarize inverts pixels at
  or above `int(M/10 * 256)` (increasing: `256 - int(M/10 * 256)`), SolarizeAdd adds `int(M/10 * 110)` to pixels
  below 128; AutoContrast, Equalize and Invert take no magnitude. The sign of the geometric and increasing colour
  operations is drawn at random (+ or -, one half each).

The pixels come from PIL's implementations (the ones timm calls); the random numbers from the generator the caller
passes (the training transform's, seeded per example and epoch), so that a resumed run augments as the uninterrupted
one did. Areas that a geometric operation uncovers are filled with `fill` (timm: the normalisation mean, 128 for
ViT's 0.5). `w` (timm's weighted op choice) is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
from PIL import ImageEnhance, ImageOps

LEVEL_DENOM = 10.0

RAND_OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "Posterize",
    "Solarize",
    "SolarizeAdd",
    "Color",
    "Contrast",
    "Brightness",
    "Sharpness",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
RAND_INCREASING_OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "PosterizeIncreasing",
    "SolarizeIncreasing",
    "SolarizeAdd",
    "ColorIncreasing",
    "ContrastIncreasing",
    "BrightnessIncreasing",
    "SharpnessIncreasing",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)

RESAMPLING = {
    "nearest": PIL.Image.Resampling.NEAREST,
    "bilinear": PIL.Image.Resampling.BILINEAR,
    "bicubic": PIL.Image.Resampling.BICUBIC,
}


@dataclass(frozen=True)
class RandAugmentPolicy:
    """A parsed `--rand_augment` string."""

    magnitude: float = 10.0
    num_ops: int = 2
    magnitude_std: float = 0.0
    magnitude_max: float = LEVEL_DENOM
    increasing: bool = False

    @property
    def ops(self) -> tuple[str, ...]:
        return RAND_INCREASING_OPS if self.increasing else RAND_OPS


def parse_rand_augment(text: str) -> RandAugmentPolicy:
    """`rand-m9-mstd0.5[-n2][-mmax10][-inc1]` (timm's notation) as a policy; anything else is refused by name."""
    parts = text.strip().split("-")
    if parts[0] != "rand":
        raise ValueError(f"--rand_augment takes timm's notation, e.g. rand-m9-mstd0.5-inc1; got {text!r}.")
    fields: dict[str, float | int | bool] = {}
    for part in parts[1:]:
        match = re.fullmatch(r"([a-z]+)(\d+(?:\.\d*)?)", part)
        if match is None:
            raise ValueError(f"--rand_augment {text!r}: cannot read the section {part!r} (a key and a number).")
        key, value = match.groups()
        if key == "m":
            fields["magnitude"] = float(value)
        elif key == "n":
            if int(float(value)) < 1 or float(value) != int(float(value)):
                raise ValueError(f"--rand_augment {text!r}: n (operations per image) must be a whole number >= 1.")
            fields["num_ops"] = int(float(value))
        elif key == "mstd":
            std = float(value)
            fields["magnitude_std"] = math.inf if std > 100 else std
        elif key == "mmax":
            fields["magnitude_max"] = float(value)
        elif key == "inc":
            if value not in ("0", "1"):
                raise ValueError(f"--rand_augment {text!r}: inc takes 0 or 1.")
            fields["increasing"] = value == "1"
        elif key == "w":
            raise ValueError(
                f"--rand_augment {text!r}: the weighted operation choice (w) is not supported; drop the section to "
                "draw the operations uniformly."
            )
        else:
            raise ValueError(f"--rand_augment {text!r}: unknown section {part!r} (known: m, n, mstd, mmax, inc).")
    return RandAugmentPolicy(**fields)


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def _signed(value: float, generator: torch.Generator | None) -> float:
    return -value if _uniform(generator) > 0.5 else value


# Each level function maps (magnitude, generator) to the operation's argument, as timm's LEVEL_TO_ARG.
def _rotate_level(m, g):
    return _signed(m / LEVEL_DENOM * 30.0, g)


def _shear_level(m, g):
    return _signed(m / LEVEL_DENOM * 0.3, g)


def _translate_level(m, g):
    return _signed(m / LEVEL_DENOM * 0.45, g)


def _enhance_level(m, g):
    return m / LEVEL_DENOM * 1.8 + 0.1


def _enhance_increasing_level(m, g):
    return max(0.1, 1.0 + _signed(m / LEVEL_DENOM * 0.9, g))


def _posterize_level(m, g):
    return int(m / LEVEL_DENOM * 4)


def _posterize_increasing_level(m, g):
    return 4 - int(m / LEVEL_DENOM * 4)


def _solarize_level(m, g):
    return int(m / LEVEL_DENOM * 256)


def _solarize_increasing_level(m, g):
    return 256 - int(m / LEVEL_DENOM * 256)


def _solarize_add_level(m, g):
    return int(m / LEVEL_DENOM * 110)


def _affine(image: PIL.Image.Image, matrix: tuple[float, ...], fill, resample) -> PIL.Image.Image:
    # PIL maps each output pixel (x, y) to the input pixel (a x + b y + c, d x + e y + f).
    return image.transform(image.size, PIL.Image.Transform.AFFINE, matrix, resample=resample, fillcolor=fill)


def posterize(image: PIL.Image.Image, bits: int) -> PIL.Image.Image:
    """Keep the `bits` most significant bits of each channel (0 to 8; 0 makes the image black, as TensorFlow's and
    timm's posterize mean at the strongest magnitude: `PosterizeIncreasing` at 10, `Posterize` below 2.5). PIL's
    `ImageOps.posterize` refuses 0 bits, so the table is built here."""
    if bits >= 8:
        return image
    mask = 0xFF & ~(2 ** (8 - max(bits, 0)) - 1)
    return image.point([i & mask for i in range(256)] * len(image.getbands()))


def solarize_add(image: PIL.Image.Image, add: int, threshold: int = 128) -> PIL.Image.Image:
    table = [min(255, i + add) if i < threshold else i for i in range(256)]
    return image.point(table * len(image.getbands()))


OPERATIONS: dict[str, tuple[Callable | None, Callable]] = {
    # name: (level function or None, operation(image, argument, fill, resample))
    "AutoContrast": (None, lambda im, a, f, r: ImageOps.autocontrast(im)),
    "Equalize": (None, lambda im, a, f, r: ImageOps.equalize(im)),
    "Invert": (None, lambda im, a, f, r: ImageOps.invert(im)),
    "Rotate": (_rotate_level, lambda im, a, f, r: im.rotate(a, resample=r, fillcolor=f)),
    "Posterize": (_posterize_level, lambda im, a, f, r: posterize(im, a)),
    "PosterizeIncreasing": (_posterize_increasing_level, lambda im, a, f, r: posterize(im, a)),
    "Solarize": (_solarize_level, lambda im, a, f, r: ImageOps.solarize(im, a)),
    "SolarizeIncreasing": (_solarize_increasing_level, lambda im, a, f, r: ImageOps.solarize(im, a)),
    "SolarizeAdd": (_solarize_add_level, lambda im, a, f, r: solarize_add(im, a)),
    "Color": (_enhance_level, lambda im, a, f, r: ImageEnhance.Color(im).enhance(a)),
    "ColorIncreasing": (_enhance_increasing_level, lambda im, a, f, r: ImageEnhance.Color(im).enhance(a)),
    "Contrast": (_enhance_level, lambda im, a, f, r: ImageEnhance.Contrast(im).enhance(a)),
    "ContrastIncreasing": (_enhance_increasing_level, lambda im, a, f, r: ImageEnhance.Contrast(im).enhance(a)),
    "Brightness": (_enhance_level, lambda im, a, f, r: ImageEnhance.Brightness(im).enhance(a)),
    "BrightnessIncreasing": (_enhance_increasing_level, lambda im, a, f, r: ImageEnhance.Brightness(im).enhance(a)),
    "Sharpness": (_enhance_level, lambda im, a, f, r: ImageEnhance.Sharpness(im).enhance(a)),
    "SharpnessIncreasing": (_enhance_increasing_level, lambda im, a, f, r: ImageEnhance.Sharpness(im).enhance(a)),
    "ShearX": (_shear_level, lambda im, a, f, r: _affine(im, (1, a, 0, 0, 1, 0), f, r)),
    "ShearY": (_shear_level, lambda im, a, f, r: _affine(im, (1, 0, 0, a, 1, 0), f, r)),
    "TranslateXRel": (_translate_level, lambda im, a, f, r: _affine(im, (1, 0, a * im.size[0], 0, 1, 0), f, r)),
    "TranslateYRel": (_translate_level, lambda im, a, f, r: _affine(im, (1, 0, 0, 0, 1, a * im.size[1]), f, r)),
}


def to_pil(pixels: torch.Tensor) -> PIL.Image.Image:
    """A uint8 [C, H, W] tensor (C = 1 or 3) as a PIL image (mode L or RGB). Each channel plane is wrapped as it lies
    (no copy) and PIL interleaves them: several times faster than transposing the tensor to [H, W, C] first."""
    planes = np.ascontiguousarray(pixels.numpy())
    height, width = planes.shape[1:]
    bands = [PIL.Image.frombuffer("L", (width, height), plane, "raw", "L", 0, 1) for plane in planes]
    return bands[0] if len(bands) == 1 else PIL.Image.merge("RGB", bands)


def from_pil(image: PIL.Image.Image) -> torch.Tensor:
    array = np.array(image)
    return torch.from_numpy(array[..., None] if array.ndim == 2 else array).permute(2, 0, 1)


def _resampling(value: Any) -> PIL.Image.Resampling:
    """PIL's filter for `value` (a name or PIL's number); PIL's rotations and affine maps take nearest, bilinear and
    bicubic only, so others (e.g. lanczos, a processor's resize filter) become bilinear."""
    if isinstance(value, str):
        chosen = RESAMPLING.get(value.lower())
    else:
        try:
            chosen = PIL.Image.Resampling(int(value))
        except (TypeError, ValueError):
            chosen = None
    return chosen if chosen in RESAMPLING.values() else PIL.Image.Resampling.BILINEAR


class RandAugment:
    """`policy` applied to uint8 [C, H, W] images (C = 1 or 3), drawing from `generator`."""

    def __init__(self, policy: RandAugmentPolicy | str, fill: int | tuple[int, ...] = 128, resample="bilinear"):
        self.policy = parse_rand_augment(policy) if isinstance(policy, str) else policy
        self.fill = fill
        self.resample = _resampling(resample)

    def magnitude(self, generator: torch.Generator | None) -> float:
        policy = self.policy
        magnitude = policy.magnitude
        if policy.magnitude_std == math.inf:
            magnitude = _uniform(generator) * magnitude
        elif policy.magnitude_std > 0:
            magnitude = magnitude + policy.magnitude_std * float(torch.randn((), generator=generator))
        return max(0.0, min(magnitude, policy.magnitude_max))

    def apply(self, image: PIL.Image.Image, name: str, magnitude: float, generator=None) -> PIL.Image.Image:
        """One operation at `magnitude` (its random sign, if any, drawn from `generator`)."""
        level, operation = OPERATIONS[name]
        argument = level(magnitude, generator) if level is not None else None
        fill = self.fill if image.mode == "RGB" or isinstance(self.fill, int) else self.fill[0]
        if image.mode == "RGB" and isinstance(fill, int):
            fill = (fill,) * 3
        return operation(image, argument, fill, self.resample)

    def __call__(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if pixels.ndim != 3 or pixels.shape[0] not in (1, 3):
            raise ValueError(
                f"--rand_augment works on grey or RGB images (1 or 3 channels), got an image of shape "
                f"{tuple(pixels.shape)}: drop --rand_augment for images of other channels."
            )
        ops = self.policy.ops
        chosen = torch.randint(len(ops), (self.policy.num_ops,), generator=generator).tolist()
        image = None
        for index in chosen:
            if _uniform(generator) > 0.5:  # each operation applies with probability 1/2
                continue
            magnitude = self.magnitude(generator)
            if image is None:
                image = to_pil(_to_uint8(pixels))
            image = self.apply(image, ops[index], magnitude, generator)
        return pixels if image is None else from_pil(image)


def _to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    # Images of more than 8 bits arrive as floats on the 0..255 scale: RandAugment's operations are 8-bit ones.
    return pixels if pixels.dtype == torch.uint8 else pixels.round().clamp(0, 255).to(torch.uint8)
