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

The pixels are those of PIL's implementations (the ones timm calls), computed on uint8 arrays where that is faster (see
the note above `_blend`: the same pixels, or at most 1 apart for shears and translations); the random numbers come from
the generator the caller passes (the training transform's, seeded per example and epoch), so that a resumed run
augments as the uninterrupted one did. Areas that a geometric operation uncovers are filled with `fill` (timm: the
normalisation mean, 128 for ViT's 0.5). `w` (timm's weighted op choice) is refused.
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

from ...model.image_geometry import to_resampling

LEVEL_DENOM = 10.0


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


def _signed(value: float, draw: float | torch.Generator | None) -> float:
    """`value` negated when the uniform `draw` (or one drawn from the generator `draw`) is above 1/2."""
    return -value if (draw if isinstance(draw, float) else float(torch.rand((), generator=draw))) > 0.5 else value


def _signed_level(largest: float) -> Callable:
    """The level of the operations whose argument is +-`largest` at magnitude 10, its sign drawn."""
    return lambda m, g: _signed(m / LEVEL_DENOM * largest, g)


# ---------------------------------------------------------------------------------------------------------------------
# Pillow's operations, the ones timm calls: the reference, and the road for resampling filters other than bilinear


def _pil_affine(image: PIL.Image.Image, matrix: tuple[float, ...], fill, resample) -> PIL.Image.Image:
    # PIL maps each output pixel centre (x, y) to the input point (a x + b y + c, d x + e y + f), matrix (a, ..., f).
    return image.transform(image.size, PIL.Image.Transform.AFFINE, matrix, resample=resample, fillcolor=fill)


def posterize(image: PIL.Image.Image, bits: int) -> PIL.Image.Image:
    """Keep the `bits` most significant bits of each channel (0 to 8; 0 makes the image black, as TensorFlow's and
    timm's posterize mean at the strongest magnitude: `PosterizeIncreasing` at 10, `Posterize` below 2.5). PIL's
    `ImageOps.posterize` refuses 0 bits, so the table is built here."""
    if bits >= 8:
        return image
    return image.point([i & _posterize_mask(bits) for i in range(256)] * len(image.getbands()))


def _posterize_mask(bits: int) -> int:
    return 0xFF & ~(2 ** (8 - max(bits, 0)) - 1)


PIL_OPERATIONS: dict[str, Callable] = {
    # name: operation(image, argument, fill, resample) on a PIL image, as timm's
    "AutoContrast": lambda im, a, f, r: ImageOps.autocontrast(im),
    "Equalize": lambda im, a, f, r: ImageOps.equalize(im),
    "Invert": lambda im, a, f, r: ImageOps.invert(im),
    "Rotate": lambda im, a, f, r: im.rotate(a, resample=r, fillcolor=f),
    "Posterize": lambda im, a, f, r: posterize(im, a),
    "Solarize": lambda im, a, f, r: ImageOps.solarize(im, a),
    "SolarizeAdd": lambda im, a, f, r: im.point(
        [min(255, i + a) if i < 128 else i for i in range(256)] * len(im.getbands())
    ),
    "Color": lambda im, a, f, r: ImageEnhance.Color(im).enhance(a),
    "Contrast": lambda im, a, f, r: ImageEnhance.Contrast(im).enhance(a),
    "Brightness": lambda im, a, f, r: ImageEnhance.Brightness(im).enhance(a),
    "Sharpness": lambda im, a, f, r: ImageEnhance.Sharpness(im).enhance(a),
    "ShearX": lambda im, a, f, r: _pil_affine(im, (1.0, a, 0.0, 0.0, 1.0, 0.0), f, r),
    "ShearY": lambda im, a, f, r: _pil_affine(im, (1.0, 0.0, 0.0, a, 1.0, 0.0), f, r),
    "TranslateXRel": lambda im, a, f, r: _pil_affine(im, (1.0, 0.0, a * im.size[0], 0.0, 1.0, 0.0), f, r),
    "TranslateYRel": lambda im, a, f, r: _pil_affine(im, (1.0, 0.0, 0.0, 0.0, 1.0, a * im.size[1]), f, r),
}
RAND_OPS = tuple(PIL_OPERATIONS)
# The operations whose strength timm's increasing variants turn around (`inc1`).
_INCREASING = ("Posterize", "Solarize", "Color", "Contrast", "Brightness", "Sharpness")
RAND_INCREASING_OPS = tuple(f"{name}Increasing" if name in _INCREASING else name for name in RAND_OPS)


# ---------------------------------------------------------------------------------------------------------------------
# The same operations on uint8 [H, W, C] arrays, where that is faster than Pillow's per-pixel calls and Python tables:
# the colour operations with Pillow's own arithmetic (its float32 blend, its integer luminance, its SMOOTH filter): the
# same pixels; shears and translations by gathering whole input lines and interpolating neighbouring ones in float32.
# Pillow samples each pixel in float64 and truncates: where its value lands a hair below a whole number (a neighbour
# difference times a fraction that should be whole), the float32 one, nudged by `_ROUNDING`, gives that whole number,
# one more; so those differ by at most 1, on a few percent of the pixels (tests/test_recipes.py measures it against
# Pillow). AutoContrast, Equalize, Color and Rotate run in Pillow, as do the geometric operations with nearest or
# bicubic resampling.


def _blend(degenerate: np.ndarray | float, image: np.ndarray, factor: float) -> np.ndarray:
    """Pillow's `Image.blend(degenerate, image, factor)`: `degenerate + factor * (image - degenerate)` in float32,
    clipped to 0..255 and truncated (ImageEnhance's Color, Contrast, Brightness and Sharpness are such blends)."""
    out = image.astype(np.float32)
    out -= degenerate
    out *= np.float32(factor)
    out += degenerate
    if not 0 <= factor <= 1:  # between the two images the values stay in 0..255 (truncating -0.0001 gives 0)
        np.clip(out, 0, 255, out=out)
    return out.astype(np.uint8)


def _contrast(image: np.ndarray, factor: float) -> np.ndarray:
    # Pillow's grey of an RGB image: (299 R + 587 G + 114 B) / 1000 in its integer rounding
    grey = image if image.shape[2] == 1 else np.asarray(_array_to_pil(image).convert("L"))
    mean = int(grey.sum(dtype=np.int64) / grey.size + 0.5)  # ImageStat's mean, rounded as ImageEnhance rounds it
    return _blend(np.float32(mean), image, factor)


def _color(image: np.ndarray, factor: float) -> np.ndarray:
    if image.shape[2] == 1:  # a grey image is its own degenerate: unchanged, as in Pillow
        return image
    pil = _array_to_pil(image)  # Pillow's grey, back to RGB, and its blend: three passes in C
    return _pil_to_array(PIL.Image.blend(pil.convert("L").convert("RGB"), pil, factor))


def _sharpness(image: np.ndarray, factor: float) -> np.ndarray:
    """Blend with Pillow's SMOOTH filter (the 3x3 kernel of ones with 5 in the centre, over 13, rounded; the border
    rows and columns kept), summed in integers."""
    height, width = image.shape[:2]
    if height < 3 or width < 3:
        return _via_pil(image, "Sharpness", factor, None, None)
    wide = image.astype(np.uint16)
    rows = wide[:, :-2] + wide[:, 1:-1] + wide[:, 2:]
    total = rows[:-2] + rows[1:-1] + rows[2:] + 4 * wide[1:-1, 1:-1]
    smooth = image.copy()
    smooth[1:-1, 1:-1] = (total + 6) // 13
    return _blend(smooth.astype(np.float32), image, factor)


def _solarize_add(image: np.ndarray, add: int, threshold: int = 128) -> np.ndarray:
    below = (image < threshold).view(np.uint8)
    if threshold + add <= 256:  # no sum passes 255: uint8 arithmetic is exact
        return image + below * np.uint8(add)
    return np.minimum(image.astype(np.uint16) + below * np.uint16(add), 255).astype(np.uint8)


# Pillow interpolates in float64 and truncates; float32 lands a whole-number value (a flat area, a pixel-aligned map)
# a hair below it as often as above, so the float32 results are nudged up by this before truncation.
_ROUNDING = np.float32(1e-3)


def _interpolate(lower: np.ndarray, upper: np.ndarray, weight) -> np.ndarray:
    """`lower + weight * (upper - lower)` of two uint8 arrays in float32, nudged by `_ROUNDING` and truncated to
    uint8 (`weight` a number, or an array that broadcasts: one per line)."""
    result = upper.astype(np.float32)
    low = lower.astype(np.float32)
    result -= low
    result *= weight
    result += low
    result += _ROUNDING
    return result.astype(np.uint8)


def _translate_bilinear(image: np.ndarray, offset: float, axis: int, fill: np.ndarray) -> np.ndarray:
    """PIL's bilinear map for a translation by `offset` pixels along `axis` (1: x, 0: y): output pixel `i` takes
    input pixels `i + k` and `i + k + 1` (k = floor(offset), edges clamped) in the proportion of offset's fraction,
    interpolated in float32; pixels whose centre `i + 0.5 + offset` falls outside (PIL's float64 test) take `fill`.
    The two input rows (or columns) come as slices of the image padded by its edge pixels."""
    out = np.empty_like(image)
    lines, source = np.moveaxis(out, axis, 0), np.moveaxis(image, axis, 0)  # views, the lines first
    centres = (np.arange(len(source)) + 0.5) + offset
    inside = np.flatnonzero((centres >= 0) & (centres < len(source)))
    if inside.size == 0:
        out[...] = fill
        return out
    first, last = int(inside[0]), int(inside[-1]) + 1
    whole = math.floor(offset)
    padded = np.concatenate([image.take([0], axis), image, image.take([-1], axis)], axis)  # the image's layout
    padded = np.moveaxis(padded, axis, 0)  # padded[j] is source[clip(j - 1)]
    start = first + whole + 1
    lower, upper = padded[start : start + last - first], padded[start + 1 : start + 1 + last - first]
    lines[first:last] = _interpolate(lower, upper, np.float32(offset - whole))
    lines[:first] = lines[last:] = fill
    return out


def _padded_lines(image: np.ndarray, axis: int, margin: int, fill: np.ndarray) -> np.ndarray:
    """`image` padded along `axis` by `margin` pixels each side: its edge pixels once (PIL clamps at the edges), then
    `fill` (an input pixel further out only feeds output pixels that PIL fills)."""
    height, width, channels = image.shape
    shape = [height, width, channels]
    shape[axis] += 2 * margin
    padded = np.empty(shape, dtype=np.uint8)
    filler = np.tile(fill, max(height, width) + 2 * margin).reshape(-1, channels)  # rows of fill, copied as blocks
    if axis == 1:
        padded[:, : margin - 1] = filler[: margin - 1]
        padded[:, margin + width + 1 :] = filler[: margin - 1]
        padded[:, margin - 1] = image[:, 0]
        padded[:, margin : margin + width] = image
        padded[:, margin + width] = image[:, -1]
    else:
        padded[: margin - 1] = filler[:width]
        padded[margin + height + 1 :] = filler[:width]
        padded[margin - 1] = image[0]
        padded[margin : margin + height] = image
        padded[margin + height] = image[-1]
    return padded


def _shear_bilinear(image: np.ndarray, factor: float, axis: int, fill: np.ndarray) -> np.ndarray:
    """PIL's bilinear shear: ShearX (`axis` 1) samples row y at x + 0.5 + factor (y + 0.5), ShearY (`axis` 0)
    column x at y + 0.5 + factor (x + 0.5). Each line (row or column) is its input line moved by a whole number of
    pixels and interpolated with its neighbour in float32; the moved lines are gathered from the padded image in one
    indexing (a window per row for ShearX, a column offset per column for ShearY); pixels whose centre falls
    outside (PIL's float64 test) take `fill`."""
    height, width, channels = image.shape
    along, across = (width, height) if axis == 1 else (height, width)
    shifts = factor * (np.arange(across) + 0.5)
    whole = np.floor(shifts)
    weights = (shifts - whole).astype(np.float32)
    whole = whole.astype(np.int64)
    margin = int(np.abs(whole).max()) + 2
    flat = _padded_lines(image, axis, margin, fill).reshape(-1)
    if axis == 1:  # row y starts at padded column margin + whole[y]: a window of the flat image per row
        line = (width + 2 * margin) * channels
        windows = np.lib.stride_tricks.sliding_window_view(flat, (width + 1) * channels)
        pairs = windows[np.arange(height) * line + (margin + whole) * channels]
        lower, upper = pairs[:, :-channels], pairs[:, channels:]
        weight = weights[:, None]
    else:  # column x starts at padded row margin + whole[x]: rows of the flat image, an offset per column
        line = width * channels
        rows = np.lib.stride_tricks.as_strided(flat, (height, flat.size - (height - 1) * line), (line, 1))
        offsets = ((margin + whole) * line + np.arange(width) * channels)[:, None] + np.arange(channels)
        offsets = offsets.reshape(-1)
        lower, upper = rows[:, offsets], rows[:, offsets + line]
        weight = np.repeat(weights, channels)[None, :]
    out = _interpolate(lower, upper, weight).reshape(height, width, channels)
    # The pixels next to the edges that read an edge pixel and a fill pixel: PIL fills them unless their centre is in.
    first = np.arange(across)
    candidates = (np.array([-2, -1, along - 1, along])[:, None] - whole[None, :]).reshape(-1)
    lines = np.tile(first, 4)
    centres = (candidates + 0.5) + shifts[lines]
    chosen = (candidates >= 0) & (candidates < along) & ((centres < 0) | (centres >= along))
    if axis == 1:
        out[lines[chosen], candidates[chosen]] = fill
    else:
        out[candidates[chosen], lines[chosen]] = fill
    return out


def _array_to_pil(image: np.ndarray) -> PIL.Image.Image:
    if image.shape[2] == 1:
        return PIL.Image.fromarray(np.ascontiguousarray(image[..., 0]), mode="L")
    height, width = image.shape[:2]
    return PIL.Image.frombuffer("RGB", (width, height), np.ascontiguousarray(image), "raw", "RGB", 0, 1)


def _pil_to_array(image: PIL.Image.Image) -> np.ndarray:
    array = np.asarray(image)
    return array[..., None] if array.ndim == 2 else array


def _via_pil(image: np.ndarray, name: str, argument, fill: np.ndarray | None, resample) -> np.ndarray:
    fill = fill if fill is None else tuple(int(v) for v in fill) if fill.size > 1 else int(fill[0])  # as PIL takes it
    return _pil_to_array(PIL_OPERATIONS[name](_array_to_pil(image), argument, fill, resample))


def _geometric(name: str) -> Callable:
    def operation(image: np.ndarray, argument: float, fill, resample) -> np.ndarray:
        # Bilinear shears and translations are computed here; rotations and the other filters by Pillow.
        if resample != PIL.Image.Resampling.BILINEAR or name == "Rotate":
            return _via_pil(image, name, argument, fill, resample)
        height, width = image.shape[:2]
        if name == "TranslateXRel":
            return _translate_bilinear(image, argument * width, 1, fill)
        if name == "TranslateYRel":
            return _translate_bilinear(image, argument * height, 0, fill)
        return _shear_bilinear(image, argument, 1 if name == "ShearX" else 0, fill)

    return operation


_ARRAY_OPERATIONS: dict[str, Callable] = {
    # name: operation(image [H, W, C] uint8, argument, fill [C] uint8, resample) -> new array (or `image` unchanged)
    "AutoContrast": lambda im, a, f, r: _via_pil(im, "AutoContrast", a, None, r),  # a histogram and a table each:
    "Equalize": lambda im, a, f, r: _via_pil(im, "Equalize", a, None, r),  # numpy's are no faster than Pillow's
    "Invert": lambda im, a, f, r: np.uint8(255) - im,
    "Posterize": lambda im, a, f, r: im if a >= 8 else im & np.uint8(_posterize_mask(a)),
    "Solarize": lambda im, a, f, r: im ^ ((im >= a).view(np.uint8) * np.uint8(255)),  # 255 - x: x's bits flipped
    "SolarizeAdd": lambda im, a, f, r: _solarize_add(im, a),
    "Color": lambda im, a, f, r: _color(im, a),
    "Contrast": lambda im, a, f, r: _contrast(im, a),
    "Brightness": lambda im, a, f, r: _blend(np.float32(0), im, a),
    "Sharpness": lambda im, a, f, r: _sharpness(im, a),
    **{name: _geometric(name) for name in ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")},
}

# Each level function maps (magnitude, sign draw) to the operation's argument, as timm's LEVEL_TO_ARG.
_LEVELS: dict[str, Callable | None] = {
    **dict.fromkeys(("AutoContrast", "Equalize", "Invert")),  # no argument
    "Rotate": _signed_level(30.0),
    "Posterize": lambda m, g: int(m / LEVEL_DENOM * 4),
    "PosterizeIncreasing": lambda m, g: 4 - int(m / LEVEL_DENOM * 4),
    "Solarize": lambda m, g: int(m / LEVEL_DENOM * 256),
    "SolarizeIncreasing": lambda m, g: 256 - int(m / LEVEL_DENOM * 256),
    "SolarizeAdd": lambda m, g: int(m / LEVEL_DENOM * 110),
    **{name: lambda m, g: m / LEVEL_DENOM * 1.8 + 0.1 for name in _INCREASING[2:]},
    **{
        f"{name}Increasing": lambda m, g: max(0.1, 1.0 + _signed(m / LEVEL_DENOM * 0.9, g)) for name in _INCREASING[2:]
    },
    "ShearX": _signed_level(0.3),
    "ShearY": _signed_level(0.3),
    "TranslateXRel": _signed_level(0.45),
    "TranslateYRel": _signed_level(0.45),
}

# name (timm's, the increasing variants included): (level function or None, the operation it applies)
OPERATIONS: dict[str, tuple[Callable | None, str]] = {
    name: (level, name.removesuffix("Increasing")) for name, level in _LEVELS.items()
}


def _resampling(value: Any) -> PIL.Image.Resampling:
    """PIL's filter for `value` (a name or PIL's number); PIL's rotations and affine maps take nearest, bilinear and
    bicubic only, so others (e.g. lanczos, a processor's resize filter) become bilinear."""
    try:
        return PIL.Image.Resampling(int(to_resampling(value)))
    except (TypeError, ValueError):
        return PIL.Image.Resampling.BILINEAR


class RandAugment:
    """`policy` applied to uint8 [C, H, W] images (C = 1 or 3), drawing from `generator`."""

    def __init__(self, policy: RandAugmentPolicy | str, fill: int | tuple[int, ...] = 128, resample="bilinear"):
        self.policy = parse_rand_augment(policy) if isinstance(policy, str) else policy
        self.fill = fill
        self.resample = _resampling(resample)

    def magnitude(self, uniform: float, normal: float) -> float:
        """The policy's magnitude, with its noise (`normal` times mstd, or `uniform` times m when mstd is above 100),
        clipped to [0, mmax]."""
        policy, std = self.policy, self.policy.magnitude_std  # (m + 0 * normal is m, to the bit)
        magnitude = uniform * policy.magnitude if std == math.inf else policy.magnitude + std * normal
        return max(0.0, min(magnitude, policy.magnitude_max))

    def apply(self, image, name: str, magnitude: float, sign=None, *, reference: bool = False):
        """One operation at `magnitude` on a uint8 [H, W, C] array or a PIL image (returned as the same kind); its
        sign, for the operations that take one, is - when `sign` (a uniform draw, or a generator to draw it from) is
        above 1/2. `reference` runs Pillow's implementation (timm's) instead."""
        level, operation = OPERATIONS[name]
        argument = level(magnitude, sign) if level is not None else None
        as_pil = isinstance(image, PIL.Image.Image)
        array = _pil_to_array(image) if as_pil else image
        channels = array.shape[2]
        fill = (self.fill,) * channels if isinstance(self.fill, int) else tuple(self.fill)[:channels]
        fill = np.asarray(fill * (channels // len(fill)), dtype=np.uint8)
        if reference:
            result = _via_pil(array, operation, argument, fill, self.resample)
        else:
            result = _ARRAY_OPERATIONS[operation](array, argument, fill, self.resample)
        return _array_to_pil(result) if as_pil else result

    def __call__(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if pixels.ndim != 3 or pixels.shape[0] not in (1, 3):
            raise ValueError(
                f"--rand_augment works on grey or RGB images (1 or 3 channels), got an image of shape "
                f"{tuple(pixels.shape)}: drop --rand_augment for images of other channels."
            )
        ops, count = self.policy.ops, self.policy.num_ops
        # All of the image's draws in one call, per operation: which one, whether it applies (below 1/2), its sign,
        # and its magnitude's noise (uniform, or normal by Box-Muller from two uniforms).
        draws = torch.rand((count, 6), generator=generator).tolist()
        chosen = [min(int(row[0] * len(ops)), len(ops) - 1) for row in draws]
        uniforms = [row[1:4] for row in draws]
        normals = [math.sqrt(-2 * math.log1p(-row[4])) * math.cos(2 * math.pi * row[5]) for row in draws]
        image = None
        for index, (coin, sign, spread), normal in zip(chosen, uniforms, normals):
            if coin > 0.5:  # each operation applies with probability 1/2
                continue
            magnitude = self.magnitude(spread, normal)
            if image is None:  # the [C, H, W] tensor as an [H, W, C] array (no copy in the pixel path's layout)
                # (images of more than 8 bits arrive as floats on the 0..255 scale: the operations are 8-bit ones)
                uint8 = pixels if pixels.dtype == torch.uint8 else pixels.round().clamp(0, 255).to(torch.uint8)
                image = np.ascontiguousarray(uint8.permute(1, 2, 0).numpy())
            image = self.apply(image, ops[index], magnitude, sign)
        if image is None:
            return pixels
        if not image.flags.writeable:  # an array Pillow handed back
            image = image.copy()
        return torch.from_numpy(image).permute(2, 0, 1)
